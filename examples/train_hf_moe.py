"""Train a tiny Hugging Face MoE model (Mixtral by default; random weights from a config) converted by
DeepSpeed's AutoEP, balanced by eb_deepspeed, on the Python standard library's sources (or Zipf-skewed ids).

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/train_hf_moe.py \
        --deepspeed_config configs/train_hf_cpu_2rank.json --steps 60 --run-dir runs/hf

The training loop is the plain HF + DeepSpeed one (`out = engine(input_ids=..., labels=...)`,
`engine.backward(out.loss)`, `engine.step()`): the balance loss rides on the routes. Writes
RUN_DIR/balance/balance.jsonl and its PNGs, RUN_DIR/ckpt, RUN_DIR/summary.json (loss, per-layer expert
max/mean over the last 10 steps, second-half means) and a W&B offline run when the config's "wandb" block is on.
With --baseline (a finished run of the same job, e.g. --mode observe), the two side by side: vs_baseline in
summary.json, a one-line verdict, RUN_DIR/compare.png. `bash launch/train_cpu.sh` runs both (the main job).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_moe import FAMILIES, autoep_section, hf_moe_model, zipf_tokens  # noqa: E402
from moe_lm import run_and_exit, versus  # noqa: E402

# What "did balancing help" compares with --baseline, second half of each run (lower is better). No steps/s:
# CPU time on a shared machine is not what a GPU step would take (docs/benchmarks.md measures that).
VERSUS = (("device_max_over_mean_p90", "busiest EP rank's routed tokens / mean, p90 over layers (a dropless "
                                       "layer's time on a GPU)"),
          ("expert_max_over_mean_p90", "expert max/mean, p90 over layers"),
          ("lm_loss", "LM loss"), ("val_loss", "held-out loss"))


def parse_args(argv=None):
    import deepspeed
    from eb_deepspeed.core.policies import POLICIES
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    p.add_argument("--family", choices=FAMILIES, default="mixtral", help="HF model class and AutoEP preset")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps in total (a resumed run continues)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn", type=int, default=128, help="each expert's hidden size")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--data", choices=["stdlib", "zipf"], default="stdlib",
                   help="the stdlib sources byte-level, or i.i.d. Zipf-distributed token ids")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--mode", choices=["observe", "balance"], default=None, help="override easybalance.mode")
    p.add_argument("--aux-policy", choices=list(POLICIES), default=None, help="override easybalance.aux.policy")
    p.add_argument("--loss-coeff", type=float, default=None, help="override easybalance.aux.loss_coeff")
    p.add_argument("--bias-rate", type=float, default=None, help="override easybalance.aux.bias_rate")
    p.add_argument("--eval-batches", type=int, default=0,
                   help="at the end: validation loss over this many batches (8 sequences each) of held-out stdlib "
                        "sources, and how differently the experts serve Python sources and the stdlib's text files "
                        "(0: none)")
    p.add_argument("--hf-aux-coef", type=float, default=None,
                   help="turn HF's own pooled load-balancing loss on with this router_aux_loss_coef (default off)")
    p.add_argument("--zero", type=int, default=None, help="override zero_optimization.stage")
    p.add_argument("--train-placement", type=int, default=0, metavar="N",
                   help="easybalance.train_placement: re-place experts over the EP ranks every N steps (0: off)")
    p.add_argument("--time-experts", action="store_true",
                   help="time each rank's expert compute (forward and backward) into summary.json")
    p.add_argument("--micro-batch", type=int, default=None, help="override train_micro_batch_size_per_gpu")
    p.add_argument("--grad-accum", type=int, default=None, help="override gradient_accumulation_steps")
    p.add_argument("--gradient-checkpointing", action="store_true", help="HF activation checkpointing")
    p.add_argument("--max-bytes", type=int, default=2_000_000, help="training text to read (--data stdlib)")
    p.add_argument("--run-dir", default="runs/hf")
    p.add_argument("--resume", action="store_true", help="continue from RUN_DIR/ckpt")
    p.add_argument("--no-report", action="store_true", help="skip rendering the PNGs at the end")
    p.add_argument("--baseline", default=None, metavar="RUN_DIR",
                   help="a finished run of the same job (e.g. --mode observe: plain AutoEP, watched): summary.json "
                        "compares the two (vs_baseline, one line printed), RUN_DIR/compare.png overlays them")
    deepspeed.add_config_arguments(p)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "offline")  # never needs a W&B account; `wandb sync` uploads later
    os.makedirs(args.run_dir, exist_ok=True)
    os.environ.setdefault("WANDB_DIR", os.path.abspath(args.run_dir))

    import deepspeed
    from deepspeed.moe.utils import configure_moe_param_groups
    import eb_deepspeed

    with open(args.deepspeed_config, encoding="utf-8") as f:
        ds_config = json.load(f)
    ds_config.setdefault("expert_parallel", autoep_section(args.family))["preset_model"] = args.family
    if args.micro_batch is not None:
        ds_config["train_micro_batch_size_per_gpu"] = args.micro_batch
    if args.grad_accum is not None:
        ds_config["gradient_accumulation_steps"] = args.grad_accum
    if args.zero is not None:
        ds_config.setdefault("zero_optimization", {})["stage"] = args.zero
    block = ds_config.setdefault("easybalance", {})
    block.setdefault("log", {})["dir"] = os.path.join(args.run_dir, "balance")
    if args.mode is not None:
        block["mode"] = args.mode
    if args.train_placement:
        block["train_placement"] = {"enabled": True, "interval": args.train_placement}
    for key, value in (("policy", args.aux_policy), ("loss_coeff", args.loss_coeff), ("bias_rate", args.bias_rate)):
        if value is not None:
            block.setdefault("aux", {})[key] = value

    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(args.seed)
    model = hf_moe_model(args.family, layers=args.layers, hidden=args.hidden, experts=args.experts, k=args.k,
                         ffn=args.ffn, seq_len=args.seq_len, router_aux_loss_coef=args.hf_aux_coef)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    # AutoEP's MoE parameter groups (needed by ZeRO 1/2); a torch optimizer: no fused-Adam compile
    engine, _, _, _ = eb_deepspeed.initialize(
        model=model, config=ds_config,
        optimizer=lambda ps: torch.optim.AdamW(configure_moe_param_groups(list(ps)), lr=args.lr, weight_decay=0.0))
    balancer = getattr(engine, "easybalance", None)

    expert_clock = ExpertClock(engine.module) if args.time_experts else None

    ckpt_dir = os.path.join(args.run_dir, "ckpt")
    start = 0
    if args.resume:
        load_path, client = engine.load_checkpoint(ckpt_dir)
        if load_path is None:
            raise FileNotFoundError(f"--resume: no checkpoint under {ckpt_dir}")
        start = int(client["step"])

    corpus = None
    if args.data == "stdlib":
        from moe_lm import StdlibCorpus
        corpus = StdlibCorpus(max_bytes=args.max_bytes)
    micro_batch, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    coef = args.hf_aux_coef or 0.0
    history, step_times = [], []
    for step in range(start, args.steps):
        t_step = time.perf_counter()
        for micro in range(accum):
            g = torch.Generator().manual_seed(hash((args.seed, rank, step, micro)) % (2**62))
            x = zipf_tokens(micro_batch, args.seq_len, g) if corpus is None else \
                corpus.batch("train", micro_batch, args.seq_len, g)[0]
            out = engine(input_ids=x.to(engine.device), labels=x.to(engine.device))
            lm_loss = out.loss - coef * out.aux_loss if coef else out.loss      # HF adds its aux loss to .loss
            engine.backward(out.loss)
            if balancer is not None:
                balancer.note(lm_loss=float(lm_loss.detach()))   # logged beside the balance numbers (JSONL, W&B, eb report)
            engine.step()
        step_times.append(time.perf_counter() - t_step)
        if expert_clock is not None and step + 1 == args.steps // 2:
            expert_clock.seconds = 0.0                  # the second half: the routers have settled
        row = {"step": step + 1, "lm_loss": float(lm_loss.detach())}
        if balancer is not None:
            m = balancer.metrics()
            experts_L = torch.tensor([v for v in m["expert_max_over_mean"] if v is not None] or [1.0])
            row.update(expert_max_over_mean=m["expert_max_over_mean"], device_max_over_mean=m["device_max_over_mean"],
                       device_max_over_mean_p90=m["device_max_over_mean_p90"],
                       expert_max_over_mean_p90=float(torch.quantile(experts_L, 0.9)),
                       routed_LE=balancer.view.last.routed_LE.tolist())
        history.append(row)
        if rank == 0 and ((step + 1) % 10 == 0 or step + 1 == args.steps):
            print(f"step {step + 1}: lm_loss {row['lm_loss']:.4f}" + (
                "  expert max/mean " + " ".join(f"{v:.2f}" for v in row["expert_max_over_mean"] if v is not None)
                if balancer is not None else ""), flush=True)

    expert_seconds = expert_clock.gather() if expert_clock is not None else None
    engine.save_checkpoint(ckpt_dir, client_state={"step": args.steps})
    final = evaluate(engine, corpus, args, rank) if args.eval_batches > 0 and corpus is not None else {}
    if rank == 0:
        summary = summarize(history, step_times, micro_batch * args.seq_len * accum * world, args)
        summary["final"] = final
        if expert_seconds is not None:
            summary["expert_seconds_per_rank"] = expert_seconds
        if balancer is not None:
            summary["balance"] = {k: v for k, v in balancer.metrics().items() if not isinstance(v, list)}
            balancer.close()        # the log ends on the last step
            if not args.no_report:
                from eb_deepspeed.observe.report import render_report
                summary["plots"] = render_report(os.path.join(args.run_dir, "balance"))
        if args.baseline:
            compare_with_baseline(summary, args)
        with open(os.path.join(args.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(json.dumps({k: v for k, v in summary.items() if k != "plots"}, indent=2))
        if "vs_baseline" in summary:
            print(summary["vs_baseline"]["verdict"])
    # torn down while Python runs: left to the interpreter's exit, gloo has aborted a rank there
    # ("terminate called without an active exception") after a run that had finished
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    if history and math.isnan(history[-1]["lm_loss"]):
        raise SystemExit("training diverged (NaN loss)")


class ExpertClock:
    """Each rank's time in its AutoEP layers' grouped experts (forward and backward, by module hooks): the
    compute a dropless layer's busiest rank makes every rank wait for."""

    def __init__(self, module):
        from eb_deepspeed.adapters.autoep import find_autoep_layers
        self.seconds, self._started = 0.0, None
        for _, layer in find_autoep_layers(module):
            layer.experts.register_forward_pre_hook(lambda *a: self._start())
            layer.experts.register_forward_hook(lambda *a: self._stop())
            layer.experts.register_full_backward_pre_hook(lambda *a: self._start())
            layer.experts.register_full_backward_hook(lambda *a: self._stop())

    def _start(self):
        self._started = time.perf_counter()

    def _stop(self):
        if self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self._started = None

    def gather(self) -> list[float]:
        out = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(out, self.seconds)
        return out


