"""Expert placement and replication planned over all layers at once, in the shape of DeepSeek's EPLB.

Shape legend: L layers, E logical experts, G devices (EP ranks), S slots per device,
P physical slots per layer (G * S; slot p lives on device p // S), R max replicas of one expert.

    plan = plan_placement(load_LE, num_devices=8, slots_per_device=5, num_nodes=2, previous=old_plan)
    plan.phy2log   # [L, P] logical expert in each physical slot, -1 = empty
    plan.log2phy   # [L, E, R] physical slots of each expert's replicas, -1 padded (R = the most replicas)
    plan.logcnt    # [L, E] replica count per expert
    plan.moves     # replicas placed where `previous` did not hold that expert (weight copies)
    plan.steered_load_LG   # [L, G] expected tokens per device once steering splits them over replicas

`plan_placement` is the one entry point; its steps are functions of their own:

1. `replica_counts`: without a budget every layer's P slots are apportioned to its experts in
   proportion to load (largest remainder, at least 1 and at most G replicas each); with
   `slot_budget` (total slots over all layers) one global threshold on load relative to the layer
   mean, so more skewed layers get more replicas.
2. `assign_replicas`: replicas in descending load per replica, one replica rank at a time for all
   layers (a Python loop over the P slot ranks, vectorised over layers), each to the least loaded
   device with a free slot that does not hold its expert yet, spreading replicas over nodes and
   preferring the device that held the expert in `previous`.
3. `refine.refine_for_steering`: a bounded local search that scores placements by the slowest
   device after steering (`flows.steer_flows`), not by the even split.
4. `index_maps`: phy2log, log2phy (its inverse), logcnt, moves against `previous`, expected loads.

Costs are measured by `eb bench plan` (docs/benchmarks.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .refine import refine_for_steering
from .slots import holds_mask

# Sizes the planner takes: its work grows with layers x slots (the refinement copies candidates of them).
MAX_SLOTS = 1 << 16
MAX_LAYER_SLOTS = 1 << 24
MAX_STICKINESS = 1e3

__all__ = ["Placement", "plan_placement", "static_placement", "replica_counts", "assign_replicas", "index_maps",
           "expected_padded_cost", "expected_slot_ratio"]


@dataclass
class Placement:
    phy2log: torch.Tensor       # [L, P] long, -1 = empty slot
    log2phy: torch.Tensor       # [L, E, R] long, -1 padded
    logcnt: torch.Tensor        # [L, E] long
    num_devices: int
    slots_per_device: int
    moves: int = 0              # weight copies against `previous` (0 without one)
    device_load_LG: torch.Tensor | None = None  # expected load per device, even split over replicas
    steered_load_LG: torch.Tensor | None = None  # expected load per device after steering (refined plans)

    @property
    def num_experts(self) -> int:
        return self.logcnt.shape[1]

    def holds(self) -> torch.Tensor:
        """holds_LGE [L, G, E] bool: device g holds a replica of expert e."""
        return torch.from_numpy(holds_mask(self.phy2log.numpy(), self.slots_per_device, self.num_experts))

    def expert_devices(self) -> torch.Tensor:
        """Device of each replica, [L, E, R] long (-1 padded)."""
        return torch.where(self.log2phy >= 0, self.log2phy // self.slots_per_device, -1)


def static_placement(num_layers: int, num_experts: int, num_devices: int) -> Placement:
    """DeepSpeed's layout: one replica per expert, expert e on device e // (E / G)."""
    if num_experts % num_devices:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by num_devices ({num_devices})")
    S = num_experts // num_devices
    phy2log = torch.arange(num_experts).expand(num_layers, num_experts).clone()
    return index_maps(phy2log, num_experts, num_devices, S)


