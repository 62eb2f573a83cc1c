"""Step 3 of the planner (numbered in `placement`'s module doc): `refine_for_steering`, a local search scored by
the slowest device after steering. A cold expert with a copy on two hot devices is a bridge that steering uses to
level them; a load-ordered greedy, which balances the even split, never builds it; this does.

Shape legend: L layers, E logical experts, G devices, S slots per device, P physical slots (G * S),
A layers still improving, K candidate moves per layer, M partner devices, Q partner slots (M * S),
N rows of any of these (layers or candidates)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .flows import steer_flows
from .slots import MoveFrame, SlotCounts, best_moves, node_checks, row_chunks

__all__ = []


@dataclass
class _Search:
    load_LE: np.ndarray
    G: int
    S: int
    node_G: np.ndarray
    was: SlotCounts | None         # the replicas `previous` held per (layer, device, expert), or None
    iters: int
    work: int

    def __post_init__(self):
        self.E, self.P = self.load_LE.shape[1], self.G * self.S
        self.nodes = int(self.node_G.max()) + 1
        self.mean_L = self.load_LE.sum(1) / self.G
        self.tol_L = 1e-6 * self.mean_L + 1e-12

    def n_iter(self, rows: int, least: int) -> int:
        """Water-filling rounds for steering `rows` placements at once: more where they are cheap."""
        return int(np.clip((8 * self.work) // (rows * self.P), least, 100))

    def steer(self, x_NP: np.ndarray, phy_NP: np.ndarray, rows_N: np.ndarray, least: int) -> np.ndarray:
        return steer_flows(x_NP, phy_NP, self.load_LE[rows_N], self.S, self.n_iter(len(rows_N), least))

    def score(self, x_NP: np.ndarray, phy_NP: np.ndarray, rows_N: np.ndarray, move_cost_L: np.ndarray):
        """(slowest device + priced weight moves, sum of squared device loads), each [N]."""
        y_NG = x_NP.reshape(len(x_NP), self.G, self.S).sum(2)
        cost_N = 0.0 if self.was is None else \
            SlotCounts.devices(phy_NP, self.S, self.E).new_pairs(self.was.select(rows_N)) * move_cost_L[rows_N]
        return y_NG.max(1) + cost_N, (y_NG ** 2).sum(1)


def refine_for_steering(phy_LP: np.ndarray, load_LE: np.ndarray, G: int, S: int, node_G: np.ndarray,
                        was: SlotCounts | None, stickiness: float, rounds: int, iters: int,
                        work: int, partners: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Improve each layer's slowest device after steering: phy_LP [L, P], changed in place, and the steered
    tokens per slot x_LP [L, P].

    A round, for every layer still improving, lists every legal move of one replica a on the slowest device g*
    to a slot q of one of its `partners` least loaded devices:
      swap     a and the expert b in q (or the empty slot q) trade places;
      replace  q's expert b, which keeps another replica, becomes a second copy of a.
    The best K moves of each layer by a cheap estimate (`_screen`; a round steers about `work` slots) are confirmed by
    steering them (`_confirm`); the best is kept when it lowers the slowest device (ties: the sum of squared device
    loads), else the layer stops. With `previous` (was: its replicas, `SlotCounts`) each weight move adds `stickiness` x
    the mean device load / P. No move puts two replicas of an expert on one device or takes an expert off a node it
    alone covered; a layer whose moves did not pay after all returns to the greedy plan (`_settle`)."""
    L, P = phy_LP.shape
    search = _Search(load_LE, G, S, node_G, was, iters, work)
    move_cost_L = stickiness * search.mean_L / P              # moving every slot: stickiness x the mean load
    # Step 3a: the greedy placement, steered.
    x_LP = search.steer(np.ones((L, P)), phy_LP, np.arange(L), 4 * iters)
    phy0_LP, x0_LP = phy_LP.copy(), x_LP.copy()
    M = min(G - 1, partners)
    active = np.arange(L)
    for _ in range(rounds):
        if active.size == 0 or M < 1:
            break
        phy_AP, x_AP = phy_LP[active], x_LP[active]
        # Step 3b: screen (in chunks of layers), keep each layer's best K by estimate.
        K = max(1, work // (active.size * P))
        parts = [_screen(search, phy_AP[c], x_AP[c], M, K) for c in row_chunks(active.size, S, M, P)]
        pick_AK, legal_AK, p_AS, q_AQ = (np.concatenate(part) for part in zip(*parts))
        n_legal = int(legal_AK.sum(1).max())
        if n_legal == 0:
            break
        K = min(K, n_legal)
        # Step 3c: confirm the best K of each layer by steering them.
        cphy_AKP, cx_AKP = _candidates(pick_AK[:, :K], phy_AP, x_AP, p_AS, q_AQ)
        active = _confirm(search, active, phy_LP, x_LP, cphy_AKP, cx_AKP, legal_AK[:, :K], move_cost_L)
    # Step 3d: settle.
    return _settle(search, phy_LP, x_LP, phy0_LP, x0_LP)


def _screen(search: _Search, phy_AP: np.ndarray, x_AP: np.ndarray, M: int, K: int):
    """Every legal move of each layer's slowest device g*, screened by a cheap estimate of its slowest device.
    -> the best K moves of each layer, pick_AK [A, K] (index kind * S' * Q + s * Q + q: kind 0 swap / 1 replace,
    s the slot on g*, q the partner slot), legal_AK [A, K], and the slots p_AS' of g* and q_AQ of its partners
    (`slots.MoveFrame`)."""
    G, S, E = search.G, search.S, search.E
    f = MoveFrame(phy_AP, x_AP, G, S, M, E)    # g*: the slowest device; a on g*, b in the partner slots (-1: empty)
    A, rows_A1, y_AG, rank_AG, g_A, h_AQ = f.A, f.rows, f.y_AG, f.rank_AG, f.g, f.h_AQ
    p_AS, q_AQ, a_AS, b_AQ = f.p_AS, f.q_AQ, f.a_AS, f.b_AQ
    y_g = y_AG[rows_A1[:, 0], g_A][:, None, None]
    # what the layer's slowest device is at least after a move: the slowest device it does not touch
    second_A = y_AG[rows_A1[:, 0], rank_AG[:, -2]] if G > 1 else np.zeros(A)
    if M < G - 1:                                               # every partner is below the second slowest
        untouched = second_A[:, None, None]
    else:                                                       # all other devices are partners
        third_A = y_AG[rows_A1[:, 0], rank_AG[:, -3]] if G > 2 else np.zeros(A)
        untouched = np.where(h_AQ == rank_AG[:, -2:-1], third_A[:, None], second_A[:, None])[:, None, :]
    x_a = x_AP[rows_A1, p_AS][:, :, None]                       # their tokens, [A, S', 1] and [A, 1, Q]
    x_b = x_AP[rows_A1, q_AQ][:, None, :]
    a_id, b_id = a_AS.clip(0)[:, :, None], b_AQ.clip(0)         # indexable ids (empty slots masked below)
    count_AE = np.bincount((rows_A1 * (E + 1) + phy_AP + 1).ravel(), minlength=A * (E + 1)).reshape(A, E + 1)[:, 1:]
    # legality: a may go to h (h does not hold a yet); b may come to g* (swap), or b keeps another replica (replace)
    base = (a_AS[:, :, None] >= 0) & (f.holds.counts(rows_A1[:, :, None], h_AQ[:, None, :], a_id) == 0)
    b_may_come = ((b_AQ < 0) | (f.holds.counts(rows_A1, g_A[:, None], b_id) == 0))[:, None, :]
    b_spare = ((b_AQ >= 0) & (count_AE[rows_A1, b_id] >= 2))[:, None, :]
    if search.nodes > 1:                                        # never take an expert off a node it alone covers
        per_node = SlotCounts.nodes(phy_AP, search.node_G, S, E)
        keeps, _, a_there, b_alone = node_checks(per_node.counts, a_AS, b_AQ, search.node_G[g_A][:, None],
                                                 search.node_G[h_AQ])
        swap_ok = base & b_may_come & keeps
        a_everywhere = (per_node.groups_holding()[rows_A1, a_AS.clip(0)] == search.nodes)[:, :, None]
        replace_ok = base & b_spare & ~b_alone & (~a_there | a_everywhere)
    else:
        swap_ok, replace_ok = base & b_may_come, base & b_spare
    # estimates: tokens move with their experts; a new copy of a takes up to half the gap
    y_h = y_AG[rows_A1, h_AQ][:, None, :]
    est_swap = np.maximum(np.maximum(y_g - x_a + x_b, y_h - x_b + x_a), untouched)
    shift = np.clip((y_g - y_h + x_b) / 2, 0, x_a)
    est_replace = np.maximum(np.maximum(y_g - shift, y_h - x_b + shift), untouched)
    est_AX = np.stack([np.where(swap_ok, est_swap, np.inf), np.where(replace_ok, est_replace, np.inf)],
                      1).reshape(A, -1)
    K = min(K, est_AX.shape[1])
    if K == 1:
        pick_AK = est_AX.argmin(1)[:, None]
    else:
        part = np.argpartition(est_AX, K - 1, 1)[:, :K]
        pick_AK = np.take_along_axis(part, np.argsort(np.take_along_axis(est_AX, part, 1), 1, kind="stable"), 1)
    return pick_AK, np.take_along_axis(est_AX, pick_AK, 1) < np.inf, p_AS, q_AQ


def _candidates(pick_AK, phy_AP, x_AP, p_AS, q_AQ):
    """The moves pick_AK [A, K] (see `_screen`) applied to copies: cphy_AKP, cx_AKP (tokens follow their
    experts, a new copy starts empty)."""
    A, K = len(phy_AP), pick_AK.shape[1]
    rows_A1 = np.arange(A)[:, None]
    Sp, Q = p_AS.shape[1], q_AQ.shape[1]
    kind, s, qi = pick_AK // (Sp * Q), pick_AK // Q % Sp, pick_AK % Q
    p = np.take_along_axis(p_AS, s, 1)
    q = np.take_along_axis(q_AQ, qi, 1)
    cphy_AKP = np.repeat(phy_AP[:, None, :], K, 1)
    cx_AKP = np.repeat(x_AP[:, None, :], K, 1)
    a_AK, b_AK = phy_AP[rows_A1, p], phy_AP[rows_A1, q]
    xa_AK, xb_AK = x_AP[rows_A1, p], x_AP[rows_A1, q]
    rr, kk = np.broadcast_to(rows_A1, (A, K)), np.broadcast_to(np.arange(K), (A, K))
    swap = kind == 0
    cphy_AKP[rr, kk, q] = a_AK
    cphy_AKP[rr, kk, p] = np.where(swap, b_AK, a_AK)
    cx_AKP[rr, kk, q] = np.where(swap, xa_AK, 0.0)
    cx_AKP[rr, kk, p] = np.where(swap, xb_AK, xa_AK)
    return cphy_AKP, cx_AKP


def _confirm(search: _Search, active, phy_LP, x_LP, cphy_AKP, cx_AKP, legal_AK, move_cost_L) -> np.ndarray:
    """Steer the candidates beside the current placements (the same iterations for both, so a move never
    wins by extra iterations alone); keep each layer's best move when it lowers the slowest device
    (ties: the sum of squares). Updates phy_LP and x_LP in place; returns the layers still improving."""
    A, K, P = cphy_AKP.shape
    phy_AP = phy_LP[active]
    rows = np.concatenate([np.repeat(active, K), active])
    both = search.steer(np.concatenate([cx_AKP.reshape(A * K, P), x_LP[active]]),
                        np.concatenate([cphy_AKP.reshape(A * K, P), phy_AP]), rows, search.iters)
    cx, x_AP = both[:A * K], both[A * K:]
    x_LP[active] = x_AP
    cmax, csq = (np.where(legal_AK.ravel(), v, np.inf).reshape(A, K)
                 for v in search.score(cx, cphy_AKP.reshape(A * K, P), rows[:A * K], move_cost_L))
    pick, keep = best_moves(cmax, csq, *search.score(x_AP, phy_AP, active, move_cost_L), search.tol_L[active],
                            search.mean_L[active])
    phy_LP[active[keep]] = cphy_AKP[keep, pick[keep]]
    x_LP[active[keep]] = cx.reshape(A, K, P)[keep, pick[keep]]
    return active[keep]


def _settle(search: _Search, phy_LP, x_LP, phy0_LP, x0_LP):
    """Settle both splits and return a layer to the greedy plan where its moves did not pay after all:
    moves are confirmed on splits a few rounds from settled, which can mislead on slow layers."""
    n_iter = search.n_iter(len(phy_LP), 4 * search.iters)
    x_LP = steer_flows(x_LP, phy_LP, search.load_LE, search.S, n_iter)
    changed = np.flatnonzero((phy_LP != phy0_LP).any(1))
    if changed.size:
        x0 = steer_flows(x0_LP[changed], phy0_LP[changed], search.load_LE[changed], search.S, n_iter)
        shape = (len(changed), search.G, search.S)
        back = x_LP[changed].reshape(shape).sum(2).max(1) > x0.reshape(shape).sum(2).max(1) + search.tol_L[changed]
        phy_LP[changed[back]], x_LP[changed[back]] = phy0_LP[changed[back]], x0[back]
    return phy_LP, x_LP
