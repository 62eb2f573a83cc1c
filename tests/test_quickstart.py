"""docs/quickstart.md's blocks for the three hosts (HF under AutoEP, your own DeepSpeed-MoE model, Megatron-Core),
run as a user types them: each `bash` block marked `<!-- quickstart test: run -->`, verbatim, in a copy of the
checkout (its tracked and untracked files, as a clone has them) with this checkout's venv."""
import json
import os
import re
import shutil
import subprocess

import pytest
import torch

from conftest import EXT_DIR, ROOT
from test_main_job import PNG_MAGIC

pytestmark = pytest.mark.slow
MARK = "<!-- quickstart test: run -->"


def quickstart_blocks() -> list[str]:
    text = open(os.path.join(ROOT, "docs", "quickstart.md"), encoding="utf-8").read()
    return re.findall(re.escape(MARK) + r"\n```bash\n(.*?)```", text, flags=re.S)


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.splitlines()
    root = tmp_path_factory.mktemp("clone")
    for name in files:
        if os.path.isfile(os.path.join(ROOT, name)):
            os.makedirs(root / os.path.dirname(name), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, name), root / name)
    return root


def run_block(block: str, cwd) -> subprocess.CompletedProcess:
    env = dict(os.environ, EB_VENV=os.path.join(ROOT, ".venv"), TORCH_EXTENSIONS_DIR=EXT_DIR, WANDB_MODE="offline")
    env.pop("DS_ACCELERATOR", None)             # the block's own `source launch/setup_cpu.sh` sets it
    shm = "/dev/shm"
    before = set(os.listdir(shm))
    try:
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=600)
    finally:       # the blocks' jobs use DeepSpeed's default port: remove the shm buffers they left
        for name in set(os.listdir(shm)) - before:
            if name.startswith("deepspeed_allreduce_buffer"):
                os.unlink(os.path.join(shm, name))
    assert proc.returncode == 0, f"{block}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_quickstart_has_one_marked_block_per_host():
    blocks = quickstart_blocks()
    assert len(blocks) == 3
    assert "quickstart_hf.py" in blocks[0] and "quickstart_moe.py" in blocks[1] and "train_megatron_cpu.sh" in blocks[2]


def test_the_hf_block_balances_the_autoep_model_against_its_observed_twin(checkout):
    proc = run_block(quickstart_blocks()[0], checkout)
    assert "expert max/mean per layer:" in proc.stdout and "busiest rank's load / mean per layer:" in proc.stdout
    runs = checkout / "runs" / "quickstart_hf"
    balanced, watched = records(runs / "balance" / "balance.jsonl"), records(runs / "observe" / "balance.jsonl")
    assert balanced[-1]["step"] == watched[-1]["step"] == 60 and balanced[-1]["policy"] == "bias_cross_layer"
    assert len(balanced[-1]["expert_max_over_mean"]) == 4 and all("lm_loss" in r for r in balanced)

    def late(rs, key):     # the last 10 steps' mean over layers: the balanced routes spread, the watched collapse
        tail = [r for r in rs if r["step"] > 50]
        return sum(sum(r[key]) / len(r[key]) for r in tail) / len(tail)
    assert late(balanced, "expert_max_over_mean") < late(watched, "expert_max_over_mean")
    assert (runs / "compare.png").read_bytes()[:8] == PNG_MAGIC


def test_the_deepspeed_moe_block_trains_both_runs_and_compares_them(checkout):
    proc = run_block(quickstart_blocks()[1], checkout)
    assert "device max/mean per layer:" in proc.stdout
    runs = checkout / "runs" / "quickstart"
    for mode in ("balance", "observe"):
        last = records(runs / mode / "balance.jsonl")[-1]
        assert last["step"] == 40 and last["mode"] == mode and len(last["device_max_over_mean"]) == 3
    assert (runs / "compare.png").read_bytes()[:8] == PNG_MAGIC


def test_the_megatron_block_trains_a_gpt_with_moe_layers_balanced(checkout):
    """examples/megatron_train_moe.py under the real launcher: 2 CPU ranks, EP 2, balance log, plots, W&B offline
    run, the balancer state file."""
    run_block(quickstart_blocks()[2], checkout)
    run = checkout / "runs" / "megatron"
    rs = records(run / "balance" / "balance.jsonl")
    assert [r["step"] for r in rs] == [5, 10, 15, 20] and rs[0]["run_start"] == 0   # "interval": 5
    assert all(isinstance(r.get("lm_loss"), float) for r in rs)      # the loop's loss beside the balance numbers
    last = rs[-1]
    assert last["mode"] == "balance" and last["ready"] and last["policy"] == "bias_cross_layer"
    assert len(last["pressure_LG"]) == 4 and len(last["pressure_LG"][0]) == 2          # 4 MoE layers x EP 2
    assert 0.0 < last["token_drop_rate"] < 1.0                 # capacity factor 1.0: the demand exceeds it
    summary = json.loads((run / "summary.json").read_text())
    assert summary["framework"] == "megatron-core" and summary["world_size"] == 2 and summary["final"]["val_loss"] < 6.0
    for png in summary["plots"] + ["runs/megatron/balance/plots/summary.png"]:     # paths from the checkout
        assert (checkout / png).read_bytes()[:8] == PNG_MAGIC, png
    state = torch.load(run / "ckpt" / "easybalance.pt", weights_only=True)
    assert state["view"]["steps"] == 20 and state["aux"]["bias_LE"].abs().sum() > 0
    assert list((run / "wandb").glob("offline-run-*/run-*.wandb"))
