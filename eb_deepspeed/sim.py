"""Cluster cost model and workloads for benchmarks: what placement and steering are worth before
the runtime uses them.

    eb simulate                     # seed 000's table for a 32-layer MoE on 8 devices, + our rows
    eb simulate --json --workload drifting

Shape legend: N steps, L layers, G devices (= source ranks), E logical experts, R replicas.

Cost of one layer on device d (seconds):
    compute   = routes processed on d * route_s       (* padded capacity instead, with `padded`)
    all2all   = 2 * max(intra bytes / intra_bw, inter bytes / inter_bw) + messages * latency
                (dispatch and combine; bytes = tokens sent to other ranks * hidden * 2)
    decisions = routes decided on d / decision_batch * decision_s   (the seed's 2-3 ms per layer
                per-token cost against 0.3 ms batched is what decision_s and decision_batch model)
Execution is synchronised per layer (a layer takes its slowest device), or with bounded run-ahead:
a device may start layer l once every device has finished layer l - window.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from . import metrics as M
from .placement import Placement, _finish, plan_placement, static_placement
from .steering import NODE_HOP, even_split, steer

__all__ = ["Topology", "TOPOLOGIES", "ClusterModel", "SimConfig", "Workload", "synthetic_workload", "uniform_workload",
           "load_trace", "trace_workload", "simulate", "STRATEGIES", "run_table", "WORKLOADS"]


@dataclass(frozen=True)
class Topology:
    name: str
    devices_per_node: int
    intra_bw: float      # bytes/s inside a node
    inter_bw: float      # bytes/s between nodes
    intra_lat: float     # s per message inside a node
    inter_lat: float     # s per message between nodes


TOPOLOGIES = {
    "nvlink": Topology("nvlink", 8, 150e9, 150e9, 8e-6, 8e-6),
    "pcie": Topology("pcie", 8, 16e9, 16e9, 15e-6, 15e-6),
    "multi_node": Topology("multi_node", 4, 150e9, 12.5e9, 8e-6, 30e-6),
}


@dataclass(frozen=True)
class ClusterModel:
    topology: Topology = TOPOLOGIES["pcie"]
    hidden: int = 4096
    bytes_per_elem: int = 2
    route_s: float = 0.6e-6        # expert compute per routed token (8192 routes/device ~ 4.9 ms)
    decision_s: float = 0.3e-6     # one steering decision (per-token: ~2.5 ms per layer at 4096 x 2)
    padded: bool = False           # compute ~ padded capacity (DeepSpeed drop_tokens=False) instead of tokens
    window: int = 1                # 1 = synchronised per layer; w > 1 = bounded run-ahead

    def node_of(self, G: int) -> torch.Tensor:
        return torch.arange(G) // min(G, self.topology.devices_per_node)

    def layer_times(self, traffic_GG: torch.Tensor, compute_G: torch.Tensor, messages_G: torch.Tensor,
                    decisions_G: torch.Tensor) -> torch.Tensor:
        """Per-device time of one layer [G] from tokens sent s->d [G, G] (weighted), routes processed [G],
        messages sent [G] and steering decisions made [G]."""
        G = traffic_GG.shape[0]
        node = self.node_of(G)
        same = node[:, None] == node[None, :]
        off = ~torch.eye(G, dtype=torch.bool)
        tok_bytes = self.hidden * self.bytes_per_elem
        t = self.topology
        intra_send = (traffic_GG * (same & off)).sum(1) * tok_bytes / t.intra_bw
        inter_send = (traffic_GG * ~same).sum(1) * tok_bytes / t.inter_bw
        intra_recv = (traffic_GG * (same & off)).sum(0) * tok_bytes / t.intra_bw
        inter_recv = (traffic_GG * ~same).sum(0) * tok_bytes / t.inter_bw
        lat = t.inter_lat if int(node.max()) > 0 else t.intra_lat
        a2a = 2 * torch.maximum(torch.maximum(intra_send, inter_send), torch.maximum(intra_recv, inter_recv)) \
            + messages_G * lat
        return compute_G * self.route_s + a2a + decisions_G * self.decision_s

    def step_time(self, times_LG: torch.Tensor) -> float:
        """Wall time of one step from per-layer per-device times [L, G]."""
        if self.window <= 1:
            return float(times_LG.amax(1).sum())
        L, G = times_LG.shape
        finish = torch.zeros(L, G, dtype=torch.float64)
        for l in range(L):  # layers, not tokens
            ready = finish[l - 1] if l else torch.zeros(G, dtype=torch.float64)
            if l - self.window >= 0:
                ready = torch.maximum(ready, finish[l - self.window].max().expand(G))
            finish[l] = ready + times_LG[l]
        return float(finish[-1].max())


@dataclass
class Workload:
    name: str
    counts_NLGE: torch.Tensor        # routes per step, layer, source rank, expert
    weight_G: torch.Tensor = None    # per-source cost weight (mixed sequence lengths), default 1
    k: int = 2

    def __post_init__(self):
        if self.weight_G is None:
            self.weight_G = torch.ones(self.counts_NLGE.shape[2], dtype=torch.float64)


def _zipf_probs(E: int, s: float) -> torch.Tensor:
    return 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** s


def synthetic_workload(name: str = "skewed_correlated", layers: int = 32, experts: int = 64, devices: int = 8,
                       steps: int = 40, tokens_per_rank: int = 4096, k: int = 2, zipf: float = 1.1,
                       correlation: float = 0.8, drift: float = 0.0, mixed_lengths: bool = False,
                       seed: int = 0) -> Workload:
    """Zipf-skewed expert popularity per layer, hot experts shared across layers with probability
    `correlation` (so a static layout stacks the same hot device layer after layer), popularity that
    drifts by `drift` per step (fraction of the ranking that rotates), and optionally mixed sequence
    lengths (source ranks whose tokens cost 0.5x-2x)."""
    g = torch.Generator().manual_seed(seed)
    base = _zipf_probs(experts, zipf)
    shared = torch.randperm(experts, generator=g)
    perms = []
    for _ in range(layers):
        own = torch.randperm(experts, generator=g)
        keep = torch.rand(experts, generator=g) < correlation
        perm = torch.where(keep, shared, own)
        # repair duplicates so every layer's ranking is a permutation
        seen, out = set(), []
        for e in perm.tolist():
            out.append(e if e not in seen else -1)
            seen.add(e)
        missing = [e for e in own.tolist() if e not in seen]
        perms.append(torch.tensor([e if e >= 0 else missing.pop(0) for e in out]))
    rank_LE = torch.stack(perms)                                  # expert at popularity rank r
    logits_LE = torch.zeros(layers, experts, dtype=torch.float64)
    logits_LE.scatter_(1, rank_LE, base.log().expand(layers, -1))
    counts = []
    for _ in range(steps):
        if drift > 0:
            logits_LE = logits_LE + drift * torch.randn(layers, experts, generator=g, dtype=torch.float64) * 3
        p_LE = torch.softmax(logits_LE, 1)
        n = tokens_per_rank * k
        c = torch.stack([torch.multinomial(p_LE[l], n * devices, replacement=True, generator=g)
                         .view(devices, n) for l in range(layers)])             # [L, G, n] expert ids
        counts.append(torch.zeros(layers, devices, experts, dtype=torch.long).scatter_add_(
            2, c, torch.ones_like(c)))
    weight_G = None
    if mixed_lengths:
        weight_G = 2.0 ** (torch.rand(devices, generator=g, dtype=torch.float64) * 2 - 1)
    return Workload(name, torch.stack(counts), weight_G, k)


def uniform_workload(layers=32, experts=64, devices=8, steps=10, tokens_per_rank=4096, k=2) -> Workload:
    """Exactly balanced: every source sends the same number of routes to every expert."""
    per = tokens_per_rank * k // experts
    return Workload("uniform", torch.full((steps, layers, devices, experts), per, dtype=torch.long), k=k)


WORKLOADS = {
    "skewed_correlated": dict(),
    "drifting": dict(drift=0.05),
    "mixed_lengths": dict(mixed_lengths=True),
    "weakly_correlated": dict(correlation=0.2),
}


# ---------------------------------------------------------------------- traces
def load_trace(path: str) -> torch.Tensor:
    """Expert load trace [steps, layers, experts] from a file.

    * SGLang expert-distribution dump (`torch.save` of a dict with `logical_count`
      [steps, layers, experts] or [layers, experts]);
    * vLLM-style expert load (a dict with `expert_load_window` [window, layers, physical] or
      `expert_load_pass` [layers, physical], plus `physical_to_logical_map` [layers, physical]; or a
      logical `global_expert_load` [layers, experts]);
    * our own balance log (`balance.jsonl`, the `expert_counts_LE` of each record).
    Read with `torch.load(..., weights_only=True)`; malformed files raise ValueError naming the problem.
    """
    if path.endswith(".jsonl") or os.path.isdir(path):
        from .report import read_log
        rows = [r["expert_counts_LE"] for r in read_log(path) if "expert_counts_LE" in r]
        if not rows:
            raise ValueError(f"{path}: no record holds expert_counts_LE")
        return torch.tensor(rows, dtype=torch.float64)
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle/zip errors differ by cause; all mean "not a torch.save'd dict"
        raise ValueError(f"{path}: not a torch.save file readable with weights_only=True ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a dict of tensors, got {type(data).__name__}")

    def tensor(key, dims):
        t = data[key]
        if not isinstance(t, torch.Tensor) or t.dim() not in dims:
            raise ValueError(f"{path}: '{key}' must be a tensor with {' or '.join(map(str, dims))} dimensions, "
                             f"got {type(t).__name__}{'' if not isinstance(t, torch.Tensor) else tuple(t.shape)}")
        t = t.to(torch.float64)
        if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
            raise ValueError(f"{path}: '{key}' must be finite and non-negative")
        return t

    if "logical_count" in data:                                   # SGLang
        t = tensor("logical_count", (2, 3))
        return t[None] if t.dim() == 2 else t
    if "global_expert_load" in data:                              # vLLM, logical
        t = tensor("global_expert_load", (2, 3))
        return t[None] if t.dim() == 2 else t
    for key in ("expert_load_window", "expert_load_pass"):        # vLLM, physical
        if key in data:
            t = tensor(key, (2, 3))
            t = t[None] if t.dim() == 2 else t
            if "physical_to_logical_map" not in data:
                raise ValueError(f"{path}: '{key}' counts physical experts; 'physical_to_logical_map' is missing")
            p2l = data["physical_to_logical_map"]
            if not isinstance(p2l, torch.Tensor) or tuple(p2l.shape) != tuple(t.shape[1:]):
                raise ValueError(f"{path}: physical_to_logical_map must be {tuple(t.shape[1:])} to match '{key}'")
            p2l = p2l.long()
            E = int(p2l.max()) + 1
            out = torch.zeros(t.shape[0], t.shape[1], E + 1, dtype=torch.float64)
            out.scatter_add_(2, (p2l + 1).clamp_min(0).expand_as(t), t)
            return out[:, :, 1:]
    raise ValueError(f"{path}: no expert load found; expected one of logical_count (SGLang), global_expert_load, "
                     f"expert_load_window / expert_load_pass (vLLM); keys present: {sorted(data)}")


def trace_workload(trace_NLE: torch.Tensor, devices: int, name: str = "trace", k: int = 2) -> Workload:
    """Spread a logical trace [steps, layers, experts] evenly over `devices` source ranks
    (remainders go to consecutive ranks starting at the expert's own index, so no rank is favoured)."""
    c = torch.as_tensor(trace_NLE).round().long()
    N, L, E = c.shape
    base, rem = c // devices, c % devices
    src_G = torch.arange(devices)
    offset_GE = (src_G[:, None] - torch.arange(E)[None, :]) % devices          # rank's position for expert e
    counts = base[:, :, None, :] + (offset_GE[None, None] < rem[:, :, None, :]).long()
    return Workload(name, counts, k=k)


# ---------------------------------------------------------------------- strategies
STRATEGIES = ("static", "per_token", "batched_ema", "aggregated", "placement_steering_cross", "placement_steering",
              "greedy_eplb")
STRATEGY_LABELS = {
    "static": "static baseline (DeepSpeed layout)",
    "per_token": "cross-layer re-routing, per-token decisions",
    "batched_ema": "+ batched decisions (8) and EMA view",
    "aggregated": "+ communication aggregation",
    "placement_steering_cross": "eb placement + steering, seed weights",
    "placement_steering": "eb placement + steering, cross folded",
    "greedy_eplb": "per-layer greedy replication (EPLB-style)",
}


@dataclass
class SimConfig:
    model: ClusterModel = field(default_factory=ClusterModel)
    extra_slots: int = 2             # replica slots per device beyond E / G (the equal budget)
    replan_every: int = 10           # steps between re-plans (weights move in gaps)
    warmup: int = 3                  # steps of view before the first plan (seed 000 §4.3)
    movable: float = 0.35            # fraction of routes with a near-tie candidate expert (seed's steering)
    ema_alpha: float = 0.3
    window: int = 5
    decision_batch: int = 8
    weights: tuple = (0.3, 0.5, 0.2)
    topology: str = "pcie"


def _greedy_eplb(load_LE: torch.Tensor, G: int, S: int) -> Placement:
    """EPLB-style per-layer replication (re-implemented from its published description): each extra
    slot to the expert with the highest load per replica, then balanced packing (heaviest replica
    to the least loaded device with room, no expert twice on a device). No cross-layer, node or
    previous-plan awareness; tokens are split evenly among replicas."""
    L, E = load_LE.shape
    P = G * S
    cnt = torch.ones(L, E, dtype=torch.long)
    lidx = torch.arange(L)
    for _ in range(P - E):
        per = torch.where(cnt < G, load_LE / cnt, -1.0)
        cnt[lidx, per.argmax(1)] += 1
    phy = torch.full((L, P), -1, dtype=torch.long)
    for l in range(L):   # layers; the per-layer planner is the point of this baseline
        reps = sorted(((float(load_LE[l, e]) / int(cnt[l, e]), e) for e in range(E) for _ in range(int(cnt[l, e]))),
                      reverse=True)
        dev_load, used, holds = [0.0] * G, [0] * G, [set() for _ in range(G)]
        for w, e in reps:
            cands = [d for d in range(G) if used[d] < S and e not in holds[d]]
            if not cands:
                continue
            d = min(cands, key=lambda d: dev_load[d])
            phy[l, d * S + used[d]] = e
            used[d] += 1
            dev_load[d] += w
            holds[d].add(e)
    return _finish(phy, E, G, S, load_LE, None)


def _candidate_rebalance(load_G: torch.Tensor, predicted_G: torch.Tensor, movable: float,
                         cross_G: torch.Tensor, weights, hop_GG: torch.Tensor) -> torch.Tensor:
    """The seed's candidate-expert steering at device level: up to `movable` of each device's routes
    move to candidate experts on cheaper devices, decided on the *predicted* loads (instantaneous for
    per-token decisions, the EMA view for batched ones). Returns the moved-token matrix [G, G]."""
    G = load_G.shape[0]
    w_intra, w_cross, w_comm = weights
    target = predicted_G.mean()
    cross_n = cross_G / cross_G.mean().clamp_min(1e-12)
    # score of a destination: predicted load + cross-layer pressure + hop cost from each source
    surplus_G = (predicted_G - target).clamp_min(0) * (load_G / predicted_G.clamp_min(1e-12))
    surplus_G = torch.minimum(surplus_G, movable * load_G)
    room_G = (target - predicted_G).clamp_min(0)
    moved_GG = torch.zeros(G, G, dtype=torch.float64)
    if float(room_G.sum()) <= 0:
        return moved_GG
    pref_GG = -(w_cross * cross_n[None, :] + w_comm * hop_GG) + w_intra * room_G[None, :] / target.clamp_min(1)
    share_GG = torch.softmax(pref_GG * 4.0, dim=1) * (room_G > 0)[None, :]
    share_GG = share_GG / share_GG.sum(1, keepdim=True).clamp_min(1e-12)
    total_move = min(float(surplus_G.sum()), float(room_G.sum()))
    scale = total_move / max(float(surplus_G.sum()), 1e-12)
    moved_GG = surplus_G[:, None] * scale * share_GG
    moved_GG.fill_diagonal_(0.0)
    return moved_GG


def simulate(workload: Workload, strategy: str, cfg: SimConfig | None = None, progress=None) -> dict[str, float]:
    """Run one strategy over the workload; returns step time, throughput, balance and moves."""
    cfg = cfg or SimConfig()
    counts = workload.counts_NLGE
    N, L, G, E = counts.shape
    model = cfg.model
    node_G = model.node_of(G)
    hop_GG = torch.where(node_G[:, None] == node_G[None, :], NODE_HOP[cfg.topology], 1.0).to(torch.float64)
    hop_GG.fill_diagonal_(0.0)
    weight_G = workload.weight_G
    S = E // G + cfg.extra_slots
    static = static_placement(L, E, G)
    placement = static
    heat_LE = None
    pressure_LG = None
    moves = replan_moves = 0
    times, utils, bal_num, bal_den = [], [], 0.0, 0.0
    tokens_per_step = float(counts[0].sum()) / workload.k
    decision_batch = 1 if strategy == "per_token" else cfg.decision_batch
    intra, cross, comm = cfg.weights
    # Within a synchronised step a layer waits for its slowest device whatever its neighbours do, so
    # "placement_steering" folds the cross-layer weight into the intra-layer one; the cross-layer view
    # still acts through the planner. "placement_steering_cross" keeps the configured (seed) weights.
    weights = cfg.weights if strategy == "placement_steering_cross" else (intra + cross, 0.0, comm)
    for n in range(N):
        c_LGE = counts[n]
        replan = n == cfg.warmup or (n > cfg.warmup and n % cfg.replan_every == 0)
        if strategy in ("placement_steering", "placement_steering_cross", "greedy_eplb") and replan:
            if strategy.startswith("placement_steering"):
                new = plan_placement(heat_LE, G, S, num_nodes=int(node_G.max()) + 1,
                                     previous=None if placement is static else placement)
            else:
                new = _greedy_eplb(heat_LE, G, S)
            # weight copies: replicas on a device that did not hold that expert; the first plan (from
            # DeepSpeed's static layout, no `previous` to keep) is counted apart from the re-plans
            copies = int((new.holds() & ~placement.holds()).sum())
            moves += copies
            if placement is not static:
                replan_moves += copies
            placement = new
        devices_LER = placement.expert_devices()
        times_LG = torch.zeros(L, G, dtype=torch.float64)
        load_LG = torch.zeros(L, G, dtype=torch.float64)
        for l in range(L):   # layers of one step
            c_GE = c_LGE[l]
            dev_ER = devices_LER[l]
            decisions_G = torch.zeros(G, dtype=torch.float64)
            if strategy.startswith("placement_steering") and placement is not static:
                cross_G = _cross(pressure_LG, l, cfg.window) if pressure_LG is not None else None
                split = steer(c_GE, dev_ER, node_G, pressure_G=cross_G, weights=weights, topology=cfg.topology,
                              decision_batch=cfg.decision_batch, weight_G=weight_G)
                decisions_G = c_GE.sum(1).to(torch.float64) / cfg.decision_batch
            else:
                split = even_split(c_GE, dev_ER)
            # traffic s -> d (tokens, weighted by the source's sequence-length cost)
            traffic_GG = torch.zeros(G, G, dtype=torch.float64)
            dst = dev_ER.clamp_min(0)[None].expand(G, -1, -1)
            traffic_GG.scatter_add_(1, dst.reshape(G, -1), split.reshape(G, -1).to(torch.float64))
            traffic_GG = traffic_GG * weight_G[:, None]
            messages_G = ((traffic_GG > 0) & ~torch.eye(G, dtype=torch.bool)).sum(1).to(torch.float64)
            if strategy in ("per_token", "batched_ema", "aggregated"):
                actual_G = traffic_GG.sum(0)
                if strategy == "per_token" or pressure_LG is None:
                    predicted_G = actual_G
                else:
                    predicted_G = pressure_LG[l] / pressure_LG[l].sum().clamp_min(1e-12) * actual_G.sum()
                cross_G = _cross(pressure_LG, l, cfg.window) if pressure_LG is not None else torch.ones(G)
                moved_GG = _candidate_rebalance(actual_G, predicted_G, cfg.movable, cross_G, cfg.weights, hop_GG)
                # moved tokens leave their device's queue and travel from their source to the new device:
                # approximated as sent by the overloaded device's sources in proportion
                src_share_GG = traffic_GG / traffic_GG.sum(0, keepdim=True).clamp_min(1e-12)  # [s, d_from]
                extra_GG = src_share_GG @ moved_GG                                            # [s, d_to]
                removed_G = moved_GG.sum(1)                                                   # from d
                traffic_GG = traffic_GG - src_share_GG * removed_G[None, :] + extra_GG
                decisions_G = c_GE.sum(1).to(torch.float64) / decision_batch
                if strategy != "aggregated":   # without aggregation every decision is its own message
                    messages_G = messages_G + (extra_GG.sum(1) / decision_batch)
            processed_G = traffic_GG.sum(0)
            compute_G = processed_G
            if model.padded:
                compute_G = torch.full_like(processed_G, float(processed_G.max()))
            times_LG[l] = model.layer_times(traffic_GG, compute_G, messages_G, decisions_G)
            load_LG[l] = processed_G
        times.append(model.step_time(times_LG))
        utils.append(M.device_util_std(load_LG))
        bal_num += float(load_LG.mean(1).sum())
        bal_den += float(load_LG.amax(1).sum())
        # the view: EMA of expert heat and device pressure, as LoadView keeps it
        h = (c_LGE * weight_G[None, :, None]).sum(1)   # sequence-length weighted heat, as the view keeps it
        a = cfg.ema_alpha
        heat_LE = h if heat_LE is None else a * h + (1 - a) * heat_LE
        pressure_LG = load_LG if pressure_LG is None else a * load_LG + (1 - a) * pressure_LG
        if progress is not None:
            progress.update(1)
    step = sum(times) / len(times)
    return {"step_ms": step * 1e3, "throughput_tokens_s": tokens_per_step / step,
            "device_util_std": sum(utils) / len(utils), "balancedness": bal_num / bal_den, "moves": moves,
            "replan_moves": replan_moves}


def _cross(pressure_LG: torch.Tensor, l: int, window: int) -> torch.Tensor:
    lo, hi = max(0, l - window), min(pressure_LG.shape[0], l + window + 1)
    return pressure_LG[lo:hi].sum(0)


def run_table(workload: Workload, cfg: SimConfig | None = None, strategies=STRATEGIES, progress=None) -> dict:
    cfg = cfg or SimConfig()
    rows = {}
    for name in strategies:
        rows[name] = simulate(workload, name, cfg, progress)
    base = rows["static"]["throughput_tokens_s"]
    for row in rows.values():
        row["relative_throughput"] = row["throughput_tokens_s"] / base
    return {"workload": workload.name, "shape": list(workload.counts_NLGE.shape), "topology": cfg.topology,
            "extra_slots_per_device": cfg.extra_slots, "rows": rows}


def evaluate_targets(tables: dict[str, dict]) -> dict[str, object]:
    """The issue's targets: on skewed_correlated, eb >= 1.35x static throughput and device_util_std <= 0.08;
    balancedness >= the greedy planner's on every workload; >= 50% fewer moves on drifting workloads."""
    out = {}
    main = tables.get("skewed_correlated")
    if main:
        ours = main["rows"]["placement_steering"]
        out["throughput_x_static"] = round(ours["relative_throughput"], 3)
        out["device_util_std"] = round(ours["device_util_std"], 4)
        out["throughput_ok"] = ours["relative_throughput"] >= 1.35
        out["util_std_ok"] = ours["device_util_std"] <= 0.08
    out["balancedness_vs_greedy"] = {name: [round(t["rows"]["placement_steering"]["balancedness"], 4),
                                            round(t["rows"]["greedy_eplb"]["balancedness"], 4)]
                                     for name, t in tables.items()}
    out["balancedness_ok"] = all(a >= b for a, b in out["balancedness_vs_greedy"].values())
    if "drifting" in tables:
        rows = tables["drifting"]["rows"]
        out["drifting_moves"] = [rows["placement_steering"]["moves"], rows["greedy_eplb"]["moves"]]
        out["drifting_replan_moves"] = [rows["placement_steering"]["replan_moves"], rows["greedy_eplb"]["replan_moves"]]
        out["moves_ok"] = rows["placement_steering"]["moves"] <= 0.5 * rows["greedy_eplb"]["moves"]
        out["replan_moves_ok"] = rows["placement_steering"]["replan_moves"] <= 0.5 * rows["greedy_eplb"]["replan_moves"]
    return out


def format_table(table: dict) -> str:
    lines = [f"workload {table['workload']} {tuple(table['shape'])} (steps, layers, ranks, experts), "
             f"topology {table['topology']}, +{table['extra_slots_per_device']} slots/device",
             f"{'strategy':46s} {'throughput':>10s} {'util std':>9s} {'balanced':>9s} {'moves':>7s} {'re-plan':>8s}"]
    for name, row in table["rows"].items():
        lines.append(f"{STRATEGY_LABELS[name]:46s} {row['relative_throughput'] * 100:9.1f}% "
                     f"{row['device_util_std']:9.3f} {row['balancedness']:9.3f} {row['moves']:7d} "
                     f"{row['replan_moves']:8d}")
    return "\n".join(lines)
