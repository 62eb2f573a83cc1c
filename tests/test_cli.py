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
    from benchmarks.__main__ import ranks_in_log
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


def _npz(path, **arrays):
    import numpy as np
    np.savez(path, **{name: np.asarray(a) for name, a in arrays.items()})
    return str(path)


def test_eb_plan_reads_the_replay_s_counts_npz_summing_samples_and_workloads(tmp_path, capsys):
    from eb_deepspeed.observe.traces import load_total
    from eb_deepspeed.tools.cli import main
    path = _npz(tmp_path / "counts.npz", a=[[[1, 0, 2], [0, 3, 0]], [[2, 1, 0], [1, 1, 1]]], b=[[[0, 0, 4], [2, 0, 0]]])
    # by hand: every sample of a and b, layer 0: [1+2+0, 0+1+0, 2+0+4]; layer 1: [0+1+2, 3+1+0, 0+1+0]
    assert [t.tolist() if i == 0 else t for i, t in enumerate(load_total(path))] == [[[3, 1, 6], [3, 4, 1]], 3]
    assert load_total(path, workload="a")[0].tolist() == [[3, 1, 2], [1, 4, 1]]
    assert load_total(path, last=1)[0].tolist() == [[0, 0, 4], [2, 0, 0]]          # the last sample: b's
    assert main(["plan", path, "--devices", "3", "--slots", "1"]) == 0
    assert f"{path}: 3 samples (every workload), 2 layers x 3 experts -> 3 devices x 1 slots" in capsys.readouterr().out
    assert main(["plan", path, "--devices", "3", "--slots", "1", "--workload", "b", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["steps"], out["workload"], out["layers"], out["experts"]) == (1, "b", 2, 3)


@pytest.mark.parametrize("name", ["esft_dsv2lite_counts.npz", "olmoe_expert_counts.npz"])
def test_eb_plan_plans_from_the_data_the_benchmarks_replay(name, tmp_path):
    import numpy as np
    from benchmarks.replay import load_counts
    from eb_deepspeed.observe.traces import load_total
    from eb_deepspeed.tools.cli import main
    path = os.path.join(ROOT, "benchmarks", "data", name)
    counts = load_counts(path)
    total_LE, samples = load_total(path)
    assert samples == sum(len(c) for c in counts.values())
    assert np.allclose(total_LE.numpy(), sum(c.double().sum(0) for c in counts.values()).numpy())
    assert main(["plan", path, "--devices", "4", "--redundant", "4", "--out", str(tmp_path / "plan.json")]) == 0
    assert json.loads((tmp_path / "plan.json").read_text())["num_experts"] == 64


def _bad_npz(path, case):
    import numpy as np
    if case == "text":
        path.write_text("intent,law\n1,2\n")
    elif case == "npy":
        with open(path, "wb") as f:
            np.save(f, np.ones((1, 2, 4)))
    elif case == "no arrays":
        np.savez(path)
    elif case == "objects":
        np.savez(path, a=np.array([[[1]], "x"], dtype=object))
    elif case == "bomb":          # 80 MB of zeros in a small file: past max(64 MiB, 8 x its size)
        np.savez_compressed(path, a=np.zeros((2_500_000, 1, 4)))
    else:
        np.savez(path, **case)
    return str(path)


@pytest.mark.parametrize("case, message", [
    ("text", r"bad.npz: not an .npz of count arrays \(numpy.savez\) \(ValueError: not a zip archive\)"),
    ("npy", r"bad.npz: not an .npz of count arrays \(numpy.savez\) \(ValueError: not a zip archive\)"),
    ("objects", r"bad.npz: not an .npz of count arrays .*allow_pickle=False"),
    ("bomb", r"bad.npz: its zip entries expand to 800\d{5} bytes, more than the 67108864 allowed"),
    ("no arrays", r"bad.npz: holds no arrays"),
    ({"a": [[1, 2], [3, 4]]}, r"bad.npz: every array must be \[samples, layers, experts\] .* got \{'a': \(2, 2\)\}"),
    ({"a": [[[1, 2]]], "b": [[[1, 2, 3]]]},
     r"bad.npz: every array must be \[samples, layers, experts\] of the same layers and experts, got "
     r"\{'a': \(1, 1, 2\), 'b': \(1, 1, 3\)\}"),
    ({"a": [[[1, -2]]]}, r"bad.npz: 'a' must be finite and non-negative"),
    ({"a": [[[1, 2]]], "b": [[[float("nan"), 2]]]}, r"bad.npz: 'b' must be finite and non-negative"),
    ({"a": [[[1.0, float("inf")]]]}, r"bad.npz: 'a' must be finite and non-negative"),
    ({"a": [[[True, False]]]}, r"bad.npz: 'a' must hold real token counts, got torch.bool"),
    ({"a": __import__("numpy").zeros((0, 2, 4))}, r"bad.npz: 'a' is empty"),
], ids=lambda c: c if isinstance(c, str) else None)
def test_a_malformed_counts_npz_is_refused_with_one_line_naming_the_file_and_the_problem(tmp_path, capsys, case,
                                                                                        message):
    from eb_deepspeed.observe.traces import load_trace
    from eb_deepspeed.tools.cli import main
    path = _bad_npz(tmp_path / "bad.npz", case)
    with pytest.raises(ValueError, match=message):
        load_trace(path)
    assert main(["plan", path, "--devices", "2", "--slots", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"eb plan: error: {path}: ") and err.count("\n") == 1 and "Traceback" not in err


def test_eb_plan_workload_names_an_array_of_the_npz_and_goes_with_an_npz_only(tmp_path, capsys):
    from eb_deepspeed.tools.cli import main
    path = _npz(tmp_path / "counts.npz", law=[[[1, 2]]], intent=[[[3, 4]]])
    assert main(["plan", path, "--devices", "2", "--slots", "1", "--workload", "code"]) == 2
    assert f"eb plan: error: {path}: no workload 'code'; it holds ['law', 'intent']" in capsys.readouterr().err
    (tmp_path / "balance.jsonl").write_text(json.dumps({"step": 1, "expert_counts_LE": [[1, 2]]}) + "\n")
    assert main(["plan", str(tmp_path), "--devices", "2", "--slots", "1", "--workload", "law"]) == 2
    assert f"{tmp_path}: workload 'law' names an array of an .npz of counts; this is no .npz" in capsys.readouterr().err


def test_an_npz_whose_arrays_together_pass_the_trace_bound_is_refused_before_any_copy(tmp_path, monkeypatch):
    from eb_deepspeed.observe import traces
    path = _npz(tmp_path / "counts.npz", a=[[[1, 2]] * 2], b=[[[3, 4]] * 2])   # 4 counts each, 8 together
    monkeypatch.setattr(traces, "MAX_TRACE_COUNTS", 5)                          # each under the bound, both over
    with pytest.raises(ValueError, match=r"counts.npz: its arrays \{'a': \(1, 2, 2\), 'b': \(1, 2, 2\)\} hold more "
                                         r"than the 5 counts a trace may take"):
        traces.load_trace(path)

@pytest.mark.parametrize("argv, message", [(["--steps", "-5"], "--steps: -5 must be >= 1"),
                                           (["--interval", "0"], "--interval: 0 must be >= 1")])
def test_the_benchmark_refuses_bad_counts_before_launching_anything(argv, message, capsys, monkeypatch):
    import benchmarks.train_placement as bench
    monkeypatch.setattr(bench, "run_variant", lambda *a: pytest.fail("launched"))
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err

def test_the_bound_plans_on_the_first_half_and_judges_the_second_with_and_without_replicas(tmp_path, capsys):
    from benchmarks.train_placement import main

    def bound(name, halves):        # one layer, 4 experts on 2 ranks, two records a half
        (tmp_path / name / "balance").mkdir(parents=True)
        with open(tmp_path / name / "balance" / "balance.jsonl", "w") as f:
            for step in range(4):
                f.write(json.dumps({"step": step, "expert_counts_LE": halves[step // 2],
                                    "device_max_over_mean": [1.0 + step / 10]}) + "\n")
        assert main(["--bound", str(tmp_path / name)]) == 0
        return json.loads(capsys.readouterr().out)
    steady = bound("steady", ([[8, 4, 2, 2]], [[8, 4, 2, 2]]))
    # the best permutation puts the hot expert beside a cold one: (8 + 2) / 8; a copy of it splits it: 1
    assert steady["permutation_share"] == [1.25] and steady["replicas_1_share"] == [1.0]
    assert steady["hottest_expert_over_rank_share"] == [1.0] and steady["run_share"] == [pytest.approx(1.25)]
    moved = bound("moved", ([[8, 4, 2, 2]], [[2, 2, 4, 8]]))    # judged on traffic whose hot expert moved
    # the homes were planned on the old hot expert (now 2 + 8 on one rank); each step's copy follows the new one
    assert moved["permutation_share"] == [1.25] and moved["replicas_1_share"] == [1.0]


def test_the_bound_of_a_missing_or_empty_run_is_one_clear_line(tmp_path, capsys):
    from benchmarks.train_placement import main
    (tmp_path / "empty" / "balance").mkdir(parents=True)
    (tmp_path / "empty" / "balance" / "balance.jsonl").write_text("")
    for run, says in ((tmp_path / "missing", "no balance log at"), (tmp_path / "empty", "holds no records yet")):
        assert main(["--bound", str(run)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err and "Traceback" not in err


def test_the_held_out_table_judges_each_plan_on_a_workload_it_did_not_see_and_keeps_the_lp_a_bound():
    from benchmarks.held_out import _workloads, held_out_row
    from benchmarks.replay import TRACES
    workloads = _workloads("mixtral_domain_counts.npz", TRACES)
    assert len(workloads) == 5 and all(bool((c == c.round()).all()) for c in workloads.values())   # whole routes
    row = held_out_row(workloads, 4, 3)
    assert row["workloads"] == 5
    for who in ("ours", "eplb"):       # the runtime's integer split never beats the LP on the same placement
        assert row[f"{who}_runtime"] <= row[f"{who}_lp"] + 1e-4 and row[f"{who}_runtime"] > row[f"{who}_even"] - 0.05
    assert max(row["ours_lp"], row["eplb_lp"]) <= row["limit"] + 1e-4            # planned on the workload itself
    # held out for real: planning on the workload itself would change the plan (the limit is above ours)
    assert row["limit"] > row["ours_even"]
    assert 0 < row["even_gap_se"] < 0.05        # the even split's gap to EPLB varies over the held-out workloads
    from eb_deepspeed.planning import placement
    assert {"ours_even_heat_alone", "ours_even_uncapped"} <= set(row) and placement.HEDGE_COST == 0.02   # restored
    assert held_out_row(workloads, 4, 3) == row                                   # deterministic


def test_python_m_eb_deepspeed_run_runs_the_script_as_python_would_after_one_idempotent_patch(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import sys, deepspeed, eb_deepspeed\n"
        "wrapped = deepspeed.initialize\n"
        "eb_deepspeed.patch_deepspeed()                  # a second patch changes nothing\n"
        "import transformers.trainer as t\n"
        "from eb_deepspeed.adapters.deepspeed.trainer import BalanceCallback\n"
        "print(repr((__name__, sys.argv[1:], wrapped is deepspeed.initialize, wrapped.easybalance,\n"
        "            wrapped.__wrapped__.__module__, t.DEFAULT_CALLBACKS.count(BalanceCallback))))\n")
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    proc = subprocess.run([sys.executable, "-m", "eb_deepspeed.run", "--local_rank=1", str(script), "--lr", "1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    name, argv, same, marked, inner, callbacks = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    # __main__, the launcher's --local_rank first as `deepspeed --module` passes it, DeepSpeed's own initialize
    # wrapped once, the Trainer's callback registered once
    assert (name, argv, same, marked, inner, callbacks) == ("__main__", ["--local_rank=1", "--lr", "1"], True, True,
                                                            "deepspeed", 1)
    usage = subprocess.run([sys.executable, "-m", "eb_deepspeed.run"], capture_output=True, text=True, env=env)
    assert usage.returncode != 0 and "usage: python -m eb_deepspeed.run SCRIPT" in usage.stderr
