"""Expert placement and replication planned over all layers at once (pure tensor code).

Shape legend: L layers, E logical experts, G devices (EP ranks), S slots per device,
P physical slots per layer (G * S; slot p lives on device p // S), R max replicas of one expert.

    plan = plan_placement(load_LE, num_devices=8, slots_per_device=5, num_nodes=2, previous=old_plan)
    plan.phy2log   # [L, P] logical expert in each physical slot, -1 = empty
    plan.log2phy   # [L, E, R] physical slots of each expert's replicas, -1 padded
    plan.logcnt    # [L, E] replica count per expert
    plan.moves     # replicas placed where `previous` did not hold that expert (weight copies)
    plan.steered_load_LG   # [L, G] expected tokens per device once steering splits them over replicas

The algorithm, in the style of DeepSeek's EPLB, with fixed output sizes and no Python loop over
experts or tokens:

1. Replica counts. Without a budget every layer's P slots are apportioned to its experts in
   proportion to load (largest remainder, at least 1 and at most G replicas each). With
   `slot_budget` (total slots over all layers, when per-device memory rather than per-layer count
   is the limit) each expert gets cnt = clamp(ceil(load / (tau * layer mean)), 1, G) for one
   global tau found by bisection, so layers that are more skewed get more replicas; the few slots
   the discrete ceil cannot hit exactly go to the highest relative load per replica.
2. Assignment. Replicas are sorted by load per replica (descending) and each goes to the least
   loaded device that has a free slot and does not hold that expert yet (so no device holds two
   replicas of one expert), preferring nodes that do not hold the expert yet (replicas spread
   across nodes, so steering can keep tokens node-local), and preferring the device that held the
   expert in `previous` when its load is within `stickiness` of the best (few weight moves for
   the same balance). One step per replica rank, vectorised over layers.
3. Refinement, steering-aware. Steps 1-2 balance the even split over replicas, but at run time
   steering splits each expert's tokens freely among its replicas, and then what counts is the
   slowest device after steering; a cold expert with a copy on two hot devices, for example, can
   act as a bridge that the load-ordered greedy never builds. A bounded local search (`_refine`)
   steers every layer (per-expert water filling, `_steer_flows`), and on each layer's slowest
   device tries swapping one replica with a slot of a less loaded device, or turning a spare
   replica there into a second copy of it; moves are screened by a cheap estimate, the best are
   confirmed by steering them, and one is kept per layer and round when it lowers the slowest
   device. With `previous`, weight moves are priced (moving all P slots of a layer must gain
   `stickiness` x the mean device load). The rounds shrink with the input so the
   refinement costs about the same at every size (22-35 ms at 61 x 256 x 64 on this noisy machine);
   a layer whose moves did not pay once both splits are settled returns to the greedy plan.
4. Index maps: phy2log, log2phy (inverse), logcnt; moves against `previous`; the expected load per
   device with an even split (`device_load_LG`) and after steering (`steered_load_LG`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Placement", "plan_placement", "static_placement", "replica_counts"]


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
        return torch.from_numpy(_holds(self.phy2log.numpy(), self.slots_per_device, self.num_experts))

    def expert_devices(self) -> torch.Tensor:
        """Device of each replica, [L, E, R] long (-1 padded)."""
        return torch.where(self.log2phy >= 0, self.log2phy // self.slots_per_device, -1)


def _holds(phy_NP: np.ndarray, S: int, E: int) -> np.ndarray:
    """holds_NGE [N, G, E] bool from phy_NP [N, P] (-1 = empty): device g holds a replica of expert e."""
    N, P = phy_NP.shape
    h = np.zeros((N, P // S, E + 1), dtype=bool)
    h[np.arange(N)[:, None], np.arange(P)[None, :] // S, phy_NP + 1] = True
    return h[:, :, 1:]


def static_placement(num_layers: int, num_experts: int, num_devices: int) -> Placement:
    """DeepSpeed's layout: one replica per expert, expert e on device e // (E / G)."""
    if num_experts % num_devices:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by num_devices ({num_devices})")
    S = num_experts // num_devices
    phy2log = torch.arange(num_experts).expand(num_layers, num_experts).clone()
    return _finish(phy2log, num_experts, num_devices, S, None, None)


