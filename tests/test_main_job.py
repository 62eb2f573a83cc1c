"""The README's main job, small: the real `deepspeed` launcher, 2 CPU ranks, W&B offline, JSONL,
PNG plots, a checkpoint, and a resume that continues the same run."""
import json
import os
import re
import subprocess
import sys

from conftest import EXT_DIR, ROOT, free_port

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def wandb_history(data: bytes, key: str) -> list[float]:
    """Values logged under `key` in an offline .wandb file, in order (HistoryItem: key, then value_json)."""
    out = []
    for m in re.finditer(re.escape(key.encode()) + rb"\x82\x01", data):
        n = data[m.end()]
        out.append(float(data[m.end() + 1:m.end() + 1 + n]))
    return out


def in_order(logged: list[float], expected: list[float]) -> bool:
    """Every expected value was logged, in this order (the file also repeats values in run summaries)."""
    it = iter(logged)
    return all(any(v == e for v in it) for e in expected)


def deepspeed_launch(run_dir, *extra, timeout=420):
    env = dict(os.environ, DS_ACCELERATOR="cpu", WANDB_MODE="offline", TORCH_EXTENSIONS_DIR=EXT_DIR,
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
           os.path.join(ROOT, "examples", "train_moe_lm.py"), "--deepspeed_config",
           os.path.join(ROOT, "configs", "train_cpu_2rank.json"), "--run-dir", str(run_dir), "--layers", "2",
           "--max-bytes", "300000", "--eval-every", "3", "--eval-batches", "1", *extra]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_the_main_job_trains_logs_plots_checkpoints_and_resumes(tmp_path):
    run = tmp_path / "run"
    deepspeed_launch(run, "--steps", "10")
    records = [json.loads(line) for line in (run / "balance" / "balance.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [5, 10]  # "interval": 5 in configs/train_cpu_2rank.json
    last = records[-1]
    assert len(last["device_max_over_mean"]) == 2 and all(v >= 1.0 for v in last["device_max_over_mean"])
    assert len(last["pressure_LG"]) == 2 and len(last["pressure_LG"][0]) == 2  # layers x EP ranks
    assert 0.0 <= last["token_drop_rate"] < 1.0
    # the default policy (cross_layer) acts after warm-up: weights keep mean 1 inside [0.5, 2.0]
    assert abs(sum(last["aux_weight"]) / 2 - 1.0) < 1e-9 and all(0.5 <= w <= 2.0 for w in last["aux_weight"])
    assert last["aux_weight"] != [1.0, 1.0] and len(last["aux_loss"]) == 2

    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 10
    assert summary["balance"]["token_drop_rate"] == last["token_drop_rate"]
    assert summary["final"]["val_loss"] < 5.545  # below a uniform guess over 256 bytes (ln 256)
    assert summary["final"]["val_max_vio"] >= 0 and 0 <= summary["final"]["val_token_drop_rate"] < 1
    for path in summary["plots"]:
        with open(path, "rb") as f:
            assert f.read(8) == PNG_MAGIC, path
    assert {os.path.basename(p) for p in summary["plots"]} >= {"device_max_over_mean.png", "pressure_heatmap.png",
                                                               "summary.png", "token_drop_rate.png"}

    wandb_runs = list((run / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 1 and list(wandb_runs[0].glob("run-*.wandb"))
    wandb_bytes = next(wandb_runs[0].glob("run-*.wandb")).read_bytes()
    for key, column in (("easybalance/layer_01/device_max_over_mean", "device_max_over_mean"),
                        ("easybalance/layer_00/aux_weight", "aux_weight"), ("easybalance/layer_01/aux_loss", "aux_loss")):
        layer = int(key.split("/")[1][-2:])
        assert in_order(wandb_history(wandb_bytes, key), [r[column][layer] for r in records]), key
    assert in_order(wandb_history(wandb_bytes, "easybalance/token_drop_rate"), [r["token_drop_rate"] for r in records])
    assert (run / "ckpt" / "latest").read_text().strip()

    deepspeed_launch(run, "--steps", "15", "--resume", "--no-report")
    records = [json.loads(line) for line in (run / "balance" / "balance.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [5, 10, 15]  # the resumed view continues the step count
    assert json.loads((run / "summary.json").read_text())["steps"] == 15