def replica_counts(load_LE: torch.Tensor, slots_L: torch.Tensor | int, max_replicas: int,
                   slot_budget: int | None = None, iters: int = 40) -> torch.Tensor:
    """Step 1: replica count per expert [L, E]. slots_L: slots each layer may fill.

    Without a budget: each layer's slots are apportioned to its experts in proportion to load
    (largest remainder; at least 1, at most `max_replicas` = G each), vectorised over layers: every
    replica then carries about the same share, which is what steering can balance best.
    With a budget: one global threshold tau on load relative to the layer mean (bisection), then
    the few slots the ceil cannot hit exactly go to the highest relative load per replica.
    """
    load_LE = load_LE.to(torch.float64).clamp_min(0)
    L, E = load_LE.shape
    slots_L = torch.as_tensor(slots_L, dtype=torch.long).expand(L)
    cap_L = torch.minimum(slots_L, torch.full_like(slots_L, E * max_replicas))
    if slot_budget is None:
        return torch.from_numpy(_apportion(load_LE.numpy(), cap_L.numpy(), max_replicas))

    rel_LE = load_LE / load_LE.mean(1, keepdim=True).clamp_min(1e-12) + 1e-9

    def counts(tau_L1):
        return torch.ceil(rel_LE / tau_L1).clamp(1, max_replicas).long()

    # per-layer tau that fills at most cap_L slots, then one global tau for the budget
    lo = torch.full((L, 1), 1e-6, dtype=torch.float64)
    hi = torch.full((L, 1), float(rel_LE.max()) + 1.0, dtype=torch.float64)
    for _ in range(iters):
        mid = (lo * hi).sqrt()
        over = counts(mid).sum(1, keepdim=True) > cap_L[:, None]
        lo, hi = torch.where(over, mid, lo), torch.where(over, hi, mid)
    tau_L1 = hi
    lo_t, hi_t = torch.tensor(1e-6, dtype=torch.float64), torch.tensor(float(rel_LE.max()) + 1.0)
    for _ in range(iters):
        mid = (lo_t * hi_t).sqrt()
        over = counts(torch.maximum(tau_L1, mid)).sum() > slot_budget
        lo_t, hi_t = torch.where(over, mid, lo_t), torch.where(over, hi_t, mid)
    cnt_LE = counts(torch.maximum(tau_L1, hi_t))
    room_L = cap_L - cnt_LE.sum(1)
    room_total = slot_budget - int(cnt_LE.sum())
    per_rep_LE = torch.where(cnt_LE < max_replicas, rel_LE / cnt_LE, -1.0)
    rank_LE = torch.argsort(torch.argsort(per_rep_LE, dim=1, descending=True), dim=1)
    score = torch.where((rank_LE < room_L[:, None]) & (per_rep_LE >= 0), per_rep_LE, -1.0).flatten()
    take = max(0, min(room_total, int((score >= 0).sum())))
    if take:
        cnt_LE.view(-1)[torch.topk(score, take).indices] += 1
    return cnt_LE


def _apportion(load_LE: np.ndarray, slots_L: np.ndarray, max_replicas: int) -> np.ndarray:
    """Largest-remainder apportionment of slots_L[l] replicas over experts by load, each in [1, max]."""
    L, E = load_LE.shape
    load = load_LE + 1e-12
    quota = load / load.sum(1, keepdims=True) * slots_L[:, None]
    cnt = np.clip(np.floor(quota), 1, max_replicas).astype(np.int64)
    lidx = np.arange(L)
    excess = cnt.sum(1) - slots_L
    per_rep = np.where(cnt > 1, quota / cnt, np.inf)    # updated where a count changes
    for _ in range(E * max_replicas):   # too many (the floor of 1): take from the least loaded per replica
        over = excess > 0
        if not over.any():
            break
        ol = lidx[over]
        worst = per_rep[ol].argmin(1)
        cnt[ol, worst] -= 1
        excess[ol] -= 1
        per_rep[ol, worst] = np.where(cnt[ol, worst] > 1, quota[ol, worst] / cnt[ol, worst], np.inf)
    for _ in range(E * max_replicas):   # too few: the largest remainders first
        room = slots_L - cnt.sum(1)
        remainder = np.where(cnt < max_replicas, quota - cnt, -np.inf)
        order = np.argsort(-remainder, axis=1, kind="stable")
        rank = np.empty_like(order)
        rank[lidx[:, None], order] = np.arange(E)[None, :]
        add = (rank < room[:, None]) & np.isfinite(remainder)
        if not add.any():
            break
        cnt += add
    return cnt


