"""Expert placement and replication planned over all layers at once, in the shape of DeepSeek's EPLB.

Shape legend: L layers, E logical experts, G devices (EP ranks), S slots per device,
P physical slots per layer (G * S; slot p lives on device p // S), R max replicas of one expert.

    plan = plan_placement(load_LE, num_devices=8, slots_per_device=5, num_nodes=2, previous=old_plan)
    plan.phy2log   # [L, P] logical expert in each physical slot, -1 = empty
    plan.log2phy   # [L, E, R] physical slots of each expert's replicas, -1 padded (R = the most replicas)
    plan.logcnt    # [L, E] replica count per expert

`plan_placement` is the one entry point; its steps, each a function, numbered as in EPLB (u: `uniform.py`):
1u. `uniform.count_variants`: replica counts that minimise the largest share (D'Hondt), and a few neighbours
    on small inputs.
2.  `assign_replicas`: replicas in descending share, each to the least loaded device that may take it.
3u. `uniform.refine_uniform`: local moves off each layer's slowest device, scored under the even split.
3.  `refine.refine_for_steering` (steered only): local moves scored after steering (`flows.steer_flows`),
    from the uniform plan; on small inputs also from the load-proportional greedy plan (`replica_counts`).
4.  `_choose`: each layer's best candidate under its dispatch (`previous` is one), node spread and weight
    moves priced; `index_maps`: phy2log, log2phy, logcnt."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Optional

import numpy as np
import torch

from ..core.metrics import max_over_mean
from .flows import steer_flows, steered_load
from .refine import refine_for_steering
from .slots import SlotCounts, checked_load, holds_mask, integer_tensor, is_integer, real_tensor
from .uniform import count_variants, even_split_loads, refine_uniform, slot_shares

# Sizes the planner takes: its memory is linear in layers x slots, step 2's time in layers x slots x devices.
MAX_SLOTS = 1 << 16
MAX_LAYER_SLOTS = 1 << 24
MAX_SCAN = 1 << 34
# Weight moves against `previous`: each costs STICKINESS x the layer's mean device load / P (in step 2 an
# expert's old device is preferred within STICKINESS x the mean device load).
STICKINESS = 0.1
REFINE_ITERS = 2            # water-filling iterations per confirmation of the steering-aware search
REFINE_WORK = 1 << 14       # slots steered per round to confirm moves (more candidates per layer on smaller inputs)
SPREAD_WEIGHT = 0.1         # steered default: 1 % of the mean device load per 0.1 of `cross_node_fraction`
EXTRA_WORK = 1 << 14        # up to this many layers x slots, more candidates (greedy start, no spread)
HEDGE = 2.0                 # an even split's replica counts go by load + HEDGE x swing (docs/benchmarks.md)
SCENARIOS = 256             # with a swing, each layer's plan is chosen on this many loads drawn within it
HEDGE_COST = 0.02           # ... and hedged only where that costs at most 2 % more at the mean load (benchmarks.md)
# A new placement must be expected to cut the cost by this much (`choose_placement`): the expectation is of the EMA
# heat, while each batch's load is its own, and moving weights costs time too. Measured on the example model: a 3 %
# expected gain was a loss.
MIN_GAIN = 0.10

__all__ = ["Placement", "plan_placement", "static_placement", "Dispatch", "choose_placement"]


def check_plan_size(num_layers: int, num_slots: int, num_devices: int) -> None:
    """ValueError when L layers x P slots a layer over G devices is more than the planner takes (its caps above)."""
    L, P, G = num_layers, num_slots, num_devices
    if P > MAX_SLOTS or L * P > MAX_LAYER_SLOTS or L * P * G > MAX_SCAN:
        raise ValueError(f"{L} layers x {P} slots over {G} devices is more than the planner takes ({MAX_SLOTS} slots "
                         f"per layer, {MAX_LAYER_SLOTS} in all, layers x slots x devices <= {MAX_SCAN})")


@dataclass
class Placement:
    phy2log: torch.Tensor       # [L, P] long, -1 = empty slot
    log2phy: torch.Tensor       # [L, E, R] long, -1 padded
    logcnt: torch.Tensor        # [L, E] long
    num_devices: int
    slots_per_device: int

    def __post_init__(self):
        _check_maps(self, "Placement")

    @property
    def num_experts(self) -> int:
        return self.logcnt.shape[1]

    def holds_mask(self) -> torch.Tensor:
        """holds_LGE [L, G, E] bool: device g holds a replica of expert e (dense: for small plans and tests)."""
        return torch.from_numpy(holds_mask(self.phy2log.numpy(), self.slots_per_device, self.num_experts))

    def expert_devices(self) -> torch.Tensor:
        """Device of each replica, [L, E, R] long (-1 padded)."""
        return torch.where(self.log2phy >= 0, self.log2phy // self.slots_per_device, -1)


@dataclass(frozen=True)
class Dispatch:
    """How a runtime splits each expert's routes over its copies, as the planner and the re-plan rule see it (one
    name per model, `DISPATCH`). padded: evenly, every slot padded to the largest (DeepSpeed's MOELayer);
    steered: each batch by the exact split (`steering.split`, our AutoEP layers), scored after `flows.steered_load`;
    neither: evenly, dropless (AutoEP's layer with the `view` split; vLLM, SGLang, EPLB)."""
    name: str
    padded: bool = False
    steered: bool = False

    def device_load(self, heat_LE: torch.Tensor, plan: Placement) -> torch.Tensor:
        """[L, G] each device's expected routes under this split (a dropless layer's time is its busiest)."""
        return steered_load(plan, heat_LE) if self.steered else expected_device_load(heat_LE, plan)

    def cost(self, heat_LE: torch.Tensor, plan: Placement) -> torch.Tensor:
        """[L] what a layer computes and sends: slots x the largest slot (padded), else the busiest device."""
        return expected_padded_cost(heat_LE, plan) if self.padded else self.device_load(heat_LE, plan).amax(1)

    def ratio(self, heat_LE: torch.Tensor, plan: Placement) -> torch.Tensor:
        """[L] the skew `replan_threshold` is compared with: the largest slot or the busiest device over the mean."""
        return expected_slot_ratio(heat_LE, plan) if self.padded else max_over_mean(self.device_load(heat_LE, plan))


DISPATCH = {d.name: d for d in (Dispatch("steered", steered=True), Dispatch("uniform"), Dispatch("padded", padded=True))}


def runtime_dispatch(padded: bool, split: str) -> Dispatch:
    """The model of a runtime (`padded`: DeepSpeed's MOELayer) serving `easybalance.inference.split` ("exact" or
    "view"): a padded layer always splits evenly."""
    return DISPATCH["padded" if padded else "steered" if split == "exact" else "uniform"]


def static_placement(num_layers: int, num_experts: int, num_devices: int) -> Placement:
    """DeepSpeed's layout: one replica per expert, expert e on device e // (E / G)."""
    for name, value in (("num_layers", num_layers), ("num_experts", num_experts), ("num_devices", num_devices)):
        if not is_integer(value) or value < 1:
            raise ValueError(f"{name} ({value!r}) must be an integer >= 1")
    if num_experts % num_devices:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by num_devices ({num_devices})")
    check_plan_size(num_layers, num_experts, num_devices)
    return trivial_placement(num_layers, num_experts, num_devices, num_experts // num_devices)


def trivial_placement(num_layers: int, num_experts: int, num_devices: int, slots_per_device: int) -> Placement:
    """The layout without a planner: slot p holds expert p % E (DeepSpeed's contiguous layout when P == E;
    SGLang's `trivial` and vLLM's `linear` layouts with redundant slots)."""
    P = num_devices * slots_per_device
    if P < num_experts:
        raise ValueError(f"{num_devices} devices x {slots_per_device} slots ({P}) cannot hold {num_experts} experts")
    phy = (torch.arange(P) % num_experts).expand(num_layers, P).clone()
    return index_maps(phy, num_experts, num_devices, slots_per_device)


def replica_counts(load_LE: np.ndarray, slots: int, max_replicas: int) -> np.ndarray:
    """Step 1 (steered, small inputs): replica count per expert [L, E]: min(slots, E x max_replicas) apportioned to
    the experts by load (largest remainder), each in [1, max_replicas]."""
    L, E = load_LE.shape
    slots_L = np.full(L, min(slots, E * max_replicas))
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
                    was: SlotCounts | None, stickiness: float) -> np.ndarray:
    """Step 2: put every replica on a device. Returns phy_LP [L, G * S] (expert per slot, -1 empty).

    load_LE: [L, E] loads; cnt_LE: [L, E] replica counts (step 1); node_G: [G] or [L, G] node of each device
    (all zeros = no spread); was: `previous`'s replicas per (layer, device, expert) (`SlotCounts`, or None).
    Replicas go in descending load per replica, one replica rank per step for all layers at once, each to the
    least loaded device with a free slot that does not hold its expert yet, preferring nodes that do not hold
    it yet and, within `stickiness` x the layer's mean device load, the device that held it before."""
    L, E = load_LE.shape
    P = G * S
    node_LG = np.broadcast_to(np.asarray(node_G), (L, G))
    num_nodes = int(node_LG.max()) + 1
    weight_LE = load_LE / cnt_LE

    # Replicas sorted by load per replica, padded to P per layer (expert -1 = empty); an expert's are consecutive.
    order_LE = torch.argsort(weight_LE, dim=1, descending=True, stable=True)
    ends_LE = cnt_LE.gather(1, order_LE).cumsum(1)
    pos_LE = torch.searchsorted(ends_LE, torch.arange(P).expand(L, P).contiguous(), right=True)
    live_LP = pos_LE < E
    rep_expert_LP = torch.where(live_LP, order_LE.gather(1, pos_LE.clamp_max(E - 1)), -1)
    rep_w_LP = torch.where(live_LP, weight_LE.gather(1, rep_expert_LP.clamp_min(0)), 0.0)

    # In NumPy (less per-call overhead than torch): one step per replica rank, over all layers.
    dev_load_LG = np.zeros((L, G))
    used_LG = np.zeros((L, G), dtype=np.int64)
    # pen_LG: penalties for each layer's current expert, reset where its next expert starts: HUGE where it is
    # (forbidden), `big` on the other devices of those nodes (spread), minus the bonus where `previous` held it.
    HUGE, big = 1e30, float(load_LE.sum()) * 4 + 1.0
    pen_LG = np.zeros((L, G))
    rep_expert = np.ascontiguousarray(rep_expert_LP.numpy().T)             # [P, L]: one contiguous row per step
    rep_w = np.ascontiguousarray(rep_w_LP.numpy().T)
    starts_PL = (rep_expert >= 0) & np.concatenate([np.ones((1, L), bool), rep_expert[1:] != rep_expert[:-1]])
    step_F, layer_F = np.nonzero(starts_PL)
    first_P = np.searchsorted(step_F, np.arange(P + 1))                      # the starts of step i: [first[i], first[i+1])
    if was is not None:   # (layer, device) of the bonus at each start, grouped by step the same way
        q, bonus_dev = was.holders(layer_F, rep_expert[step_F, layer_F])
        bonus_layer, bonus_first = layer_F[q], np.searchsorted(q, first_P)
        bonus = -(stickiness * load_LE.sum(1) / G).numpy()[bonus_layer]
    phy = np.full((L, P + 1), -1, dtype=np.int64)  # column P: where illegal replicas are parked
    lidx = np.arange(L)

    for i in range(P):
        e_L = rep_expert[i]
        pen_LG[layer_F[first_P[i]:first_P[i + 1]]] = 0.0
        if was is not None:
            at = slice(bonus_first[i], bonus_first[i + 1])
            pen_LG[bonus_layer[at], bonus_dev[at]] = bonus[at]
        key_LG = dev_load_LG + pen_LG   # a full device's load carries HUGE (below)
        best_L = key_LG.argmin(1)
        # A surplus replica with nowhere legal to go is dropped (its expert keeps its other replicas).
        ok_L = (e_L >= 0) & (key_LG[lidx, best_L] < HUGE / 2)
        if ok_L.all():
            okl, okb, e_ok, w_ok = lidx, best_L, e_L, rep_w[i]
        else:
            okl, okb, e_ok, w_ok = lidx[ok_L], best_L[ok_L], e_L[ok_L], rep_w[i][ok_L]
        used = used_LG[okl, okb]
        phy[okl, okb * S + used] = e_ok
        used_LG[okl, okb] = used + 1
        dev_load_LG[okl, okb] += w_ok + (used + 1 == S) * HUGE
        pen_LG[okl, okb] += HUGE
        if num_nodes > 1:
            pen_LG[okl] += (node_LG[okl] == node_LG[okl, okb][:, None]) * big
    return np.ascontiguousarray(phy[:, :P])


def plan_placement(load_LE: torch.Tensor, num_devices: int, slots_per_device: int, *, num_nodes: int = 1,
                   previous: Placement | None = None, refine_rounds: int | None = None,
                   dispatch: str | Dispatch = "steered", swing_LE: torch.Tensor | None = None) -> Placement:
    """Plan replicas and their devices for every layer at once (see the module doc).

    load_LE: [L, E] expected tokens per layer and logical expert (e.g. the view's heat).
    num_nodes must divide num_devices (device d on node d // (G / num_nodes)).
    previous: the placement serving now; weight moves away from it are priced (`STICKINESS`).
    refine_rounds: rounds of every local search (0 = greedy only); None: fewer on larger inputs.
    dispatch: how the runtime splits an expert's tokens over its replicas (a name of `DISPATCH`, or its model).
    "steered" (ours, `steering.steer`): plans for the slowest device after steering. "uniform" (vLLM, SGLang, EPLB,
    AutoEP's dropless layer with our `view` split: evenly): the counts may change in the search. "padded"
    (DeepSpeed's MOELayer: evenly, every slot padded to the largest): the counts stay, swaps balance.
    Nodes: "steered" weighs SPREAD_WEIGHT x the mean device load per unit of `cross_node_fraction` against the
    slowest device (steering keeps tokens node-local); "uniform" and "padded" ignore them.
    swing_LE: [L, E] how far each expert's load swings from batch to batch (a standard deviation, the view's
    `swing_LE`), or None: "uniform" and "padded" then give replica counts by load + HEDGE x swing and keep
    them in the search; "steered" splits each batch as it comes and ignores it.
    Raises TypeError / ValueError naming the argument; never returns a placement that leaves an expert out or
    puts two replicas of one expert on one device."""
    load_LE, G, S, dispatch, previous = _checked_inputs(load_LE, num_devices, slots_per_device, num_nodes, previous,
                                              refine_rounds, dispatch)
    if swing_LE is not None:
        swing_LE = real_tensor("swing_LE", swing_LE, "[layers, experts]")
        if swing_LE.shape != load_LE.shape:
            raise ValueError(f"swing_LE must have load_LE's shape {tuple(load_LE.shape)}, got {tuple(swing_LE.shape)}")
    # The penalties of the search are absolute (a forbidden device costs 1e30): plan in units where the
    # largest load is 1 when loads are far from that.
    peak = float(load_LE.max())
    scale = 2.0 ** math.frexp(peak)[1] if peak > 0 and not 1e-6 <= peak <= 1e12 else 1.0   # exact division
    task = _Task(load_LE / scale, G, S, num_nodes, previous, refine_rounds, dispatch,
                 None if swing_LE is None else swing_LE / scale)
    # Steps 1-3: each layer's candidates.
    cands, x_LP = _steered_candidates(task) if dispatch.steered else (_uniform_candidates(task), None)
    # Step 4: each layer's best candidate, and its index maps.
    weight = SPREAD_WEIGHT if dispatch.steered else 0.0
    # keeping a layer as it is moves nothing: `previous` is a candidate where it has this call's slots and is legal
    was = previous is not None and previous.slots_per_device == S and is_legal(previous)
    kept = [previous.phy2log.numpy().astype(np.int64)] if was else []
    phy = _choose(task, np.stack(cands + kept), dispatch, weight, x_LP)[0]
    plan = index_maps(torch.from_numpy(np.ascontiguousarray(phy)), task.E, G, S)
    assert is_legal(plan), "an expert was left without a replica, or a device holds two replicas of one expert"
    return plan


@dataclass
class _Task:
    """One planning call's checked arguments, and what every step derives from them."""
    load_LE: torch.Tensor
    G: int
    S: int
    num_nodes: int
    previous: Placement | None
    refine_rounds: int | None
    dispatch: Dispatch
    swing_LE: torch.Tensor | None = None
    hedge: bool | None = None       # replica counts by load + HEDGE x swing (True) or load alone (False); None: both

    def __post_init__(self):
        self.L, self.E = self.load_LE.shape
        self.P = self.G * self.S
        self.load = self.load_LE.numpy()
        self.node_G = np.arange(self.G) // (self.G // self.num_nodes)
        self.none_G = np.zeros(self.G, dtype=np.int64)
        # steered: spread is weighed, and plans without spread are candidates too
        self.weighed = self.dispatch.steered and self.num_nodes > 1
        self.spread_G = self.node_G if self.dispatch.steered else self.none_G
        self.was = None if self.previous is None else _replicas(self.previous)
        self.small = self.L * self.P <= EXTRA_WORK


def _uniform_candidates(t: _Task) -> list[np.ndarray]:
    """Steps 1u, 2, 3u (see `uniform.py`): one phy_LP spread over nodes and, where spread is weighed, one without
    (steered: only on small inputs), planned side by side. On small inputs several replica-count variants are
    placed and refined too (about 2**15 slots of work in all), and each layer keeps its best. Steered: a start
    for the steering-aware search, refined a quarter as long. Padded, or with swing_LE: the counts (by load +
    HEDGE x swing) stay, only swaps balance; the counts by load alone are planned too, and each layer keeps
    whichever does better on loads drawn within the swing (`_choose`), the hedged one only within HEDGE_COST of the
    other's busiest rank at the mean load."""
    steered = t.dispatch.steered
    hedged = t.swing_LE is not None and not steered if t.hedge is None else t.hedge
    if hedged and t.hedge is None and not t.dispatch.padded:
        unhedged = _uniform_candidates(replace(t, hedge=False))
        pairs = [np.stack([h, u]) for h, u in zip(_uniform_candidates(replace(t, hedge=True)), unhedged)]
        for pair in pairs:          # hedged only where it costs at most HEDGE_COST more at the mean load
            at_mean = even_split_loads(pair.reshape(2 * t.L, t.P), np.tile(t.load, (2, 1)), t.G, t.S).max(1)
            pair[0] = np.where((at_mean[:t.L] <= (1 + HEDGE_COST) * at_mean[t.L:])[:, None], pair[0], pair[1])
        return [_choose(t, pair, DISPATCH["uniform"])[0] for pair in pairs]
    fixed_counts = t.dispatch.padded or t.hedge is True
    nodes_list = [t.spread_G, t.none_G] if t.weighed and (t.small or not steered) else [t.spread_G]
    L, P, n = t.L, t.P, len(nodes_list)
    by = t.load_LE + HEDGE * t.swing_LE if hedged else t.load_LE
    tries = 1 if fixed_counts else int(np.clip((1 << 15) // (n * L * P), 1, 4))
    variants = count_variants(by.numpy(), P, t.G, tries)
    V = len(variants)
    load_N = np.tile(t.load, (n * V, 1))
    node_NG = np.repeat(np.stack(nodes_list), V * L, 0)
    was_N = None if t.was is None else t.was.select(np.tile(np.arange(L), n * V))
    phy = assign_replicas(torch.from_numpy(load_N), torch.from_numpy(np.tile(np.concatenate(variants), (n, 1))), t.G,
                          t.S, node_NG, was_N, STICKINESS)
    # about the same search time at every size: fewer rounds on larger inputs (a steered start, fewer still)
    work, least = ((1 << 16), 0) if steered else ((1 << 18), 4)
    rounds = int(np.clip(work // (n * V * L * P), least, 8 * t.G)) if t.refine_rounds is None else t.refine_rounds
    if rounds > 0:
        phy = refine_uniform(phy, load_N, t.G, t.S, rounds, node_NG if node_NG.max() > 0 else None, was_N, STICKINESS,
                             swaps_only=fixed_counts)
    phy = phy.reshape(n, V, L, P)
    return list(phy[:, 0]) if V == 1 else [_choose(t, phy[i], DISPATCH["uniform"])[0] for i in range(n)]


def _steered_candidates(t: _Task) -> tuple[list[np.ndarray], np.ndarray | None]:
    """Steps 1u-3u, then 3: the plan that balances without steering, improved for steering; on small inputs also
    from the load-proportional greedy start (steps 1-3), and the no-spread plan. -> (candidates, the first
    candidate's steered slot loads x_LP or None)"""
    uni = _uniform_candidates(t)
    # about the same refinement time at every size: fewer rounds on larger inputs
    rounds = int(np.clip((1 << 16) // (t.L * t.P), 1, 64)) if t.refine_rounds is None else t.refine_rounds
    refine = lambda phy: refine_for_steering(phy, t.load, t.G, t.S, t.spread_G, t.was, STICKINESS, rounds,
                                             REFINE_ITERS, REFINE_WORK)
    first, x_LP = refine(uni[0].copy()) if rounds > 0 else (uni[0], None)
    if not t.small:
        return [first], x_LP
    phy = assign_replicas(t.load_LE, torch.from_numpy(replica_counts(t.load, t.P, t.G)), t.G, t.S, t.spread_G,
                          t.was, STICKINESS)
    return [first, refine(phy)[0] if rounds > 0 else phy] + uni[1:], x_LP


def cross_node_fraction(phy_NP: np.ndarray, load_NE: np.ndarray, node_G: np.ndarray, S: int) -> np.ndarray:
    """[N] expected fraction of routes that leave their node when tokens start evenly over the nodes and
    go to a replica on their own node whenever their expert has one there."""
    covered_NE = SlotCounts.nodes(phy_NP, node_G, S, load_NE.shape[1]).groups_holding() / (int(node_G.max()) + 1)
    total = load_NE.sum(1)
    return np.where(total > 0, (load_NE * (1 - covered_NE)).sum(1) / np.where(total > 0, total, 1), 0.0)


def _choose(t: _Task, phy_CLP: np.ndarray, dispatch: Dispatch, spread_weight: float = 0.0, x0_LP=None):
    """Per layer the best of C candidate placements phy_CLP [C, L, P]: the slowest device under `dispatch` (steered:
    after `flows.steer_flows`), plus spread_weight x the mean device load x the cross-node route fraction, plus
    priced weight moves. x0_LP: the first candidate's steered split, or None. -> (phy_LP, x_LP: tokens per slot
    after steering, or None)."""
    C, L, P = phy_CLP.shape
    G, S = t.G, t.S
    if C == 1 and (not dispatch.steered or x0_LP is not None):
        return phy_CLP[0], x0_LP
    phy_NP = phy_CLP.reshape(C * L, P)
    load_NE = np.tile(t.load, (C, 1))
    if dispatch.steered:
        start = np.ones((C * L, P))
        if x0_LP is not None:
            start[:L] = x0_LP
        x_NP = steer_flows(start, phy_NP, load_NE, S,
                           int(np.clip((8 * REFINE_WORK) // (C * L * P), 4 * REFINE_ITERS, 100)))
        y_NG = x_NP.reshape(C * L, G, S).sum(2)
    else:
        x_NP, y_NG = None, even_split_loads(phy_NP, load_NE, G, S)
    mean = t.load.sum(1) / G
    score = y_NG.max(1).reshape(C, L)
    if not (dispatch.steered or dispatch.padded) and t.swing_LE is not None:   # mean busiest over loads in the swing
        rng, swing = np.random.default_rng(0), t.swing_LE.numpy()
        drawn = (np.clip(t.load + rng.standard_normal(t.load.shape) * swing, 0.0, None) for _ in range(SCENARIOS))
        score = np.mean([even_split_loads(phy_NP, np.tile(d, (C, 1)), G, S).max(1).reshape(C, L) for d in drawn], 0)
    if dispatch.padded:   # every slot is padded to the largest: slots x the largest share, per device
        score = (slot_shares(phy_NP, load_NE)[2].max(1) * S).reshape(C, L)
    if spread_weight > 0 and t.node_G.max() > 0:
        score = score + spread_weight * mean * cross_node_fraction(phy_NP, load_NE, t.node_G, S).reshape(C, L)
    if t.was is not None:   # weight copies against `previous`: stickiness x the mean device load / P each
        moves = SlotCounts.devices(phy_NP, S, t.E).new_pairs(t.was.select(np.tile(np.arange(L), C)))
        score = score + (moves * STICKINESS * load_NE.sum(1) / G / P).reshape(C, L)
    sq = np.where(score <= score.min(0) + (1e-9 * mean + 1e-12), (y_NG ** 2).sum(1).reshape(C, L), np.inf)
    pick, rows = sq.argmin(0), np.arange(L)
    return phy_CLP[pick, rows], None if x_NP is None else x_NP.reshape(C, L, P)[pick, rows]


def _checked_inputs(load_LE, num_devices, slots_per_device, num_nodes, previous, refine_rounds, dispatch):
    """`plan_placement`'s arguments checked: (load_LE float64 [L, E], G, S, previous with clean index maps or
    None); TypeError / ValueError naming the argument and what is valid."""
    load_LE = real_tensor("load_LE", load_LE, "[layers, experts]")
    if 0 in load_LE.shape:
        raise ValueError(f"load_LE must be [layers, experts] with at least one of each, got shape {tuple(load_LE.shape)}")
    L, E = load_LE.shape
    for name, value in (("num_devices", num_devices), ("slots_per_device", slots_per_device), ("num_nodes", num_nodes),
                        ("refine_rounds", refine_rounds)):
        optional = name == "refine_rounds"
        if not is_integer(value) and not (optional and value is None):
            raise ValueError(f"{name} ({value!r}) must be an integer" + (" or None" if optional else ""))
    G, S = int(num_devices), int(slots_per_device)
    P = G * S
    if G < 1 or S < 1:
        raise ValueError(f"num_devices ({G}) and slots_per_device ({S}) must be >= 1")
    if P < E:
        raise ValueError(f"num_devices * slots_per_device ({G} * {S} = {P}) must be >= num_experts ({E}): "
                         "every expert needs a slot")
    check_plan_size(L, P, G)
    if num_nodes < 1 or G % num_nodes:
        raise ValueError(f"num_nodes ({num_nodes}) must divide num_devices ({G})")
    if refine_rounds is not None and refine_rounds < 0:
        raise ValueError(f"refine_rounds ({refine_rounds}) must be >= 0 or None")
    if not isinstance(dispatch, Dispatch) and (not isinstance(dispatch, str) or dispatch not in DISPATCH):
        raise ValueError(f"dispatch ({dispatch!r}) must be one of {list(DISPATCH)}")
    dispatch = DISPATCH.get(dispatch, dispatch) if isinstance(dispatch, str) else dispatch
    return load_LE, G, S, dispatch, None if previous is None else _checked_previous(previous, L, E, G)


def _checked_previous(previous, L: int, E: int, G: int) -> Placement:
    """`previous` as a Placement of this model's layers, experts and devices, its maps derived afresh from
    its phy2log (on the CPU, int64); ValueError / TypeError naming what is wrong."""
    if not isinstance(previous, Placement):
        raise ValueError(f"previous must be a Placement, got {type(previous).__name__}")
    _check_maps(previous, "previous")
    phy = previous.phy2log
    if phy.shape[0] != L or previous.num_devices != G or previous.num_experts != E:
        raise ValueError(f"previous placement must have the same layers, experts and devices ({L}, {E}, {G}), got "
                         f"phy2log {tuple(phy.shape)} for {previous.num_devices} devices x "
                         f"{previous.slots_per_device} slots and {previous.num_experts} experts")
    if bool((phy < -1).any()) or bool((phy >= E).any()):
        raise ValueError(f"previous placement holds expert ids outside [-1, {E})")
    return index_maps(phy.detach().cpu().long(), E, G, previous.slots_per_device)


def _check_maps(plan: Placement, who: str) -> None:
    """Integer index maps of matching shapes and positive integer sizes (their values are not read)."""
    for name, least in (("num_devices", 1), ("slots_per_device", 1)):
        value = getattr(plan, name)
        if not is_integer(value) or value < least:
            raise ValueError(f"{who}.{name} ({value!r}) must be an integer >= {least}")
    for name, dims in (("phy2log", 2), ("log2phy", 3), ("logcnt", 2)):
        t = getattr(plan, name)
        if not (isinstance(t, torch.Tensor) and t.dim() == dims and not t.is_floating_point() and not t.is_complex()
                and t.dtype != torch.bool):
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{who}.{name} must be a {dims}-D integer torch tensor, got {got}")
    (L, P), (Lc, E) = plan.phy2log.shape, plan.logcnt.shape
    if Lc != L or plan.log2phy.shape[:2] != (L, E) or P != plan.num_devices * plan.slots_per_device:
        raise ValueError(f"{who}'s maps disagree: phy2log {tuple(plan.phy2log.shape)} (must be [layers, num_devices x "
                         f"slots_per_device] = [L, {plan.num_devices} x {plan.slots_per_device}]), log2phy "
                         f"{tuple(plan.log2phy.shape)} ([L, E, R]), logcnt {tuple(plan.logcnt.shape)} ([L, E])")


def _replicas(plan: Placement) -> SlotCounts:
    """Replicas per (layer, device, expert)."""
    return SlotCounts.devices(plan.phy2log.numpy(), plan.slots_per_device, plan.num_experts)


def is_legal(plan: Placement) -> bool:
    """Every expert has a replica and no device holds two of one expert."""
    return bool((plan.logcnt >= 1).all()) and int(_replicas(plan).triples()[3].max(initial=0)) <= 1


def index_maps(phy2log: torch.Tensor, E: int, G: int, S: int) -> Placement:
    """Step 4: a Placement from phy2log [L, P] (-1 = empty): log2phy [L, E, R] (its inverse), logcnt [L, E]."""
    phy2log = integer_tensor("phy2log", phy2log, "[layers, slots]")
    L, P = phy2log.shape
    if L < 1 or P != G * S or bool((phy2log < -1).any()) or bool((phy2log >= E).any()):
        raise ValueError(f"phy2log must be [layers, num_devices x slots_per_device] = [>= 1, {G} x {S}] with expert "
                         f"ids in [-1, {E}), got shape {(L, P)}")
    logcnt = torch.zeros(L, E + 1, dtype=torch.long).scatter_add_(1, phy2log + 1, torch.ones_like(phy2log))[:, 1:]
    R = max(1, int(logcnt.max()))
    # slots sorted by expert: each expert's replicas become consecutive; rank within the expert = column
    key = torch.where(phy2log >= 0, phy2log * P + torch.arange(P), E * P + torch.arange(P))
    order = torch.argsort(key, dim=1)
    sorted_exp = phy2log.gather(1, order)
    first = torch.cumsum(torch.cat([torch.zeros(L, 1, dtype=torch.long), logcnt], 1), 1)[:, :-1]  # [L, E]
    rank = torch.arange(P)[None, :] - first.gather(1, sorted_exp.clamp_min(0))
    log2phy = torch.full((L, E, R), -1, dtype=torch.long)
    valid = sorted_exp >= 0
    li = torch.arange(L)[:, None].expand(L, P)
    log2phy[li[valid], sorted_exp[valid], rank[valid]] = order[valid]
    return Placement(phy2log=phy2log, log2phy=log2phy, logcnt=logcnt, num_devices=G, slots_per_device=S)


def with_prefix(plan: Placement, previous: Placement | None = None, node_G: np.ndarray | None = None) -> Placement | None:
    """`plan`'s replica counts laid out so that the first H = E / G slots of the devices hold every expert once
    (the prefix, `prefix_placement`) and the other replicas the slots after them; None where they do not fit.
    Under a padded or even split the cost depends on the counts alone: the layout costs what `plan` costs, its
    prefix what DeepSpeed's layout costs, and serving flips between them by its tables, with no weight move.
    Prefix: experts in descending count dealt over the devices; extra replicas, in that order, to the devices
    with the most free slots without the expert, preferring `previous`'s, then a node without a replica of it
    (node_G: [G] node of each device; None: one node)."""
    if not isinstance(plan, Placement):
        raise TypeError(f"plan must be a Placement, got {type(plan).__name__}")
    L, E, G, S = plan.logcnt.shape[0], plan.num_experts, plan.num_devices, plan.slots_per_device
    if E % G or S < E // G:
        return None
    H = E // G
    node = np.zeros(G, dtype=np.int64) if node_G is None else np.asarray(node_G, dtype=np.int64)
    was_LGE = None if previous is None else holds_mask(previous.phy2log.numpy(), previous.slots_per_device, E)
    phy = np.full((L, G, S), -1, dtype=np.int64)
    for layer in range(L):
        cnt_E = plan.logcnt[layer].numpy()
        order = np.argsort(-cnt_E, kind="stable")
        phy[layer, np.arange(E) % G, np.arange(E) // G] = order         # the prefix: dealt over the devices
        holds_GE = np.zeros((G, E), dtype=bool)
        holds_GE[np.arange(E) % G, order] = True
        free_G = np.full(G, S - H)
        # extra replicas still to place of the experts whose prefix is on each device (they cannot go there)
        blocked_G = np.zeros(G, dtype=np.int64)
        np.add.at(blocked_G, np.arange(E) % G, cnt_E[order] - 1)
        for e in order:
            blocked_G[holds_GE[:, e].argmax()] -= int(cnt_E[e]) - 1
            for _ in range(int(cnt_E[e]) - 1):
                nodes_held = np.zeros(int(node.max()) + 1, dtype=bool)
                nodes_held[node[holds_GE[:, e]]] = True
                tie_G = 2 * nodes_held[node] - (was_LGE[layer, :, e] if was_LGE is not None else 0)
                key_G = (-free_G * (E * S + 1) - blocked_G) * 4 + tie_G
                legal_G = ~holds_GE[:, e] & (free_G > 0)
                if not legal_G.any():
                    return None
                g = int(np.where(legal_G, key_G, np.iinfo(np.int64).max).argmin())
                phy[layer, g, S - free_G[g]] = e
                free_G[g] -= 1
                holds_GE[g, e] = True
    return index_maps(torch.from_numpy(phy.reshape(L, G * S)), E, G, S)


def prefix_placement(plan: Placement) -> Placement:
    """The first H = E / G slots of every device of `plan` (a `with_prefix` plan): one slot per expert."""
    L, E, G, S = plan.logcnt.shape[0], plan.num_experts, plan.num_devices, plan.slots_per_device
    H = E // G
    return index_maps(plan.phy2log.reshape(L, G, S)[:, :, :H].reshape(L, G * H).clone(), E, G, H)


def choose_placement(heat_LE: torch.Tensor, current: Placement, home: Placement, threshold: float,
                     plan: Callable[[torch.Tensor], Placement], dispatch: Dispatch = DISPATCH["padded"],
                     move_cost: Optional[Callable[[Placement], float]] = None, horizon: float = 1.0,
                     min_gain: float = MIN_GAIN) -> Optional[Placement]:
    """The placement to serve next, or None when the view gives no reason to plan (pure).

    Plan (`plan(heat_LE)`) when a layer's skew under the current placement (`dispatch.ratio`) passes `threshold`, or
    when the home layout would cost `min_gain` less than the current one (replicas traffic no longer needs).
    `dispatch.cost` [L]: what each layer computes and sends. The cheaper of the plan and the home layout replaces
    the current placement when it costs `min_gain` less and, with `move_cost(plan)` (its weight copies, in the
    same units), what it saves over `horizon` steps pays for its moves; else the current one is returned (planned,
    nothing moves)."""
    def total(p: Placement) -> float:
        return float(dispatch.cost(heat_LE, p).sum())

    skewed = float(dispatch.ratio(heat_LE, current).max()) > threshold
    unneeded = current is not home and total(home) < (1 - min_gain) * total(current)
    if not (skewed or unneeded):
        return None
    best = min((plan(heat_LE), home), key=total)
    gain = total(current) - total(best)
    if gain <= min_gain * total(current) or (move_cost is not None and gain * horizon <= move_cost(best)):
        return current
    return best


def expected_slot_ratio(heat_LE: torch.Tensor, plan: Placement) -> torch.Tensor:
    """[L] max / mean of the expected load per physical slot, each expert's routes heat_LE [L, E] split evenly
    over its replicas (under padded dispatch, DeepSpeed's: capacity over ideal)."""
    return max_over_mean(_slot_loads(checked_load("heat_LE", heat_LE, plan), plan))


def expected_padded_cost(heat_LE: torch.Tensor, plan: Placement) -> torch.Tensor:
    """[L] slots x the expected largest slot load, each expert's routes heat_LE [L, E] split evenly over its
    replicas: what a padded dispatch (DeepSpeed's MOELayer) computes and sends per layer."""
    slot_LP = _slot_loads(checked_load("heat_LE", heat_LE, plan), plan)
    return slot_LP.shape[1] * slot_LP.amax(1)


def expected_device_load(heat_LE: torch.Tensor, plan: Placement) -> torch.Tensor:
    """[L, G] expected routes per device, each expert's routes heat_LE [L, E] split evenly over its replicas (in
    a dropless layer, AutoEP's, the busiest device's load is the layer's time)."""
    slot_LP = _slot_loads(checked_load("heat_LE", heat_LE, plan), plan)
    return slot_LP.view(slot_LP.shape[0], plan.num_devices, plan.slots_per_device).sum(2)


def _slot_loads(heat_LE: torch.Tensor, plan: Placement) -> torch.Tensor:
    """[L, P] each slot's expected routes when every expert's routes split evenly over its replicas (0: empty)."""
    return torch.from_numpy(slot_shares(plan.phy2log.numpy(), heat_LE.detach().double().numpy())[2]).to(heat_LE.dtype)
