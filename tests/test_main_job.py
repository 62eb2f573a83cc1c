"""The README's main job, small: the real `deepspeed` launcher, 2 CPU ranks, W&B offline, JSONL,
PNG plots, a checkpoint, and a resume that continues the same run."""
import json
import os
import subprocess
import sys

import pytest

from conftest import EXT_DIR, ROOT, free_port, unlink_shm_buffers
from eb_deepspeed.observe.monitor import flatten_record

pytestmark = pytest.mark.slow
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def wandb_history(run_file) -> dict[int, dict]:
    """History rows of an offline `.wandb` file by step, read with W&B's own reader (`wandb leet inspect`)."""
    proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows: dict[int, dict] = {}
    for line in proc.stdout.splitlines():
        record = json.loads(line)
        if record.get("type") == "history":
            history = record["history"]
            rows.setdefault(int(history["step"]["num"]), {}).update(history["item"])
    return rows


def launcher(script, *args, timeout=420, cwd=ROOT):
    """The real `deepspeed` launcher with 2 CPU ranks."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", WANDB_MODE="offline", TORCH_EXTENSIONS_DIR=EXT_DIR,
               OMP_NUM_THREADS="1")
    port = free_port()
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port),
           os.path.join(ROOT, "examples", script), *args]
    try:
        proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    finally:
        unlink_shm_buffers(port)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def deepspeed_launch(run_dir, *extra):
    return launcher("train_moe_lm.py", "--deepspeed_config", os.path.join(ROOT, "configs", "train_cpu_2rank.json"),
                    "--run-dir", str(run_dir), "--layers", "2", "--max-bytes", "300000", "--eval-every", "3",
                    "--eval-batches", "1", *extra)


def test_the_main_job_trains_logs_plots_checkpoints_resumes_and_serves_against_its_baseline(tmp_path):
    """One job, as the README runs it: plain DeepSpeed watched (observe), the balanced run against it, a resume,
    then examples/infer_moe_lm.py serving the checkpoint (plain DeepSpeed and replicated serving side by side)."""
    run, baseline = tmp_path / "run", tmp_path / "baseline"
    deepspeed_launch(baseline, "--steps", "4", "--mode", "observe", "--no-report")
    proc = deepspeed_launch(run, "--steps", "10", "--baseline", str(baseline))
    records = [json.loads(line) for line in (run / "balance" / "balance.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 6, 8, 10]  # "interval": 2 in configs/train_cpu_2rank.json
    last = records[-1]
    assert len(last["device_max_over_mean"]) == 2 and all(v >= 1.0 for v in last["device_max_over_mean"])
    assert len(last["pressure_LG"]) == 2 and len(last["pressure_LG"][0]) == 2  # layers x EP ranks
    assert 0.0 <= last["token_drop_rate"] < 1.0
    # the default policy (bias_cross_layer) acts after warm-up: the device-loss weights keep mean 1 inside
    # [0.25, 4.0] and move, and the bias tilts routing
    assert last["policy"] == "bias_cross_layer" and len(last["aux_loss"]) == 2 and max(last["bias_spread"]) > 0
    weights = last["device_loss_weight"]
    assert abs(sum(weights) / 2 - 1.0) < 1e-9 and all(0.25 <= w <= 4.0 for w in weights) and weights != [1.0, 1.0]

    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 10
    assert summary["balance"]["token_drop_rate"] == last["token_drop_rate"]
    assert summary["final"]["val_loss"] < 5.545  # below a uniform guess over 256 bytes (ln 256)
    # MaxVio = expert max/mean - 1: above 0 unless every expert got exactly its share, below E - 1 = 7
    assert 0 < summary["final"]["val_max_vio"] < 7 and 0 <= summary["final"]["val_token_drop_rate"] < 1
    for path in summary["plots"]:
        with open(path, "rb") as f:
            assert f.read(8) == PNG_MAGIC, path
    assert {os.path.basename(p) for p in summary["plots"]} >= {"device_max_over_mean.png", "pressure_heatmap.png",
                                                               "summary.png", "token_drop_rate.png"}

    wandb_runs = list((run / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 1
    history = wandb_history(next(wandb_runs[0].glob("run-*.wandb")))
    for record in records:   # every logged number reached W&B under its namespaced key, at the record's step
        row = history[record["samples"]]
        flat = flatten_record(record)
        assert "easybalance_layer_01/device_max_over_mean" in flat and "easybalance/token_drop_rate" in flat
        assert {key: row.get(key) for key in flat} == flat
    assert (run / "ckpt" / "latest").read_text().strip()

    # whether balancing helped, against the baseline (the summary of the run before its resume)
    base = json.loads((baseline / "summary.json").read_text())
    versus = summary["vs_baseline"]
    for key in ("device_max_over_mean_p90", "lm_loss"):
        row = versus["metrics"][key]
        assert row["baseline"] == round(base["train_second_half"][key], 4)
        assert row["this_run"] == round(summary["train_second_half"][key], 4)
    assert "p90 device max/mean (the straggler)" in versus["verdict"] and versus["verdict"] in proc.stdout
    with open(run / "compare.png", "rb") as f:
        assert f.read(8) == PNG_MAGIC

    deepspeed_launch(run, "--steps", "15", "--resume", "--no-report")
    records = [json.loads(line) for line in (run / "balance" / "balance.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 6, 8, 10, 12, 14, 15]  # resumed: the step count continues (15: the last)
    assert json.loads((run / "summary.json").read_text())["steps"] == 15

    infer = tmp_path / "infer"
    launcher("infer_moe_lm.py", "--config", os.path.join(ROOT, "configs", "infer_cpu_2rank.json"), "--ckpt",
             str(run / "ckpt"), "--run-dir", str(infer), "--layers", "2", "--batches", "12", "--batch", "4")
    summary = json.loads((infer / "summary.json").read_text())
    assert summary["outputs_identical"] and summary["ranks"] == 2
    assert summary["val_loss"]["eb"] == summary["val_loss"]["plain"] < 5.545     # trained: below a uniform guess
    assert summary["tokens_per_s"]["plain"] > 0 and summary["tokens_per_s"]["eb"] > 0
    assert 0 <= summary["drop_rate_cf1"]["plain"] < 1 and 0 <= summary["drop_rate_cf1"]["eb"] < 1
    records = [json.loads(line) for line in (infer / "balance" / "balance.jsonl").read_text().splitlines()]
    assert records and records[-1]["mode"] == "balance" and len(records[-1]["pressure_LG"]) == 2
    assert "replans" in records[-1] and all(os.path.exists(p) for p in summary["plots"])
    assert records[-1]["phase"] == "serve"
    # the one-line verdict: faster or slower by how much, replicas or not and why (before: numbers only)
    speed = summary["tokens_per_s"]["eb"] / summary["tokens_per_s"]["plain"]
    assert summary["verdict"].startswith(f"serving verdict: {(speed - 1) * 100:+.1f} % tokens/s")
    assert ("replicas serve (" in summary["verdict"]) == (summary["placement_slots"] > summary["experts"])


def test_the_pr_moe_variant_of_the_example_trains_and_its_curves_render_with_eb_report(tmp_path):
    """docs/training.md: `--pyramid 4,8` (layers 0-1: 4 experts, 2-3: 8), under the launcher, then `eb report`."""
    run = tmp_path / "pyramid"
    launcher("train_moe_lm.py", "--deepspeed_config", os.path.join(ROOT, "configs", "train_cpu_2rank.json"),
             "--run-dir", str(run), "--layers", "4", "--pyramid", "4,8", "--max-bytes", "300000", "--steps", "6",
             "--eval-every", "3", "--eval-batches", "1", "--no-report")
    records = [json.loads(line) for line in (run / "balance" / "balance.jsonl").read_text().splitlines()]
    last = records[-1]
    assert [len(row) for row in last["expert_counts_LE"]] == [4, 4, 8, 8]
    assert len(last["expert_max_over_mean"]) == 4 and all(v >= 1.0 for v in last["expert_max_over_mean"])
    assert len(last["pressure_LG"]) == 4 and all(len(row) == 2 for row in last["pressure_LG"])
    summary = json.loads((run / "summary.json").read_text())
    assert 0 < summary["final"]["val_max_vio"] < 7 and summary["balance"]["ready"]       # 8 experts at most
    proc = subprocess.run([sys.executable, "-m", "eb_deepspeed.tools.cli", "report", str(run / "balance")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    plots = run / "balance" / "plots"
    for name in ("summary.png", "expert_max_over_mean.png", "pressure_heatmap.png", "bias_spread.png"):
        assert (plots / name).read_bytes()[:8] == PNG_MAGIC, name