EVAL_BATCH = 8      # sequences per evaluation forward


def compare_with_baseline(summary: dict, args) -> None:
    """summary["vs_baseline"] against the --baseline run, RUN_DIR/compare.png, and both in the W&B run
    (`easybalance/compare`, `vs_baseline/<metric>/...`) when one is open."""
    summary["vs_baseline"] = versus(summary, args.baseline, VERSUS, f"{args.baseline} -> {args.run_dir} "
                                    "(second half of each run; lower is better)")
    if args.no_report or "metrics" not in summary["vs_baseline"]:
        return
    from eb_deepspeed.observe.report import render_compare
    path = render_compare([args.baseline, args.run_dir], os.path.join(args.run_dir, "compare.png"))
    summary["plots"] = summary.get("plots", []) + [path]
    try:
        import wandb
    except ImportError:
        return
    if wandb.run is not None:
        wandb.log({"easybalance/compare": wandb.Image(path)})
        wandb.run.summary.update({f"vs_baseline/{key}/{field}": value for key, row in
                                  summary["vs_baseline"]["metrics"].items() for field, value in row.items()})


def text_files_corpus(max_bytes: int = 1_000_000) -> torch.Tensor:
    """The standard library's documentation and text files (.txt, .rst; no Python source), bytes [N]."""
    import sysconfig
    root = sysconfig.get_paths()["stdlib"]
    chunks, size = [], 0
    for dirpath, dirnames, names in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(names):
            if name.endswith((".txt", ".rst")) and size < max_bytes:
                with open(os.path.join(dirpath, name), "rb") as f:
                    chunks.append(f.read())
                size += len(chunks[-1])
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


