"""The block where people fine-tune: Hugging Face Trainer and TRL's SFTTrainer on a tiny Mixtral under DeepSpeed's
AutoEP, 2 CPU ranks under the real `deepspeed` launcher (examples/finetune_trainer.py: `patch_deepspeed()`, or the
unedited script under `--module eb_deepspeed.run`), the ds_config passed as `TrainingArguments(deepspeed=...)`."""
import json
import os
import subprocess
import sys

import pytest

from conftest import EXT_DIR, ROOT, free_port, unlink_shm_buffers
from test_main_job import wandb_history

pytestmark = pytest.mark.slow


def finetune(tmp_path, name: str, block, *extra, module: bool = False, zero: int = 2) -> dict:
    """One 2-rank Trainer job with configs/trainer_cpu_2rank.json, its block replaced (None: none); its losses.json."""
    with open(os.path.join(ROOT, "configs", "trainer_cpu_2rank.json")) as f:
        config = json.load(f)
    config["zero_optimization"]["stage"] = zero
    config.pop("easybalance")
    if "--hf-optimizer" in extra:                       # the Trainer's own optimizer, not the ds_config's
        config.pop("optimizer")
        extra = tuple(a for a in extra if a != "--hf-optimizer")
    if block is not None:
        config["easybalance"] = {"log": {"dir": str(tmp_path / name / "balance")}, **block}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    port = free_port()
    script = os.path.join(ROOT, "examples", "finetune_trainer.py")
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port),
           *(["--module", "eb_deepspeed.run"] if module else []), script, *(["--no-patch"] if module else []),
           "--ds-config", str(path), "--out", str(tmp_path / name), *extra]
    env = dict(os.environ, DS_ACCELERATOR="cpu", WANDB_MODE="offline", TORCH_EXTENSIONS_DIR=EXT_DIR,
               OMP_NUM_THREADS="1", WANDB_DIR=str(tmp_path / name))
    try:
        proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=420)
    finally:
        unlink_shm_buffers(port)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((tmp_path / name / "losses.json").read_text())


def test_trainer_with_the_block_in_observe_is_plain_trainer_and_balance_unedited_cuts_the_collapse(tmp_path):
    plain = finetune(tmp_path, "plain", None, "--steps", "12")
    observe = finetune(tmp_path, "observe", {"mode": "observe"}, "--steps", "12")
    assert observe["losses"] == plain["losses"] and observe["balanced"] and not plain["balanced"]    # bit for bit
    # the unedited script under `-m eb_deepspeed.run`, balance mode, reporting to W&B offline
    balanced = finetune(tmp_path, "balance", {"mode": "balance"}, "--steps", "12", "--report-to", "wandb",
                        "--eval-steps", "6", module=True)
    assert [step for step, _ in balanced["evals"]] == [6, 12]           # evaluation during training
    mean = lambda v: sum(v) / len(v)
    assert balanced["balanced"] and mean(balanced["expert_max_over_mean"]) < mean(observe["expert_max_over_mean"])
    runs = list((tmp_path / "balance" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1                                  # one W&B run: the Trainer's loss and the balance curves
    history = wandb_history(next(runs[0].glob("run-*.wandb")))
    keys = {k for row in history.values() for k in row}
    assert "train/loss" in keys and "train/easybalance_layer_03/expert_max_over_mean" in keys


def test_a_trainer_checkpoint_of_placed_experts_resumes_as_the_uninterrupted_run(tmp_path):
    # homes re-placed before the save (replica slots hold nothing a checkpoint keeps: the next test trains with one)
    block = {"mode": "observe", "warmup_batches": 1, "train_placement": {"interval": 2}}
    whole = finetune(tmp_path, "whole", block, "--steps", "8", "--save-steps", "4")
    assert (tmp_path / "whole" / "checkpoint-4" / "model.safetensors").exists()     # the model's weights too
    assert whole["replans"] >= 1                          # the experts were re-placed before the save
    resumed = finetune(tmp_path, "resumed", block, "--steps", "8", "--resume",
                       str(tmp_path / "whole" / "checkpoint-4"))
    later = {step: loss for step, loss in whole["losses"] if step > 4}
    assert [s for s, _ in resumed["losses"]] == [5, 6, 7, 8]
    for step, loss in resumed["losses"]:
        assert loss == pytest.approx(later[step], rel=1e-6), step


def test_a_trainer_saving_at_epoch_ends_or_new_best_evaluations_saves_placed_experts_home(tmp_path):
    # the Trainer decides these saves after its step's callbacks: at the epoch's end, after the evaluation
    block = {"mode": "observe", "warmup_batches": 1, "train_placement": {"interval": 2}}
    epochs = finetune(tmp_path, "epochs", block, "--steps", "8", "--epochs", "2", "--save-steps", "1",
                      "--save-strategy", "epoch")
    # "best" as a higher eval loss while it falls: only the first evaluation (step 3) saves, step 6's does not
    # (re-planned every 4 steps: no re-plan moves them off home at step 7 but the callback)
    best = finetune(tmp_path, "best", {**block, "train_placement": {"interval": 4}}, "--steps", "8", "--save-steps",
                    "1", "--save-strategy", "best", "--eval-steps", "3", "--greater-is-better")
    assert epochs["replans"] >= 1 and best["replans"] >= 1
    assert {p.name for p in (tmp_path / "epochs").glob("checkpoint-*")} == {"checkpoint-4", "checkpoint-8"}
    assert {p.name for p in (tmp_path / "best").glob("checkpoint-*")} == {"checkpoint-3"}
    assert 5 not in best["home_steps"] and 6 in best["home_steps"]    # placed, then home for step 6's evaluation
    assert 7 not in best["home_steps"]                                 # and back at the next step: no save came
    plain = finetune(tmp_path, "best_plain", None, "--steps", "8", "--eval-steps", "3")
    for (_, a), (_, b) in zip(best["losses"], plain["losses"]):     # the trips home and back change nothing
        assert a == pytest.approx(b, rel=1e-5)


def test_trainers_own_optimizer_with_accumulation_and_replica_slots_trains_as_plain_autoep(tmp_path):
    # ZeRO 0: DeepSpeed takes the Trainer's AdamW as it is (ZeRO 1/2 need the ds_config's optimizer, plain AutoEP's
    # own assertion: docs/training.md); a replica slot a rank, filled every micro-batch
    args = ("--steps", "6", "--accum", "2", "--hf-optimizer")
    plain = finetune(tmp_path, "hf_plain", None, *args, zero=0)
    placed = finetune(tmp_path, "hf_placed", {"mode": "observe", "train_placement": {"replica_slots": 1}}, *args,
                      zero=0)
    assert [s for s, _ in placed["losses"]] == [s for s, _ in plain["losses"]]
    for (_, a), (_, b) in zip(placed["losses"], plain["losses"]):
        assert a == pytest.approx(b, rel=1e-5)


def test_trls_sft_trainer_takes_the_block_and_observe_trains_as_without_it(tmp_path):
    plain = finetune(tmp_path, "trl_plain", None, "--steps", "4", "--trl", zero=0)
    observe = finetune(tmp_path, "trl_observe", {"mode": "observe"}, "--steps", "4", "--trl", zero=0)
    assert observe["balanced"] and observe["losses"] == plain["losses"]
