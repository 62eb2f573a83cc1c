"""Per-batch steering: split each expert's tokens among its replicas (outputs unchanged), and the
opt-in near-tie re-routing to a different expert (outputs change; bounded and reported).

Shape legend: G devices (EP ranks, also the source ranks), E logical experts, R replicas per expert,
T tokens, K top-k.

    split_GER = steer(counts_GE, devices_ER, node_G, pressure_G=view_cross_G, weights=cfg.inference.weights,
                      topology="pcie", decision_batch=8)

The cost of sending a chunk of tokens from source rank s to a replica on device d is the EasyBalance article's
(the EasyBalance article, §2.2 and §4.2) weighted sum of normalised terms:
    intra  * load_so_far[d] / mean_load          this batch's load already on d (intra-layer heat)
  + cross  * pressure[d] / mean(pressure)       the view's cross-layer window pressure on d
  + comm   * hop(s, d)                          0 same rank, the topology's `node_hop` same node, 1 other node
  - comm   * aggregation * [s sends to d for another expert]   few, large messages (the EasyBalance article, §4.2)
Starting from the even split over replicas, each round lets every source rank in turn move, for
all its experts at once, tokens from its costliest replica to its cheapest one (never overshooting,
never fewer than `decision_batch` tokens per decision): at most ROUNDS x G vectorised steps per
layer, never a Python loop over tokens.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..core.topology import TOPOLOGIES, hop_cost
from .slots import integer_tensor, is_real, real_tensor

__all__ = ["steer", "even_split", "reroute_near_ties"]


# The improvement loop's constants: rounds of G source moves at most; the aggregation bonus (a fraction of the
# comm weight) for a device the source already sends other experts' tokens to; a move closes the cost gap by
# 1 / OVERSHOOT_GUARD of its size (2: the two costs meet).
ROUNDS = 16
AGGREGATION = 0.5
OVERSHOOT_GUARD = 2.0


def steer(counts_GE: torch.Tensor, devices_ER: torch.Tensor, node_G: torch.Tensor, *,
          pressure_G: torch.Tensor | None = None, weights=None, topology: str = "pcie",
          decision_batch: int = 8, weight_G: torch.Tensor | None = None) -> torch.Tensor:
    """Tokens from each source rank to each replica of each expert. -> split_GER [G, E, R] (long)

    counts_GE: [G, E] tokens source rank s routes to logical expert e (this batch, this layer).
    devices_ER: [E, R] device of each replica, -1 padded (e.g. Placement.expert_devices()[layer]).
    node_G: [G] node of each rank. pressure_G: [G] the view's cross-layer pressure (None = none).
    topology: a `TOPOLOGIES` key (hop cost); weights: (intra, cross, comm), e.g.
    `EasyBalanceConfig.inference.weights`; None = the topology's preset.
    decision_batch: the fewest tokens one decision moves (fewer: the chunk stays).
    weight_G: [G] cost of one token from each source (sequence-length weighting); None = 1.
    Conserves tokens (split_GER.sum(2) == counts_GE) and uses only existing replicas.
    """
    counts_GE, devices_ER, node_G, pressure_G, weight_G = _checked_maps(counts_GE, devices_ER, node_G, pressure_G,
                                                                        weight_G)
    w_intra, w_cross, w_comm = _checked_options(weights, topology, decision_batch)
    # Start from the even split over replicas (EPLB's assumption), then improve it.
    split_GER = even_split(counts_GE, devices_ER)
    if bool(((devices_ER >= 0).sum(1) == 1).all()):  # no replicas anywhere: nothing to decide
        return split_GER
    static_GER = _static_costs(devices_ER, node_G, pressure_G, topology, w_cross, w_comm)
    w_G = np.ones(counts_GE.shape[0]) if weight_G is None else weight_G.numpy()
    # The improvement loop runs in NumPy (a few us per call against torch's ~10): G steps per round.
    split = split_GER.numpy().copy()
    _improve(split, devices_ER.clamp_min(0).numpy(), static_GER.numpy(), w_G, w_intra, w_comm, decision_batch)
    return torch.from_numpy(split)


def _static_costs(devices_ER, node_G, pressure_G, topology: str, w_cross: float, w_comm: float) -> torch.Tensor:
    """The terms of the cost that no move changes: cross-layer pressure and hops. -> [G, E, R] float64 (inf on
    padding)"""
    E, R = devices_ER.shape
    dev_ER = devices_ER.clamp_min(0)
    hop_GER = hop_cost(node_G, TOPOLOGIES[topology].node_hop)[:, dev_ER]
    if pressure_G is None:
        cross_term_ER = torch.zeros(E, R, dtype=torch.float64)
    else:
        cross_term_ER = (pressure_G / pressure_G.mean().clamp_min(1e-12))[dev_ER]
    static_GER = w_cross * cross_term_ER[None] + w_comm * hop_GER
    return torch.where((devices_ER >= 0)[None], static_GER, float("inf"))


def _improve(split, dev, static, w_G, w_intra: float, w_comm: float, decision_batch) -> None:
    """Improve `split` [G, E, R] in place: in each round every source rank in turn moves, for all its experts at
    once, tokens from its costliest replica to its cheapest one (`_source_moves`). Loads are updated between
    source ranks, so ranks do not all pile onto the same idle device; a move never overshoots (the load term
    would make the target the costlier one). Stops after ROUNDS rounds, or a round that moves nothing."""
    G, E, _ = split.shape
    load = np.zeros(G)
    np.add.at(load, dev.reshape(-1), (split * w_G[:, None, None]).sum(0).reshape(-1))
    mean_load = max(float(load.sum()) / G, 1e-9)
    e_idx = np.arange(E)
    for _ in range(ROUNDS):
        moved_any = False
        for s in range(G):    # source ranks (not tokens)
            src, dst, amount = _source_moves(split[s], dev, static[s], load, mean_load, w_G[s], w_intra, w_comm,
                                             decision_batch)
            if amount is None:
                continue
            moved_any = True
            split[s, e_idx, src] -= amount
            split[s, e_idx, dst] += amount
            np.add.at(load, dev[e_idx, src], -amount * w_G[s])
            np.add.at(load, dev[e_idx, dst], amount * w_G[s])
        if not moved_any:
            break


def _source_moves(split_ER, dev, static_ER, load, mean_load: float, w_s: float, w_intra: float, w_comm: float,
                  decision_batch):
    """One source's move for each expert: (from replica [E], to replica [E], tokens [E] long), or (.., None)
    where no expert moves at least `decision_batch` tokens (or all it has)."""
    G, E = load.shape[0], split_ER.shape[0]
    e_idx = np.arange(E)
    sends = np.zeros(G)
    np.add.at(sends, dev.reshape(-1), split_ER.reshape(-1))
    # aggregation: a replica on a device this source already sends other experts' tokens to costs less,
    # so a chunk that alone opens a message moves where a message goes anyway (its own chunk does
    # not count, or the even split's chunks would hold every replica in place)
    others_ER = sends[dev] - split_ER
    cost = static_ER + w_intra * (load / mean_load)[dev] - (w_comm * AGGREGATION) * (others_ER > 0)
    src = np.where(split_ER > 0, cost, -np.inf).argmax(1)
    dst = cost.argmin(1)
    gain = cost[e_idx, src] - cost[e_idx, dst]
    avail = split_ER[e_idx, src].astype(np.float64)
    moving = gain > 1e-9
    if not moving.any():
        return src, dst, None
    if w_intra > 0:
        # moving x tokens closes the gap by 2 * w_intra * x * w_s / mean_load: with OVERSHOOT_GUARD 2 a move
        # stops where the two costs meet; experts of this source moving between the same devices share that gap
        limit = np.minimum(avail, gain * mean_load / (OVERSHOOT_GUARD * w_intra * w_s))
        src_dev, dst_dev = dev[e_idx, src], dev[e_idx, dst]
        n_dst = np.maximum(np.bincount(dst_dev[moving], minlength=G), 1)
        n_src = np.maximum(np.bincount(src_dev[moving], minlength=G), 1)
        limit = limit / np.maximum(n_dst[dst_dev], n_src[src_dev])
    else:
        limit = avail
    amount = np.floor(limit)
    amount = np.where(moving & (amount >= np.minimum(avail, decision_batch)), amount, 0).astype(np.int64)
    return src, dst, amount if amount.any() else None


def _checked_maps(counts_GE, devices_ER, node_G, pressure_G, weight_G):
    """The tensors of `steer`, typed (long counts and ids, float64 pressures and weights) and checked."""
    counts_GE = integer_tensor("counts_GE", counts_GE, "[ranks, experts]")
    devices_ER = integer_tensor("devices_ER", devices_ER, "[experts, replicas]")
    G, E = counts_GE.shape
    if G < 1 or bool((counts_GE < 0).any()):
        raise ValueError(f"counts_GE must be non-negative token counts from at least one rank, got shape {(G, E)}")
    if devices_ER.shape[0] != E or devices_ER.shape[1] < 1:
        raise ValueError(f"devices_ER must be [experts, replicas] for counts_GE's {E} experts, got {tuple(devices_ER.shape)}")
    if bool((devices_ER[:, 0] < 0).any()):
        raise ValueError("every expert needs at least one replica (devices_ER[:, 0] >= 0)")
    if bool((devices_ER < -1).any()) or bool((devices_ER >= G).any()):
        raise ValueError(f"devices_ER holds device ids outside [0, {G}) (-1 pads)")
    if bool(((devices_ER[:, :-1] < 0) & (devices_ER[:, 1:] >= 0)).any()):
        raise ValueError("devices_ER pads with -1 only after an expert's replicas (a -1 mid-row would lose tokens)")
    node_G = integer_tensor("node_G", node_G, "[ranks]")
    if node_G.shape[0] != G:
        raise ValueError(f"node_G has {node_G.shape[0]} ranks, counts_GE {G}")
    per_rank = []
    for name, v in (("pressure_G", pressure_G), ("weight_G", weight_G)):
        t = None if v is None else real_tensor(name, v, "[ranks]")
        if t is not None and t.shape != (G,):
            raise ValueError(f"{name} must be a real [{G}] tensor (one per rank), got shape {tuple(t.shape)}")
        per_rank.append(t)
    return counts_GE, devices_ER, node_G, *per_rank


def _checked_options(weights, topology, decision_batch) -> tuple:
    """(w_intra, w_cross, w_comm) after checking `steer`'s options; ValueError naming the bad one."""
    if not isinstance(topology, str) or topology not in TOPOLOGIES:
        raise ValueError(f"topology ({topology!r}) must be one of {sorted(TOPOLOGIES)}")
    if weights is None:
        weights = TOPOLOGIES[topology].weights
    if hasattr(weights, "intra"):
        weights = (weights.intra, weights.cross, weights.comm)
    given = weights
    weights = tuple(weights) if isinstance(weights, (tuple, list, np.ndarray)) else (weights,)
    if not (len(weights) == 3 and all(is_real(w) and math.isfinite(w) and w >= 0 for w in weights)):
        raise ValueError(f"weights ({given!r}) must be three finite non-negative numbers (intra, cross, comm)")
    if not (is_real(decision_batch) and decision_batch >= 1):
        raise ValueError(f"decision_batch ({decision_batch!r}) must be a number >= 1")
    return tuple(float(w) for w in weights)