def replica_counts(load_LE: torch.Tensor, slots_L: torch.Tensor | int, max_replicas: int,
                   slot_budget: int | None = None, iters: int = 40) -> torch.Tensor:
    """Replica count per expert [L, E] (step 1 of the module doc). slots_L: slots each layer may fill.

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
    load_LE = torch.as_tensor(load_LE, dtype=torch.float64)
    if load_LE.dim() != 2:
        raise ValueError(f"load_LE must be [layers, experts], got shape {tuple(load_LE.shape)}")
    if not bool(torch.isfinite(load_LE).all()) or bool((load_LE < 0).any()):
        raise ValueError("load_LE must be finite and non-negative")
    L, E = load_LE.shape
    G, S = int(num_devices), int(slots_per_device)
    P = G * S
    if G < 1 or S < 1:
        raise ValueError(f"num_devices ({G}) and slots_per_device ({S}) must be >= 1")
    if P < E:
        raise ValueError(f"num_devices * slots_per_device ({G} * {S} = {P}) must be >= num_experts ({E}): "
                         "every expert needs a slot")
    if num_nodes < 1 or G % num_nodes:
        raise ValueError(f"num_nodes ({num_nodes}) must divide num_devices ({G})")
    if slot_budget is not None and not L * E <= slot_budget <= L * P:
        raise ValueError(f"slot_budget ({slot_budget}) must be in [layers * experts, layers * slots] = "
                         f"[{L * E}, {L * P}]")
    if (refine_rounds is not None and refine_rounds < 0) or refine_iters < 1 or refine_work < 1:
        raise ValueError(f"refine_rounds ({refine_rounds}) must be >= 0 or None, refine_iters ({refine_iters}) "
                         f"and refine_work ({refine_work}) >= 1")
    if previous is not None and (previous.phy2log.shape[0] != L or previous.num_devices != G
                                 or previous.num_experts != E):
        raise ValueError("previous placement must have the same layers, experts and devices")

    cnt_LE = replica_counts(load_LE, P, G, slot_budget)
    weight_LE = load_LE / cnt_LE

    # Replicas sorted by load per replica, padded to P per layer (expert -1 = empty): sort the experts,
    # then position p of a layer belongs to the expert whose cumulative replica count first exceeds p.
    order_LE = torch.argsort(weight_LE, dim=1, descending=True, stable=True)
    ends_LE = cnt_LE.gather(1, order_LE).cumsum(1)
    pos_LE = torch.searchsorted(ends_LE, torch.arange(P).expand(L, P).contiguous(), right=True)
    live_LP = pos_LE < E
    rep_expert_LP = torch.where(live_LP, order_LE.gather(1, pos_LE.clamp_max(E - 1)), -1)
    rep_w_LP = torch.where(live_LP, weight_LE.gather(1, rep_expert_LP.clamp_min(0)), 0.0)

    # The assignment loop runs in NumPy: one step per replica rank (P steps, each over all layers);
    # NumPy's per-call overhead is a few microseconds against torch's ~10, which is what makes
    # 61 layers x 256 experts x 64 devices fit in the 100 ms budget.
    node_G = np.arange(G) // (G // num_nodes)
    same_node_GG = (node_G[:, None] == node_G[None, :]).astype(np.float64)
    dev_load_LG = np.zeros((L, G))
    used_LG = np.zeros((L, G), dtype=np.int64)
    # penalty_XG: one row per (layer, expert) (row l * (E + 1) + e + 1; row 0 of a layer = "empty"):
    # HUGE on devices that already hold the expert (forbidden), `big` on the other devices of their
    # nodes (spread replicas across nodes first), minus the stickiness bonus where `previous` held it.
    HUGE, big = 1e30, float(load_LE.sum()) * 4 + 1.0
    penalty_XG = np.zeros((L * (E + 1), G))
    was_LGE = previous.holds().numpy() if previous is not None else None   # any slots per device
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

    phy = np.ascontiguousarray(phy[:, :P])
    x_LP = None
    if refine_rounds is None:   # about the same refinement time at every size: fewer rounds on larger inputs
        refine_rounds = int(np.clip((1 << 16) // (L * P), 1, 64))
    if refine_rounds > 0:
        phy, x_LP = _refine(phy, load_LE.numpy(), G, S, node_G, was_LGE, stickiness, refine_rounds, refine_iters,
                            refine_work)
    plan = _finish(torch.from_numpy(phy), E, G, S, load_LE, previous)
    if x_LP is not None:
        plan.steered_load_LG = torch.from_numpy(x_LP.reshape(L, G, S).sum(2))
    return plan


def _finish(phy2log: torch.Tensor, E: int, G: int, S: int, load_LE: torch.Tensor | None,
            previous: Placement | None) -> Placement:
    """Build log2phy / logcnt (and device loads, moves) from phy2log [L, P]."""
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




def _steer_flows(x_LP: np.ndarray, phy_LP: np.ndarray, load_LE: np.ndarray, S: int, iters: int) -> np.ndarray:
    """Tokens per slot x_LP [L, P] after `iters` rounds of per-expert water filling from x_LP.

    phy_LP [L, P]: expert per slot (-1 empty); load_LE [L, E]: tokens per expert. x_LP may be any
    non-negative start; it is first rescaled so each expert's slots carry exactly its load. Each round
    every expert computes the split of its load over its replicas that levels their devices as far
    as the other experts' current shares allow (exact water filling: start with every replica
    active, level = (load + sum of active bases) / active count, drop the replicas whose base is at
    or above it, until none drops), and all experts step towards theirs at once, expert e by
    1 / (most moving experts on one of its devices). With those steps each device's new load is a
    convex combination of single-expert moves, so the sum of squared device loads never rises
    (a plain 1/2 step oscillates when five or more experts share two devices); the fixed point
    minimises it, and with it the slowest device: the best steering can do for this placement.
    Only the slots of experts with two or more replicas move, so the loop runs on those alone, as
    flat arrays.
    """
    L, P = phy_LP.shape
    E = load_LE.shape[1]
    G = P // S
    live_LP = phy_LP >= 0
    row_LP = np.arange(L)[:, None] * E + phy_LP.clip(0)                 # (layer, expert) row of each slot
    cnt_R = np.bincount(row_LP[live_LP], minlength=L * E)
    w_LP = load_LE.ravel()[row_LP] * live_LP
    flex_LP = live_LP & (cnt_R[row_LP] >= 2)
    out_LP = np.where(flex_LP, 0.0, w_LP)                                # single replicas carry their expert
    flex = np.flatnonzero(flex_LP.ravel())
    if flex.size == 0:
        return out_LP
    fixed_D = out_LP.reshape(L * G, S).sum(1)                           # per (layer, device), flat
    dev_F = flex // S                                                    # slot p of layer l: device l * G + p // S
    row_F = row_LP.ravel()[flex]
    used_R = np.zeros(L * E, dtype=bool)
    used_R[row_F] = True
    rows = np.flatnonzero(used_R)                                         # the moving experts, dense ids
    eid_F = (np.cumsum(used_R) - 1)[row_F]
    n = len(rows)
    w_N = load_LE.ravel()[rows]
    cnt_N = np.bincount(eid_F, minlength=n).astype(np.float64)
    crowd_N = np.zeros(n)
    np.maximum.at(crowd_N, eid_F, np.bincount(dev_F, minlength=L * G)[dev_F])
    step_F = (1.0 / crowd_N)[eid_F]

    def per_expert(v):
        return np.bincount(eid_F, weights=v, minlength=n)

    def to_load(v):                                                      # rescale each expert's slots to its load
        have = per_expert(v)
        none = have <= 0
        return np.where(none[eid_F], (w_N / cnt_N)[eid_F], v * (w_N / np.where(none, 1, have))[eid_F])

    x_F = to_load(np.maximum(x_LP.ravel()[flex], 0))
    for _ in range(iters):
        y_D = fixed_D + np.bincount(dev_F, weights=x_F, minlength=L * G)
        base_F = y_D[dev_F] - x_F
        level = (w_N + per_expert(base_F)) / cnt_N
        act_F = base_F < level[eid_F]
        for _ in range(G):                                               # at most G replicas drop out
            level = (w_N + per_expert(base_F * act_F)) / np.maximum(per_expert(act_F.astype(np.float64)), 1)
            nxt = act_F & (base_F < level[eid_F])
            if np.array_equal(nxt, act_F):
                break
            act_F = nxt
        target_F = np.maximum(level[eid_F] - base_F, 0) * act_F
        x_F = x_F + step_F * (to_load(target_F) - x_F)
    out_LP.ravel()[flex] = x_F
    return out_LP


def _refine(phy_LP: np.ndarray, load_LE: np.ndarray, G: int, S: int, node_G: np.ndarray,
            was_LGE: np.ndarray | None, stickiness: float, rounds: int, iters: int,
            work: int, partners: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Steering-aware local search (step 3): improve each layer's slowest device after steering.

    phy_LP [L, P] is changed in place and returned with the steered tokens per slot x_LP [L, P].
    A round, for every layer still improving: take the slowest device g* after steering, and list
    every legal move of one replica a on g* to a slot q of one of its `partners` least loaded devices h:
      swap     a and the expert b in q (or the empty slot q) trade places;
      replace  q's expert b, which keeps another replica, becomes a second copy of a (the replica
               counts change, the number of slots used does not).
    Moves are screened by a cheap estimate (tokens move with their experts, a's new copy takes up
    to half the gap), and the best K of each layer are confirmed by steering them; K is sized so
    a round steers about `work` slots, whatever the size (every move on tiny inputs, the best
    estimate on large ones). The best confirmed move is kept when it lowers the slowest device
    (ties: the sum of squared device loads), else the layer stops. With `previous` (was_LGE
    [L, G, E], the devices that held each expert) each weight move adds `stickiness` x the mean
    device load / P to the score (moving every slot must gain `stickiness` x the mean load). No
    move puts two replicas of an expert on one device or takes an expert off a node it alone
    covered. At the end both splits are settled further and a layer whose moves did not pay
    returns to the greedy plan.
    """
    L, P = phy_LP.shape
    E = load_LE.shape[1]
    nodes = int(node_G.max()) + 1
    dev_P = np.arange(P) // S
    node_P = node_G[dev_P]

    def n_iter(rows: int, least: int) -> int:       # water-filling rounds: more where they are cheap
        return int(np.clip((8 * work) // (rows * P), least, 100))

    x_LP = _steer_flows(np.ones((L, P)), phy_LP, load_LE, S, n_iter(L, 4 * iters))
    phy0_LP, x0_LP = phy_LP.copy(), x_LP.copy()
    mean_L = load_LE.sum(1) / G
    tol_L = 1e-6 * mean_L + 1e-12
    move_cost_L = stickiness * mean_L / P                     # moving every slot: stickiness x the mean load

    def score(x, phy, rows):                                    # slowest device and sum of squares, [N]
        y = x.reshape(len(x), G, S).sum(2)
        cost = np.zeros(len(x))
        if was_LGE is not None:                                 # weight moves against previous, priced
            cost = (_holds(phy, S, E) & ~was_LGE[rows]).sum((1, 2)) * move_cost_L[rows]
        return y.max(1) + cost, (y ** 2).sum(1)

    M = min(G - 1, partners)
    active = np.arange(L)
    for _ in range(rounds):
        if active.size == 0 or M < 1:
            break
        A = active.size
        ai = np.arange(A)[:, None]
        phy, x = phy_LP[active], x_LP[active]
        holds = _holds(phy, S, E)
        y_AG = x.reshape(A, G, S).sum(2)
        rank_AG = np.argsort(y_AG, 1, kind="stable")
        g_A = rank_AG[:, -1]                                    # the slowest device
        h_AM = rank_AG[:, :M]                                   # its partners: the M least loaded
        y_g = y_AG[ai[:, 0], g_A][:, None, None]
        other_A = y_AG[ai[:, 0], rank_AG[:, -2]] if G > 1 else np.zeros(A)
        if M < G - 1:                                           # every partner is below the second slowest
            other = other_A[:, None, None]
        else:                                                   # all other devices are partners
            third_A = y_AG[ai[:, 0], rank_AG[:, -3]] if G > 2 else np.zeros(A)
            other = np.where(h_AM == rank_AG[:, -2:-1], third_A[:, None], other_A[:, None])
            other = np.repeat(other, S, 1)[:, None, :]
        p_AS = g_A[:, None] * S + np.arange(S)
        q_AQ = (h_AM[:, :, None] * S + np.arange(S)).reshape(A, M * S)
        h_AQ = q_AQ // S
        a_AS = phy[ai, p_AS]                                    # experts on g* (-1: empty slot)
        b_AQ = phy[ai, q_AQ]                                    # experts in the partner slots
        xa = x[ai, p_AS][:, :, None]
        xb = x[ai, q_AQ][:, None, :]
        ac, bc = a_AS.clip(0)[:, :, None], b_AQ.clip(0)
        cnt_AE = np.bincount((ai * (E + 1) + phy + 1).ravel(), minlength=A * (E + 1)).reshape(A, E + 1)[:, 1:]
        cnt_AQ = cnt_AE[ai, bc]
        base = (a_AS[:, :, None] >= 0) & ~holds[ai[:, :, None], h_AQ[:, None, :], ac]
        b_ok_g = ((b_AQ < 0) | ~holds[ai, g_A[:, None], bc])[:, None, :]
        b_spare = ((b_AQ >= 0) & (cnt_AQ >= 2))[:, None, :]
        if nodes > 1:                                           # replicas per node of each expert
            per_node = np.bincount(((ai * nodes + node_P) * (E + 1) + phy + 1).ravel(),
                                   minlength=A * nodes * (E + 1)).reshape(A, nodes, E + 1)[:, :, 1:]
            ng = node_G[g_A][:, None]
            nq = node_G[h_AQ]
            cross = (nq != ng)[:, None, :]
            a_alone = (per_node[ai, ng, a_AS.clip(0)] == 1)[:, :, None]
            a_there = per_node[ai[:, :, None], nq[:, None, :], ac] > 0
            b_alone = ((b_AQ >= 0) & (per_node[ai, nq, bc] == 1))[:, None, :]
            b_there = (per_node[ai, ng, bc] > 0)[:, None, :]
            swap_ok = base & b_ok_g & ~(cross & ((a_alone & a_there) | (b_alone & b_there)))
            a_full = (per_node[ai, :, a_AS.clip(0)] > 0).all(2)[:, :, None]   # a already on every node
            repl_ok = base & b_spare & ~b_alone & (~a_there | a_full)
        else:
            swap_ok, repl_ok = base & b_ok_g, base & b_spare
        y_h = y_AG[ai, h_AQ][:, None, :]
        est_swap = np.maximum(np.maximum(y_g - xa + xb, y_h - xb + xa), other)
        t = np.clip((y_g - y_h + xb) / 2, 0, xa)
        est_repl = np.maximum(np.maximum(y_g - t, y_h - xb + t), other)
        est = np.stack([np.where(swap_ok, est_swap, np.inf), np.where(repl_ok, est_repl, np.inf)], 1).reshape(A, -1)
        n_legal = int((est < np.inf).sum(1).max())
        if n_legal == 0:
            break
        K = int(np.clip(work // (A * P), 1, n_legal))
        if K == 1:
            pick_AK = est.argmin(1)[:, None]
        else:
            part = np.argpartition(est, K - 1, 1)[:, :K]
            pick_AK = np.take_along_axis(part, np.argsort(np.take_along_axis(est, part, 1), 1, kind="stable"), 1)
        legal_AK = np.take_along_axis(est, pick_AK, 1) < np.inf
        Q = M * S
        kind, s, qi = pick_AK // (S * Q), pick_AK // Q % S, pick_AK % Q
        p = g_A[:, None] * S + s
        q = np.take_along_axis(q_AQ, qi, 1)
        # candidate rows [A, K, P]: apply each move; tokens follow their experts, a new copy starts empty
        cphy = np.repeat(phy[:, None, :], K, 1)
        cx = np.repeat(x[:, None, :], K, 1)
        ak, bk = phy[ai, p], phy[ai, q]
        xak, xbk = x[ai, p], x[ai, q]
        rr, kk = np.broadcast_to(ai, (A, K)), np.broadcast_to(np.arange(K), (A, K))
        swap = kind == 0
        cphy[rr, kk, q] = ak
        cphy[rr, kk, p] = np.where(swap, bk, ak)
        cx[rr, kk, q] = np.where(swap, xak, 0.0)
        cx[rr, kk, p] = np.where(swap, xbk, xak)
        # candidates and the current placement (last A rows) get the same steering: a move never wins
        # by extra iterations alone
        rows = np.concatenate([np.repeat(active, K), active])
        both = _steer_flows(np.concatenate([cx.reshape(A * K, P), x]),
                            np.concatenate([cphy.reshape(A * K, P), phy]), load_LE[rows], S, n_iter(len(rows), iters))
        cx, x = both[:A * K], both[A * K:]
        x_LP[active] = x
        cmax, csq = score(cx, cphy.reshape(A * K, P), rows[:A * K])
        cmax = np.where(legal_AK.ravel(), cmax, np.inf).reshape(A, K)
        csq = np.where(legal_AK.ravel(), csq, np.inf).reshape(A, K)
        best = cmax.min(1)
        tol = tol_L[active]
        pick = np.where(cmax <= best[:, None] + tol[:, None], csq, np.inf).argmin(1)
        cur_max, cur_sq = score(x, phy, active)
        tied = (best <= cur_max + tol) & (csq[ai[:, 0], pick] < cur_sq - tol * mean_L[active])
        gain = (best < cur_max - tol) | tied
        keep = np.flatnonzero(gain)
        phy_LP[active[keep]] = cphy[keep, pick[keep]]
        x_LP[active[keep]] = cx.reshape(A, K, P)[keep, pick[keep]]
        active = active[keep]
    # Settle both splits and return a layer to the greedy plan where its moves did not pay after all:
    # moves are confirmed on splits a few rounds from settled, which can mislead on slow layers.
    x_LP = _steer_flows(x_LP, phy_LP, load_LE, S, n_iter(L, 4 * iters))
    changed = np.flatnonzero((phy_LP != phy0_LP).any(1))
    if changed.size:
        x0 = _steer_flows(x0_LP[changed], phy0_LP[changed], load_LE[changed], S, n_iter(L, 4 * iters))
        shape = (len(changed), G, S)
        back = x_LP[changed].reshape(shape).sum(2).max(1) > x0.reshape(shape).sum(2).max(1) + tol_L[changed]
        phy_LP[changed[back]], x_LP[changed[back]] = phy0_LP[changed[back]], x0[back]
    return phy_LP, x_LP
