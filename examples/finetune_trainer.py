"""Fine-tune a tiny Hugging Face MoE model (Mixtral, random weights from a config) with the Hugging Face Trainer under
DeepSpeed's AutoEP, balanced by the `easybalance` block of the ds_config it passes: one added line.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/finetune_trainer.py --ds-config configs/trainer_cpu_2rank.json
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --module eb_deepspeed.run examples/finetune_trainer.py --no-patch ...

The second form runs the script unedited (`--no-patch` leaves out the added line): `eb_deepspeed.run` patches first.
The data is the Python standard library's sources, byte-level. Writes OUT/losses.json (every step's loss on rank 0),
OUT/balance (the balance log) and OUT/checkpoint-* (with --save-steps).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_moe import hf_moe_model  # noqa: E402
from moe_lm import StdlibCorpus, run_and_exit  # noqa: E402


class Windows(torch.utils.data.Dataset):
    """Fixed windows of the stdlib sources (the same on every rank; the Trainer's sampler shards them)."""

    def __init__(self, count: int, seq_len: int, seed: int, split: str = "train"):
        ids, _ = StdlibCorpus(max_bytes=400_000).batch(split, count, seq_len, torch.Generator().manual_seed(seed))
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ds-config", required=True, help="the ds_config JSON, with its easybalance block")
    p.add_argument("--out", default="runs/finetune")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-steps", type=int, default=0, help="a Trainer checkpoint every this many steps (0: none)")
    p.add_argument("--save-strategy", choices=("steps", "epoch", "best"), default="steps",
                   help="with --save-steps: when the Trainer saves (best: at a new best eval loss, with --eval-steps)")
    p.add_argument("--epochs", type=int, default=1, help="the data is this many epochs of --steps")
    p.add_argument("--greater-is-better", action="store_true", help="with --save-strategy best: a higher eval loss")
    p.add_argument("--resume", default=None, help="a checkpoint folder to resume from")
    p.add_argument("--report-to", default="none")
    p.add_argument("--trl", action="store_true", help="TRL's SFTTrainer in place of the Trainer")
    p.add_argument("--bf16", action="store_true", help="bf16 (the ds_config's bf16 block: \"enabled\": \"auto\")")
    p.add_argument("--accum", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--eval-steps", type=int, default=0, help="evaluate on held-out windows every this many steps")
    p.add_argument("--no-patch", action="store_true", help="leave out the added line (run under eb_deepspeed.run)")
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args(argv)
    if not args.no_patch:
        import eb_deepspeed
        eb_deepspeed.patch_deepspeed()               # the one added line: deepspeed.initialize reads the block
    from transformers import Trainer, TrainerCallback, TrainingArguments

    torch.manual_seed(1234)
    model = hf_moe_model("mixtral", layers=4, hidden=64, experts=8, k=2, ffn=128, seq_len=64)
    with open(args.ds_config) as f:
        ds_config = json.load(f)
    losses, evals, home_steps = [], [], []

    class Losses(TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append([state.global_step, logs["loss"]])
            if logs and "eval_loss" in logs:
                evals.append([state.global_step, logs["eval_loss"]])

        def on_step_end(self, a, state, control, model=None, **kwargs):
            placement = getattr(getattr(model, "easybalance", None), "placement", None)
            if placement is not None and placement.resident is placement.home:
                home_steps.append(state.global_step)       # placed experts home (in AutoEP's layout) here
    training = dict(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=4, learning_rate=1e-3,
                    bf16=args.bf16, gradient_accumulation_steps=args.accum,
                    logging_steps=1, save_strategy=args.save_strategy if args.save_steps else "no", save_steps=args.save_steps or 1,
                    report_to=args.report_to, deepspeed=ds_config, seed=1234, data_seed=1234, use_cpu=True,
                    dataloader_drop_last=True, save_only_model=False, per_device_eval_batch_size=4,
                    eval_strategy="steps" if args.eval_steps else "no", eval_steps=args.eval_steps or None,
                    metric_for_best_model="eval_loss" if args.save_strategy == "best" else None,
                    greater_is_better=True if args.greater_is_better else None)
    evaluation = Windows(16, 64, seed=8, split="val") if args.eval_steps else None
    data = Windows(4 * 2 * args.accum * args.steps // args.epochs, 64, seed=7)
    if args.trl:                     # the same windows, already tokenized; a byte tokenizer only for its pad token
        from datasets import Dataset
        from tokenizers import Tokenizer, models
        from transformers import PreTrainedTokenizerFast
        from trl import SFTConfig, SFTTrainer
        pad = chr(0x100)
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
            {chr(0x100 + i): i for i in range(256)}, unk_token=pad)), pad_token=pad, eos_token=pad)
        trainer = SFTTrainer(model=model, args=SFTConfig(**training, dataset_kwargs={"skip_prepare_dataset": True}),
                             train_dataset=Dataset.from_dict({"input_ids": data.ids.tolist()}),
                             processing_class=tokenizer, callbacks=[Losses()])
    else:
        trainer = Trainer(model=model, args=TrainingArguments(**training), train_dataset=data, eval_dataset=evaluation,
                          callbacks=[Losses()])
    trainer.train(resume_from_checkpoint=args.resume)
    engine = trainer.model_wrapped
    if trainer.is_world_process_zero():
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "losses.json"), "w") as f:
            balancer = getattr(engine, "easybalance", None)
            placement = getattr(balancer, "placement", None)
            json.dump({"losses": losses, "evals": evals, "balanced": balancer is not None, "home_steps": home_steps,
                       "expert_max_over_mean": balancer.metrics()["expert_max_over_mean"] if balancer else None,
                       "replans": placement.replans if placement else 0}, f)
    return 0


if __name__ == "__main__":
    run_and_exit(main)     # leaves before the interpreter's teardown, where a gloo thread can abort a finished rank
