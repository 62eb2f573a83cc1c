"""Exact answers for tiny inputs, for tests and `python -m benchmarks optimum`: what steering can reach on a
placement, and the best placement of all.

Shape legend: G devices, E logical experts, S slots per device.

    steered_max_load(holds_GE, load_E)        # slowest device when tokens split freely over replicas
    brute_force_optimum(load_E, G, S)         # the best of it over every legal filling of the slots

Both are exponential (in E, and in G * S): tiny inputs only. The planner's own estimate of the same
quantity is `flows.steer_flows`, tested against these.
"""
from __future__ import annotations

import itertools

__all__ = ["steered_max_load", "brute_force_optimum"]


def steered_max_load(holds_GE, load_E) -> float:
    """Slowest device's load when steering splits each expert's tokens freely among its replicas.

    holds_GE: [G][E] bools (device g holds expert e); load_E: [E] tokens. By Hall's theorem
    (supply and demand on a bipartite graph with unbounded edges) the optimum is the max over
    expert subsets A of load(A) / |devices holding any expert of A|. Exponential in E: tiny inputs.
    """
    E = len(load_E)
    best = 0.0
    for mask in range(1, 2 ** E):
        A = [e for e in range(E) if mask >> e & 1]
        devices = {d for d in range(len(holds_GE)) for e in A if holds_GE[d][e]}
        best = max(best, sum(load_E[e] for e in A) / len(devices))
    return best


def brute_force_optimum(load_E, G: int, S: int) -> float:
    """The best steered max load over every legal filling of G * S slots (no expert twice on a device,
    every expert at least once, every slot used)."""
    E, P = len(load_E), G * S
    best = float("inf")
    seen = set()
    for assign in itertools.product(range(E), repeat=P):
        per_dev = [frozenset(assign[d * S:(d + 1) * S]) for d in range(G)]
        if any(len(d) < S for d in per_dev) or len(set(assign)) < E:
            continue
        key = tuple(sorted(tuple(sorted(d)) for d in per_dev))
        if key in seen:
            continue
        seen.add(key)
        best = min(best, steered_max_load([[e in d for e in range(E)] for d in per_dev], load_E))
    return best
