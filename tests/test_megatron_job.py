"""The Megatron-Core example under the real deepspeed launcher: 2 CPU ranks, EP 2, balance log, plots,
W&B offline run, the balancer state file."""
import json
import os

import pytest
import torch

from conftest import ROOT
from test_main_job import PNG_MAGIC, launcher

pytestmark = pytest.mark.slow


def test_the_megatron_example_trains_logs_plots_and_saves_the_balancer_state(tmp_path):
    run = tmp_path / "megatron"
    launcher("megatron_train_moe.py", "--config", os.path.join(ROOT, "configs", "megatron_cpu.json"),
             "--run-dir", str(run), "--steps", "10", "--eval-every", "5", "--eval-batches", "1",
             "--max-bytes", "300000", "--layers", "2", "--aux-policy", "bias", "--bias-rate", "0.05")
    records = [json.loads(line) for line in (run / "balance" / "balance.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [5, 10] and records[0]["run_start"] == 0
    last = records[-1]
    assert all(isinstance(r.get("lm_loss"), float) for r in records)      # the loop's loss noted beside the balance numbers
    assert last["policy"] == "bias" and len(last["pressure_LG"]) == 2 and len(last["pressure_LG"][0]) == 2
    assert 0.0 < last["token_drop_rate"] < 1.0                 # capacity factor 1.0: the demand exceeds it
    summary = json.loads((run / "summary.json").read_text())
    assert summary["framework"] == "megatron-core" and summary["world_size"] == 2
    assert summary["final"]["val_loss"] < 6.0
    for png in summary["plots"]:
        assert open(png, "rb").read(8) == PNG_MAGIC
    state = torch.load(run / "ckpt" / "easybalance.pt", weights_only=True)
    assert state["view"]["steps"] == 10 and state["aux"]["bias_LE"].abs().sum() > 0
    assert list((run / "wandb").glob("offline-run-*/run-*.wandb"))