def assign_replicas(load_LE: torch.Tensor, cnt_LE: torch.Tensor, G: int, S: int, node_G: np.ndarray,
                    was_LGE: np.ndarray | None, stickiness: float) -> np.ndarray:
    """Step 2: put every replica on a device. Returns phy_LP [L, G * S] (expert per slot, -1 empty).

    load_LE: [L, E] loads; cnt_LE: [L, E] replica counts (step 1); node_G: [G] node of each device;
    was_LGE: [L, G', E] devices of `previous` holding each expert (None without one).
    Replicas go in descending load per replica, one replica rank per step for all layers at once,
    each to the least loaded device with a free slot that does not hold its expert yet, preferring
    nodes that do not hold it yet and, within `stickiness` x the layer's mean device load, the
    device that held it before.
    """
    L, E = load_LE.shape
    P = G * S
    num_nodes = int(node_G.max()) + 1
    weight_LE = load_LE / cnt_LE

    # Replicas sorted by load per replica, padded to P per layer (expert -1 = empty): sort the experts,
    # then position p of a layer belongs to the expert whose cumulative replica count first exceeds p.
    order_LE = torch.argsort(weight_LE, dim=1, descending=True, stable=True)
    ends_LE = cnt_LE.gather(1, order_LE).cumsum(1)
    pos_LE = torch.searchsorted(ends_LE, torch.arange(P).expand(L, P).contiguous(), right=True)
    live_LP = pos_LE < E
    rep_expert_LP = torch.where(live_LP, order_LE.gather(1, pos_LE.clamp_max(E - 1)), -1)
    rep_w_LP = torch.where(live_LP, weight_LE.gather(1, rep_expert_LP.clamp_min(0)), 0.0)

    # The assignment loop runs in NumPy: one step per replica rank (P steps, each over all layers),
    # where NumPy's per-call overhead is several times smaller than torch's.
    same_node_GG = (node_G[:, None] == node_G[None, :]).astype(np.float64)
    dev_load_LG = np.zeros((L, G))
    used_LG = np.zeros((L, G), dtype=np.int64)
    # penalty_XG: one row per (layer, expert) (row l * (E + 1) + e + 1; row 0 of a layer = "empty"):
    # HUGE on devices that already hold the expert (forbidden), `big` on the other devices of their
    # nodes (spread replicas across nodes first), minus the stickiness bonus where `previous` held it.
    HUGE, big = 1e30, float(load_LE.sum()) * 4 + 1.0
    penalty_XG = np.zeros((L * (E + 1), G))
    if was_LGE is not None:
        bonus_L11 = (stickiness * load_LE.sum(1) / G).numpy()[:, None, None]
        penalty_XG.reshape(L, E + 1, G)[:, 1:] -= was_LGE.transpose(0, 2, 1) * bonus_L11
    rep_expert = rep_expert_LP.numpy()
    rep_w = rep_w_LP.numpy()
    rows_LP = np.arange(L)[:, None] * (E + 1) + rep_expert + 1
    phy = np.full((L, P + 1), -1, dtype=np.int64)  # column P: where illegal replicas are parked
    lidx = np.arange(L)
    node_mark_GG = same_node_GG * big

    for i in range(P):
        e_L, row_L = rep_expert[:, i], rows_LP[:, i]
        key_LG = dev_load_LG + penalty_XG[row_L]   # a full device's load carries HUGE (below)
        best_L = key_LG.argmin(1)
        # A surplus replica with nowhere legal to go is dropped (its expert keeps its other replicas).
        ok_L = (e_L >= 0) & (key_LG[lidx, best_L] < HUGE / 2)
        okl = lidx[ok_L]
        okb = best_L[ok_L]
        phy[okl, okb * S + used_LG[okl, okb]] = e_L[ok_L]
        used_LG[okl, okb] += 1
        dev_load_LG[okl, okb] += rep_w[ok_L, i] + (used_LG[okl, okb] == S) * HUGE
        rows = row_L[ok_L]
        penalty_XG[rows, okb] += HUGE
        if num_nodes > 1:
            penalty_XG[rows] += node_mark_GG[okb]
    return np.ascontiguousarray(phy[:, :P])


