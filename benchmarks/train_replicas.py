"""Training-time replicas on AutoEP, side by side in one 4-rank launch (issue 50): plain AutoEP, the permutation
alone (`train_placement` with no replica slots), one and two replica slots a rank; routing untouched (`observe`).

    python -m benchmarks.train_replicas [--steps 60] [--interval 3] [--offsets 2.5 2 1.5] [--json]     # ~2.5 min

The model is the main job's tiny HF Mixtral (4 layers, 8 experts, top-2, hidden 64) under AutoEP with `autoep_size`
4 (two experts a rank), trained on the stdlib sources from one seed, every variant on the same batches. Its routers
concentrate as a pretrained model's do: router weights scaled to logits of about unit spread, and a fixed offset on
three experts' logits (2.5, 2 and 1.5, other experts in each layer), so the hot experts share ranks in AutoEP's
layout. Per variant: the busiest EP rank's received routes over the mean (counted from the router's output on
AutoEP's own router, after the placement's route map: what each rank's grouped GEMM computes), mean over layers and
the steps after the first re-plan; the losses of every step against plain AutoEP's (relative); re-plans. `targets`
holds the issue's.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {"plain": None, "permutation": 0, "replicas_1": 1, "replicas_2": 2}
OFFSETS = (2.5, 2.0, 1.5)          # logit offsets of each layer's three hot experts
ROUTER_SCALE = 8.0                 # router weights x this: logits of about unit spread (random init: ~0.15)
EP, MICRO, SEQ = 4, 16, 64


def rank_job(args) -> None:
    """One rank: every variant in turn; rank 0 writes the JSON."""
    import torch
    import torch.distributed as dist
    import deepspeed
    from deepspeed.moe.utils import configure_moe_param_groups
    import eb_deepspeed
    from eb_deepspeed.adapters.autoep import find_autoep_layers
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from hf_moe import autoep_section, hf_moe_model
    from moe_lm import StdlibCorpus
    corpus = StdlibCorpus(max_bytes=400_000)
    result = {}
    for name, slots in VARIANTS.items():
        cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
               "zero_optimization": {"stage": 0}, "expert_parallel": autoep_section("mixtral", EP)}
        if slots is not None:
            log = {"dir": os.path.join(os.path.dirname(args.out), name)}
            cfg["easybalance"] = {"mode": "observe", "warmup_batches": 1, "log": log,
                                  "train_placement": {"interval": args.interval, "replica_slots": slots}}
        torch.manual_seed(args.seed)
        model = hf_moe_model("mixtral", layers=4, hidden=64, experts=8, k=2, ffn=128, seq_len=SEQ)
        init = deepspeed.initialize if slots is None else eb_deepspeed.initialize
        engine, _, _, _ = init(model=model, config=cfg,
                               optimizer=lambda ps: torch.optim.AdamW(configure_moe_param_groups(list(ps)), lr=args.lr))
        layers = [m for _, m in find_autoep_layers(engine.module)]
        routes = []            # per forward and layer: this rank's routes to each slot (after the route map)
        for index, layer in enumerate(layers):
            with torch.no_grad():
                layer.router.gate.weight.mul_(ROUTER_SCALE)
            offset_E = torch.zeros(8)
            offset_E[[(3 * index + j) % 8 for j in range(3)]] = torch.tensor(args.offsets)
            layer.router.gate.register_forward_hook(lambda m, a, logits, o=offset_E: logits + o)
            layer.router.register_forward_hook(
                lambda m, a, out, layer=layer: routes.append(out[2].detach().float().view(EP, -1).sum(1).clone()))
        g = torch.Generator().manual_seed(args.seed * 100 + dist.get_rank())
        losses = []
        for _ in range(args.steps):
            ids, targets = corpus.batch("train", MICRO, SEQ, g)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        received = torch.stack(routes).view(args.steps, len(layers), EP)
        dist.all_reduce(received)
        placer = getattr(getattr(engine, "easybalance", None), "placement", None)
        share = received.max(2).values / received.mean(2)            # [steps, layers]
        after = share[args.interval + 1:]
        result[name] = {"busiest_over_mean": round(float(after.mean()), 4),
                        "busiest_over_mean_per_layer": [round(float(v), 4) for v in after.mean(0)],
                        "losses": losses, "replans": 0 if placer is None else placer.replans,
                        "slots_served": None if placer is None else placer.placement.slots_per_device}
        del engine
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)


def summarize(runs: dict, steps: int, interval: int, offsets: list) -> dict:
    plain = runs["plain"]["losses"]
    out = {"benchmark": "train_replicas", "steps": steps, "interval": interval, "ep_size": EP, "experts": 8,
           "offsets": offsets,
           "variants": {}}
    for name, run in runs.items():
        rel = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], plain))
        out["variants"][name] = {k: v for k, v in run.items() if k != "losses"} | {"loss_max_rel_diff": rel}
    share = {k: v["busiest_over_mean"] for k, v in out["variants"].items()}
    out["targets"] = {
        "r1_25pct_below_permutation": share["replicas_1"] <= 0.75 * share["permutation"],
        "r1_50pct_below_plain": share["replicas_1"] <= 0.5 * share["plain"],
        "losses_within_1e-4": all(v["loss_max_rel_diff"] <= 1e-4 for v in out["variants"].values())}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--interval", type=int, default=3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW's (a fine-tuning rate: the routing drifts slowly)")
    p.add_argument("--offsets", type=float, nargs=3, default=list(OFFSETS),
                   help="logit offsets of each layer's three hot experts (the skew)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--rank-job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_job:
        rank_job(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "runs.json")
        port = str(29400 + os.getpid() % 500)
        cmd = ["deepspeed", "--num_gpus", str(EP), "--master_port", port, os.path.abspath(__file__), "--rank-job",
               "--out", out, "--steps", str(args.steps), "--interval", str(args.interval), "--seed", str(args.seed),
               "--lr", str(args.lr), "--offsets", *map(str, args.offsets)]
        try:
            subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), check=True,
                           stdout=subprocess.DEVNULL)
        finally:        # DeepSpeed's CPU shm comm op leaves a /dev/shm buffer per rank, named by the port
            for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
                os.remove(path)
        with open(out) as f:
            result = summarize(json.load(f), args.steps, args.interval, args.offsets)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for name, v in result["variants"].items():
            print(f"{name:12s} busiest/mean {v['busiest_over_mean']:.3f}  loss max rel diff "
                  f"{v['loss_max_rel_diff']:.1e}  replans {v['replans']}")
        print("targets:", result["targets"])
    return 0 if all(result["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
