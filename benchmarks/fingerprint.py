"""Fingerprints of the pure parts' outputs, to show a refactor changed no decision.

    python -m benchmarks.fingerprint            # one hash per part, and the case counts

planner: plan_placement on a grid of loads x shapes x dispatch models x previous plans (phy2log, log2phy, logcnt);
steering: steer on a grid of counts x replica layouts; simulator: every strategy's table on a grid of
workloads x topologies. Each hash is SHA-1 over the outputs' bytes (JSON for the tables).
"""
from __future__ import annotations

import hashlib
import itertools
import json

import numpy as np
import torch

from eb_deepspeed.planning.placement import plan_placement, static_placement
from eb_deepspeed.planning.steering import steer


def _loads(seed: int, L: int, E: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    zipf = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** (0.5 + seed % 3 * 0.4)
    rows = [zipf[torch.randperm(E, generator=g)] * (1000 + 500 * torch.rand(1, generator=g, dtype=torch.float64))
            for _ in range(L)]
    return torch.stack(rows).round()


def planner_cases():
    shapes = [(4, 8, 2, 5), (4, 8, 4, 3), (6, 16, 4, 5), (3, 16, 8, 3), (2, 12, 3, 6), (5, 32, 8, 5)]
    for seed, (L, E, G, S), dispatch, nodes, prev in itertools.product(
            range(6), shapes, ("steered", "uniform", "padded"), (1, 2), (False, True)):
        if G % nodes:
            continue
        load = _loads(seed, L, E)
        previous = None
        if prev:
            previous = plan_placement(_loads(seed + 100, L, E), G, S, num_nodes=nodes, dispatch=dispatch)
        yield (load, G, S, dict(num_nodes=nodes, dispatch=dispatch, previous=previous))


def steering_cases():
    for seed, (G, E, S), nodes in itertools.product(range(6), ((2, 8, 6), (4, 8, 3), (4, 16, 6), (8, 16, 3)), (1, 2)):
        plan = plan_placement(_loads(seed, 1, E), G, S, num_nodes=nodes)
        counts_GE = torch.randint(0, 60, (G, E), generator=torch.Generator().manual_seed(seed))
        yield counts_GE, plan.expert_devices()[0]


def _sha(parts) -> str:
    h = hashlib.sha1()
    for part in parts:
        h.update(part if isinstance(part, bytes) else np.ascontiguousarray(part).tobytes())
    return h.hexdigest()


def planner_hash() -> tuple[int, str]:
    parts, n = [], 0
    for load, G, S, kw in planner_cases():
        plan = plan_placement(load, G, S, **kw)
        parts += [plan.phy2log.numpy(), plan.log2phy.numpy(), plan.logcnt.numpy()]
        n += 1
    return n, _sha(parts)


def steering_hash() -> tuple[int, str]:
    parts, n = [], 0
    for counts, devices in steering_cases():
        parts.append(steer(counts, devices).numpy())
        n += 1
    return n, _sha(parts)


def simulator_hash() -> tuple[int, str]:
    from benchmarks import sim
    parts, n = [], 0
    for name, topology in itertools.product(("skewed_correlated", "drifting", "mixed_lengths", "weakly_correlated"), ("pcie", "multi_node")):
        if name not in sim.WORKLOADS:
            continue
        w = sim.synthetic_workload(name, layers=8, experts=16, devices=4, steps=12, seed=1, **sim.WORKLOADS[name])
        cfg = sim.SimConfig(model=sim.ClusterModel(topology=sim.TOPOLOGIES[topology]))
        table = sim.run_table(w, cfg)
        parts.append(json.dumps(table, sort_keys=True).encode())
        n += 1
    return n, _sha(parts)


if __name__ == "__main__":
    for name, fn in (("planner", planner_hash), ("steering", steering_hash), ("simulator", simulator_hash)):
        n, digest = fn()
        print(f"{name}: {n} cases, sha1 {digest}")
