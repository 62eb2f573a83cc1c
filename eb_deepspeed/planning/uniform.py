"""Steps 1u and 3u of the planner (numbered in `placement`'s module doc) for runtimes that split each expert's
tokens evenly over its replicas (vLLM, SGLang, DeepSeek's EPLB): every replica of expert e carries load_e / count_e,
and a device's load is the sum of its replicas' shares.

Shape legend: L layers, E logical experts, G devices, S slots per device, P physical slots (G * S;
slot p lives on device p // S), A layers still improving, Q candidate partner slots, K moves per layer."""
from __future__ import annotations

import numpy as np

from .slots import MoveFrame, SlotCounts, best_moves, node_checks, row_chunks

__all__ = []

PARTNERS = 8    # a move pairs the slowest device with this many of the least loaded
ONE_AT_A_TIME = 256   # `uniform_counts` hands out up to this many extra replicas in a loop, more by bisection


def uniform_counts(load_LE: np.ndarray, slots: int, max_replicas: int) -> np.ndarray:
    """cnt_LE [L, E] int64: every expert once, then `slots - E` extra replicas per layer, each to the expert whose share
    (load / count) is largest (ties: the lowest expert), at most `max_replicas` each: the D'Hondt apportionment of
    load_LE >= 0. One at a time for up to ONE_AT_A_TIME of them; for more, the value of the last quotient load_e / c
    taken is found by bisection on its bits (exact) and the ties at it go to the lowest experts: the same counts."""
    L, E = load_LE.shape
    extra = min(slots, E * max_replicas) - E
    cnt = np.ones((L, E), dtype=np.int64)
    if extra <= ONE_AT_A_TIME:
        rows = np.arange(L)
        for _ in range(extra):
            share = np.where(cnt < max_replicas, load_LE / cnt, -1.0)
            cnt[rows, share.argmax(1)] += 1
        return cnt
    lo = np.zeros(L, dtype=np.int64)                                 # the bits of 0.0: every quotient is >= it
    hi = np.full(L, np.float64(load_LE.max()).view(np.int64) + 1)    # above every quotient
    while (hi - lo > 1).any():
        mid = lo + (hi - lo) // 2                                    # (lo + hi would overflow)
        enough = _quotients_at_least(load_LE, mid, max_replicas - 1).sum(1) >= extra
        lo, hi = np.where(enough, mid, lo), np.where(enough, hi, mid)
    above = _quotients_at_least(load_LE, lo + 1, max_replicas - 1)
    tied = _quotients_at_least(load_LE, lo, max_replicas - 1) - above
    room = extra - above.sum(1, keepdims=True)
    return cnt + above + np.clip(room - (np.cumsum(tied, 1) - tied), 0, tied)


def _quotients_at_least(load_LE: np.ndarray, bits_L: np.ndarray, m: int) -> np.ndarray:
    """[L, E] how many of load_e / c, c = 1 .. m (as float64 divisions) are >= the value with bits bits_L."""
    tau = bits_L.view(np.float64)[:, None]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):   # 0 / 0, x / 0, x / tiny: all m
        k = np.nan_to_num(np.floor(load_LE / tau), nan=m, posinf=m).clip(0, m).astype(np.int64)
    for _ in range(2):   # the float estimate is off by at most one either way
        k += (k < m) & (load_LE / (k + 1) >= tau)
        k -= (k > 0) & (load_LE / k.clip(1) < tau)
    return k


def count_variants(load_LE: np.ndarray, slots: int, max_replicas: int, n: int) -> list[np.ndarray]:
    """`n` replica-count vectors [L, E]: `uniform_counts`, then for j = 0 .. n - 2 the same with one replica of
    the layer's j-th most-replicated expert given to the expert with the next-largest share (fewer, larger
    shares of a hot expert can pack tighter; `placement._choose` keeps each layer's best)."""
    base = uniform_counts(load_LE, slots, max_replicas)
    L, E = load_LE.shape
    rows = np.arange(L)
    order = np.lexsort((-load_LE, -base), axis=1)            # most replicas first, then most load
    out = [base]
    for j in range(min(n - 1, E)):
        top = order[:, j]
        cnt = base.copy()
        ok = cnt[rows, top] >= 2
        cnt[rows[ok], top[ok]] -= 1
        share = np.where(cnt < max_replicas, load_LE / cnt, -1.0)
        share[rows, top] = -1.0
        cnt[rows[ok], share.argmax(1)[ok]] += 1
        out.append(cnt)
    return out


