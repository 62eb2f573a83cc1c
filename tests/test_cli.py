"""The `eb` command as a new user meets it: help without loading torch, help text on every option, one-line
errors, and `eb simulate --workload trace` taking the rank count from our own log."""
import ast
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.unit


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_eb_help_and_import_eb_deepspeed_do_not_load_torch():
    res = _python("import sys\nfrom eb_deepspeed.tools.cli import main\n"
                  "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
                  "for c in (['report', '--help'], ['plan', '--help']):\n"
                  "    try:\n        main(c)\n    except SystemExit:\n        pass\n"
                  "import eb_deepspeed\nprint('TORCH', 'torch' in sys.modules)")
    assert res.returncode == 0, res.stderr
    assert "usage: eb" in res.stdout and "TORCH False" in res.stdout


def test_the_public_names_still_import_from_eb_deepspeed():
    res = _python("import eb_deepspeed as e\n"
                  "print(e.plan_placement.__name__, e.metrics.balancedness.__name__, e.EasyBalanceConfig.__name__, "
                  "e.initialize.__name__, sorted(set(e.__all__) - set(dir(e))))")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1].split() == ["plan_placement", "balancedness", "EasyBalanceConfig",
                                                         "initialize", "[]"]


def test_every_eb_option_has_help_text():
    src = open(os.path.join(ROOT, "eb_deepspeed", "tools", "cli.py")).read()
    missing = [node.lineno for node in ast.walk(ast.parse(src)) if isinstance(node, ast.Call)
               and getattr(node.func, "attr", "") == "add_argument" and not any(k.arg == "help" for k in node.keywords)]
    assert missing == [], f"add_argument without help= at lines {missing}"


def test_eb_simulate_trace_reads_the_rank_count_from_our_log(tmp_path):
    from eb_deepspeed.core.record import EXPERT_COUNTS, PRESSURE
    from eb_deepspeed.observe.traces import ranks_in_log
    log = tmp_path / "balance.jsonl"
    with open(log, "w") as f:
        for step in (5, 10):
            f.write(json.dumps({"step": step, EXPERT_COUNTS: [[3, 1, 2, 2]] * 2, PRESSURE: [[1.0, 2.0, 1.5]] * 2}) + "\n")
    assert ranks_in_log(str(tmp_path)) == 3 and ranks_in_log(str(log)) == 3
    assert ranks_in_log(str(tmp_path / "dump.pt")) is None           # SGLang / vLLM files name no ranks


def test_each_benchmark_has_its_own_help_with_only_its_options(capsys):
    from benchmarks.__main__ import main
    for what, has, lacks in (("gate", "--tokens", "--steps"), ("train", "--sweep", "--tokens"),
                             ("infer", "--ranks", "--sweep"), ("plan", "--json", "--ranks")):
        with pytest.raises(SystemExit):
            main([what, "--help"])
        text = capsys.readouterr().out
        assert has in text and lacks not in text, what


def test_eb_plan_names_its_metric_and_which_way_is_better(tmp_path, capsys):
    from eb_deepspeed.tools.cli import main
    records = [{"step": 2 * i, "expert_counts_LE": [[9, 1, 1, 1]], "devices": 2} for i in range(1, 4)]
    (tmp_path / "balance.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["plan", str(tmp_path), "--devices", "2", "--slots", "3"]) == 0
    out = capsys.readouterr().out
    assert "3 load records (one per logged step)" in out          # before: "3 steps" for a 6-step run
    assert "balancedness = mean / max device load" in out and "higher is better" in out


def test_eb_simulate_ends_with_its_targets_in_words_not_a_raw_json_line(capsys):
    from benchmarks.__main__ import main
    assert main(["simulate", "--layers", "2", "--experts", "8", "--devices", "4", "--steps", "4"]) == 0
    tail = capsys.readouterr().out.strip().splitlines()[-3:]
    assert tail[0] == "targets:" and "target >= 1.35" in tail[1] and "higher is better" in tail[2]
    assert not any(line.lstrip().startswith("{") for line in tail)
