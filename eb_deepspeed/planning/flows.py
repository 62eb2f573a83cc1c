"""The planner's model of steering: per-expert water filling of each expert's tokens over its replicas.

Shape legend: L layers, E logical experts, G devices, S slots per device, P slots (G * S; slot p on device p // S).

    x_LP = steer_flows(np.ones((L, P)), phy2log_LP, load_LE, S, iters=100)   # tokens per slot
    steered_load(plan, load_LE)    # [L, G] tokens per device after steering

The continuous relaxation of what steering can reach (any token to any replica of its expert, from any source),
which the planner scores placements by; tested against the exact optimum (`benchmarks/exact.py`). The runtime's
`steering.steer` splits whole routes per source rank: it reaches this bound only approximately."""
from __future__ import annotations

import numpy as np
import torch

from .slots import checked_load

__all__ = ["steered_load"]


def steer_flows(x_LP: np.ndarray, phy_LP: np.ndarray, load_LE: np.ndarray, S: int, iters: int) -> np.ndarray:
    """Tokens per slot x_LP [L, P] after `iters` rounds of per-expert water filling from x_LP.

    phy_LP [L, P]: expert per slot (-1 empty); load_LE [L, E]: tokens per expert; x_LP: any non-negative
    start, first rescaled so each expert's slots carry its load. Each round every expert computes the split of
    its load that levels its replicas' devices as far as the others' current shares allow (exact water filling:
    level = (load + sum of active bases) / active count, drop the replicas whose base is at or above it, until
    none drops), and all step towards theirs at once, expert e by 1 / (most moving experts on one of its
    devices): each device's new load is a convex combination of single-expert moves, so the sum of squared
    device loads never rises (a plain 1/2 step oscillates); the fixed point minimises it, and with it the
    slowest device: the best steering can do for this placement."""
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


def steered_load(plan, load_LE: torch.Tensor, iters: int = 100) -> torch.Tensor:
    """[L, G] tokens per device once `steer_flows` has split each expert's load over `plan`'s replicas.

    plan: a `placement.Placement`; load_LE: [L, E] tokens per layer and expert."""
    load_LE = checked_load("load_LE", load_LE, plan)
    L, P = plan.phy2log.shape
    S = plan.slots_per_device
    x_LP = steer_flows(np.ones((L, P)), plan.phy2log.numpy(), load_LE.numpy(), S, iters)
    return torch.from_numpy(x_LP.reshape(L, P // S, S).sum(2))