def even_split(counts_GE: torch.Tensor, devices_ER: torch.Tensor) -> torch.Tensor:
    """Each source's tokens for an expert divided evenly over its replicas -> [G, E, R] (long)."""
    valid_ER = devices_ER >= 0
    n_E = valid_ER.sum(1).clamp_min(1)
    base, rem = counts_GE // n_E, counts_GE % n_E
    r_idx = torch.arange(devices_ER.shape[1])
    return (base[:, :, None] + (r_idx[None, None, :] < rem[:, :, None]).long()) * valid_ER[None]


def split_device_loads(split_GER: torch.Tensor, devices_ER: torch.Tensor, num_devices: int) -> torch.Tensor:
    """Tokens each device processes: [G, E, R] split -> [G] load."""
    dev_ER = torch.as_tensor(devices_ER).clamp_min(0)
    per_ER = split_GER.sum(0).to(torch.float64)
    return torch.zeros(num_devices, dtype=torch.float64).index_add_(0, dev_ER.reshape(-1), per_ER.reshape(-1))


def reroute_near_ties(topk_idx_TK: torch.Tensor, probs_TE: torch.Tensor, device_load_G: torch.Tensor,
                      expert_device_E: torch.Tensor, gap: float) -> tuple[torch.Tensor, float]:
    """Seed 000's candidate-expert steering, opt-in: move a route to a different expert whose gate
    probability is within `gap` of the chosen one and whose device is less loaded.

    This changes the model's output (a different expert computes the token), so it is bounded by
    `gap` and reported: returns (new topk_idx [T, K], fraction of routes changed). The token's
    own other choices are never picked (no expert twice per token). Vectorised over tokens.
    """
    T, K = topk_idx_TK.shape
    if T == 0 or gap <= 0:
        return topk_idx_TK.clone(), 0.0
    dev_load_E = torch.as_tensor(device_load_G, dtype=torch.float64)[expert_device_E]
    chosen_TE = torch.zeros_like(probs_TE, dtype=torch.bool).scatter_(1, topk_idx_TK, True)
    p_TK = probs_TE.gather(1, topk_idx_TK)
    new = topk_idx_TK.clone()
    for k in range(K):  # K is the top-k (1..8), not tokens
        ok_TE = (~chosen_TE) & (probs_TE >= (p_TK[:, k:k + 1] - gap))
        score_TE = torch.where(ok_TE, dev_load_E[None, :].expand(T, -1), float("inf"))
        best_T = score_TE.argmin(1)
        better_T = score_TE.gather(1, best_T[:, None]).squeeze(1) < dev_load_E[new[:, k]]
        chosen_TE.scatter_(1, new[:, k:k + 1], ~better_T[:, None] & chosen_TE.gather(1, new[:, k:k + 1]))
        new[:, k] = torch.where(better_T, best_T, new[:, k])
        chosen_TE.scatter_(1, new[:, k:k + 1], True)
    return new, float((new != topk_idx_TK).float().mean())
