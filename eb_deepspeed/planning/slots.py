"""Helpers shared by the planner's steps and steering: tables of the replicas in the physical slots (`SlotCounts`),
what a round of local search looks at and keeps, and the checks that turn a caller's tensors into typed ones.

Shape legend: N rows (layers, or candidate placements), P physical slots (G * S; slot p lives on
device p // S), G devices, S slots per device, E logical experts, H groups of slots (devices or nodes),
A rows still improving, M partner devices, Q partner slots, K candidates per row."""
from __future__ import annotations

import copy
import math
import numbers

import numpy as np
import torch

__all__ = []

DENSE_PER_SLOT = 8          # a dense table while it holds at most this many entries per slot ...
DENSE_ANYWAY = 1 << 16      # ... or at most this many in all
PAIRS_PER_SLOT = 16         # the local searches pair at most this many slots x partner slots per slot of a layer
CHUNK_PAIRS = 1 << 21       # ... and screen at most this many pairs at once (more rows: in chunks)


def holds_mask(phy_NP: np.ndarray, S: int, E: int) -> np.ndarray:
    """holds_NGE [N, G, E] bool from phy_NP [N, P] (-1 = empty): device g holds a replica of expert e (dense:
    for small inputs and tests; the planner uses `SlotCounts`)."""
    N, P = phy_NP.shape
    h = np.zeros((N, P // S, E + 1), dtype=bool)
    h[np.arange(N)[:, None], np.arange(P)[None, :] // S, phy_NP + 1] = True
    return h[:, :, 1:]


def move_slots(w_AP: np.ndarray, g_A: np.ndarray, h_AM: np.ndarray, S: int) -> tuple[np.ndarray, np.ndarray]:
    """The slots a local search pairs: p_AS' on each row's slowest device g_A [A], q_AQ' on its partners
    h_AM [A, M]. All of them (S and M * S) while S x M * S <= PAIRS_PER_SLOT x P; beyond that (few
    devices with many slots each) the n heaviest of g*'s slots by w_AP [A, P] and the m lightest
    partner slots, n x m <= PAIRS_PER_SLOT x P, so the search's memory stays linear in the slots."""
    A, P = w_AP.shape
    M = h_AM.shape[1]
    p_AS = g_A[:, None] * S + np.arange(S)
    q_AQ = (h_AM[:, :, None] * S + np.arange(S)).reshape(A, M * S)
    pairs = PAIRS_PER_SLOT * P
    if S * M * S <= pairs:
        return p_AS, q_AQ
    n = min(S, math.isqrt(pairs))
    rows = np.arange(A)[:, None]
    return _lightest(p_AS, -w_AP[rows, p_AS], n), _lightest(q_AQ, w_AP[rows, q_AQ], min(M * S, pairs // n))


class MoveFrame:
    """What a round of local search looks at in rows phy_AP [A, P] with slot loads w_AP [A, P]: device loads y_AG,
    the slowest device g [A], its slots p_AS' and those q_AQ of its M least loaded partners (`move_slots`, on
    devices h_AQ), their experts a_AS and b_AQ (-1 = empty), and the replicas per device (`holds`)."""

    def __init__(self, phy_AP: np.ndarray, w_AP: np.ndarray, G: int, S: int, M: int, E: int):
        (A, P), rows = phy_AP.shape, np.arange(len(phy_AP))[:, None]
        self.phy_AP, self.w_AP, self.A, self.P, self.E, self.G, self.S, self.rows = phy_AP, w_AP, A, P, E, G, S, rows
        self.y_AG = w_AP.reshape(A, G, S).sum(2)
        self.rank_AG = np.argsort(self.y_AG, 1, kind="stable")
        self.g = self.rank_AG[:, -1]
        self.p_AS, self.q_AQ = move_slots(w_AP, self.g, self.rank_AG[:, :M], S)
        self.h_AQ = self.q_AQ // S
        self.a_AS, self.b_AQ = phy_AP[rows, self.p_AS], phy_AP[rows, self.q_AQ]
        self.holds = SlotCounts.devices(phy_AP, S, E)


def row_chunks(A: int, S: int, M: int, P: int) -> list[slice]:
    """Slices of A rows that screen at most CHUNK_PAIRS (slot, partner slot) pairs each (one row at least)."""
    step = max(1, CHUNK_PAIRS // max(1, min(S * M * S, PAIRS_PER_SLOT * P)))
    return [slice(i, i + step) for i in range(0, A, step)]


def _lightest(slots_AX: np.ndarray, w_AX: np.ndarray, n: int) -> np.ndarray:
    """[A, n] the n slots of each row with the smallest w, in slot order."""
    if n >= slots_AX.shape[1]:
        return slots_AX
    part = np.argpartition(w_AX, n - 1, 1)[:, :n]
    return np.sort(np.take_along_axis(slots_AX, part, 1), 1)


class SlotCounts:
    """Replicas of each expert per (row, group) of phy_NP [N, P] (-1 = empty); group_NP: [P] or [N, P] group of
    each slot in [0, H) (its device p // S, or its node). counts(rows, groups, experts) -> int64 counts, the
    three broadcast together (expert -1: 0); `select(rows_A)` re-indexes the rows without copying. A dense
    [N, H, E] table while it holds at most DENSE_PER_SLOT entries per slot (or few in all), else the sorted keys
    of the occupied (row, group, expert) triples: memory linear in the slots either way."""

    def __init__(self, phy_NP: np.ndarray, group_NP: np.ndarray, H: int, E: int):
        N, P = phy_NP.shape
        self.N, self.H, self.E = N, H, E
        self.row_map = self.seg_key = None
        key = ((np.arange(N)[:, None] * H + group_NP) * (E + 1) + phy_NP + 1)[phy_NP >= 0]
        self.dense = N * H * (E + 1) <= max(DENSE_ANYWAY, DENSE_PER_SLOT * N * P)
        if self.dense:
            self.table = np.bincount(key, minlength=N * H * (E + 1))
        else:   # a key -1 that nothing matches keeps the search in bounds when no slot is occupied
            self.keys, self.table = np.unique(np.append(key, -1), return_counts=True)
            self.table[0] = 0

    @classmethod
    def devices(cls, phy_NP: np.ndarray, S: int, E: int) -> SlotCounts:
        """Replicas per (row, device, expert)."""
        return cls(phy_NP, np.arange(phy_NP.shape[1]) // S, phy_NP.shape[1] // S, E)

    @classmethod
    def nodes(cls, phy_NP: np.ndarray, node_G: np.ndarray, S: int, E: int) -> SlotCounts:
        """Replicas per (row, node, expert); node_G: [G] or [N, G] node of each device."""
        return cls(phy_NP, node_G[..., np.arange(phy_NP.shape[1]) // S], int(node_G.max()) + 1, E)

    def select(self, rows_A: np.ndarray) -> SlotCounts:
        view = copy.copy(self)
        view.row_map = np.asarray(rows_A) if self.row_map is None else self.row_map[rows_A]
        return view

    def counts(self, rows, groups, experts) -> np.ndarray:
        rows = np.asarray(rows) if self.row_map is None else self.row_map[rows]
        key = (rows * self.H + groups) * (self.E + 1) + experts + 1    # expert -1: a key no slot has
        if self.dense:
            return self.table[key]
        at = np.searchsorted(self.keys, key).clip(max=len(self.keys) - 1)
        return np.where(self.keys[at] == key, self.table[at], 0)

    def triples(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(row, group, expert, count) of every occupied triple, in key order (row-major)."""
        keys = np.flatnonzero(self.table) if self.dense else self.keys[1:]
        count = self.table[keys] if self.dense else self.table[1:]
        rest, expert = np.divmod(keys, self.E + 1)
        row, group = np.divmod(rest, self.H)
        return row, group, expert - 1, count

    def holders(self, rows_Q: np.ndarray, experts_Q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(query q, group) for every group that holds expert experts_Q[q] in row rows_Q[q], by query."""
        if self.seg_key is None:   # the triples by (row, expert), built on first use
            row, group, expert, _ = self.triples()
            key = row * self.E + expert
            order = np.argsort(key, kind="stable")
            self.seg_key, self.seg_group = key[order], group[order]
        rows_Q = rows_Q if self.row_map is None else self.row_map[rows_Q]
        want = rows_Q * self.E + experts_Q
        lo, hi = np.searchsorted(self.seg_key, want, "left"), np.searchsorted(self.seg_key, want, "right")
        n_Q = hi - lo
        q = np.repeat(np.arange(len(want)), n_Q)
        return q, self.seg_group[np.arange(n_Q.sum()) - np.repeat(np.cumsum(n_Q) - n_Q - lo, n_Q)]

    def groups_holding(self) -> np.ndarray:
        """[N, E] how many groups of each row hold each expert (for the rows of `select`, those)."""
        row, _, expert, _ = self.triples()
        spread_NE = np.bincount(row * self.E + expert, minlength=self.N * self.E).reshape(self.N, self.E)
        return spread_NE if self.row_map is None else spread_NE[self.row_map]

    def new_pairs(self, was: SlotCounts) -> np.ndarray:
        """[N] (group, expert) pairs each row holds that `was` (indexed by the same rows) does not."""
        assert self.row_map is None, "new_pairs counts the rows of the table it is called on"
        row, group, expert, _ = self.triples()
        return np.bincount(row, weights=was.counts(row, group, expert) == 0, minlength=self.N)


def node_checks(per_node, a_AS: np.ndarray, b_AQ: np.ndarray, ng_A1: np.ndarray, nq_AQ: np.ndarray):
    """What node spread allows when expert a_AS [A, S] (on the slowest device, node ng_A1 [A, 1]) and b_AQ [A, Q]
    (in partner slots on nodes nq_AQ) trade places (-1 = empty); per_node(rows, nodes, experts): replicas per node.
    -> (swap_ASQ: neither leaves a node it alone covers for a node that holds it; a_alone [A, S, 1], b_alone
    [A, 1, Q]: the expert's only replica on its node; a_there [A, S, Q]: q's node holds a)."""
    rows = np.arange(len(a_AS))[:, None]
    a_id, b_id = a_AS.clip(0), b_AQ.clip(0)
    a_alone = ((a_AS >= 0) & (per_node(rows, ng_A1, a_id) == 1))[:, :, None]
    a_there = per_node(rows[:, :, None], nq_AQ[:, None, :], a_id[:, :, None]) > 0
    b_alone = ((b_AQ >= 0) & (per_node(rows, nq_AQ, b_id) == 1))[:, None, :]
    b_there = (per_node(rows, ng_A1, b_id) > 0)[:, None, :]
    cross = (nq_AQ != ng_A1)[:, None, :]
    return ~(cross & ((a_alone & a_there) | (b_alone & b_there))), a_alone, a_there, b_alone


def best_moves(score_AK: np.ndarray, sq_AK: np.ndarray, cur_A: np.ndarray, cur_sq_A: np.ndarray, tol_A: np.ndarray,
               mean_A: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's best candidate: the lowest score_AK [A, K] (within tol_A of it, the lowest sum of squared device
    loads sq_AK). -> (pick_A, keep: the rows whose pick lowers cur_A by more than tol_A, or keeps it and lowers
    cur_sq_A by more than tol_A x mean_A)."""
    best = score_AK.min(1)
    pick = np.where(score_AK <= best[:, None] + tol_A[:, None], sq_AK, np.inf).argmin(1)
    tied = (best <= cur_A + tol_A) & (sq_AK[np.arange(len(pick)), pick] < cur_sq_A - tol_A * mean_A)
    return pick, np.flatnonzero(((best < cur_A - tol_A) | tied) & np.isfinite(best))


def checked_load(name: str, load_LE, plan) -> torch.Tensor:
    """load_LE as float64 [L, E] for `plan`'s layers and experts (finite, non-negative)."""
    if not hasattr(plan, "phy2log") or not hasattr(plan, "logcnt"):
        raise TypeError(f"plan must be a Placement, got {type(plan).__name__}")
    load_LE = real_tensor(name, load_LE, "[layers, experts]")
    if load_LE.shape != plan.logcnt.shape:
        raise ValueError(f"{name} must be [layers, experts] = {tuple(plan.logcnt.shape)} for this plan, got "
                         f"{tuple(load_LE.shape)}")
    return load_LE


def real_tensor(name: str, value, shape: str) -> torch.Tensor:
    """`value` (a tensor, NumPy array or nested list) as a float64 CPU tensor, finite and non-negative, with
    as many dimensions as `shape` names (e.g. "[layers, experts]"). TypeError / ValueError naming `name`."""
    t = _numbers(name, value, shape, "real numbers").to(torch.float64)
    if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
        raise ValueError(f"{name} must be finite and non-negative")
    return t


def integer_tensor(name: str, value, shape: str) -> torch.Tensor:
    """`value` as an int64 CPU tensor with as many dimensions as `shape` names; floats only when they hold
    whole finite numbers (below 2**62). TypeError / ValueError naming `name`."""
    t = _numbers(name, value, shape, "integers")
    if t.is_floating_point():
        if not bool(torch.isfinite(t).all()) or bool((t != t.round()).any()) or bool((t.abs() >= 2.0 ** 62).any()):
            raise ValueError(f"{name} must hold whole numbers (no NaN, inf or fractions)")
    return t.to(torch.long)


def _numbers(name: str, value, shape: str, what: str) -> torch.Tensor:
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):     # objects, strings, ragged lists, None
        kind = f"a NumPy array of {value.dtype}" if isinstance(value, np.ndarray) else type(value).__name__
        raise TypeError(f"{name} must be a tensor, NumPy array or nested list of {what} {shape}, got {kind}") from None
    dims = shape.count(",") + 1
    if t.dim() != dims:
        raise ValueError(f"{name} must be {shape} ({dims} dimension{'s' * (dims > 1)}), got shape {tuple(t.shape)}")
    if t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} must hold {what}, got {t.dtype}")
    return t.detach().cpu()


def is_integer(value) -> bool:
    """A Python or NumPy integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))

