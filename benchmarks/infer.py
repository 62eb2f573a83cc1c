"""`python -m benchmarks infer`: replicated serving against plain DeepSpeed on real MoE layers and gloo ranks.

Shape legend: T tokens per rank, M model dim, E logical experts, K top-k, G EP ranks, S slots per rank,
P physical slots (G * S).

    python -m benchmarks infer --json          # 2 and 4 ranks: the trained example model, a Zipf router, a drifting one

Every row runs plain DeepSpeed (groups handed, eval mode: its exact expert-parallel forward) and
`eb_deepspeed.init_inference` with replicas side by side in the same processes, on the same batches,
interleaved, after the view has warmed up and the first placement is serving. Measured per row:
  * outputs_equal: every output bit-identical (fp32, no drops);
  * capacity / ideal (no drops): DeepSpeed pads every slot to the capacity C, the most routes any
    rank sends to one slot; ideal = the busiest rank's routes / slots (E for plain, P for ours);
    `bound` is the least any placement can reach (at most G replicas of an expert, whole slots);
  * drop rate at eval capacity factor 1.0 (drop_tokens=True, equal batches so plain DeepSpeed runs);
  * MoE-layer forward time (gate, All-to-All, experts; forward hooks) of plain / ours (`speedup`), and
    the whole forward (view update included; `tokens_per_s_ratio`);
  * the gate's extra work (ours - plain gate time: replica split, capacity) and re-planning
    (plan + weight moves, amortised over `replan_interval`) against our MoE-layer forward.
Worker processes are started here with RANK / WORLD_SIZE set (no launcher needed).
"""
from __future__ import annotations

import functools
import os
import statistics
import sys
import time

import torch

__all__ = ["bench_infer", "slot_bound", "gate_medians_ms"]

TARGETS = {"capacity_over_ideal": 1.15, "speedup_zipf": 1.5, "drop_rate_cut": 0.5, "overhead_ratio": 0.03,
           "example_vs_plain": 0.98}


def zipf(E: int, s: float) -> torch.Tensor:
    """Zipf(s) probabilities over E experts, [E]."""
    z = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** s
    return z / z.sum()


def slot_bound(share_E: torch.Tensor, G: int, S: int) -> float:
    """The least capacity / ideal any placement reaches for route shares [E] on G ranks x S slots: replica
    counts by highest share per replica (at most G each), slot load = share / count, ideal = 1 / P."""
    share_E = torch.as_tensor(share_E, dtype=torch.float64)
    E, P = share_E.numel(), G * S
    cnt_E = torch.ones(E, dtype=torch.long)
    for _ in range(P - E):
        per_E = torch.where(cnt_E < G, share_E / cnt_E, -1.0)
        cnt_E[int(per_E.argmax())] += 1
    return float((share_E / cnt_E).max() * P)


# ---------------------------------------------------------------------- one rank
def _zipf_layer(E: int, hidden: int, G: int, drop: bool, seed: int = 0):
    """One DeepSpeed MoE layer (top-2, MLP experts) whose router sends a token of class c to experts c
    and c + 1: classes drawn from a Zipf distribution make the routes Zipf-skewed."""
    from deepspeed.moe.layer import MoE
    torch.manual_seed(seed)
    expert = torch.nn.Sequential(torch.nn.Linear(hidden, 2 * hidden), torch.nn.GELU(), torch.nn.Linear(2 * hidden, hidden))
    layer = MoE(hidden, expert, num_experts=E, ep_size=G, k=2, min_capacity=1, drop_tokens=drop, use_rts=False,
                eval_capacity_factor=1.0, top2_2nd_expert_sampling=False)
    classes = torch.nn.functional.normalize(torch.randn(E, hidden), dim=1)
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.copy_(8 * classes + 4 * classes.roll(-1, 0))
    return layer, classes


class ZipfModel(torch.nn.Module):
    def __init__(self, E, hidden, G, drop):
        super().__init__()
        self.layer, self.classes = _zipf_layer(E, hidden, G, drop)

    def forward(self, x):
        return self.layer(x)[0], None


