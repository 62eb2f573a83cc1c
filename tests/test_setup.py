"""launch/setup_cpu.sh builds DeepSpeed's shm comm op once into this checkout's venv and reuses it (a second
checkout never rebuilds another checkout's copy); an installed package works outside a checkout."""
import os
import subprocess

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow


def test_sourcing_the_setup_reuses_this_checkouts_shm_op_and_leaves_the_callers_shell_options_as_they_were():
    """Sourced in a shell with `set +euo pipefail`: the options come back as they were (before: `set -euo pipefail`
    stayed, so the caller's next failing command closed the terminal); TORCH_EXTENSIONS_DIR is this checkout's,
    and the op built there (by the set-up that ran the tests) is loaded, not rebuilt; one thread per rank."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_EXTENSIONS_DIR", "EB_VENV", "OMP_NUM_THREADS")}
    ext_dir = os.path.join(ROOT, ".venv", "torch_extensions")          # keyed per checkout, not a shared cache
    built = [os.path.join(d, f) for d, _, files in os.walk(ext_dir) for f in files if f.endswith(".so")]
    assert built, f"no compiled op under {ext_dir}"
    before = {path: os.stat(path).st_mtime_ns for path in built}
    script = ('set +euo pipefail; before="$(set +o)"; source launch/setup_cpu.sh >/dev/null; after="$(set +o)"; '
              '[ "$before" = "$after" ] && echo same-options; false; echo "$TORCH_EXTENSIONS_DIR $OMP_NUM_THREADS"')
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-2:] == ["same-options", f"{ext_dir} 1"]     # one thread per rank
    assert {path: os.stat(path).st_mtime_ns for path in built} == before   # loaded, not rebuilt


def test_an_installed_package_plans_and_reports_outside_a_checkout(tmp_path):
    """`pip install .` (here into a target folder; its dependencies are this venv's), then `eb` from another
    directory: the package is what a user imports (no benchmarks, no simulator) and `eb plan` / `eb report` work
    from it alone."""
    import json
    import shutil
    import sys
    source, target, elsewhere = tmp_path / "source", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    source.mkdir()                       # a copy: the build writes its build/ and egg-info next to setup.py
    for name in ("setup.py", "README.md"):
        shutil.copy(os.path.join(ROOT, name), source / name)
    shutil.copytree(os.path.join(ROOT, "eb_deepspeed"), source / "eb_deepspeed",
                    ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--target", str(target), str(source)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (target / "benchmarks").exists() and (target / "eb_deepspeed").is_dir()
    env = dict(os.environ, PYTHONPATH=str(target), DS_ACCELERATOR="cpu")
    where = subprocess.run([sys.executable, "-c", "import eb_deepspeed; print(eb_deepspeed.__file__)"], cwd=elsewhere,
                           env=env, capture_output=True, text=True, timeout=300)
    assert where.stdout.strip().startswith(str(target)), where.stdout
    log = elsewhere / "run"
    log.mkdir()
    records = [{"step": i, "expert_counts_LE": [[9, 1, 1, 1]] * 2} for i in range(1, 4)]
    (log / "balance.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    eb = [sys.executable, str(target / "bin" / "eb")]
    plan = subprocess.run(eb + ["plan", str(log), "--devices", "2", "--slots", "3", "--json"], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=600)
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert json.loads(plan.stdout)["slots_per_device"] == 3