def evaluate(engine, corpus, args, rank: int) -> dict:
    """Validation loss (held-out stdlib sources) and expert specialisation: each layer's expert usage on
    Python sources (the held-out files) against the stdlib's text files, as a total-variation distance
    0.5 x sum_e |p_code(e) - p_text(e)| (0: used alike, 1: disjoint), averaged over layers; every rank's
    batches together. Every rank runs the same number of forwards (AutoEP's all-to-all)."""
    from eb_deepspeed.adapters.autoep import find_autoep_layers
    layers = [m for _, m in find_autoep_layers(engine.module)]
    usage = {}

    def counter(kind):
        def hook(router, inputs, output):
            selected_TK = output[1]
            usage[kind].append(torch.bincount(selected_TK.reshape(-1).long().cpu(), minlength=args.experts))
        return hook

    text = text_files_corpus()
    engine.eval()
    sums = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for kind in ("code", "text"):
            usage[kind] = []
            handles = [layer.router.register_forward_hook(counter(kind)) for layer in layers]
            for i in range(args.eval_batches):      # the same windows for every run of a seed (ints hash alike)
                g = torch.Generator().manual_seed(hash((args.seed, rank, kind == "code", i)) % (2**62))
                if kind == "code":
                    x = corpus.batch("val", EVAL_BATCH, args.seq_len, g)[0]
                else:
                    starts_B = torch.randint(0, text.numel() - args.seq_len, (EVAL_BATCH, ), generator=g)
                    x = text[starts_B[:, None] + torch.arange(args.seq_len)[None, :]]
                out = engine(input_ids=x.to(engine.device), labels=x.to(engine.device))
                if kind == "code":
                    sums += torch.tensor([float(out.loss), 1.0], dtype=torch.float64)
            for h in handles:
                h.remove()
    engine.train()
    L = len(layers)
    counts = torch.stack([torch.stack(usage[k]).view(-1, L, args.experts).sum(0).double() for k in ("code", "text")])
    torch.distributed.all_reduce(sums)
    torch.distributed.all_reduce(counts)
    p = counts / counts.sum(-1, keepdim=True).clamp_min(1.0)                # [2, L, E]
    tv_L = 0.5 * (p[0] - p[1]).abs().sum(-1)
    return {"val_loss": float(sums[0] / sums[1]), "specialisation_tv": float(tv_L.mean()),
            "specialisation_tv_per_layer": [round(v, 4) for v in tv_L.tolist()]}


