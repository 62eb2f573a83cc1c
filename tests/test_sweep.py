"""`eb bench train --sweep`, `eb bench noise` and `eb report --compare`: statistics and verdicts from
hand-made runs (unit), and the quick sweep itself under the real deepspeed launcher (slow)."""
import json
import statistics

import pytest

from benchmarks.sweep import SWEEP_METRICS, score_noise, sweep_stats, sweep_targets
from eb_deepspeed.tools.cli import main as eb_main
from benchmarks.__main__ import main as bench_main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(policy, coeff, seed, drop, p90, loss=2.0):
    values = {m: 0.5 for m in SWEEP_METRICS}
    values.update(token_drop_rate=drop, device_max_over_mean_p90=p90, val_loss=loss)
    return {"policy": policy, "coeff": coeff, "seed": seed, **values}


@pytest.mark.unit
def test_sweep_rows_are_the_mean_and_sample_std_over_seeds():
    runs = [run("fixed", 0.01, s, d, 1.1) for s, d in ((1, 0.10), (2, 0.12), (3, 0.14))]
    (row, ) = sweep_stats(runs)
    assert row["seeds"] == 3 and row["token_drop_rate"]["mean"] == pytest.approx(0.12)
    assert row["token_drop_rate"]["std"] == pytest.approx(statistics.stdev([0.10, 0.12, 0.14]))
    assert row["device_max_over_mean_p90"] == {"mean": pytest.approx(1.1), "std": pytest.approx(0.0)}


@pytest.mark.unit
def test_dominating_needs_both_cuts_beyond_the_seed_spread_at_two_of_three_coefficients():
    runs = []
    for c in (0.003, 0.01, 0.03):
        for s, jitter in ((1, -0.002), (2, 0.0), (3, 0.002)):
            runs.append(run("fixed", c, s, 0.10 + jitter, 1.10 + jitter))
            # cross_layer: 30 % fewer drops and p90 excess at two coefficients, the same at the third
            good = c != 0.03
            runs.append(run("cross_layer", c, s, (0.07 if good else 0.10) + jitter, (1.07 if good else 1.10) + jitter))
            runs.append(run("bias", c, s, 0.085 + jitter, 1.085 + jitter))
            runs.append(run("bias_cross_layer", c, s, 0.085 + jitter, 1.085 + jitter))   # no better than bias
    verdicts, targets = sweep_targets(sweep_stats(runs), runs)
    assert targets == {"cross_layer_dominates_fixed": True, "bias_cross_layer_beats_bias_on_p90": False,
                       "bias_cross_layer_dominates_fixed": False}     # 15 % fewer drops: short of the 20 % rule
    assert verdicts["0.01"]["cross_layer_vs_fixed"]["drop_rate_cut"] == pytest.approx(0.3, abs=1e-4)
    assert verdicts["0.03"]["cross_layer_vs_fixed"]["dominates"] is False
    # seeds move both rows alike: a seed spread far wider than the gap still leaves a clear paired win
    shared = [dict(r, token_drop_rate=r["token_drop_rate"] + 0.05 * (r["seed"] - 2)) for r in runs]
    assert sweep_targets(sweep_stats(shared), shared)[1]["cross_layer_dominates_fixed"] is True
    # per-seed differences that scatter more than their mean: not beyond the spread, not a win
    noisy = [dict(r, token_drop_rate=r["token_drop_rate"] + (0.1 * (r["seed"] - 2) if r["policy"] == "cross_layer"
                                                               else 0.0)) for r in runs]
    assert sweep_targets(sweep_stats(noisy), noisy)[1]["cross_layer_dominates_fixed"] is False
    # a val loss 1 % worse loses the win
    worse = [dict(r, val_loss=2.02) if r["policy"] == "cross_layer" else r for r in runs]
    assert sweep_targets(sweep_stats(worse), worse)[1]["cross_layer_dominates_fixed"] is False