def zipf_batches(classes, n: int, T: int, s: float, rank: int, drift: int = 0):
    """n batches [1, T, M] of class embeddings + noise; with `drift`, the hot class moves every `drift` batches."""
    E = classes.shape[0]
    p = zipf(E, s)
    out = []
    for b in range(n):
        g = torch.Generator().manual_seed(1000 * b + rank)
        shift = (b // drift) if drift else 0
        c = (torch.multinomial(p, T, replacement=True, generator=g) + shift) % E
        out.append((classes[c] + 0.05 * torch.randn(T, classes.shape[1], generator=g))[None])
    return out


def _example_batches(args, n: int, rank: int):
    sys.path.insert(0, os.path.join(args["root"], "examples"))
    from moe_lm import StdlibCorpus
    corpus = StdlibCorpus(max_bytes=400_000)
    g = torch.Generator().manual_seed(7 + rank)
    return [corpus.batch("val", args["batch"], args["seq_len"], g)[0] for _ in range(n)]


def _example_model(args, G: int, drop: bool, ckpt: str | None):
    sys.path.insert(0, os.path.join(args["root"], "examples"))
    from moe_lm import MoELM
    torch.manual_seed(0)
    return MoELM(layers=args["layers"], hidden=args["model_hidden"], experts=args["experts"], ep_size=G, k=2,
                 seq_len=args["seq_len"], drop_tokens=drop, capacity_factor=1.0)


def _timed_moes(module, into: list):
    """Forward hooks that add each MoE layer's forward time (and its gate's) to `into` = [moe_s, gate_s]."""
    from eb_deepspeed.adapters.deepspeed.engine import find_moe_layers
    for _, moe in find_moe_layers(module):
        _time_into(moe, into, 0)
        _time_into(moe.deepspeed_moe.gate, into, 1)


def _time_into(module, into: list, index: int) -> None:
    """Add `module`'s forward wall time to into[index] (a pre-hook starts the clock, a hook stops it)."""
    start = []
    module.register_forward_pre_hook(lambda m, a: start.append(time.perf_counter()))

    def stop(m, a, o):
        into[index] += time.perf_counter() - start.pop()
    module.register_forward_hook(stop)


def _plain_capacity(module) -> int:
    """DeepSpeed's no-drop capacity of the last forward: the most routes any rank sent to one expert."""
    from eb_deepspeed.adapters.deepspeed.engine import find_moe_layers
    worst = max(int(m.deepspeed_moe.exp_counts.max()) for _, m in find_moe_layers(module))
    t = torch.tensor([worst])
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return int(t)


def run_rank(args: dict) -> dict:
    """One rank's row: plain DeepSpeed and our serving engine on the same batches, measured side by side."""
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    G = torch.distributed.get_world_size()
    block = {"mode": "balance", "warmup_batches": args["warmup"], "log": {"dir": args["log_dir"], "interval": 10},
             "inference": {"replica_slots": args["replica_slots"], "split": args["split"],
                           "view_interval": args["view_interval"], "replan_interval": args["replan_interval"],
                           "replan_threshold": args["replan_threshold"]}}
    build = functools.partial(_build_model, args, G)
    plain, engine = _plain_and_ours(args, build, block)
    n = args["warmup_batches"] + args["batches"]
    rank = torch.distributed.get_rank()
    batches = _example_batches(args, n, rank) if args["router"] == "example" else \
        zipf_batches(plain.classes, n, args["tokens"], args["zipf"], rank, args.get("drift", 0))
    timer = _ServingTimer(engine.serving)
    run = _interleaved(args, plain, engine, batches, timer)
    drops = _drop_rates(args, build, _plain_of, block, batches[args["warmup_batches"]:], rank)
    return _result(args, engine, run, timer, drops, batches[-1], rank)


def _build_model(args: dict, G: int, drop: bool):
    """The row's model: the example LM (from the main job's checkpoint when there is one) or the Zipf layer."""
    if args["router"] == "example":
        return _example_model(args, G, drop, args.get("ckpt"))
    return ZipfModel(args["experts"], args["hidden"], G, drop)


def _plain_of(model):
    """Plain DeepSpeed's exact expert-parallel forward: groups handed, eval mode."""
    from eb_deepspeed.adapters.deepspeed.engine import find_moe_layers
    for _, moe in find_moe_layers(model):
        moe.set_deepspeed_parallelism()
    return model.eval()


def _plain_and_ours(args: dict, build, block: dict):
    """(plain model, our serving engine) with the same weights: the checkpoint's, where the row has one."""
    from eb_deepspeed.adapters.deepspeed import init_inference
    plain = _plain_of(build(False))
    engine = init_inference(build(False), config={"easybalance": block})
    if args["router"] == "example" and args.get("ckpt"):
        engine.serving.load_checkpoint(args["ckpt"])
        _load_plain(plain, args["ckpt"])
    return plain, engine


class _ServingTimer:
    """Wall time of the serving engine's per-batch view update and of each applied re-plan, by wrapping the
    two `ServingEngine` methods that run after a batch."""

    def __init__(self, serving):
        self.view_s, self.replan_s = 0.0, []
        self._after, self._replan = serving.after_batch, serving.maybe_replan
        serving.after_batch, serving.maybe_replan = self._timed_after, self._timed_replan

    def _timed_after(self):
        t0 = time.perf_counter()
        self._after()
        self.view_s += time.perf_counter() - t0

    def _timed_replan(self):
        t0 = time.perf_counter()
        applied = self._replan()
        if applied:
            self.replan_s.append(time.perf_counter() - t0)
        return applied


def _interleaved(args: dict, plain, engine, batches, timer: _ServingTimer) -> dict:
    """Warm the view up and let the first placement in, then run plain and ours on each batch in
    alternating order: outputs compared, forwards timed, padded capacities against the ideal recorded."""
    serving = engine.serving
    times = {"plain": [0.0, 0.0], "ours": [0.0, 0.0]}
    _timed_moes(plain, times["plain"])
    _timed_moes(engine.module, times["ours"])
    run = dict(times=times, equal=True, caps_plain=[], caps_ours=[], ideal_plain=[], ideal_ours=[],
               forward_s={"plain": 0.0, "ours": 0.0}, replan_warmup=0.0)
    measuring = False
    with torch.no_grad():
        for b, x in enumerate(batches):
            # the view warms up and the first placement goes in
            if b < args["warmup_batches"]:
                engine(x)
                continue
            if not measuring:
                measuring = True
                times["plain"][:], times["ours"][:] = [0.0, 0.0], [0.0, 0.0]
                timer.view_s = 0.0
                run["replan_warmup"] = sum(timer.replan_s)
            if len(run["caps_ours"]) == args["batches"]:
                break
            out = {}
            for name in (("plain", "ours") if b % 2 else ("ours", "plain")):
                torch.manual_seed(b)
                torch.distributed.barrier()          # every rank starts the timed forward together
                t0 = time.perf_counter()
                out[name] = (plain if name == "plain" else engine)(x)[0]
                run["forward_s"][name] += time.perf_counter() - t0
            run["equal"] &= bool(torch.equal(out["plain"], out["ours"]))
            routes = torch.tensor([x.shape[0] * x.shape[1] * 2 if x.dim() == 2 else x.shape[1] * 2])
            torch.distributed.all_reduce(routes, op=torch.distributed.ReduceOp.MAX)
            run["caps_plain"].append(_plain_capacity(plain))
            run["caps_ours"].append(max(g.last_capacity for g in serving.gates))
            run["ideal_plain"].append(int(routes) / serving.E)
            run["ideal_ours"].append(int(routes) / serving.P)
    return run


def _result(args: dict, engine, run: dict, timer: _ServingTimer, drops: dict, last_batch, rank: int) -> dict:
    """The row's numbers (docs/benchmarks.md): capacities, drops, forward times, and our overheads."""
    serving = engine.serving
    G = torch.distributed.get_world_size()
    heat = engine.easybalance.view.heat_LE
    share = heat / heat.sum(1, keepdim=True)
    bound = max(slot_bound(share[layer], G, serving.S_max) for layer in range(share.shape[0]))
    expert_bytes = sum(p.numel() * p.element_size() for p in serving.store.expert_module(0, 0).parameters())
    measured = len(run["caps_ours"])
    times, forward_s, replan_s = run["times"], run["forward_s"], timer.replan_s
    ratio = lambda caps, ideal: round(statistics.mean(c / i for c, i in zip(caps, ideal)), 4)
    result = {
        "router": args["router"], "ranks": G, "split": args["split"], "replica_slots": args["replica_slots"],
        "experts": serving.E, "slots": serving.P, "batches": measured, "outputs_equal": run["equal"],
        "capacity_over_ideal_plain": ratio(run["caps_plain"], run["ideal_plain"]),
        "capacity_over_ideal_ours": ratio(run["caps_ours"], run["ideal_ours"]),
        "capacity_over_ideal_bound": round(bound, 4),
        "drop_rate_plain": drops["plain"], "drop_rate_ours": drops["ours"],
        "moe_forward_ms_plain": round(1e3 * times["plain"][0] / measured, 3),
        "moe_forward_ms_ours": round(1e3 * times["ours"][0] / measured, 3),
        "speedup": round(times["plain"][0] / max(times["ours"][0], 1e-12), 4),
        "forward_ms_plain": round(1e3 * forward_s["plain"] / measured, 3),
        "forward_ms_ours": round(1e3 * forward_s["ours"] / measured, 3),
        # tokens/s end to end against plain (the same tokens): the whole forward, view update and trials included
        "tokens_per_s_ratio": round(forward_s["plain"] / max(forward_s["ours"], 1e-12), 4),
        "slots_serving": serving.P,
        "steering_ms": _steering_ms(serving, last_batch) if rank == 0 else 0.0,
        "view_ms": round(1e3 * (timer.view_s - (sum(replan_s) - run["replan_warmup"])) / measured, 3),
        "replans": serving.replans, "weight_moves": serving.weight_moves,
        "replan_ms": round(1e3 * statistics.mean(replan_s), 2) if replan_s else 0.0,
        "replan_bytes": serving.weight_moves * expert_bytes,
    }
    amortised = (result["replan_ms"] / args["replan_interval"]) if replan_s else 0.0
    # steering (the gate's extra work, every MoE layer) + re-planning amortised over its interval, against
    # the MoE layers' forward; the view update (one all-reduce per batch) apart
    steer_t = torch.tensor([result["steering_ms"]], dtype=torch.float64)
    torch.distributed.broadcast(steer_t, 0)
    result["steering_ms"] = round(float(steer_t) * len(serving.gates), 3)
    forward = max(result["moe_forward_ms_ours"], 1e-9)
    result["overhead_ratio"] = round((result["steering_ms"] + amortised) / forward, 4)
    result["view_ratio"] = round(result["view_ms"] / forward, 4)
    return result


def _steering_ms(serving, x, repeats: int = 30) -> float:
    """One layer's steering cost in one process: our gate (replica split, slots, capacity, tally) on the
    placement that serves, minus DeepSpeed's gate on the same tokens; medians of interleaved repeats.
    Both run without collectives (one rank holds every slot), so waits on other ranks do not count."""
    from deepspeed.moe.sharded_moe import TopKGate

    from eb_deepspeed.adapters.deepspeed.replicas import ReplicaGate
    from eb_deepspeed.adapters.routing import Routing, SlotTable
    gate = serving.gates[0]
    E, M = gate.wg.weight.shape[0], gate.wg.weight.shape[1]
    plain = TopKGate(M, E, gate.k, gate.capacity_factor, gate.eval_capacity_factor, gate.min_capacity, None,
                     False, gate.use_rts, None, gate.top2_2nd_expert_sampling).eval()
    plain.wg = gate.wg
    ours = ReplicaGate.from_gate(plain, 1, serving.P, table=SlotTable.even(serving.placement.log2phy[0]),
                                 routing=Routing(exact=gate.routing.exact))
    ours.drop_tokens = gate.drop_tokens
    h = torch.randn(x.reshape(-1, x.shape[-1]).shape[0] if x.dtype.is_floating_point else x.numel(), M)
    ms = gate_medians_ms(plain, ours, h, repeats, skip=3, take_every=1)
    return round(ms["ours"] - ms["plain"], 4)


def gate_medians_ms(plain, ours, h: torch.Tensor, repeats: int, skip: int, take_every: int) -> dict:
    """Median ms of DeepSpeed's gate (`plain`) and a ReplicaGate (`ours`) on tokens h [T, M], called in
    alternating order `repeats` times after `skip` unmeasured rounds, and of `ours`' tally take every
    `take_every` rounds (one view step): {"plain", "ours", "take"}."""
    times = {"plain": [], "ours": [], "take": []}
    with torch.no_grad():
        for rep in range(repeats + skip):
            for name, g in (("plain", plain), ("ours", ours)) if rep % 2 else (("ours", ours), ("plain", plain)):
                torch.manual_seed(rep)
                t0 = time.perf_counter()
                g(h, None, True, False)
                if rep >= skip:
                    times[name].append(time.perf_counter() - t0)
            if rep % take_every == take_every - 1:
                t0 = time.perf_counter()
                ours.tally.take()
                if rep >= skip:
                    times["take"].append(time.perf_counter() - t0)
    return {name: 1e3 * statistics.median(values) if values else 0.0 for name, values in times.items()}


def _load_plain(plain, ckpt: str) -> None:
    """The plain model gets the checkpoint's weights, in DeepSpeed's layout."""
    from eb_deepspeed import load_moe_checkpoint
    load_moe_checkpoint(plain, ckpt)


def _drop_rates(args, build, plain_of, block, batches, rank) -> dict:
    """Dropped routes / routes at eval capacity factor 1.0 (drop_tokens=True), plain and ours, after our
    first placement serves. Kept routes: indices >= 0 in the gates' sparse outputs."""
    from eb_deepspeed.adapters.deepspeed import init_inference
    from eb_deepspeed.adapters.deepspeed.engine import find_moe_layers
    plain = plain_of(build(True))
    engine = init_inference(build(True), config={"easybalance": {**block, "log": {
        "dir": block["log"]["dir"] + "_drops", "interval": 1000}}})
    if args["router"] == "example" and args.get("ckpt"):
        engine.serving.load_checkpoint(args["ckpt"])
        _load_plain(plain, args["ckpt"])
    counted = {"plain": [0, 0], "ours": [0, 0]}
    live = {"on": False}

    def counter(name):
        def hook(gate, inputs, out):
            if live["on"]:
                counted[name][0] += int((out[3] >= 0).sum())
                counted[name][1] += int(out[6].sum())
        return hook
    for name, model in (("plain", plain), ("ours", engine.module)):
        for _, moe in find_moe_layers(model):
            moe.deepspeed_moe.gate.register_forward_hook(counter(name))
    warm = min(len(batches) - 1, args["warmup"] + 1)      # our first placement is planned after the warm-up
    with torch.no_grad():
        for b, x in enumerate(batches):
            live["on"] = b >= warm
            torch.manual_seed(b)
            engine(x)
            torch.manual_seed(b)
            plain(x)
    out = {}
    for name, (kept, routes) in counted.items():
        t = torch.tensor([routes - kept, routes], dtype=torch.float64)
        torch.distributed.all_reduce(t)
        out[name] = round(float(t[0] / t[1].clamp_min(1)), 4)
    return out


# ---------------------------------------------------------------------- driver
ROWS = (
    {"name": "example", "router": "example"},
    {"name": "zipf", "router": "zipf"},
    {"name": "zipf_drifting", "router": "zipf", "drift": 8},
)


def bench_infer(ranks=(2, 4), splits=("view", ), batches: int = 40, warmup_batches: int = 6,
                replica_slots: int = 1, ckpt: str = "runs/ds/ckpt", progress: bool = True) -> dict:
    from .bench import _repo_root, free_port
    from .ranks import launch_ranks
    root = _repo_root()
    rows = []
    for G in ranks:
        for row in ROWS:
            for split in (splits if row["name"] == "zipf" else splits[:1]):
                # the example row serves as the example's config does (the view every 8 batches); the Zipf rows
                # step it more often; every row re-plans at the slightest skew (threshold 1.05)
                view_interval = 8 if row["router"] == "example" else 1 if row.get("drift") else 2
                args = {"root": root, "router": row["router"], "split": split, "replica_slots": replica_slots,
                        "warmup": 2, "view_interval": view_interval,
                        "replan_interval": 8 if row.get("drift") else 1000, "replan_threshold": 1.05,
                        # the example row's margin is a few %: twice the batches to measure it
                        "batches": 2 * batches if row["router"] == "example" else batches,
                        "warmup_batches": max(warmup_batches, 3 * view_interval),
                        "tokens": 2048, "zipf": 1.0,
                        "experts": 8, "hidden": 256, "drift": row.get("drift", 0), "layers": 4, "model_hidden": 64, "seq_len": 128,
                        "batch": 4, "ckpt": os.path.abspath(ckpt) if row["router"] == "example" and os.path.isdir(ckpt) else None,
                        "log_dir": os.path.join("runs", "bench_infer", f"{row['name']}_{G}_{split}")}
                if progress:
                    print(f"[benchmarks infer] {row['name']}, {G} ranks, split {split} ...", file=sys.stderr, flush=True)
                result = launch_ranks(args, G, free_port())
                result["row"] = row["name"]
                rows.append(result)
    zipf_rows = [r for r in rows if r["row"] == "zipf" and r["split"] == "view"]
    example_rows = [r for r in rows if r["row"] == "example"]
    targets = {
        "outputs_bit_identical": all(r["outputs_equal"] for r in rows),
        "capacity_over_ideal_le_1.15_zipf": all(r["capacity_over_ideal_ours"] <= TARGETS["capacity_over_ideal"]
                                                for r in zipf_rows),
        "forward_1.5x_faster_zipf": all(r["speedup"] >= TARGETS["speedup_zipf"] for r in zipf_rows),
        "tokens_per_s_ge_0.98x_plain_example": all(r["tokens_per_s_ratio"] >= TARGETS["example_vs_plain"]
                                                   for r in example_rows),
        "drop_rate_halved_zipf": all(r["drop_rate_ours"] <= TARGETS["drop_rate_cut"] * r["drop_rate_plain"]
                                     for r in zipf_rows),
        "overhead_le_3pct": all(r["overhead_ratio"] <= TARGETS["overhead_ratio"] for r in rows if r["split"] == "view"),
    }
    return {"benchmark": "infer", "rows": rows, "targets": targets, "target_values": TARGETS}


if __name__ == "__main__":
    from .ranks import rank_main
    rank_main(run_rank, "infer")
