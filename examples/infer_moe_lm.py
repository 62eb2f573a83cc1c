"""Serve the main job's trained byte-level MoE LM on held-out stdlib text: plain DeepSpeed against
eb_deepspeed's replicated serving, side by side on the same batches.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/infer_moe_lm.py \
        --config configs/infer_cpu_2rank.json --ckpt runs/ds/ckpt --run-dir runs/infer

Both models load the checkpoint that `examples/train_moe_lm.py` wrote (DeepSpeed's MoE file layout);
plain DeepSpeed gets its expert-parallel groups and eval mode (what `deepspeed.init_inference`
leaves out), eb_deepspeed gets `eb_deepspeed.init_inference` with the config's `easybalance` block.
Every batch is scored by both (next-byte loss); the script prints tokens/s, the capacity DeepSpeed
pads every slot to, the drop rate at capacity factor 1.0 (with a second pair of models), the balance,
whether the outputs were identical, and writes RUN_DIR/balance/balance.jsonl, its PNG plots and
RUN_DIR/summary.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_lm import MoELM, StdlibCorpus, run_and_exit  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    p.add_argument("--config", default="configs/infer_cpu_2rank.json", help="inference config with an easybalance block")
    p.add_argument("--ckpt", default="runs/ds/ckpt", help="launch/train_ds_cpu.sh's checkpoint directory")
    p.add_argument("--run-dir", default="runs/infer")
    p.add_argument("--batches", type=int, default=60)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and batch")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-report", action="store_true")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import deepspeed

    import eb_deepspeed
    from eb_deepspeed.adapters.deepspeed import find_moe_layers
    from eb_deepspeed.core import metrics as M
    from eb_deepspeed.planning import expected_slot_ratio

    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    with open(args.config, encoding="utf-8") as f:
        config = json.load(f)
    config.setdefault("easybalance", {}).setdefault("log", {})["dir"] = os.path.join(args.run_dir, "balance")

    def build(drop_tokens: bool) -> MoELM:
        torch.manual_seed(args.seed)
        return MoELM(layers=args.layers, hidden=args.hidden, experts=args.experts, ep_size=world, k=2,
                     seq_len=args.seq_len, drop_tokens=drop_tokens)

    def plain_of(model: MoELM) -> MoELM:
        """DeepSpeed's exact expert-parallel forward: its groups (what deepspeed.init_inference never hands
        over) and eval mode, with the checkpoint in DeepSpeed's own layout."""
        for _, moe in find_moe_layers(model):
            moe.set_deepspeed_parallelism()
        eb_deepspeed.load_moe_checkpoint(model, args.ckpt)
        return model.eval()

    engine = eb_deepspeed.init_inference(build(False), config=config)
    engine.serving.load_checkpoint(args.ckpt)
    plain = plain_of(build(False))
    drops = {"plain": plain_of(build(True)), "eb": eb_deepspeed.init_inference(build(True), config={
        **config, "easybalance": {**config["easybalance"], "log": {"dir": os.path.join(args.run_dir, "balance_drops"),
                                                                      "interval": 10**6}}})}
    drops["eb"].serving.load_checkpoint(args.ckpt)

    corpus = StdlibCorpus(max_bytes=2_000_000)
    g = torch.Generator().manual_seed(args.seed + 7 + rank)
    seconds = {"plain": 0.0, "eb": 0.0}
    loss = {"plain": 0.0, "eb": 0.0}
    kept = {"plain": [0, 0], "eb": [0, 0]}
    counting = {"on": False}

    def count_kept(name):
        def hook(gate, inputs, out):
            if counting["on"]:
                kept[name][0] += int((out[3] >= 0).sum())
                kept[name][1] += int(out[6].sum())
        return hook
    for name, model in (("plain", drops["plain"]), ("eb", drops["eb"].module)):
        for _, moe in find_moe_layers(model):
            moe.deepspeed_moe.gate.register_forward_hook(count_kept(name))
    identical, capacities, tokens = True, {"plain": [], "eb": []}, 0
    warmup = engine.easybalance.config.warmup_batches + 1
    with torch.no_grad():
        for b in range(args.batches):
            x, y = corpus.batch("val", args.batch, args.seq_len, g)
            outs = {}
            for name, model in (("plain", plain), ("eb", engine)) if b % 2 else (("eb", engine), ("plain", plain)):
                torch.manual_seed(b)                   # DeepSpeed's top-2 samples its second expert
                torch.distributed.barrier()
                t0 = time.perf_counter()
                logits, _ = model(x)
                seconds[name] += time.perf_counter() - t0
                outs[name] = logits
                loss[name] += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()))
            identical &= bool(torch.equal(outs["plain"], outs["eb"]))
            capacities["eb"].append(max(gate.last_capacity for gate in engine.serving.gates))
            worst = torch.tensor([max(int(m.deepspeed_moe.exp_counts.max()) for _, m in find_moe_layers(plain))])
            torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)
            capacities["plain"].append(int(worst))
            tokens += x.numel()
            counting["on"] = b >= warmup
            for name in ("plain", "eb"):
                torch.manual_seed(b)
                drops[name](x)
    totals = torch.tensor([tokens, loss["plain"], loss["eb"], *kept["plain"], *kept["eb"]], dtype=torch.float64)
    torch.distributed.all_reduce(totals)
    tokens_all = float(totals[0])
    engine.serving.settle()                            # the view step in flight, if any
    balancer = engine.easybalance
    view = balancer.view
    summary = {
        "ranks": world, "batches": args.batches, "tokens": int(tokens_all), "outputs_identical": identical,
        "tokens_per_s": {name: round(tokens_all / (seconds[name] * world), 1) for name in seconds},
        "val_loss": {"plain": float(totals[1]) / (args.batches * world), "eb": float(totals[2]) / (args.batches * world)},
        "capacity": {name: sum(c) / len(c) for name, c in capacities.items()},
        "drop_rate_cf1": {"plain": 1 - float(totals[3] / totals[4]), "eb": 1 - float(totals[5] / totals[6])},
        "placement_slots": engine.serving.P, "experts": engine.serving.E, "replica_slots": engine.serving.R,
        "replans": engine.serving.replans, "failed_moves": engine.serving.failed_moves,
        "weight_moves": engine.serving.weight_moves,
        "expected_slot_max_over_mean": [round(float(v), 4) for v in expected_slot_ratio(view.heat_LE,
                                                                                        engine.serving.placement)],
        "device_max_over_mean": M.max_over_mean(view.pressure_LG).tolist(),
    }
    summary["verdict"] = serving_verdict(summary)
    if rank == 0:
        balancer.close()            # the log ends on the last view update
        if not args.no_report:
            from eb_deepspeed.observe.report import render_report
            summary["plots"] = render_report(os.path.join(args.run_dir, "balance"))
        with open(os.path.join(args.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(json.dumps(summary, indent=2))
        print(summary["verdict"])
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def serving_verdict(summary: dict) -> str:
    """One line: was serving faster or slower than plain DeepSpeed (tokens/s, side by side in this run), did
    replicas serve, and what they changed (capacity, drops) - so the summary never leaves it to the reader."""
    speed = summary["tokens_per_s"]["eb"] / summary["tokens_per_s"]["plain"]
    faster = f"{(speed - 1) * 100:+.1f} % tokens/s against plain DeepSpeed ({speed:.3f}x, measured side by side)"
    cap, drops = summary["capacity"], summary["drop_rate_cf1"]
    changed = (f"capacity {cap['plain']:.0f} -> {cap['eb']:.0f}, drop rate (capacity factor 1) "
               f"{drops['plain']:.3f} -> {drops['eb']:.3f}")
    if summary["placement_slots"] > summary["experts"]:
        why = (f"replicas serve ({summary['placement_slots']} slots for {summary['experts']} experts after "
               f"{summary['replans']} re-plan(s), {summary['weight_moves']} expert weights moved)")
    elif summary["replica_slots"] == 0:
        why = "no replicas: easybalance.inference.replica_slots is 0 (or mode observe)"
    elif summary["failed_moves"]:
        why = f"DeepSpeed's layout serves: {summary['failed_moves']} weight move(s) failed (see the warnings)"
    else:
        why = ("DeepSpeed's layout serves" + (f" again after {summary['replans']} re-plan(s)" if summary["replans"]
                                             else "") + ": no plan was expected to cut the padded cost by "
               "MIN_GAIN; the difference is the cost of watching")
    return f"serving verdict: {faster}; {why}; {changed}; outputs identical: {summary['outputs_identical']}"


if __name__ == "__main__":
    run_and_exit(main)
