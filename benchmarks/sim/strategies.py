"""Strategies compared by the simulator, and the table `python -m benchmarks simulate` prints.

Shape legend: N steps, L layers, G devices (= source ranks), E logical experts, R replicas.

    table = run_table(synthetic_workload("skewed_correlated"), SimConfig())
    print(format_table(table)); evaluate_targets({table["workload"]: table})

The simulated cross-layer view is the real one (`core.view.LoadView`, fed the simulated device
loads), costs and topologies come from `model.py` and `core.topology`, placements from `planning`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eb_deepspeed.core import metrics as M
from eb_deepspeed.core.view import LoadView
from eb_deepspeed.planning.placement import Placement, index_maps, plan_placement, static_placement
from eb_deepspeed.planning.steering import steer
from .model import ARTICLE_WEIGHTS, ClusterModel, hop_cost
from .workloads import Workload
from .model import tally_of

__all__ = ["SimConfig", "STRATEGIES", "STRATEGY_LABELS", "simulate", "run_table", "evaluate_targets",
           "format_targets", "format_table"]


# The article's table and ours (`placement_view`, replicas with an even split, is simulated on request: `eb bench
# infer --framework autoep` sets it beside its measurement)
STRATEGIES = ("static", "per_token", "batched_ema", "aggregated", "placement_steering", "greedy_eplb")
STRATEGY_LABELS = {
    "static": "static baseline (DeepSpeed layout)",
    "per_token": "cross-layer re-routing, per-token decisions",
    "batched_ema": "+ batched decisions (8) and EMA view",
    "aggregated": "+ communication aggregation",
    "placement_steering": "eb placement + the exact split of each batch",
    "placement_view": "eb placement, each expert's routes split evenly over its replicas (no steering)",
    "greedy_eplb": "per-layer greedy replication (EPLB-style)",
}


@dataclass(frozen=True)
class Strategy:
    """What a strategy does, as named switches (`STRATEGY_SPECS`); `simulate` reads only these.

    plan: how it places replicas at each re-plan: None (DeepSpeed's static layout), "steered" / "uniform"
    (our planner under that dispatch model), "greedy" (per-layer EPLB-style). steer: split each expert's
    routes over its replicas by `steering.steer` (else evenly). rebalance: the article's candidate-expert
    re-routing at device level; per_token: decide every token on instantaneous loads (else batched, on the
    EMA view's prediction); aggregate: rebalanced routes share messages.
    """
    plan: str | None = None
    steer: bool = False
    rebalance: bool = False
    per_token: bool = False
    aggregate: bool = False


STRATEGY_SPECS = {
    "static": Strategy(),
    "per_token": Strategy(rebalance=True, per_token=True),
    "batched_ema": Strategy(rebalance=True),
    "aggregated": Strategy(rebalance=True, aggregate=True),
    "placement_steering": Strategy(plan="steered", steer=True),
    "placement_view": Strategy(plan="uniform"),
    "greedy_eplb": Strategy(plan="greedy"),
}


@dataclass
class SimConfig:
    model: ClusterModel = field(default_factory=ClusterModel)
    extra_slots: int = 2             # replica slots per device beyond E / G (the equal budget)
    replan_every: int = 10           # steps between re-plans (weights move in gaps)
    warmup: int = 3                  # steps of view before the first plan (the EasyBalance article, §4.3)
    movable: float = 0.35            # fraction of routes with a near-tie candidate expert (the EasyBalance article's steering)
    ema_alpha: float = 0.3
    window: int = 5                  # the view's cross-layer half-width (easybalance.window)
    decision_batch: int = 8          # routes per re-routing decision (the EasyBalance article, §4.1)

    @property
    def cost_weights(self) -> tuple[float, float, float]:
        """The article's (intra, cross, comm) weights of its candidate-expert re-routing, for the topology."""
        return ARTICLE_WEIGHTS[self.model.topology.name]



def even_split(counts_GE: torch.Tensor, devices_ER: torch.Tensor) -> torch.Tensor:
    """Each source's routes for an expert divided evenly over its copies -> [G, E, R] (long)."""
    valid_ER = devices_ER >= 0
    n_E = valid_ER.sum(1).clamp_min(1)
    base, rem = counts_GE // n_E, counts_GE % n_E
    r_idx = torch.arange(devices_ER.shape[1])
    return (base[:, :, None] + (r_idx[None, None, :] < rem[:, :, None]).long()) * valid_ER[None]

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
    return index_maps(phy, E, G, S)


def _candidate_rebalance(load_G: torch.Tensor, predicted_G: torch.Tensor, movable: float,
                         cross_G: torch.Tensor, weights, hop_GG: torch.Tensor) -> torch.Tensor:
    """The EasyBalance article's candidate-expert steering at device level: up to `movable` of each device's routes
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


def simulate(workload: Workload, strategy: str | Strategy, cfg: SimConfig | None = None,
             progress=None) -> dict[str, float]:
    """Run one strategy (a `STRATEGY_SPECS` name, or a `Strategy`) over the workload; returns step time,
    throughput, balance and weight moves."""
    cfg = cfg or SimConfig()
    if isinstance(strategy, str) and strategy not in STRATEGY_SPECS:
        raise ValueError(f"strategy ({strategy!r}) must be one of: {', '.join(STRATEGY_SPECS)}")
    spec = STRATEGY_SPECS[strategy] if isinstance(strategy, str) else strategy
    counts = workload.counts_NLGE
    N, L, G, E = counts.shape
    node_G = cfg.model.node_of(G)
    hop_GG = hop_cost(node_G, cfg.model.topology.name)
    S = E // G + cfg.extra_slots
    static = static_placement(L, E, G)
    placement = static
    view = LoadView(L, E, G, ema_alpha=cfg.ema_alpha, window=cfg.window)   # the real view, fed simulated loads
    moves = replan_moves = 0
    times, utils, bal_num, bal_den = [], [], 0.0, 0.0
    for n in range(N):
        if spec.plan is not None and (n == cfg.warmup or (n > cfg.warmup and n % cfg.replan_every == 0)):
            new = _replan(spec, view, placement, static, G, S, node_G)
            # weight copies: replicas on a device that did not hold that expert; the first plan (from
            # DeepSpeed's static layout, no `previous` to keep) is counted apart from the re-plans
            copies = int((new.holds_mask() & ~placement.holds_mask()).sum())
            moves += copies
            replan_moves += copies if placement is not static else 0
            placement = new
        times_LG, load_LG = _step(spec, cfg, counts[n], placement, placement is not static, view, node_G, hop_GG,
                                  workload.weight_G)
        times.append(cfg.model.step_time(times_LG))
        utils.append(M.device_util_std(load_LG))
        bal_num += float(load_LG.mean(1).sum())
        bal_den += float(load_LG.amax(1).sum())
        # the view: sequence-length weighted heat per expert, device pressure from the simulated loads
        heat_step_LE = (counts[n] * workload.weight_G[None, :, None]).sum(1)
        view.update(tally_of(heat_step_LE, device_LG=load_LG))
        if progress is not None:
            progress.update(1)
    step = sum(times) / len(times)
    return {"step_ms": step * 1e3, "throughput_tokens_s": float(counts[0].sum()) / workload.k / step,
            "device_util_std": sum(utils) / len(utils), "balancedness": bal_num / bal_den, "moves": moves,
            "replan_moves": replan_moves}


def _replan(spec: Strategy, view: LoadView, placement: Placement, static: Placement, G: int, S: int,
            node_G: torch.Tensor) -> Placement:
    """A new placement from the view's heat: our planner (under the strategy's dispatch) or EPLB-style."""
    if spec.plan == "greedy":
        return _greedy_eplb(view.heat_LE, G, S)
    return plan_placement(view.heat_LE, G, S, num_nodes=int(node_G.max()) + 1,
                          previous=None if placement is static else placement, dispatch=spec.plan)


def _step(spec: Strategy, cfg: SimConfig, c_LGE: torch.Tensor, placement: Placement, planned: bool,
          view: LoadView, node_G: torch.Tensor, hop_GG: torch.Tensor, weight_G: torch.Tensor):
    """One synchronised step, layer by layer: the routes' traffic, the strategy's decisions, each device's
    time. Returns times_LG [L, G] and the processed load_LG [L, G]."""
    L, G, _ = c_LGE.shape
    model = cfg.model
    devices_LER = placement.expert_devices()
    cross_LG = view.window_pressure() if view.steps else None
    times_LG = torch.zeros(L, G, dtype=torch.float64)
    load_LG = torch.zeros(L, G, dtype=torch.float64)
    for l in range(L):   # layers of one step
        c_GE, dev_ER = c_LGE[l], devices_LER[l]
        steered = spec.steer and planned
        decisions_G = torch.zeros(G, dtype=torch.float64)
        split = steer(c_GE, dev_ER) if steered else even_split(c_GE, dev_ER)
        traffic_GG = _traffic(split, dev_ER, weight_G)
        messages_G = ((traffic_GG > 0) & ~torch.eye(G, dtype=torch.bool)).sum(1).to(torch.float64)
        if spec.rebalance:
            traffic_GG, decisions_G, extra_messages_G = _rebalance(spec, cfg, traffic_GG, c_GE, view, l, cross_LG,
                                                                   hop_GG)
            messages_G = messages_G + extra_messages_G
        processed_G = traffic_GG.sum(0)
        compute_G = torch.full_like(processed_G, float(processed_G.max())) if model.padded else processed_G
        times_LG[l] = model.layer_times(traffic_GG, compute_G, messages_G, decisions_G,
                                        model.steer_s if steered else 0.0)
        load_LG[l] = processed_G
    return times_LG, load_LG


def _traffic(split_GER: torch.Tensor, dev_ER: torch.Tensor, weight_G: torch.Tensor) -> torch.Tensor:
    """Tokens s -> d [G, G] of a split, weighted by each source's sequence-length cost."""
    G = split_GER.shape[0]
    traffic_GG = torch.zeros(G, G, dtype=torch.float64)
    dst = dev_ER.clamp_min(0)[None].expand(G, -1, -1)
    traffic_GG.scatter_add_(1, dst.reshape(G, -1), split_GER.reshape(G, -1).to(torch.float64))
    return traffic_GG * weight_G[:, None]


def _rebalance(spec: Strategy, cfg: SimConfig, traffic_GG: torch.Tensor, c_GE: torch.Tensor, view: LoadView,
               layer: int, cross_LG, hop_GG: torch.Tensor):
    """The article's candidate-expert re-routing of one layer: moved traffic, decisions per device, and the
    messages it adds (none when aggregated)."""
    G = traffic_GG.shape[0]
    actual_G = traffic_GG.sum(0)
    if spec.per_token or cross_LG is None:
        predicted_G = actual_G
    else:
        p_G = view.pressure_LG[layer]
        predicted_G = p_G / p_G.sum().clamp_min(1e-12) * actual_G.sum()
    cross_G = cross_LG[layer] if cross_LG is not None else torch.ones(G)
    moved_GG = _candidate_rebalance(actual_G, predicted_G, cfg.movable, cross_G, cfg.cost_weights, hop_GG)
    # moved tokens leave their device's queue and travel from their source to the new device:
    # approximated as sent by the overloaded device's sources in proportion
    src_share_GG = traffic_GG / traffic_GG.sum(0, keepdim=True).clamp_min(1e-12)  # [s, d_from]
    extra_GG = src_share_GG @ moved_GG                                            # [s, d_to]
    removed_G = moved_GG.sum(1)                                                   # from d
    traffic_GG = traffic_GG - src_share_GG * removed_G[None, :] + extra_GG
    decision_batch = 1 if spec.per_token else cfg.decision_batch
    decisions_G = c_GE.sum(1).to(torch.float64) / decision_batch
    # without aggregation every decision is its own message
    extra_messages_G = torch.zeros(G, dtype=torch.float64) if spec.aggregate else extra_GG.sum(1) / decision_batch
    return traffic_GG, decisions_G, extra_messages_G


def run_table(workload: Workload, cfg: SimConfig | None = None, strategies=STRATEGIES, progress=None) -> dict:
    cfg = cfg or SimConfig()
    rows = {}
    for name in strategies:
        rows[name] = simulate(workload, name, cfg, progress)
    base = rows["static"]["throughput_tokens_s"]
    for row in rows.values():
        row["relative_throughput"] = row["throughput_tokens_s"] / base
    return {"workload": workload.name, "shape": list(workload.counts_NLGE.shape), "topology": cfg.model.topology.name,
            "extra_slots_per_device": cfg.extra_slots, "rows": rows}


def evaluate_targets(tables: dict[str, dict]) -> dict[str, object]:
    """The simulator's targets, measured: on skewed_correlated, placement + steering >= 1.35x static
    throughput and device_util_std <= 0.08; balancedness >= the greedy planner's on every workload;
    >= 50% fewer weight moves than it on the drifting workload."""
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


def format_targets(targets: dict[str, object]) -> str:
    """`evaluate_targets`' result as one line per target: the measured value, the target, met or not."""
    verdict = {True: "met", False: "NOT met"}
    lines = ["targets:"]
    if "throughput_x_static" in targets:
        lines.append(f"  skewed_correlated: placement + steering {targets['throughput_x_static']}x static throughput "
                     f"(target >= 1.35: {verdict[targets['throughput_ok']]}); device util std "
                     f"{targets['device_util_std']} (target <= 0.08: {verdict[targets['util_std_ok']]})")
    pairs = ", ".join(f"{name} {ours} vs {greedy}" for name, (ours, greedy) in targets["balancedness_vs_greedy"].items())
    lines.append(f"  balancedness (mean / max device load, higher is better) >= the greedy planner's on every "
                 f"workload: {verdict[targets['balancedness_ok']]} ({pairs})")
    if "drifting_moves" in targets:
        ours, greedy = targets["drifting_moves"]
        lines.append(f"  drifting: weight moves {ours} vs the greedy planner's {greedy} (target <= half: "
                     f"{verdict[targets['moves_ok']]})")
    return "\n".join(lines)


def format_table(table: dict) -> str:
    lines = [f"workload {table['workload']} {tuple(table['shape'])} (steps, layers, ranks, experts), "
             f"topology {table['topology']}, +{table['extra_slots_per_device']} slots/device",
             f"{'strategy':46s} {'throughput':>10s} {'util std':>9s} {'balanced':>9s} {'moves':>7s} {'re-plan':>8s}"]
    for name, row in table["rows"].items():
        lines.append(f"{STRATEGY_LABELS[name]:46s} {row['relative_throughput'] * 100:9.1f}% "
                     f"{row['device_util_std']:9.3f} {row['balancedness']:9.3f} {row['moves']:7d} "
                     f"{row['replan_moves']:8d}")
    return "\n".join(lines)
