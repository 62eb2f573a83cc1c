"""Workloads for the simulator: routed counts per step, layer, source rank and expert.

Shape legend: N steps, L layers, G devices (= source ranks), E logical experts.

    w = synthetic_workload("skewed_correlated", layers=32, experts=64, devices=8)
    w = trace_workload(load_trace("balance.jsonl"), devices=8)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Workload", "synthetic_workload", "trace_workload", "WORKLOADS"]


@dataclass
class Workload:
    name: str
    counts_NLGE: torch.Tensor        # routes per step, layer, source rank, expert
    weight_G: torch.Tensor = None    # per-source cost weight (mixed sequence lengths), default 1
    k: int = 2

    def __post_init__(self):
        if self.weight_G is None:
            self.weight_G = torch.ones(self.counts_NLGE.shape[2], dtype=torch.float64)


def _zipf_probs(E: int, s: float) -> torch.Tensor:
    return 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** s


def synthetic_workload(name: str = "skewed_correlated", layers: int = 32, experts: int = 64, devices: int = 8,
                       steps: int = 40, tokens_per_rank: int = 4096, k: int = 2, zipf: float = 1.1,
                       correlation: float = 0.8, drift: float = 0.0, mixed_lengths: bool = False,
                       seed: int = 0) -> Workload:
    """Zipf-skewed expert popularity per layer, hot experts shared across layers with probability
    `correlation` (so a static layout stacks the same hot device layer after layer), popularity that
    drifts by `drift` per step (fraction of the ranking that rotates), and optionally mixed sequence
    lengths (source ranks whose tokens cost 0.5x-2x)."""
    g = torch.Generator().manual_seed(seed)
    base = _zipf_probs(experts, zipf)
    shared = torch.randperm(experts, generator=g)
    perms = []
    for _ in range(layers):
        own = torch.randperm(experts, generator=g)
        keep = torch.rand(experts, generator=g) < correlation
        perm = torch.where(keep, shared, own)
        # repair duplicates so every layer's ranking is a permutation
        seen, out = set(), []
        for e in perm.tolist():
            out.append(e if e not in seen else -1)
            seen.add(e)
        missing = [e for e in own.tolist() if e not in seen]
        perms.append(torch.tensor([e if e >= 0 else missing.pop(0) for e in out]))
    rank_LE = torch.stack(perms)                                  # expert at popularity rank r
    logits_LE = torch.zeros(layers, experts, dtype=torch.float64)
    logits_LE.scatter_(1, rank_LE, base.log().expand(layers, -1))
    counts = []
    for _ in range(steps):
        if drift > 0:
            logits_LE = logits_LE + drift * torch.randn(layers, experts, generator=g, dtype=torch.float64) * 3
        p_LE = torch.softmax(logits_LE, 1)
        n = tokens_per_rank * k
        c = torch.stack([torch.multinomial(p_LE[l], n * devices, replacement=True, generator=g)
                         .view(devices, n) for l in range(layers)])             # [L, G, n] expert ids
        counts.append(torch.zeros(layers, devices, experts, dtype=torch.long).scatter_add_(
            2, c, torch.ones_like(c)))
    weight_G = None
    if mixed_lengths:
        weight_G = 2.0 ** (torch.rand(devices, generator=g, dtype=torch.float64) * 2 - 1)
    return Workload(name, torch.stack(counts), weight_G, k)


WORKLOADS = {
    "skewed_correlated": dict(),
    "drifting": dict(drift=0.05),
    "mixed_lengths": dict(mixed_lengths=True),
    "weakly_correlated": dict(correlation=0.2),
}


def trace_workload(trace_NLE: torch.Tensor, devices: int, name: str = "trace", k: int = 2) -> Workload:
    """Spread a logical trace [steps, layers, experts] evenly over `devices` source ranks
    (remainders go to consecutive ranks starting at the expert's own index, so no rank is favoured)."""
    c = torch.as_tensor(trace_NLE).round().long()
    N, L, E = c.shape
    base, rem = c // devices, c % devices
    src_G = torch.arange(devices)
    offset_GE = (src_G[:, None] - torch.arange(E)[None, :]) % devices          # rank's position for expert e
    counts = base[:, :, None, :] + (offset_GE[None, None] < rem[:, :, None, :]).long()
    return Workload(name, counts, k=k)