def plan_placement(load_LE: torch.Tensor, num_devices: int, slots_per_device: int, *, num_nodes: int = 1,
                   previous: Placement | None = None, slot_budget: int | None = None,
                   stickiness: float = 0.1, refine_rounds: int | None = None, refine_iters: int = 2,
                   refine_work: int = 1 << 14) -> Placement:
    """Plan replicas and their devices for every layer at once (see the module doc).

    load_LE: [L, E] expected tokens per layer and logical expert (e.g. the view's heat).
    num_nodes must divide num_devices (devices d of node d // (G / num_nodes)).
    slot_budget: total physical slots over all layers (L*E <= budget <= L*G*S); None fills every slot.
    stickiness: with `previous`, keep an expert on its old device when that device's load is within
    this fraction of the layer's mean device load of the best choice (step 2); in the refinement
    (step 3) moving all P slots of a layer must gain this fraction of the mean device load.
    refine_rounds: local-search rounds (0 = greedy only); None = clamp(2**16 // (L * P), 1, 64).
    refine_iters: water-filling iterations per confirmation; refine_work: slots steered per round
    to confirm moves (more candidates per layer on smaller inputs).
    Raises ValueError on bad shapes or values; never returns a placement that leaves an expert out
    or puts two replicas of one expert on one device.
    """
    load_LE = torch.as_tensor(load_LE)
    if load_LE.is_complex() or load_LE.dtype == torch.bool:
        raise ValueError(f"load_LE must hold real numbers, got {load_LE.dtype}")
    load_LE = load_LE.to(torch.float64)
    if load_LE.dim() != 2 or 0 in load_LE.shape:
        raise ValueError(f"load_LE must be [layers, experts] with at least one of each, got shape {tuple(load_LE.shape)}")
    if not bool(torch.isfinite(load_LE).all()) or bool((load_LE < 0).any()):
        raise ValueError("load_LE must be finite and non-negative")
    L, E = load_LE.shape
    for name, value in (("num_devices", num_devices), ("slots_per_device", slots_per_device), ("num_nodes", num_nodes)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{name} ({value!r}) must be an integer")
    G, S = int(num_devices), int(slots_per_device)
    P = G * S
    if G < 1 or S < 1:
        raise ValueError(f"num_devices ({G}) and slots_per_device ({S}) must be >= 1")
    if P < E:
        raise ValueError(f"num_devices * slots_per_device ({G} * {S} = {P}) must be >= num_experts ({E}): "
                         "every expert needs a slot")
    if P > MAX_SLOTS or L * P > MAX_LAYER_SLOTS:
        raise ValueError(f"{L} layers x {P} slots is more than the planner takes ({MAX_SLOTS} slots per layer, "
                         f"{MAX_LAYER_SLOTS} in all)")
    if num_nodes < 1 or G % num_nodes:
        raise ValueError(f"num_nodes ({num_nodes}) must divide num_devices ({G})")
    if slot_budget is not None and not L * E <= slot_budget <= L * P:
        raise ValueError(f"slot_budget ({slot_budget}) must be in [layers * experts, layers * slots] = "
                         f"[{L * E}, {L * P}]")
    if (refine_rounds is not None and refine_rounds < 0) or refine_iters < 1 or refine_work < 1:
        raise ValueError(f"refine_rounds ({refine_rounds}) must be >= 0 or None, refine_iters ({refine_iters}) "
                         f"and refine_work ({refine_work}) >= 1")
    if not (isinstance(stickiness, (int, float)) and 0.0 <= float(stickiness) <= MAX_STICKINESS):
        raise ValueError(f"stickiness ({stickiness!r}) must be a number in [0, {MAX_STICKINESS}] (a fraction of the "
                         "mean device load)")
    if previous is not None:
        _check_previous(previous, L, E, G)
    # The penalties below are absolute (a forbidden device costs 1e30): plan in units where the largest
    # load is 1 when loads are far from that, and report the loads in the caller's units.
    peak = float(load_LE.max())
    scale = 2.0 ** math.frexp(peak)[1] if peak > 0 and not 1e-6 <= peak <= 1e12 else 1.0   # exact division
    if scale != 1.0:
        plan = plan_placement(load_LE / scale, G, S, num_nodes=num_nodes, previous=previous, slot_budget=slot_budget,
                              stickiness=stickiness, refine_rounds=refine_rounds, refine_iters=refine_iters,
                              refine_work=refine_work)
        for name in ("device_load_LG", "steered_load_LG"):
            if getattr(plan, name) is not None:
                setattr(plan, name, getattr(plan, name) * scale)
        return plan

    # Step 1: replica counts.
    cnt_LE = replica_counts(load_LE, P, G, slot_budget)
    # Step 2: devices for the replicas.
    node_G = np.arange(G) // (G // num_nodes)
    was_LGE = previous.holds().numpy() if previous is not None else None   # any slots per device
    phy = assign_replicas(load_LE, cnt_LE, G, S, node_G, was_LGE, stickiness)
    # Step 3: steering-aware refinement; step 4: index maps.
    x_LP = None
    if refine_rounds is None:   # about the same refinement time at every size: fewer rounds on larger inputs
        refine_rounds = int(np.clip((1 << 16) // (L * P), 1, 64))
    if refine_rounds > 0:
        phy, x_LP = refine_for_steering(phy, load_LE.numpy(), G, S, node_G, was_LGE, stickiness, refine_rounds, refine_iters,
                                       refine_work)
    plan = index_maps(torch.from_numpy(phy), E, G, S, load_LE, previous)
    if x_LP is not None:
        plan.steered_load_LG = torch.from_numpy(x_LP.reshape(L, G, S).sum(2))
    _assert_legal(plan)
    return plan


def _check_previous(previous, L: int, E: int, G: int) -> None:
    """A `previous` placement of this model's layers, experts and devices, with legal index maps."""
    if not isinstance(previous, Placement):
        raise ValueError(f"previous must be a Placement, got {type(previous).__name__}")
    phy = previous.phy2log
    if phy.dim() != 2 or phy.shape[0] != L or previous.num_devices != G or previous.num_experts != E \
            or phy.shape[1] != G * previous.slots_per_device:
        raise ValueError(f"previous placement must have the same layers, experts and devices ({L}, {E}, {G}), got "
                         f"phy2log {tuple(phy.shape)} for {previous.num_devices} devices x "
                         f"{previous.slots_per_device} slots and {previous.num_experts} experts")
    if bool((phy < -1).any()) or bool((phy >= E).any()):
        raise ValueError(f"previous placement holds expert ids outside [-1, {E})")


def _assert_legal(plan: Placement) -> None:
    """The placement's own invariants (internal: a failure here is a planner bug, not a user error)."""
    assert bool((plan.logcnt >= 1).all()), "an expert was left without a replica"
    assert bool((plan.holds().sum(1) == plan.logcnt).all()), "a device holds two replicas of one expert"


def index_maps(phy2log: torch.Tensor, E: int, G: int, S: int, load_LE: torch.Tensor | None = None,
               previous: Placement | None = None) -> Placement:
    """Step 4: a Placement from phy2log [L, P] (-1 = empty): log2phy [L, E, R] (its inverse), logcnt
    [L, E]; with load_LE [L, E] the expected load per device with an even split; with `previous`
    the weight moves against it."""
    L, P = phy2log.shape
    logcnt = torch.zeros(L, E + 1, dtype=torch.long).scatter_add_(1, phy2log + 1, torch.ones_like(phy2log))[:, 1:]
    R = max(1, int(logcnt.max()))
    # slots sorted by expert: each expert's replicas become consecutive; rank within the expert = column
    key = torch.where(phy2log >= 0, phy2log * P + torch.arange(P), E * P + torch.arange(P))
    order = torch.argsort(key, dim=1)
    sorted_exp = phy2log.gather(1, order)
    first = torch.cumsum(torch.cat([torch.zeros(L, 1, dtype=torch.long), logcnt], 1), 1)[:, :-1]  # [L, E]
    rank = torch.arange(P)[None, :] - first.gather(1, sorted_exp.clamp_min(0))
    log2phy = torch.full((L, E + 1, R), -1, dtype=torch.long)
    valid = sorted_exp >= 0
    li = torch.arange(L)[:, None].expand(L, P)
    log2phy[li[valid], sorted_exp[valid], rank[valid]] = order[valid]
    plan = Placement(phy2log=phy2log, log2phy=log2phy[:, :E], logcnt=logcnt, num_devices=G, slots_per_device=S)
    if load_LE is not None:
        per_rep = torch.where(phy2log >= 0, (load_LE / logcnt.clamp_min(1)).gather(1, phy2log.clamp_min(0)), 0.0)
        plan.device_load_LG = per_rep.view(L, G, S).sum(2)
    if previous is not None:
        plan.moves = int((plan.holds() & ~previous.holds()).sum())
    return plan


def expected_slot_ratio(heat_LE: torch.Tensor, plan: Placement) -> torch.Tensor:
    """[L] max / mean of the expected load per physical slot when each expert's routes split evenly
    over its replicas (with padded dispatch, DeepSpeed's, every slot is padded to the largest: this is
    capacity over ideal)."""
    heat_LE = torch.as_tensor(heat_LE, dtype=torch.float64)
    L, P = plan.phy2log.shape
    mean_L = heat_LE.sum(1) / P
    return torch.where(mean_L > 0, expected_padded_cost(heat_LE, plan) / P / mean_L.clamp_min(1e-300),
                       torch.ones(L, dtype=torch.float64))


def expected_padded_cost(heat_LE: torch.Tensor, plan: Placement) -> torch.Tensor:
    """[L] slots x the expected largest slot load: what a padded dispatch (DeepSpeed's MOELayer pads every
    slot to the capacity) computes and sends per layer, in routes, with each expert's routes split
    evenly over its replicas. heat_LE: [L, E] expected routes."""
    heat_LE = torch.as_tensor(heat_LE, dtype=torch.float64)
    P = plan.phy2log.shape[1]
    per_replica_LE = heat_LE / plan.logcnt.clamp_min(1)
    slot_LP = torch.where(plan.phy2log >= 0, per_replica_LE.gather(1, plan.phy2log.clamp_min(0)), 0.0)
    return P * slot_LP.amax(1)