@pytest.mark.unit
def test_one_seed_has_no_spread_and_an_unrun_comparison_is_no_verdict():
    runs = [run("fixed", 0.01, 1, 0.10, 1.10), run("cross_layer", 0.01, 1, 0.05, 1.05)]
    verdicts, targets = sweep_targets(sweep_stats(runs), runs)
    assert verdicts["0.01"]["cross_layer_vs_fixed"]["drop_beyond_spread"] is None
    assert targets == {"cross_layer_dominates_fixed": False, "bias_cross_layer_beats_bias_on_p90": None,
                       "bias_cross_layer_dominates_fixed": None}


@pytest.mark.unit
@pytest.mark.parametrize("argv, message", [
    (["train", "--policies", "fixed"], "only with bench train --sweep"),
    (["train", "--scopes"], "--scopes: only with bench train --sweep"),
    (["gate", "--coeffs", "0.1"], "unrecognized arguments: --coeffs"),      # each benchmark its own options
    (["train", "--sweep", "--run", "x"], "unrecognized arguments: --run"),
    (["noise"], "the following arguments are required: --run"),
])
def test_sweep_and_noise_options_are_refused_where_they_do_nothing(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.unit
def test_a_saved_sweep_is_re_judged_and_re_drawn_from_its_runs(tmp_path, capsys):
    runs = [run(p, 0.01, s, d + 0.001 * s, 1.1) for p, d in (("fixed", 0.1), ("cross_layer", 0.05)) for s in (1, 2)]
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps({"benchmark": "train_sweep", "runs": runs, "targets": {"stale": True}}))
    assert bench_main(["train", "--sweep", "--from", str(saved), "--out", str(tmp_path / "out"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert "stale" not in result["targets"] and result["runs"] == runs
    assert result["against"]["0.01"]["cross_layer_vs_fixed"]["drop_rate_cut"] == pytest.approx(0.5, abs=0.02)
    assert (tmp_path / "out" / "pareto.png").read_bytes()[:8] == PNG_MAGIC


def _write_log(path, scores_by_step):
    """A balance log whose pressure rows give the wanted device imbalance per layer (2 devices)."""
    with open(path / "balance.jsonl", "w") as f:
        for step, excess_L in enumerate(scores_by_step, 1):
            f.write(json.dumps({"step": step, "pressure_LG": [[1.0 + e, 1.0 - e] for e in excess_L]}) + "\n")


@pytest.mark.unit
def test_the_noise_measurement_tells_persistent_skew_from_noise(tmp_path):
    import random
    rng = random.Random(0)
    # layer 0 persistently worse (0.2 +- noise), layers 1, 2 noise around 0.05
    steps = [[0.2 + rng.gauss(0, 0.02), abs(0.05 + rng.gauss(0, 0.03)), abs(0.05 + rng.gauss(0, 0.03))]
             for _ in range(200)]
    _write_log(tmp_path, steps)
    out = score_noise(str(tmp_path))
    assert out["records"] == 150 and out["mean_error"][0] > 0.5 > max(out["mean_error"][1:])
    assert out["steps_to_tell_apart"][0] < 10             # a clear skew is told apart at once
    assert 0 < out["gain_rule_stalling"] and out["gain_rule"] > 0


@pytest.mark.unit
def test_eb_report_compare_overlays_runs_in_one_png(tmp_path, capsys):
    for name, drop in (("a", 0.1), ("b", 0.2)):
        (tmp_path / name).mkdir()
        with open(tmp_path / name / "balance.jsonl", "w") as f:
            for step in range(1, 11):
                f.write(json.dumps({"step": step, "policy": name, "mode": "balance", "token_drop_rate": drop,
                                    "device_util_std": 0.01 * step, "device_max_over_mean_p90": 1.1}) + "\n")
    out = tmp_path / "cmp.png"
    assert eb_main(["report", "--compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out) and out.read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(SystemExit):
        eb_main(["report", "--compare", str(tmp_path / "a")])     # one run is not a comparison


@pytest.mark.slow
def test_the_quick_sweep_runs_the_real_launcher_and_writes_stats_a_pareto_png_and_targets(tmp_path, capsys):
    # one policy, two seeds: the launcher, the statistics and the plot (the verdicts: the hand-made runs above)
    assert bench_main(["train", "--sweep", "--quick", "--policies", "cross_layer", "--json", "--out",
                       str(tmp_path)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["quick"] and result["seeds"] == [1, 2] and len(result["runs"]) == 2
    row, = result["rows"]
    assert row["policy"] == "cross_layer"
    assert row["val_loss"]["mean"] == pytest.approx(statistics.fmean(r["val_loss"] for r in result["runs"]))
    assert 0 <= row["token_drop_rate"]["mean"] < 1 and row["device_max_over_mean_p90"]["mean"] >= 1
    assert result["targets"] == {"cross_layer_dominates_fixed": None, "bias_cross_layer_beats_bias_on_p90": None,
                                 "bias_cross_layer_dominates_fixed": None}      # no row to compare with
    assert (tmp_path / "pareto.png").read_bytes()[:8] == PNG_MAGIC
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))          # the Pareto plot went to W&B
    seed1, seed2 = result["runs"]
    assert seed1["val_loss"] != seed2["val_loss"]            # the seed reaches the data and the model


@pytest.mark.unit
def test_the_noise_measurement_reads_only_the_latest_run_of_a_re_run_log(tmp_path):
    import random
    rng = random.Random(1)
    first = [[0.5, 0.01, 0.01]] * 60                   # an older run in the same log, superseded by the re-run
    second = [[0.2 + rng.gauss(0, 0.02), abs(0.05 + rng.gauss(0, 0.03)), 0.05] for _ in range(60)]
    (tmp_path / "alone").mkdir()
    (tmp_path / "both").mkdir()
    _write_log(tmp_path / "alone", second)
    _write_log(tmp_path / "both", first)
    with open(tmp_path / "both" / "balance.jsonl") as f:
        old = f.read()
    _write_log(tmp_path / "both", second)
    lines = (tmp_path / "both" / "balance.jsonl").read_text().splitlines()
    marked = [json.loads(lines[0]) | {"run_start": 0}] + [json.loads(line) for line in lines[1:]]
    (tmp_path / "both" / "balance.jsonl").write_text(old + "".join(json.dumps(r) + "\n" for r in marked))
    both, alone = score_noise(str(tmp_path / "both")), score_noise(str(tmp_path / "alone"))
    assert {k: v for k, v in both.items() if k != "run"} == {k: v for k, v in alone.items() if k != "run"}


def framework_run(policy, coeff, seed, p90, loss, spec=0.2):
    from benchmarks.sweep_frameworks import AUTOEP_METRICS
    values = {m: 1.0 for m in AUTOEP_METRICS}
    values.update(device_max_over_mean_p90=p90, val_loss=loss, specialisation_tv=spec)
    return {"policy": policy, "coeff": coeff, "seed": seed, **values}


@pytest.mark.unit
def test_the_framework_sweep_judges_per_layer_weights_paired_and_the_global_loss_at_micros_balance():
    from benchmarks.sweep_frameworks import AUTOEP_METRICS, framework_targets
    runs = []
    for s in (1, 2, 3):
        # micro: more coefficient, better balance, worse loss (p90 1.4 / 1.3 / 1.2, loss 2.00 / 2.02 / 2.04)
        runs += [framework_run("micro", c, s, p, l + 0.001 * s) for c, p, l in
                 ((0.003, 1.4, 2.00), (0.01, 1.3, 2.02), (0.03, 1.2, 2.04))]
        # cross_layer: the p90 excess cut by half at every coefficient, loss unchanged
        runs += [framework_run("cross_layer", c, s, 1 + (p - 1) / 2 + 0.001 * s, l + 0.001 * s) for c, p, l in
                 ((0.003, 1.4, 2.00), (0.01, 1.3, 2.02), (0.03, 1.2, 2.04))]
        # global_exact at micro's balance of 0.01 (p90 1.3, where micro's loss is 2.02), 0.03 lower in loss
        runs += [framework_run("global_exact", c, s, 1.3, 1.99 + 0.001 * s) for c in (0.003, 0.01, 0.03)]
    stats = sweep_stats(runs, AUTOEP_METRICS)
    verdicts, targets = framework_targets(stats, runs)
    assert verdicts["cross_layer@0.01"]["vs_micro_same_coeff"]["p90_excess_cut"] == pytest.approx(0.5, abs=0.02)
    assert verdicts["cross_layer@0.01"]["vs_micro_same_coeff"]["wins"] is True
    assert verdicts["global_exact@0.01"]["vs_micro_at_equal_balance"]["micro_val_loss_at_this_balance"] == \
        pytest.approx(2.022)
    assert targets == {"cross_layer_beats_micro": True, "global_exact_beats_micro_at_equal_balance": True,
                       "global_lagged_beats_micro_at_equal_balance": None}
    # where tokens drop, the drops must fall as well: the same p90 cut with drops unchanged wins nothing
    dropping = [dict(r, token_drop_rate=0.2 + 0.001 * r["seed"]) for r in runs]
    with_drops = {**AUTOEP_METRICS, "token_drop_rate": ("train_second_half", "drop rate")}
    v, t = framework_targets(sweep_stats(dropping, with_drops), dropping)
    assert v["cross_layer@0.01"]["vs_micro_same_coeff"]["drop_rate_cut"] == pytest.approx(0.0)
    assert t["cross_layer_beats_micro"] is False
    # the global row no better than micro's curve at its balance: no win
    worse = [dict(r, val_loss=2.03) if r["policy"] == "global_exact" else r for r in runs]
    assert framework_targets(sweep_stats(worse, AUTOEP_METRICS), worse)[1]["global_exact_beats_micro_at_equal_balance"] \
        is False
    # a p90 outside micro's range cannot be read off its curve: no verdict for that point
    outside = [dict(r, device_max_over_mean_p90=1.05) if r["policy"] == "global_exact" else r for r in runs]
    v, t = framework_targets(sweep_stats(outside, AUTOEP_METRICS), outside)
    assert v["global_exact@0.01"]["vs_micro_at_equal_balance"] == {"micro_val_loss_at_this_balance": None}
    assert t["global_exact_beats_micro_at_equal_balance"] is None


@pytest.mark.unit
def test_a_saved_framework_sweep_is_re_judged_with_its_own_metrics(tmp_path, capsys):
    runs = [framework_run(p, 0.01, s, 1.3 - (0.1 if p == "cross_layer" else 0) + 0.01 * s, 2.0) for p in
            ("micro", "cross_layer") for s in (1, 2)]
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps({"benchmark": "train_sweep", "framework": "autoep", "runs": runs}))
    assert bench_main(["train", "--sweep", "--from", str(saved), "--out", str(tmp_path / "out"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {r["policy"] for r in result["rows"]} == {"micro", "cross_layer"} and "specialisation_tv" in result["rows"][0]
    assert result["against"]["cross_layer@0.01"]["vs_micro_same_coeff"]["p90_excess_cut"] == pytest.approx(
        1 - 0.215 / 0.315, abs=1e-3)                               # of the excess over balance: 0.315 -> 0.215
    assert (tmp_path / "out" / "pareto_autoep.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
def test_the_quick_autoep_sweep_trains_under_the_real_launcher_and_measures_specialisation(tmp_path, capsys):
    assert bench_main(["train", "--sweep", "--framework", "autoep", "--quick", "--policies", "cross_layer",
                    "--json", "--out", str(tmp_path)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["framework"] == "autoep" and result["steps"] == 8 and len(result["runs"]) == 2
    for run in result["runs"]:
        assert 0 < run["specialisation_tv"] <= 1 and len(run["specialisation_tv_per_layer"]) == 4
        assert run["device_max_over_mean_p90"] >= 1 and run["val_loss"] > 0
    seed1, seed2 = result["runs"]
    assert seed1["val_loss"] != seed2["val_loss"]                            # the seed reaches data and model
    assert result["targets"]["global_exact_beats_micro_at_equal_balance"] is None     # no micro row to compare
    assert (tmp_path / "pareto_autoep.png").read_bytes()[:8] == PNG_MAGIC