def refine_uniform(phy_LP: np.ndarray, load_LE: np.ndarray, G: int, S: int, rounds: int,
                   node_G: np.ndarray | None = None, was: SlotCounts | None = None,
                   stickiness: float = 0.0, work: int = 1 << 16, swaps_only: bool = False) -> np.ndarray:
    """Lower each layer's slowest device under an even split by local moves; phy_LP [L, P] changes in place.

    A round takes, for every layer still improving, the slowest device g* and three kinds of move:
      swap   a replica a on g* trades places with a replica b (or an empty slot) on another device;
      drop   a replica of a on g* whose expert has others becomes a new replica of an expert c not on g*;
      add    a replica of b elsewhere, whose expert has others, becomes a new replica of an expert a on g*.
    No move puts two replicas of an expert on one device or leaves an expert without one. The best K moves of
    each layer by estimate (`_moves`; a round looks at about `work` slots) get their exact device loads, and the
    best is applied when it lowers the slowest device, or keeps it and lowers the sum of squared device loads
    (`slots.best_moves`); `rounds` bounds the search. node_G [G] or [L, G] (all zeros = no spread): no expert
    leaves a node it alone covers (for one that holds it, in a swap). was (`previous`'s replicas, `SlotCounts`):
    every replica a move puts where `previous` did not hold it costs `stickiness` x the mean device load / P,
    every one it puts back earns as much. swaps_only: keep every expert's replica count."""
    L, P = phy_LP.shape
    if G < 2:                                  # one device: nothing to move between
        return phy_LP
    mean_L = load_LE.sum(1) / G
    move_cost_L = stickiness * mean_L / P
    tol_L = 1e-9 * mean_L + 1e-12
    node_LG = None if node_G is None else np.broadcast_to(np.asarray(node_G), (L, G))
    nodes = 1 if node_G is None else int(node_LG.max()) + 1
    active = np.arange(L)
    for _ in range(rounds):
        if active.size == 0:
            break
        K = max(1, min(64, work // (len(active) * P)))
        parts = [_moves(phy_LP[ac], load_LE[ac], G, S, node_LG[ac] if nodes > 1 else None,
                        None if was is None else was.select(ac), move_cost_L[ac], K, swaps_only=swaps_only)
                 for ac in (active[c] for c in row_chunks(len(active), S, min(G - 1, PARTNERS), P))]
        cand_AKP, score_AK, y_AKG, y_AG = (np.concatenate(part) for part in zip(*parts))
        # scores are relative to the current weight moves (a move's own are added)
        pick, keep = best_moves(score_AK, (y_AKG ** 2).sum(2), y_AG.max(1), (y_AG ** 2).sum(1), tol_L[active],
                                mean_L[active])
        phy_LP[active[keep]] = cand_AKP[keep, pick[keep]]
        active = active[keep]
    return phy_LP


def even_split_loads(phy_NP: np.ndarray, load_NE: np.ndarray, G: int, S: int) -> np.ndarray:
    """y_NG [N, G]: each device's load when every expert splits evenly over its replicas in phy_NP."""
    return slot_shares(phy_NP, load_NE)[2].reshape(len(phy_NP), G, S).sum(2)


def slot_shares(phy_NP: np.ndarray, load_NE: np.ndarray):
    """The even split of every expert over its replicas in phy_NP [N, P]: (cnt_NE replica counts, share_NE =
    load / count, w_NP [N, P] the share each slot takes, 0 where empty)."""
    N, P = phy_NP.shape
    E = load_NE.shape[1]
    rows = np.arange(N)[:, None]
    cnt = np.bincount((rows * (E + 1) + phy_NP + 1).ravel(), minlength=N * (E + 1)).reshape(N, E + 1)[:, 1:]
    share = load_NE / cnt.clip(1)
    return cnt, share, np.where(phy_NP >= 0, share[rows, phy_NP.clip(0)], 0.0)


def _moves(phy_AP, load_AE, G: int, S: int, node_AG, was_A, move_cost_A, K: int, partners: int = PARTNERS,
           takers: int = 16, swaps_only: bool = False):
    """The best K moves of each layer by estimate (kinds as in `refine_uniform`; swaps and adds with the slots of
    the `partners` least loaded devices, drops to the `takers` experts whose new replica would be lightest):
    (the placements cand_AKP, their exact slowest device plus priced weight moves score_AK (inf where a layer
    has fewer than K legal moves), their device loads y_AKG, the current device loads y_AG)."""
    f = _Frame(phy_AP, load_AE, G, S, partners)
    est, c_AC = _estimates(f, node_AG, takers, swaps_only)
    if was_A is not None:   # the weight copies a move makes or undoes, priced
        moves_AX = _move_count(was_A.counts, f, c_AC)
        est = est + moves_AX * move_cost_A[:, None]
    K = min(K, est.shape[1])
    pick = np.argpartition(est, K - 1, 1)[:, :K] if K < est.shape[1] else np.tile(np.arange(K), (f.A, 1))
    est_AK = np.take_along_axis(est, pick, 1)
    kind, p, q, c = _decoded(f, pick, c_AC)
    cand, y_AKG = _applied(f, kind, p, q, c)
    score = y_AKG.max(2)
    if was_A is not None:
        score = score + np.take_along_axis(moves_AX, pick, 1) * move_cost_A[:, None]
    return cand, np.where(np.isfinite(est_AK), score, np.inf), y_AKG, f.y_AG


class _Frame(MoveFrame):
    """`slots.MoveFrame` under the even split: the shares, and how an expert's other holders change when it gains
    or loses one."""

    def __init__(self, phy_AP, load_AE, G: int, S: int, partners: int):
        cnt, share, w_AP = slot_shares(phy_AP, load_AE)
        self.cnt, self.share = cnt, share
        super().__init__(phy_AP, w_AP, G, S, min(G - 1, partners), load_AE.shape[1])
        A, P, E, rows, g, y_AG = self.A, self.P, self.E, self.rows, self.g, self.y_AG
        self.yg = y_AG[rows[:, 0], g][:, None]
        # the slowest holder of x other than g* after x loses a replica: loads rise by la / (c - 1) - la / c
        y_slot = np.where(phy_AP >= 0, y_AG[rows, np.arange(P) // S], -np.inf)
        y_slot[rows, g[:, None] * S + np.arange(S)] = -np.inf
        top_AE = np.full(A * (E + 1), -np.inf)
        np.maximum.at(top_AE, (rows * (E + 1) + phy_AP + 1).ravel(), y_slot.ravel())
        self.top_AE = top_AE.reshape(A, E + 1)[:, 1:]
        self.rise_AE = np.where(cnt >= 2, load_AE / (cnt - 1).clip(1) - share, 0.0)   # (count 1: illegal moves)
        self.c_new = load_AE / (cnt + 1)                                   # a new replica's share
        self.g_holds_AE = self.holds.counts(rows, g[:, None], np.arange(E)) > 0


def _estimates(f: _Frame, node_AG, takers: int, swaps_only: bool):
    """Every move's estimate, the largest new load among the devices it touches (inf: illegal), in the order
    swaps [S x Q], drops [S x C], adds [S x Q]. -> (est [A, X], the takers c_AC)"""
    rows, holds, cnt, share, c_new = f.rows, f.holds.counts, f.cnt, f.share, f.c_new
    a_AS, b_AQ, h_AQ, g, yg = f.a_AS, f.b_AQ, f.h_AQ, f.g, f.yg
    a_id, b_id = a_AS.clip(0), b_AQ.clip(0)
    real_a = a_AS >= 0
    sa = f.w_AP[rows, f.p_AS]
    wb = f.w_AP[rows, f.q_AQ][:, None, :]
    yh = f.y_AG[rows, h_AQ][:, None, :]
    # swap: slot s of g* <-> partner slot q (d = load leaving g*); only g* and h change
    d = sa[:, :, None] - wb
    est_swap = np.maximum(yg[:, :, None] - d, yh + d)
    a_free_h = holds(rows[:, :, None], h_AQ[:, None, :], a_id[:, :, None]) == 0       # h does not hold a
    ok_swap = (~real_a[:, :, None] | a_free_h) & ((b_AQ < 0) | (holds(rows, g[:, None], b_id) == 0))[:, None, :] & (d > 0)
    # drop: a (on g*, count >= 2) -> c (one of the takers: not on g*, count < G, lightest new share)
    c_key = np.where(~f.g_holds_AE & (cnt < f.G), c_new, np.inf)
    C = min(f.E, takers)
    c_AC = np.argpartition(c_key, C - 1, 1)[:, :C] if C < f.E else np.tile(np.arange(f.E), (f.A, 1))
    est_drop = np.maximum((yg - sa)[:, :, None] + c_new[rows, c_AC][:, None, :],
                          (f.top_AE[rows, a_id] + f.rise_AE[rows, a_id])[:, :, None])
    ok_drop = (real_a & (cnt[rows, a_id] >= 2))[:, :, None] & np.isfinite(c_key[rows, c_AC])[:, None, :]
    # add: partner slot q (b, count >= 2, h without a) -> a new replica of a (on g*)
    gain_a = (share - c_new)[rows, a_id]                               # every replica of a sheds this
    yh_new = (yh - wb) + c_new[rows, a_id][:, :, None]
    b_top = (f.top_AE + f.rise_AE)[rows, b_id][:, None, :]             # b's other holders (an upper bound)
    g_rise = (f.g_holds_AE[rows, b_id] * f.rise_AE[rows, b_id])[:, None, :]   # when g* holds b too
    est_add = np.maximum(np.maximum((yg - gain_a)[:, :, None] + g_rise, yh_new), b_top)
    ok_add = (real_a[:, :, None] & a_free_h & ((b_AQ >= 0) & (cnt[rows, b_id] >= 2))[:, None, :]
              & (b_AQ[:, None, :] != a_AS[:, :, None]))
    if node_AG is not None:   # no expert leaves a node it alone covers (drop, add), or for one that holds it (swap)
        keeps, a_alone, _, b_alone = node_checks(SlotCounts.nodes(f.phy_AP, node_AG, f.S, f.E).counts, a_AS, b_AQ,
                                                 node_AG[rows[:, 0], g][:, None], node_AG[rows, h_AQ])
        ok_swap, ok_drop, ok_add = ok_swap & keeps, ok_drop & ~a_alone, ok_add & ~b_alone
    if swaps_only:
        ok_drop, ok_add = np.zeros_like(ok_drop), np.zeros_like(ok_add)
    moves = ((ok_swap, est_swap), (ok_drop, est_drop), (ok_add, est_add))
    return np.concatenate([np.where(ok, est, np.inf).reshape(f.A, -1) for ok, est in moves], 1), c_AC


def _decoded(f: _Frame, pick, c_AC):
    """The picked estimates' moves: (kind [A, K] 0 swap / 1 drop / 2 add, slot p on g*, partner slot q, taker c)."""
    C = c_AC.shape[1]
    Sp, Q = f.p_AS.shape[1], f.q_AQ.shape[1]
    n_swap, n_drop = Sp * Q, Sp * C
    kind = np.where(pick < n_swap, 0, np.where(pick < n_swap + n_drop, 1, 2))
    local = np.where(kind == 0, pick, np.where(kind == 1, pick - n_swap, pick - n_swap - n_drop))
    s = np.where(kind == 1, local // C, local // Q)
    x = np.where(kind == 1, local % C, local % Q)
    p = np.take_along_axis(f.p_AS, s, 1)
    q = np.take_along_axis(f.q_AQ, np.where(kind == 1, 0, x), 1)
    c = np.take_along_axis(c_AC, np.where(kind == 1, x, 0), 1)
    return kind, p, q, c


def _applied(f: _Frame, kind, p, q, c):
    """The moves made: (cand_AKP the placements, y_AKG their exact device loads, from the changes each move
    makes rather than by recounting)."""
    A, K = kind.shape
    rows, holds, share, c_new, rise_AE, yg = f.rows, f.holds.counts, f.share, f.c_new, f.rise_AE, f.yg
    ra, kk = np.broadcast_to(rows, (A, K)), np.broadcast_to(np.arange(K), (A, K))
    a, b = f.phy_AP[ra, p], f.phy_AP[ra, q]
    swap, drop, add = kind == 0, kind == 1, kind == 2
    cand = np.repeat(f.phy_AP[:, None, :], K, 1)
    cand[ra[swap], kk[swap], q[swap]] = a[swap]
    cand[ra[swap], kk[swap], p[swap]] = b[swap]
    cand[ra[drop], kk[drop], p[drop]] = c[drop]
    cand[ra[add], kk[add], q[add]] = a[add]
    h = q // f.S
    a0, b0, c0 = a.clip(0), b.clip(0), c.clip(0)
    hold_a, hold_b, hold_c = (holds(ra[..., None], np.arange(f.G), x[..., None]) > 0 for x in (a0, b0, c0))  # [A, K, G]
    sa_k, sb_k = f.w_AP[ra, p], f.w_AP[ra, q]
    dy = np.zeros((A, K, f.G))
    dy += (drop * rise_AE[ra, a0])[..., None] * hold_a                  # drop: a's other holders take more
    dy -= (drop * (share - c_new)[ra, c0])[..., None] * hold_c          #       c's holders take less
    dy -= (add * (share - c_new)[ra, a0])[..., None] * hold_a           # add:  a's holders take less
    dy += (add & (b >= 0))[..., None] * rise_AE[ra, b0][..., None] * hold_b   # b's other holders take more
    y_AKG = f.y_AG[:, None, :] + dy
    g_add = yg - (share - c_new)[ra, a0] + (b >= 0) * f.g_holds_AE[ra, b0] * rise_AE[ra, b0]   # g* may hold b
    g_new = np.where(swap, yg - sa_k + sb_k, np.where(drop, yg - sa_k + c_new[ra, c0], g_add))
    h_new = np.where(swap, f.y_AG[ra, h] + sa_k - sb_k, f.y_AG[ra, h] - sb_k + c_new[ra, a0])
    y_AKG[ra, kk, f.g[:, None]] = g_new
    hh = ~drop
    y_AKG[ra[hh], kk[hh], h[hh]] = h_new[hh]
    return cand, y_AKG


def _move_count(was, f: _Frame, c_AC) -> np.ndarray:
    """[A, X] change in the number of replicas held where `previous` did not hold them, per move in the
    order of `_moves`' estimates (swap, drop, add). was(rows, devices, experts): `previous`'s replicas."""
    rows, a_AS, g_A, b_AQ, h_AQ = f.rows, f.a_AS, f.g, f.b_AQ, f.h_AQ
    a_id, b_id = a_AS.clip(0), b_AQ.clip(0)
    real_a, real_b = (a_AS >= 0), (b_AQ >= 0)
    new_a_h = was(rows[:, :, None], h_AQ[:, None, :], a_id[:, :, None]) == 0      # a placed on h: [A, S, Q]
    new_a_g = was(rows, g_A[:, None], a_id) == 0                                 # a was on g*: [A, S]
    new_b_g = was(rows, g_A[:, None], b_id) == 0                                 # b placed on g*: [A, Q]
    new_b_h = was(rows, h_AQ, b_id) == 0                                         # b was on h: [A, Q]
    swap = (real_a[:, :, None] * (new_a_h.astype(np.int64) - new_a_g[:, :, None])
            + (real_b * (new_b_g.astype(np.int64) - new_b_h))[:, None, :])
    new_c_g = was(rows, g_A[:, None], c_AC) == 0                                 # c placed on g*: [A, C]
    drop = new_c_g[:, None, :].astype(np.int64) - new_a_g[:, :, None]
    add = new_a_h.astype(np.int64) - (real_b * new_b_h)[:, None, :]
    return np.concatenate([swap.reshape(f.A, -1), drop.reshape(f.A, -1), add.reshape(f.A, -1)], 1)

