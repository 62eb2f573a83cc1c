"""Step 3 of the planner: a steering-aware local search on the greedy placement.

Shape legend: L layers, E logical experts, G devices, S slots per device, P physical slots (G * S),
A layers still improving, K candidate moves per layer, Q partner slots (M partner devices x S).

Steps 1-2 of `placement.plan_placement` balance the *even* split of each expert over its replicas;
at run time steering splits them freely, so what counts is the slowest device after steering. A
cold expert with a copy on two hot devices can act as a bridge that steering uses to level them,
and a load-ordered greedy never builds it. This search does, within a bounded number of rounds.
"""
from __future__ import annotations

import numpy as np

from .flows import steer_flows
from .slots import holds_mask

__all__ = ["refine_for_steering"]


def refine_for_steering(phy_LP: np.ndarray, load_LE: np.ndarray, G: int, S: int, node_G: np.ndarray,
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

    x_LP = steer_flows(np.ones((L, P)), phy_LP, load_LE, S, n_iter(L, 4 * iters))
    phy0_LP, x0_LP = phy_LP.copy(), x_LP.copy()
    mean_L = load_LE.sum(1) / G
    tol_L = 1e-6 * mean_L + 1e-12
    move_cost_L = stickiness * mean_L / P                     # moving every slot: stickiness x the mean load

    def score(x, phy, rows):                                    # slowest device and sum of squares, [N]
        y = x.reshape(len(x), G, S).sum(2)
        cost = np.zeros(len(x))
        if was_LGE is not None:                                 # weight moves against previous, priced
            cost = (holds_mask(phy, S, E) & ~was_LGE[rows]).sum((1, 2)) * move_cost_L[rows]
        return y.max(1) + cost, (y ** 2).sum(1)

    M = min(G - 1, partners)
    active = np.arange(L)
    for _ in range(rounds):
        if active.size == 0 or M < 1:
            break
        A = active.size
        ai = np.arange(A)[:, None]
        phy, x = phy_LP[active], x_LP[active]
        holds = holds_mask(phy, S, E)
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
        both = steer_flows(np.concatenate([cx.reshape(A * K, P), x]),
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
    x_LP = steer_flows(x_LP, phy_LP, load_LE, S, n_iter(L, 4 * iters))
    changed = np.flatnonzero((phy_LP != phy0_LP).any(1))
    if changed.size:
        x0 = steer_flows(x0_LP[changed], phy0_LP[changed], load_LE[changed], S, n_iter(L, 4 * iters))
        shape = (len(changed), G, S)
        back = x_LP[changed].reshape(shape).sum(2).max(1) > x0.reshape(shape).sum(2).max(1) + tol_L[changed]
        phy_LP[changed[back]], x_LP[changed[back]] = phy0_LP[changed[back]], x0[back]
    return phy_LP, x_LP
