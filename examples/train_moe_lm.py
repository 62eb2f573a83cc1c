"""Train a small byte-level MoE language model on the Python standard library's sources with
DeepSpeed + eb_deepspeed, and write balance curves (JSONL, W&B offline, PNGs).

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/train_moe_lm.py \
        --deepspeed_config configs/train_cpu_2rank.json --steps 60 --run-dir runs/ds

Writes RUN_DIR/balance/balance.jsonl (the easybalance log), RUN_DIR/balance/plots/*.png,
RUN_DIR/ckpt (DeepSpeed checkpoint, resumable with --resume), RUN_DIR/summary.json, and a W&B
offline run under RUN_DIR/wandb when the config's "wandb" block is enabled.
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
from moe_lm import MoELM, StdlibCorpus, deepspeed_capacity, dropped_routes, pyramid, run_and_exit, versus  # noqa: E402


def parse_args(argv=None):
    import deepspeed
    from eb_deepspeed.core.policies import POLICIES
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    p.add_argument("--steps", type=int, default=60, help="optimizer steps in total (a resumed run continues)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--pyramid", type=_positive_ints("E"), default=None, metavar="E1,E2,...",
                   help="PR-MoE: experts per layer growing with depth, e.g. 4,8 (layers 0-1: 4, layers 2-3: 8 of 4); "
                        "overrides --experts")
    p.add_argument("--ep-size", type=int, default=2)
    p.add_argument("--k", type=_top_ks, default=(2, ),
                   help="top-k of every MoE layer, or a comma list repeated over the layers (1,2: top-1 and top-2 "
                        "layers alternate, so layers route with different skew)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=None, help="override train_micro_batch_size_per_gpu")
    p.add_argument("--grad-accum", type=int, default=None, help="override gradient_accumulation_steps")
    p.add_argument("--capacity-factor", type=float, default=1.0)
    p.add_argument("--coeff", type=float, default=0.01, help="aux-loss coefficient (summed over layers)")
    p.add_argument("--aux-policy", choices=list(POLICIES), default=None,
                   help="override easybalance.aux.policy of the config")
    p.add_argument("--bias-rate", type=float, default=None, help="override easybalance.aux.bias_rate")
    p.add_argument("--aux-weight-range", type=float, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help="override easybalance.aux.weight_range")
    p.add_argument("--aux-gain", type=float, default=None, help="override easybalance.aux.gain")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--max-bytes", type=int, default=4_000_000, help="training text to read")
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--run-dir", default="runs/ds")
    p.add_argument("--resume", action="store_true", help="continue from RUN_DIR/ckpt")
    p.add_argument("--no-report", action="store_true", help="skip rendering the PNGs at the end")
    p.add_argument("--mode", choices=["observe", "balance"], default=None,
                   help="override easybalance.mode (observe: plain DeepSpeed routing, watched: the baseline)")
    p.add_argument("--baseline", default=None, metavar="RUN_DIR",
                   help="a finished run of the same job (e.g. --mode observe): summary.json compares the two, "
                        "RUN_DIR/compare.png overlays them")
    deepspeed.add_config_arguments(p)
    return p.parse_args(argv)


def _positive_ints(what: str):
    """An argparse type: `what` as N or N1,N2,... whole numbers >= 1."""
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(part) for part in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what} or {what}1,{what}2,... (whole numbers), got {text!r}") from None
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"every {what} must be >= 1, got {text!r}")
        return values
    return parse


_top_ks = _positive_ints("k")


# What "did balancing help" compares, second half of each run: (key, what it is, lower is better). No
# steps/s: CPU time on a shared machine is not what a GPU step would take (docs/benchmarks.md measures that)
VERSUS = (("device_max_over_mean_p90", "p90 device max/mean (the straggler)"),
          ("token_drop_rate", "token drop rate"), ("device_util_std", "device utilisation std"),
          ("lm_loss", "LM loss"))


def _mean_of(values):
    """Mean of the numbers among `values`; a step whose router logits were all non-finite has None."""
    numbers = [v for v in values if v is not None]
    return sum(numbers) / len(numbers) if numbers else None


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "offline")  # never needs a W&B account; `wandb sync` uploads later
    os.makedirs(args.run_dir, exist_ok=True)
    os.environ.setdefault("WANDB_DIR", os.path.abspath(args.run_dir))

    import deepspeed
    import eb_deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    with open(args.deepspeed_config, encoding="utf-8") as f:
        ds_config = json.load(f)
    for key, value in (("train_micro_batch_size_per_gpu", args.micro_batch),
                       ("gradient_accumulation_steps", args.grad_accum)):
        if value is not None:
            ds_config[key] = value
    block = ds_config.setdefault("easybalance", {})
    block.setdefault("log", {})["dir"] = os.path.join(args.run_dir, "balance")
    if args.mode is not None:
        block["mode"] = args.mode
    if args.aux_policy is not None:
        block.setdefault("aux", {})["policy"] = args.aux_policy
    for key, value in (("bias_rate", args.bias_rate), ("weight_range", args.aux_weight_range),
                       ("gain", args.aux_gain)):
        if value is not None:
            block.setdefault("aux", {})[key] = value

    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(args.seed)
    experts_L = pyramid(args.layers, args.pyramid) if args.pyramid else (args.experts, ) * args.layers
    model = MoELM(layers=args.layers, hidden=args.hidden, experts=experts_L, ep_size=args.ep_size, k=args.k,
                  seq_len=args.seq_len, capacity_factor=args.capacity_factor)
    params = split_params_into_different_moe_groups_for_optimizer(
        {"params": [p for p in model.parameters()], "name": "params"})
    # A torch optimizer: DeepSpeed would otherwise JIT-compile its fused Adam on first use.
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    engine, optimizer, _, _ = eb_deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    balancer = getattr(engine, "easybalance", None)

    ckpt_dir = os.path.join(args.run_dir, "ckpt")
    start = 0
    if args.resume:
        load_path, client = engine.load_checkpoint(ckpt_dir)
        if load_path is None:
            raise FileNotFoundError(f"--resume: no checkpoint under {ckpt_dir}")
        start = int(client["step"])

    corpus = StdlibCorpus(max_bytes=args.max_bytes)
    micro_batch = engine.train_micro_batch_size_per_gpu()
    accum = engine.gradient_accumulation_steps()

    def evaluate() -> dict:
        """Validation loss and balance on held-out files: rank r reads its own windows, sums are all-reduced."""
        from eb_deepspeed import metrics as M
        engine.eval()
        g = torch.Generator().manual_seed(args.seed + 7 + 1000 * rank)  # same windows every evaluation
        capacity_L1 = torch.tensor([[deepspeed_capacity(micro_batch * args.seq_len, experts_L[layer],
                                                          args.k[layer % len(args.k)], args.capacity_factor, 4)]
                                    for layer in range(args.layers)], dtype=torch.float64)
        # sums: loss, max_vio per layer, device max/mean per layer, dropped routes, routes, batches
        sums = torch.zeros(3 * args.layers + 3, dtype=torch.float64)
        L = args.layers
        with torch.no_grad():
            for _ in range(args.eval_batches):
                x, y = corpus.batch("val", micro_batch, args.seq_len, g)
                logits, _ = engine(x.to(engine.device))
                counts_LE = engine.module.last_counts_LE.double().cpu()      # [L, max E], padded per layer
                device_LG = torch.stack([counts_LE[layer, :e].view(args.ep_size, -1).sum(1)
                                         for layer, e in enumerate(experts_L)])
                sums[0] += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                                   y.to(engine.device).flatten()))
                sums[1:1 + L] += M.per_width(M.max_vio, counts_LE, torch.tensor(experts_L))
                sums[1 + L:1 + 2 * L] += M.max_over_mean(device_LG)
                sums[1 + 2 * L:1 + 3 * L] += dropped_routes(counts_LE, capacity_L1)
                sums[1 + 3 * L] += counts_LE.sum()
                sums[2 + 3 * L] += 1
        torch.distributed.all_reduce(sums)
        engine.train()
        n = float(sums[-1])
        device_mom_L = sums[1 + L:1 + 2 * L] / n
        return {"val_loss": float(sums[0]) / n, "val_max_vio": float(sums[1:1 + L].mean()) / n,
                "val_device_max_over_mean_p90": float(torch.quantile(device_mom_L, 0.9)),
                "val_token_drop_rate": float(sums[1 + 2 * L:1 + 3 * L].sum() / sums[1 + 3 * L])}

    progress = None
    if rank == 0:
        from tqdm import tqdm
        progress = tqdm(total=args.steps, initial=start, desc="train", dynamic_ncols=True)
    history = []
    t0 = time.time()
    step_times = []
    for step in range(start, args.steps):
        t_step = time.perf_counter()
        for micro in range(accum):
            g = torch.Generator().manual_seed(hash((args.seed, rank, step, micro)) % (2**62))
            x, y = corpus.batch("train", micro_batch, args.seq_len, g)
            logits, l_aux = engine(x.to(engine.device))
            lm_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.to(engine.device).flatten())
            loss = lm_loss + args.coeff * sum(l_aux)
            engine.backward(loss)
            if balancer is not None:
                balancer.note(lm_loss=lm_loss.item())   # logged beside the balance numbers (JSONL, W&B, eb report)
            engine.step()
        step_times.append(time.perf_counter() - t_step)
        row = {"step": step + 1, "lm_loss": lm_loss.item(), "aux_loss": float(sum(a.detach() for a in l_aux))}
        if balancer is not None:
            m = balancer.metrics()
            row.update(token_drop_rate=m["token_drop_rate"], device_util_std=m["device_util_std"],
                       device_max_over_mean_p90=m["device_max_over_mean_p90"])
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            row.update(evaluate())
        history.append(row)
        if progress is not None:
            progress.set_postfix({k: f"{v:.3f}" for k, v in row.items() if v is not None and k in (
                "lm_loss", "aux_loss", "val_loss", "token_drop_rate")}, refresh=False)
            progress.update(1)
    if progress is not None:
        progress.close()
    elapsed = time.time() - t0

    engine.save_checkpoint(ckpt_dir, client_state={"step": args.steps})
    if rank == 0:
        tail = history[len(history) // 2:]  # the second half of this run's steps
        summary = {"steps": args.steps, "world_size": world, "seconds": round(elapsed, 2),
                   "seconds_per_step": sum(step_times[2:]) / max(1, len(step_times[2:])),
                   "tokens_per_s": micro_batch * accum * args.seq_len * world * max(1, len(step_times[2:]))
                   / max(1e-9, sum(step_times[2:])),
                   "final": history[-1] if history else None,
                   "train_second_half": {key: _mean_of(r.get(key) for r in tail) for key in
                                         ("lm_loss", "token_drop_rate", "device_max_over_mean_p90",
                                          "device_util_std")
                                         if tail and key in tail[0]}}
        if balancer is not None:
            summary["balance"] = {k: v for k, v in balancer.metrics().items() if not isinstance(v, list)}
            balancer.close()        # the log ends on the last step
            if not args.no_report:
                from eb_deepspeed.observe.report import render_report
                summary["plots"] = render_report(os.path.join(args.run_dir, "balance"))
        if args.baseline:
            summary["vs_baseline"] = versus(summary, args.baseline, VERSUS, f"vs the baseline {args.baseline} "
                                            "(second half of each run, lower is better)")
            if not args.no_report:
                from eb_deepspeed.observe.report import render_compare
                summary["plots"] = summary.get("plots", []) + [render_compare(
                    [args.baseline, args.run_dir], os.path.join(args.run_dir, "compare.png"))]
        with open(os.path.join(args.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(json.dumps(summary, indent=2))
    if rank == 0 and "vs_baseline" in summary:
        print(summary["vs_baseline"]["verdict"])
    # torn down while Python runs: left to the interpreter's exit, gloo has aborted a rank there
    # ("terminate called without an active exception") after a run that had finished
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    if math.isnan(history[-1]["lm_loss"]) if history else False:
        raise SystemExit("training diverged (NaN loss)")


if __name__ == "__main__":
    run_and_exit(main)
