"""The HF job, small: a tiny random Mixtral converted by DeepSpeed's AutoEP, under the real `deepspeed` launcher on
2 CPU ranks with configs/train_hf_cpu_2rank.json (as launch/train_hf_cpu.sh runs it): JSONL, W&B offline, PNG
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


def test_the_hf_job_balances_an_autoep_mixtral_logs_plots_checkpoints_and_resumes(tmp_path):
    run = tmp_path / "run"
    proc = hf_launch(run, "--steps", "8")
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
    static = rows.pop("static")
    assert static["replans"] == 0 and static["device_max_over_mean"] > 1.2     # the skewed router's hot rank
    for name, r in rows.items():
        assert r["replans"] == 1 and r["slots_per_rank"] == 5, name            # replicas served the batches
        assert r["device_util_std"] < static["device_util_std"], name
    assert set(run["simulated"]) == {"article_model", "steering_cost_measured", "measured"}
    assert set(result["targets"]) == {"moe_speedup_ge_1.3x_default_4_ranks", "overhead_le_3pct_default",
                                      "outputs_within_1e-5"}
    assert "exact_aggregated" in format_autoep_infer_table(result)
