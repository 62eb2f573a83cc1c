"""The HF job, small: a tiny random Mixtral converted by DeepSpeed's AutoEP, under the real `deepspeed` launcher on
2 CPU ranks with configs/train_hf_cpu_2rank.json (launch/train_cpu.sh, the main job, in small): JSONL, W&B offline, PNG
plots, a checkpoint, and a resume that continues the same view."""
import json
import os

import pytest

from conftest import ROOT
from test_main_job import PNG_MAGIC, launcher, wandb_history

pytestmark = pytest.mark.slow


def hf_launch(run_dir, *extra):
    return launcher("train_hf_moe.py", "--deepspeed_config", os.path.join(ROOT, "configs", "train_hf_cpu_2rank.json"),
                    "--run-dir", str(run_dir), "--max-bytes", "300000", *extra)


def test_the_hf_job_balances_an_autoep_mixtral_against_plain_autoep_logs_plots_checkpoints_and_resumes(tmp_path):
    # launch/train_cpu.sh in small: plain AutoEP watched (observe), then the default block against it, then a resume
    run, baseline = tmp_path / "run", tmp_path / "baseline"
    hf_launch(baseline, "--steps", "6", "--mode", "observe", "--eval-batches", "1", "--no-report")
    proc = hf_launch(run, "--steps", "8", "--eval-batches", "1", "--baseline", str(baseline))
    assert "router_aux_loss_coef" not in proc.stderr      # HF's own loss is off: no double-push warning
    records = [json.loads(line) for line in (run / "balance" / "balance.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 6, 8]   # "interval": 2 in the config
    last = records[-1]
    assert last["policy"] == "bias_cross_layer" and len(last["expert_max_over_mean"]) == 4   # 4 AutoEP layers
    assert len(last["pressure_LG"][0]) == 2 and max(last["bias_spread"]) > 0   # 2 EP ranks; the bias acts
    assert all(v >= 1.0 for v in last["expert_max_over_mean"]) and last["token_drop_rate"] == 0.0   # dropless
    summary = json.loads((run / "summary.json").read_text())
    assert summary["family"] == "mixtral" and summary["final_lm_loss"] < 5.545          # below ln 256
    assert len(summary["last10_expert_max_over_mean"]) == 4
    # tokens/s is a step's tokens (micro-batch 4 x 64 x 2 ranks) over the mean step time
    assert summary["tokens_per_s"] * summary["seconds_per_step"] == pytest.approx(4 * 64 * 2, rel=1e-6)
    for path in summary["plots"]:
        with open(path, "rb") as f:
            assert f.read(8) == PNG_MAGIC, path
    wandb_runs = list((run / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 1
    history = wandb_history(next(wandb_runs[0].glob("run-*.wandb")))
    assert any("easybalance_layer_03/expert_max_over_mean" in row for row in history.values())

    base = json.loads((baseline / "summary.json").read_text())
    assert summary["framework"] == base["framework"] == "autoep"
    versus = summary["vs_baseline"]
    assert set(versus["metrics"]) == {"device_max_over_mean_p90", "expert_max_over_mean_p90", "lm_loss", "val_loss"}
    for key, row in versus["metrics"].items():
        where = "final" if key == "val_loss" else "train_second_half"
        assert row["baseline"] == round(base[where][key], 4) and row["this_run"] == round(summary[where][key], 4)
        assert row["change_pct"] == round(100 * (summary[where][key] - base[where][key]) / base[where][key], 1)
    assert summary["train_second_half"]["expert_max_over_mean_p90"] >= 1.0
    assert "busiest EP rank's routed tokens / mean" in versus["verdict"] and versus["verdict"] in proc.stdout
    assert "speed" not in versus["verdict"]               # no CPU steps/s passed off as a speed verdict
    assert (run / "compare.png").read_bytes()[:8] == PNG_MAGIC
    images = [key for row in history.values() for key in row if key.startswith("easybalance/compare.")]
    assert "easybalance/compare._type" in images          # the picture in W&B too (an image-file entry)

    hf_launch(run, "--steps", "10", "--resume", "--no-report")
    records = [json.loads(line) for line in (run / "balance" / "balance.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 10 and records[-1]["steps"] == 10     # the view went on from the checkpoint's 8


def test_the_autoep_serving_bench_runs_the_articles_rows_side_by_side_with_equal_outputs(tmp_path):
    from benchmarks.infer_autoep import ROWS, bench_infer_autoep, format_autoep_infer_table
    result = bench_infer_autoep(ranks=(2, ), batches=3, warmup_batches=4, layers=2, ffn=64, seq_len=32,
                                out_dir=str(tmp_path), progress=False)
    run, = result["runs"]
    rows = {r["row"]: r for r in run["rows"]}
    assert list(rows) == [name for name, _ in ROWS]
    assert all(r["outputs_equal"] for r in rows.values())             # every row plain AutoEP's logits
    # as many collectives per layer as plain AutoEP: the exact split's exchange replaces AutoEP's own
    assert {r["collectives_per_layer"] for r in rows.values()} == {3.0}
    assert rows["exact"]["split"] == "exact" and rows["view"]["split"] == "view"      # exact: the default block
    assert rows["exact"]["busiest_over_lp_max"] <= 1.02 < rows["view"]["busiest_over_lp_max"]
    static = rows.pop("static")
    assert static["replans"] == 0 and static["device_max_over_mean"] > 1.2     # the skewed router's hot rank
    assert rows.pop("static_balanced")["device_max_over_mean"] < 1.1           # the balanced router: no hot rank
    for name in ("per_token", "view", "exact"):
        r = rows[name]
        assert r["replans"] == 1 and r["slots_per_rank"] == 5, name            # replicas served the batches
        assert r["device_util_std"] < static["device_util_std"], name
    assert set(run["simulated"]) == {"article_model", "steering_cost_measured", "measured"}
    assert set(result["targets"]) == {"default_split_is_exact", "moe_speedup_ge_1.3x_default_4_ranks",
                                      "overhead_le_3pct_default", "outputs_within_1e-5",
                                      "lp_bound_within_2pct_every_batch", "collectives_per_layer_as_plain",
                                      "balanced_router_le_1.03x_view", "host_syncs_as_plain_per_forward"}
    # the CPU audit: the exact split reads AutoEP's sizes in its place (one per layer), nothing beyond plain's
    assert result["targets"]["host_syncs_as_plain_per_forward"]
    exact, plain = rows["exact"]["host_syncs_per_forward"], static["host_syncs_per_forward"]
    assert exact["ours"] == 2 and exact["ours"] + exact["theirs"] == plain["theirs"] > 0, (exact, plain)
    table = format_autoep_infer_table(result)
    assert all(f" {name} " in table for name, _ in ROWS)


def test_the_sync_audit_command_counts_a_forwards_host_syncs_ours_and_plain_autoeps(capsys):
    from benchmarks.__main__ import main
    assert main(["sync_audit", "--ranks", "2", "--layers", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = {r["row"]: r for r in result["rows"]}
    assert result["targets"] == {"host_syncs_as_plain_per_forward": True}
    assert rows["view"]["ours"] == 0 and rows["view"]["theirs"] == rows["static"]["theirs"] > 0
    # exact: AutoEP's read of its sizes, one a layer, made in our wrapper instead; nothing more
    assert rows["exact"]["ours"] == 3 and rows["exact"]["ours"] + rows["exact"]["theirs"] == rows["static"]["theirs"]
