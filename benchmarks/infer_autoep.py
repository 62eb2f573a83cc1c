"""`python -m benchmarks infer --framework autoep`: the EasyBalance article's serving table on real AutoEP layers.

Shape legend: B batches, L MoE layers, E logical experts, G EP ranks, S slots per rank, P physical slots (G * S).

    python -m benchmarks infer --framework autoep --json        # 2 and 4 gloo ranks, a tiny HF Mixtral of 8 AutoEP layers

A tiny Hugging Face Mixtral (examples/hf_moe.py), converted by DeepSpeed's AutoEP, whose routers are skewed the
same way in every layer (cross-layer correlated hot experts: each router's logits get log Zipf(s) offsets), is
served four ways side by side in the same processes, on the same batches, in rotating order (and three of them
again on a balanced router: `_balanced`, each router's lean taken out, no offsets):

  * `static`: plain AutoEP (its own layout, no replicas): the baseline;
  * `per_token`: replicas planned from the view, each route's replica decided on its own, one route after
    another, by the least load so far (the article's per-token decisions);
  * `view`: replicas, the view's split table, decided for the whole batch at once with no collective
    (`split: "view"`; the article's batched decisions + EMA view);
  * `exact`: replicas, each batch's routes split over the copies so that the busiest rank takes the fewest
    (`split: "exact"`, easybalance's default for AutoEP: one exchange of the [E] counts per layer in place of
    AutoEP's own, the split on the device).

Per row: the MoE layers' forward time and the whole forward's (medians over batches of the slowest rank's),
and against `static` (MoE speed-up, tokens/s: the median over batches of static's time over the row's in the
same batch, so that a neighbour slowing the shared host for a while slows both); the busiest rank's CPU time
in the MoE layers, static's over the row's (`busiest_rank_speedup`: what a rank with a core or a GPU of its own
would wait for; on this 2-core host 4 ranks share 2 cores, and the wall-clock ratio mixes in how the kernel
shares them); the device utilisation std
(each rank's received routes over the busiest rank's, std over ranks, mean over layers and batches); the
steering (route -> slot map, CPU time: `exact`'s count exchange included, not its wait for the other ranks) and
planning time (amortised over the default
replan_interval) against the MoE forward, and the weight moves apart (`move_ratio`, amortised the same way:
they run between batches, once per re-plan); whether every logit equals plain AutoEP's; and the
simulator's prediction for the same loads (the `view` row's balance log as its trace), as the article's model
has it (steering free) and with the steering cost this run measured (`_simulated`); the busiest rank's routes over
the LP bound's, per layer forward (`busiest_over_lp_max`); the collectives per MoE layer forward; one forward's
host syncs, ours and plain's (`host_syncs_per_forward`, the CPU audit `benchmarks.sync_audit`); the share of
routes sent to another rank (the all-to-all's bytes); the forward's
time over `view_balanced`'s, paired by batch. Worker
processes are started here with RANK / WORLD_SIZE set (no launcher needed).
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

from eb_deepspeed.core.config import EasyBalanceConfig

__all__ = ["bench_infer_autoep", "format_autoep_infer_table"]

# (row, the easybalance.inference options of its block; None: plain AutoEP). `_balanced` rows: the same model with
# each router's lean taken out and no Zipf offsets (what the default costs where there is little to balance)
ROWS = (("static", None),
        ("per_token", {"split": "view"}),
        ("view", {"split": "view"}),
        ("exact", {}),
        ("static_balanced", None),
        ("view_balanced", {"split": "view"}),
        ("exact_balanced", {}))
DEFAULT_ROW = "exact"       # easybalance's default for AutoEP (`inference.split`), chosen by this measurement
COLLECTIVES = ("all_to_all_single", "all_gather_into_tensor", "all_gather", "all_reduce", "broadcast",
               "reduce_scatter_tensor")
# each row's strategy in the simulator (`sim.strategies`)
SIMULATED = {"static": "static", "view": "placement_view", "exact": "placement_steering"}
TARGETS = {"moe_speedup_4_ranks": 1.3, "overhead_ratio": 0.03, "max_abs_diff": 1e-5, "over_lp": 1.02,
           "balanced_over_view": 1.03}
REPLAN_INTERVAL = EasyBalanceConfig().inference.replan_interval   # the default: re-planning is amortised over it


def _skew_hooks(module, experts: int, zipf_s: float, spread: float, balanced: bool = False) -> None:
    """Every router's logits x `spread` (a random tiny model's logits are nearly equal: this makes the choice
    depend on the token) + log Zipf(zipf_s) over the experts (the same hot experts in every layer). balanced: each
    expert's logits less their mean over the batch's tokens instead (a random router's own lean taken out)."""
    from eb_deepspeed.adapters.autoep import find_autoep_layers
    offset_E = -zipf_s * torch.log(torch.arange(1, experts + 1, dtype=torch.float32))
    for _, layer in find_autoep_layers(module):
        layer.router.gate.register_forward_hook(
            (lambda m, a, logits: (logits - logits.mean(0)) * spread) if balanced else
            (lambda m, a, logits: logits * spread + offset_E))


def _per_token_slots(gate):
    """`AutoEPRoutes.slots` deciding each route on its own: the replica on the rank this rank has sent the
    fewest routes of this layer so far (a Python loop over routes: the article's per-token decisions)."""
    def slots(selected_TK, counts_E):
        log2phy = gate.table.log2phy_ER.tolist()
        load_G = [0] * gate.G
        out = []
        for e in selected_TK.reshape(-1).tolist():
            best = min((p for p in log2phy[e] if p >= 0), key=lambda p: load_G[p // gate.S])
            load_G[best // gate.S] += 1
            out.append(best)
        slot_N = torch.tensor(out, dtype=torch.long)
        return slot_N.view_as(selected_TK), torch.bincount(slot_N, minlength=gate.P)
    return slots


_IN_LAYER: list = [None]       # the row clock whose measured MoE layer is running now


def _count_collectives() -> None:
    """Every torch.distributed collective (DeepSpeed's comm calls them by name) inside a measured MoE layer adds
    one to its row's `collectives`."""
    for name in COLLECTIVES:
        fn = getattr(torch.distributed, name)

        def counted(*args, _fn=fn, **kwargs):
            if _IN_LAYER[0] is not None:
                _IN_LAYER[0].collectives += 1
            return _fn(*args, **kwargs)
        setattr(torch.distributed, name, counted)


def _timed(fn, into: list, clock=time.perf_counter):
    def wrapped(*args, **kwargs):
        t0 = clock()
        out = fn(*args, **kwargs)
        into[0] += clock() - t0
        return out
    return wrapped


def _build_row(name: str, inference: dict | None, args: dict):
    """One row's model: the seeded model AutoEP converted, skewed; served by easybalance unless `static`."""
    import deepspeed

    from eb_deepspeed.adapters.serving import init_inference
    sys.path.insert(0, os.path.join(args["root"], "examples"))
    from hf_moe import autoep_section, hf_moe_model
    G = torch.distributed.get_world_size()
    torch.manual_seed(args["seed"])
    model = hf_moe_model("mixtral", layers=args["layers"], hidden=args["hidden"], experts=args["experts"], k=2,
                         ffn=args["ffn"], seq_len=args["seq_len"])
    cfg = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**6,
           "expert_parallel": autoep_section("mixtral", G)}
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    _skew_hooks(engine.module, args["experts"], args["zipf"], args["spread"], balanced=name.endswith("_balanced"))
    if inference is None:
        return engine.module.eval()
    block = {"mode": "balance", "warmup_batches": 2, "log": {"dir": os.path.join(args["log_dir"], f"{name}_{G}"),
                                                            "interval": 1},
             "inference": {"replica_slots": args["replica_slots"], "view_interval": 1, "replan_threshold": 1.05,
                           "replan_interval": 1000, **inference}}
    served = init_inference(engine, config={"easybalance": block})
    if name == "per_token":
        for gate in served.serving.gates:
            gate.slots = _per_token_slots(gate)
    return served


class _RowClock:
    """One row's measurements: MoE-layer and whole-forward seconds of each measured batch (`batches`),
    steering and planning seconds, each rank's routes sent to each rank per layer and batch (`loads`)."""

    def __init__(self, module):
        from eb_deepspeed.adapters.autoep import find_autoep_layers
        self.module = module
        self.layers = [m for _, m in find_autoep_layers(module)]
        self.moe_s, self.steer_s, self.plan_s, self.move_s = [0.0], [0.0], [0.0], [0.0]
        self.moe_cpu_s = 0.0       # this process's main thread's CPU time in the MoE layers
        # per measured batch: (MoE layers, whole forward) wall seconds, MoE main-thread CPU seconds
        self.batches: list[tuple[float, float, float]] = []
        self.loads: list[torch.Tensor] = []
        # per layer forward: this rank's routes per logical expert [E], the served layer's phy2log [P] and S
        self.routed: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self.collectives = 0        # collectives inside the measured MoE layers' forwards
        self.sent = torch.zeros(2, dtype=torch.float64)    # routes this rank sent: to other ranks, in all
        self.measuring = False
        self._started: list[tuple[float, float]] = []
        G = torch.distributed.get_world_size()
        for i, layer in enumerate(self.layers):
            layer.register_forward_pre_hook(lambda m, a: self._start())
            layer.register_forward_hook(self._stop)
            # registered last: sees the routes per physical slot the served layer sends
            layer.router.register_forward_hook(lambda m, a, out, G=G, i=i: self._count(out[2], G, i))
        serving = getattr(module, "serving", None)
        if serving is not None:
            for gate in serving.gates:
                # CPU time: `exact`'s count exchange replaces AutoEP's, whose wait for the other ranks plain pays too
                gate.slots = _timed(gate.slots, self.steer_s, time.thread_time)
            serving._plan = _timed(serving._plan, self.plan_s)
            serving.apply = _timed(serving.apply, self.move_s)     # weight moves, agreement, tables

    def _start(self):
        _IN_LAYER[0] = self if self.measuring else None
        self._started.append((time.perf_counter(), time.thread_time()))

    def _stop(self, module, args, output):
        _IN_LAYER[0] = None
        t0, cpu0 = self._started.pop()
        if self.measuring:
            self.moe_s[0] += time.perf_counter() - t0
            self.moe_cpu_s += time.thread_time() - cpu0

    def _count(self, counts_P: torch.Tensor, G: int, layer: int):
        if self.measuring:
            self.loads.append(counts_P.detach().double().view(G, -1).sum(1))
            self.sent += torch.stack((self.loads[-1].sum() - self.loads[-1][torch.distributed.get_rank()],
                                      self.loads[-1].sum()))
            serving = getattr(self.module, "serving", None)
            E = self.layers[layer].num_experts
            phy_P = serving.placement.phy2log[layer] if serving is not None else torch.arange(E)
            live = phy_P >= 0                                # a placement may leave slots empty
            self.routed.append((torch.zeros(E, dtype=torch.float64).index_add_(0, phy_P[live], counts_P.double()[live]), phy_P,
                                counts_P.numel() // G))

    def reset(self) -> None:
        self.moe_s[0], self.steer_s[0] = 0.0, 0.0
        self.loads.clear()
        self.routed.clear()
        self.measuring = True

    def over_lp(self, loads_NG: torch.Tensor) -> torch.Tensor:
        """[N] each layer forward's busiest rank's received routes over the LP's least busiest rank for the same
        counts on the same placement (`benchmarks.exact.steered_max`: every route free to go to any copy)."""
        from .exact import steered_max
        counts_NE = torch.stack([c for c, _, _ in self.routed])
        torch.distributed.all_reduce(counts_NE)                    # every rank's routes per expert
        lp_N = torch.tensor([float(steered_max(phy_P[None], counts_NE[n][None], S)[0])
                             for n, (_, phy_P, S) in enumerate(self.routed)], dtype=torch.float64)
        return loads_NG.amax(1) / lp_N.clamp_min(1e-9)

    def per_batch_ms(self) -> torch.Tensor:
        """[B, 3] the MoE layers' and the whole forward's wall ms of each measured batch, and the MoE layers'
        CPU ms on the rank's main thread, each the most of any rank (the busiest rank's)."""
        per_batch = 1e3 * torch.tensor(self.batches, dtype=torch.float64)
        torch.distributed.all_reduce(per_batch, op=torch.distributed.ReduceOp.MAX)
        return per_batch


def _host_syncs(model, ids: torch.Tensor) -> dict[str, int]:
    """One forward's host-device syncs as a GPU would see them (`benchmarks.sync_audit`, inferred on CPU): ours
    (eb_deepspeed's) and everyone else's; the view step the forward's hook runs after it apart (tests/test_sync.py
    counts it: one read a view step)."""
    from .sync_audit import SyncAudit
    audit, serving = SyncAudit(), getattr(model, "serving", None)
    if serving is not None:
        def in_step(_call=serving.after_batch):
            with audit.region("view step"):
                return _call()
        serving.after_batch = in_step
    audit.on_device(model, ids)
    try:
        with audit, audit.region("forward"), torch.no_grad():
            model(input_ids=ids)
    finally:
        if serving is not None:
            del serving.after_batch
    return {"ours": audit.total("forward"), "theirs": audit.total("forward", ours=False)}


def run_rank(args: dict) -> dict:
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    sys.path.insert(0, os.path.join(args["root"], "examples"))
    from hf_moe import zipf_tokens
    rank, G = torch.distributed.get_rank(), torch.distributed.get_world_size()
    rows = {name: _build_row(name, inference, args) for name, inference in ROWS}
    _count_collectives()
    clocks = {name: _RowClock(model) for name, model in rows.items()}
    n = args["warmup_batches"] + args["batches"]
    g = torch.Generator().manual_seed(1000 + rank)
    batches = [zipf_tokens(args["batch"], args["seq_len"], g) for _ in range(n)]
    maxdiff = {name: 0.0 for name in rows}
    with torch.no_grad():
        for b, ids in enumerate(batches):
            if b == args["warmup_batches"]:      # the replicas in place: one audited forward, then measure
                syncs = {name: _host_syncs(model, ids) for name, model in rows.items()}
                for clock in clocks.values():
                    clock.reset()
            order = list(rows)[b % len(rows):] + list(rows)[:b % len(rows)]
            logits = {}
            for name in order:
                clock = clocks[name]
                torch.distributed.barrier()          # every rank starts the timed forward together
                moe_before, cpu_before, t0 = clock.moe_s[0], clock.moe_cpu_s, time.perf_counter()
                logits[name] = rows[name](input_ids=ids).logits
                if b >= args["warmup_batches"]:
                    clock.batches.append((clock.moe_s[0] - moe_before, time.perf_counter() - t0,
                                          clock.moe_cpu_s - cpu_before))
            for name in rows:
                maxdiff[name] = max(maxdiff[name], float((logits[name] - logits[_plain(name)]).abs().max()))
    out = {"ranks": G, "layers": args["layers"], "experts": args["experts"], "zipf": args["zipf"],
           "tokens_per_rank": args["batch"] * args["seq_len"], "batches": args["batches"], "rows": []}
    per_batch = {name: clocks[name].per_batch_ms() for name, _ in ROWS}
    view_B = per_batch["view_balanced"][:, 1]
    for name, _ in ROWS:
        clock = clocks[name]
        loads_NG = torch.stack(clock.loads)
        torch.distributed.all_reduce(loads_NG)               # routes each rank received, per layer and batch
        util_NG = loads_NG / loads_NG.amax(1, keepdim=True).clamp_min(1)
        over_lp_N = clock.over_lp(loads_NG)
        torch.distributed.all_reduce(clock.sent)
        seconds = torch.tensor([clock.steer_s[0], clock.plan_s[0], clock.move_s[0], maxdiff[name]], dtype=torch.float64)
        torch.distributed.all_reduce(seconds, op=torch.distributed.ReduceOp.MAX)
        steer_s, plan_s, move_s, diff = seconds.tolist()
        serving = getattr(rows[name], "serving", None)
        moe_ms, forward_ms, moe_cpu_ms = per_batch[name].median(0).values.tolist()
        # paired by batch (the rows' forwards of one batch run within a second of each other, so a neighbour
        # on the host slows both): the median of static's time over this row's
        ratio_B3 = per_batch[_plain(name)] / per_batch[name].clamp_min(1e-9)
        moe_ratio, forward_ratio, cpu_ratio = ratio_B3.median(0).values.tolist()
        out["rows"].append({
            # the whole forward's time over the balanced view row's, paired by batch (its median): what the split
            # costs where there is little to balance
            "forward_over_view_balanced": round(float((per_batch[name][:, 1] / view_B).median()), 4),
            "row": name, "moe_forward_ms": round(moe_ms, 3), "forward_ms": round(forward_ms, 3),
            "moe_speedup": round(moe_ratio, 4), "tokens_per_s_ratio": round(forward_ratio, 4),
            # the busiest rank's CPU time in the MoE layers, static's over this row's: what a rank with a core
            # (a GPU) of its own would wait for, whatever the host's other ranks and tenants do
            "moe_cpu_ms": round(moe_cpu_ms, 3), "busiest_rank_speedup": round(cpu_ratio, 4),
            "device_util_std": round(float(util_NG.std(1, unbiased=False).mean()), 4),
            "device_max_over_mean": round(float((loads_NG.amax(1) / loads_NG.mean(1).clamp_min(1e-9)).mean()), 4),
            "steering_ms": round(1e3 * steer_s / args["batches"], 3), "plan_ms": round(1e3 * plan_s, 2),
            "move_ms": round(1e3 * move_s, 2),
            # steering every forward + planning amortised over the default replan_interval, against the MoE
            # forward; the weight moves (between batches, once per re-plan) apart, amortised the same way
            "overhead_ratio": round((1e3 * steer_s / args["batches"] + 1e3 * plan_s / REPLAN_INTERVAL)
                                    / max(moe_ms, 1e-9), 4),
            "move_ratio": round(1e3 * move_s / REPLAN_INTERVAL / max(moe_ms, 1e-9), 4),
            "max_abs_diff": diff, "outputs_equal": diff == 0.0,
            # the busiest rank's routes over the LP bound's (every route free over its expert's copies), per layer
            # forward: the worst and the mean
            "busiest_over_lp_max": round(float(over_lp_N.max()), 4), "busiest_over_lp_mean": round(float(over_lp_N.mean()), 4),
            "collectives_per_layer": clock.collectives / (args["batches"] * len(clock.layers)),
            "host_syncs_per_forward": syncs[name],
            "routes_leaving_their_rank": round(float(clock.sent[0] / clock.sent[1].clamp_min(1)), 4),
            "split": ("exact" if serving.routing.exact else "view") if serving is not None else None,
            "slots_per_rank": serving.S if serving is not None else args["experts"] // G,
            "replans": serving.replans if serving is not None else 0})
    return out


def bench_infer_autoep(ranks=(2, 4), batches: int = 24, warmup_batches: int = 4, replica_slots: int = 1,
                       layers: int = 8, ffn: int = 1024, seq_len: int = 128, out_dir: str = "runs/bench_infer_autoep",
                       progress: bool = True) -> dict:
    """Run the rows on each rank count (one launch each); ffn: each expert's hidden size (1024: the experts'
    GEMMs most of a layer's time on this CPU, as on a GPU at serving batch sizes); out_dir: the rows' balance
    logs (`logs/ROW_RANKS`)."""
    import shutil

    from .bench import _repo_root, free_port, unlink_shm_buffers
    from .ranks import launch_ranks
    root = _repo_root()
    out_dir = os.path.abspath(out_dir)
    log_dir = os.path.join(out_dir, "logs")
    runs = []
    for G in ranks:
        for name, _ in ROWS:                # each run's balance logs are its own (the simulator reads them)
            shutil.rmtree(os.path.join(log_dir, f"{name}_{G}"), ignore_errors=True)
        args = {"root": root, "batches": batches, "warmup_batches": warmup_batches, "replica_slots": replica_slots,
                "layers": layers, "hidden": 64, "ffn": ffn, "experts": 8, "seq_len": seq_len, "batch": 4,
                "zipf": 1.2, "spread": 8.0,
                "seed": 0, "log_dir": log_dir, "out_dir": out_dir}
        if progress:
            print(f"[benchmarks infer --framework autoep] {G} ranks, {len(ROWS)} rows side by side ...", file=sys.stderr,
                  flush=True)
        port = free_port()
        try:
            runs.append(launch_ranks(args, G, port, module="benchmarks.infer_autoep", out_dir=out_dir))
        finally:
            unlink_shm_buffers(port)
    for run in runs:
        run["simulated"] = _simulated(run, os.path.join(log_dir, f"view_{run['ranks']}"), replica_slots)
    default = [r for run in runs for r in run["rows"] if r["row"] == DEFAULT_ROW]
    four = [r for run in runs if run["ranks"] == 4 for r in run["rows"] if r["row"] == DEFAULT_ROW]
    served = [r for run in runs for r in run["rows"] if not r["row"].startswith("static")]
    exact = [r for run in runs for r in run["rows"] if r["row"].startswith("exact")]
    targets = {
        "default_split_is_exact": all(r["split"] == "exact" for r in exact),
        "moe_speedup_ge_1.3x_default_4_ranks": bool(four) and all(r["moe_speedup"] >= TARGETS["moe_speedup_4_ranks"]
                                                                   for r in four),
        "overhead_le_3pct_default": all(r["overhead_ratio"] <= TARGETS["overhead_ratio"] for r in default),
        "outputs_within_1e-5": all(r["max_abs_diff"] <= TARGETS["max_abs_diff"] for r in served),
        "lp_bound_within_2pct_every_batch": all(r["busiest_over_lp_max"] <= TARGETS["over_lp"] for r in exact),
        "collectives_per_layer_as_plain": all(r["collectives_per_layer"] == _static(run, r)["collectives_per_layer"]
                                              for run in runs for r in run["rows"] if r["row"].startswith("exact")),
        "host_syncs_as_plain_per_forward": all(
            r["host_syncs_per_forward"]["ours"] + r["host_syncs_per_forward"]["theirs"]
            <= _static(run, r)["host_syncs_per_forward"]["theirs"] for run in runs for r in run["rows"]
            if r["row"].startswith(("view", "exact"))),
        "balanced_router_le_1.03x_view": all(r["forward_over_view_balanced"] <= TARGETS["balanced_over_view"]
                                             for r in exact if r["row"] == "exact_balanced"),
    }
    return {"benchmark": "infer_autoep", "default_row": DEFAULT_ROW, "cpu_count": os.cpu_count(), "runs": runs,
            "targets": targets, "target_values": TARGETS}


def _simulated(run: dict, view_log: str, replica_slots: int) -> dict:
    """The simulator on the loads this run served (the `view` row's balance log, one record a batch): each row's
    throughput against static, as the article's model has it (steering free) and corrected by what exact
    steering cost here per layer (in the model's units: its measured share of the static layer's time)."""
    from .sim.model import ClusterModel
    from .sim.strategies import SimConfig, simulate
    from eb_deepspeed.observe.traces import load_trace
    from .sim.workloads import trace_workload
    G, L = run["ranks"], run["layers"]
    workload = trace_workload(load_trace(view_log), G)
    rows = {r["row"]: r for r in run["rows"]}
    article = ClusterModel(hidden=64, bytes_per_elem=4)
    static_ms = simulate(workload, "static", SimConfig(model=article, extra_slots=replica_slots))["step_ms"]
    steer_share = rows["exact"]["steering_ms"] / max(rows["static"]["moe_forward_ms"], 1e-9)
    corrected = ClusterModel(hidden=64, bytes_per_elem=4, steer_s=1e-3 * static_ms * steer_share / L)
    out = {}
    for label, model in (("article_model", article), ("steering_cost_measured", corrected)):
        times = {}
        for row, strategy in SIMULATED.items():
            cfg = SimConfig(model=model, extra_slots=replica_slots, warmup=3, replan_every=10**9)
            times[row] = simulate(workload, strategy, cfg)["step_ms"]
        out[label] = {row: round(times["static"] / t, 4) for row, t in times.items()}
    out["measured"] = {row: rows[row]["moe_speedup"] for row in SIMULATED}
    return out


def _plain(name: str) -> str:
    """The plain AutoEP row a row is judged against: `static`, or `static_balanced` for a `_balanced` row."""
    return "static_balanced" if name.endswith("_balanced") else "static"


def _static(run: dict, row: dict) -> dict:
    return next(r for r in run["rows"] if r["row"] == _plain(row["row"]))


def format_autoep_infer_table(result: dict) -> str:
    """The article's table: one line per rank count and row, then the targets."""
    lines = [f"{'ranks':>5} {'row':16s} {'MoE x':>6} {'busiest x':>9} {'tokens/s x':>10} {'util std':>8} "
             f"{'max/mean':>8} {'/ LP':>6} {'coll.':>5} {'steer ms':>8} {'overhead':>8} {'max |diff|':>10}"]
    for run in result["runs"]:
        for r in run["rows"]:
            lines.append(f"{run['ranks']:>5} {r['row']:16s} {r['moe_speedup']:>6.3f} {r['busiest_rank_speedup']:>9.3f} "
                         f"{r['tokens_per_s_ratio']:>10.3f} {r['device_util_std']:>8.3f} "
                         f"{r['device_max_over_mean']:>8.3f} {r['busiest_over_lp_max']:>6.3f} "
                         f"{r['collectives_per_layer']:>5.2f} {r['steering_ms']:>8.2f} {r['overhead_ratio']:>8.3f} "
                         f"{r['max_abs_diff']:>10.2g}")
    return "\n".join(lines) + "\ntargets: " + json.dumps(result["targets"])


if __name__ == "__main__":
    from .ranks import rank_main
    rank_main(run_rank, "infer", "--framework", "autoep")
