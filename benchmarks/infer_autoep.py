"""`python -m benchmarks infer --framework autoep`: the EasyBalance article's serving table on real AutoEP layers.

Shape legend: B batches, L MoE layers, E logical experts, G EP ranks, S slots per rank, P physical slots (G * S).

    python -m benchmarks infer --framework autoep --json        # 2 and 4 gloo ranks, a tiny HF Mixtral of 8 AutoEP layers

A tiny Hugging Face Mixtral (examples/hf_moe.py), converted by DeepSpeed's AutoEP, whose routers are skewed the
same way in every layer (cross-layer correlated hot experts: each router's logits get log Zipf(s) offsets), is
served four ways side by side in the same processes, on the same batches, in rotating order:

  * `static`: plain AutoEP (its own layout, no replicas): the baseline;
  * `per_token`: replicas planned from the view, each route's replica decided on its own, one route after
    another, by the least load so far (the article's per-token decisions);
  * `view`: replicas, the view's split table, decided for the whole batch at once with no collective
    (`split: "view"`; the article's batched decisions + EMA view; easybalance's default, from this measurement);
  * `exact`: replicas, each batch's routes split over the copies so that the busiest rank takes the fewest
    (`split: "exact"`: one all-gather of the [E] counts per layer, the split on the device).

Per row: the MoE layers' forward time and the whole forward's (medians over batches of the slowest rank's),
and against `static` (MoE speed-up, tokens/s: the median over batches of static's time over the row's in the
same batch, so that a neighbour slowing the shared host for a while slows both); the busiest rank's CPU time
in the MoE layers, static's over the row's (`busiest_rank_speedup`: what a rank with a core or a GPU of its own
would wait for; on this 2-core host 4 ranks share 2 cores, and the wall-clock ratio mixes in how the kernel
shares them); the device utilisation std
(each rank's received routes over the busiest rank's, std over ranks, mean over layers and batches); the
steering (route -> slot map, its all-gather included) and planning time (amortised over the default
replan_interval) against the MoE forward, and the weight moves apart (`move_ratio`, amortised the same way:
they run between batches, once per re-plan); whether every logit equals plain AutoEP's; and the
simulator's prediction for the same loads (the `view` row's balance log as its trace), as the article's model
has it (steering free) and with the steering cost this run measured (`_simulated`). Worker
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

# (row, the easybalance.inference options of its block; None: plain AutoEP)
ROWS = (("static", None),
        ("per_token", {"split": "view"}),
        ("view", {"split": "view"}),
        ("exact", {"split": "exact"}))
DEFAULT_ROW = "view"        # easybalance's default (`inference.split`), chosen by this measurement
# each row's strategy in the simulator (`sim.strategies`)
SIMULATED = {"static": "static", "view": "placement_view", "exact": "placement_steering"}
TARGETS = {"moe_speedup_4_ranks": 1.3, "overhead_ratio": 0.03, "max_abs_diff": 1e-5}
REPLAN_INTERVAL = EasyBalanceConfig().inference.replan_interval   # the default: re-planning is amortised over it


def _skew_hooks(module, experts: int, zipf_s: float, spread: float) -> None:
    """Every router's logits x `spread` (a random tiny model's logits are nearly equal: this makes the choice
    depend on the token) + log Zipf(zipf_s) over the experts (the same hot experts in every layer)."""
    from eb_deepspeed.adapters.autoep import find_autoep_layers
    offset_E = -zipf_s * torch.log(torch.arange(1, experts + 1, dtype=torch.float32))
    for _, layer in find_autoep_layers(module):
        layer.router.gate.register_forward_hook(lambda m, a, logits: logits * spread + offset_E)


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


def _timed(fn, into: list):
    def wrapped(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        into[0] += time.perf_counter() - t0
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
    _skew_hooks(engine.module, args["experts"], args["zipf"], args["spread"])
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
        self.measuring = False
        self._started: list[tuple[float, float]] = []
        G = torch.distributed.get_world_size()
        for layer in self.layers:
            layer.register_forward_pre_hook(lambda m, a: self._started.append((time.perf_counter(), time.thread_time())))
            layer.register_forward_hook(self._stop)
            # registered last: sees the routes per physical slot the served layer sends
            layer.router.register_forward_hook(lambda m, a, out, G=G: self._count(out[2], G))
        serving = getattr(module, "serving", None)
        if serving is not None:
            for gate in serving.gates:
                gate.slots = _timed(gate.slots, self.steer_s)
            serving._plan = _timed(serving._plan, self.plan_s)
            serving.apply = _timed(serving.apply, self.move_s)     # weight moves, agreement, tables

    def _stop(self, module, args, output):
        t0, cpu0 = self._started.pop()
        if self.measuring:
            self.moe_s[0] += time.perf_counter() - t0
            self.moe_cpu_s += time.thread_time() - cpu0

    def _count(self, counts_P: torch.Tensor, G: int):
        if self.measuring:
            self.loads.append(counts_P.detach().double().view(G, -1).sum(1))

    def reset(self) -> None:
        self.moe_s[0], self.steer_s[0] = 0.0, 0.0
        self.loads.clear()
        self.measuring = True

    def per_batch_ms(self) -> torch.Tensor:
        """[B, 3] the MoE layers' and the whole forward's wall ms of each measured batch, and the MoE layers'
        CPU ms on the rank's main thread, each the most of any rank (the busiest rank's)."""
        per_batch = 1e3 * torch.tensor(self.batches, dtype=torch.float64)
        torch.distributed.all_reduce(per_batch, op=torch.distributed.ReduceOp.MAX)
        return per_batch


def run_rank(args: dict) -> dict:
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    sys.path.insert(0, os.path.join(args["root"], "examples"))
    from hf_moe import zipf_tokens
    rank, G = torch.distributed.get_rank(), torch.distributed.get_world_size()
    rows = {name: _build_row(name, inference, args) for name, inference in ROWS}
    clocks = {name: _RowClock(model) for name, model in rows.items()}
    n = args["warmup_batches"] + args["batches"]
    g = torch.Generator().manual_seed(1000 + rank)
    batches = [zipf_tokens(args["batch"], args["seq_len"], g) for _ in range(n)]
    maxdiff = {name: 0.0 for name in rows}
    with torch.no_grad():
        for b, ids in enumerate(batches):
            if b == args["warmup_batches"]:
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
                maxdiff[name] = max(maxdiff[name], float((logits[name] - logits["static"]).abs().max()))
    out = {"ranks": G, "layers": args["layers"], "experts": args["experts"], "zipf": args["zipf"],
           "tokens_per_rank": args["batch"] * args["seq_len"], "batches": args["batches"], "rows": []}
    per_batch = {name: clocks[name].per_batch_ms() for name, _ in ROWS}
    for name, _ in ROWS:
        clock = clocks[name]
        loads_NG = torch.stack(clock.loads)
        torch.distributed.all_reduce(loads_NG)               # routes each rank received, per layer and batch
        util_NG = loads_NG / loads_NG.amax(1, keepdim=True).clamp_min(1)
        seconds = torch.tensor([clock.steer_s[0], clock.plan_s[0], clock.move_s[0], maxdiff[name]], dtype=torch.float64)
        torch.distributed.all_reduce(seconds, op=torch.distributed.ReduceOp.MAX)
        steer_s, plan_s, move_s, diff = seconds.tolist()
        serving = getattr(rows[name], "serving", None)
        moe_ms, forward_ms, moe_cpu_ms = per_batch[name].median(0).values.tolist()
        # paired by batch (the rows' forwards of one batch run within a second of each other, so a neighbour
        # on the host slows both): the median of static's time over this row's
        ratio_B3 = per_batch["static"] / per_batch[name].clamp_min(1e-9)
        moe_ratio, forward_ratio, cpu_ratio = ratio_B3.median(0).values.tolist()
        out["rows"].append({
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
    served = [r for run in runs for r in run["rows"] if r["row"] != "static"]
    targets = {
        "moe_speedup_ge_1.3x_default_4_ranks": bool(four) and all(r["moe_speedup"] >= TARGETS["moe_speedup_4_ranks"]
                                                                   for r in four),
        "overhead_le_3pct_default": all(r["overhead_ratio"] <= TARGETS["overhead_ratio"] for r in default),
        "outputs_within_1e-5": all(r["max_abs_diff"] <= TARGETS["max_abs_diff"] for r in served),
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


def format_autoep_infer_table(result: dict) -> str:
    """The article's table: one line per rank count and row, then the targets."""
    lines = [f"{'ranks':>5} {'row':16s} {'MoE x':>6} {'busiest x':>9} {'tokens/s x':>10} {'util std':>8} "
             f"{'max/mean':>8} {'steer ms':>8} {'overhead':>8} {'max |diff|':>10}"]
    for run in result["runs"]:
        for r in run["rows"]:
            lines.append(f"{run['ranks']:>5} {r['row']:16s} {r['moe_speedup']:>6.3f} {r['busiest_rank_speedup']:>9.3f} "
                         f"{r['tokens_per_s_ratio']:>10.3f} {r['device_util_std']:>8.3f} "
                         f"{r['device_max_over_mean']:>8.3f} {r['steering_ms']:>8.2f} {r['overhead_ratio']:>8.3f} "
                         f"{r['max_abs_diff']:>10.2g}")
    return "\n".join(lines) + "\ntargets: " + json.dumps(result["targets"])


if __name__ == "__main__":
    from .ranks import rank_main
    rank_main(run_rank, "infer", "--framework", "autoep")