def summarize(history: list[dict], step_times: list[float], tokens_per_step: int, args) -> dict:
    """The run in numbers: loss (last step, and mean of the last 10), each layer's expert max/mean averaged
    over the last 10 steps, tokens/s over the steps after the first two (warm-up)."""
    tail = history[-10:]
    timed = step_times[2:] or step_times
    out = {"framework": "autoep", "family": args.family, "steps": args.steps, "data": args.data, "lr": args.lr, "seed": args.seed,
           "final_lm_loss": history[-1]["lm_loss"] if history else None,
           "last10_lm_loss": sum(r["lm_loss"] for r in tail) / max(1, len(tail)),
           "seconds_per_step": sum(timed) / max(1, len(timed)),
           "tokens_per_s": tokens_per_step * len(timed) / max(1e-9, sum(timed))}
    if tail and "expert_max_over_mean" in tail[0]:
        for key in ("expert_max_over_mean", "device_max_over_mean"):     # each step's, averaged
            per_layer = list(zip(*(r[key] for r in tail)))
            out[f"last10_{key}"] = [sum(v for v in vals if v is not None) / max(1, sum(v is not None for v in vals))
                                    for vals in per_layer]
        routed_LE = torch.tensor([r["routed_LE"] for r in tail]).sum(0)    # the 10 steps' routes together
        out["last10_sum_expert_max_over_mean"] = (routed_LE.amax(1) / routed_LE.mean(1).clamp_min(1e-9)).tolist()
        half = history[len(history) // 2:]                  # once the routers have settled: the straggler's share
        out["train_second_half"] = {
            "lm_loss": sum(r["lm_loss"] for r in half) / len(half),
            "device_max_over_mean_p90": sum(r["device_max_over_mean_p90"] for r in half) / len(half),
            "expert_max_over_mean_p90": sum(r["expert_max_over_mean_p90"] for r in half) / len(half),
            "expert_max_over_mean_mean": sum(sum(v for v in r["expert_max_over_mean"] if v is not None)
                                             / max(1, sum(v is not None for v in r["expert_max_over_mean"]))
                                             for r in half) / len(half)}
    for row in history:
        row.pop("routed_LE", None)
    return out


if __name__ == "__main__":
    run_and_exit(main)
