"""Our planner against DeepSeek's EPLB (a port, `eplb_port.py`), side by side in one run.

    python -m benchmarks.plan_vs_eplb [--json] [--quick] [--out FILE]

For every load matrix in `cases()` (several seeds each) both planners place the same replicas, and
each placement is judged under both dispatch models by one judge (`exact.py`):
  uniform   each expert's tokens split evenly over its replicas (vLLM, SGLang, EPLB assume this);
  steered   tokens split freely over replicas, the slowest device solved exactly (a linear program).
Ours runs with dispatch="uniform" for the uniform column and dispatch="steered" for the steered one;
EPLB runs its global policy and, where its hierarchical policy applies (nodes divide groups), that too.
Balancedness: aggregate (sum over layers of mean / sum of max device load) and worst layer (min of
mean / max). Then the timing: median planner time at 61 x 256 x 64 (5 slots, 8 nodes) for ours and for
EPLB's port in the same run, and ours at 128 devices x 384 experts.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch

from eb_deepspeed.planning.placement import plan_placement

from .eplb_port import rebalance_experts, rebalance_global
from .exact import balancedness_of, steered_max, uniform_loads

__all__ = ["cases", "compare_case", "time_planners", "main"]


def _zipf(L: int, E: int, rng: np.random.Generator, s: float, correlated: float) -> np.ndarray:
    """Zipf(s) expert loads; `correlated` in [0, 1]: how much layers share one ranking of hot experts."""
    base = 1.0 / np.arange(1, E + 1) ** s
    shared = rng.permutation(E)
    out = np.empty((L, E))
    for l in range(L):
        perm = shared if rng.random() < correlated else rng.permutation(E)
        out[l, perm] = base * rng.uniform(0.8, 1.25, E)
    return out * 1e4


def _deepseek_like(L: int, E: int, groups: int, rng: np.random.Generator) -> np.ndarray:
    """DeepSeek-V3-like loads: node-limited group routing (some groups hotter), log-normal experts
    within groups, a persistent ranking across layers with per-layer drift."""
    group_heat = rng.lognormal(0.0, 0.5, groups)
    expert_heat = rng.lognormal(0.0, 0.8, E)
    out = np.empty((L, E))
    for l in range(L):
        g = group_heat * rng.lognormal(0.0, 0.3, groups)
        out[l] = np.repeat(g, E // groups) * expert_heat * rng.lognormal(0.0, 0.5, E)
    return out * 1e4 / out.mean()


EPLB_README = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
               [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]


def cases(quick: bool = False) -> list[dict]:
    """Load matrices: name, load [L, E], devices G, slots per device S, nodes, EPLB groups."""
    seeds = range(2) if quick else range(4)
    out = [dict(name="eplb-readme 2x12, 8 dev, 2 nodes", load=np.array(EPLB_README, float), G=8, S=2, nodes=2,
                groups=4, seed=0)]
    for seed in seeds:
        rng = np.random.default_rng(seed)
        out += [
            dict(name="zipf 24x64, 16 dev", load=_zipf(24, 64, rng, 1.0, 0.0), G=16, S=5, nodes=1, groups=1),
            dict(name="zipf correlated 24x64, 16 dev, 2 nodes", load=_zipf(24, 64, rng, 1.0, 0.9), G=16, S=5,
                 nodes=2, groups=8),
            dict(name="zipf 1.2 correlated 16x128, 32 dev, 4 nodes", load=_zipf(16, 128, rng, 1.2, 0.8), G=32, S=5,
                 nodes=4, groups=8),
            dict(name="mixtral-like 32x8, 4 dev", load=_zipf(32, 8, rng, 0.8, 0.5), G=4, S=3, nodes=1, groups=1),
            dict(name="deepseek-like 58x256, 32 dev, 4 nodes", load=_deepseek_like(58, 256, 8, rng), G=32, S=9,
                 nodes=4, groups=8),
        ]
        if not quick:
            out.append(dict(name="deepseek-like 58x256, 64 dev, 8 nodes", load=_deepseek_like(58, 256, 8, rng),
                            G=64, S=5, nodes=8, groups=8))
        for c in out[-6:]:
            c.setdefault("seed", seed)
    return out


def _judge(phy_LP, load_LE, G: int, S: int) -> dict:
    uni = uniform_loads(phy_LP, load_LE, S).max(1)
    ste = steered_max(phy_LP, load_LE, S)
    ua, uw = balancedness_of(uni, load_LE, G)
    sa, sw = balancedness_of(ste, load_LE, G)
    return {"uniform": [round(ua, 5), round(uw, 5)], "steered": [round(sa, 5), round(sw, 5)]}


def compare_case(case: dict) -> dict:
    """Every planner on one case, judged under both dispatch models: {planner: {dispatch: [agg, worst]}}."""
    load, G, S, nodes = case["load"], case["G"], case["S"], case["nodes"]
    w = torch.from_numpy(load)
    row = {"name": case["name"], "seed": case["seed"]}
    ours_u = plan_placement(w, G, S, num_nodes=nodes, dispatch="uniform")
    ours_s = plan_placement(w, G, S, num_nodes=nodes, dispatch="steered")
    row["ours"] = {"uniform": _judge(ours_u.phy2log, load, G, S)["uniform"],
                   "steered": _judge(ours_s.phy2log, load, G, S)["steered"]}
    row["eplb_global"] = _judge(rebalance_global(w, G * S, G)[0], load, G, S)
    if case["groups"] % nodes == 0 and load.shape[1] % case["groups"] == 0 and nodes > 1:
        row["eplb_hierarchical"] = _judge(rebalance_experts(w, G * S, case["groups"], nodes, G)[0], load, G, S)
    return row


def _verdict(rows: list[dict]) -> dict:
    """Per dispatch: cases where ours is >= every EPLB policy on both aggregate and worst layer."""
    out = {}
    for d in ("uniform", "steered"):
        losses = []
        for r in rows:
            for pol in ("eplb_global", "eplb_hierarchical"):
                if pol in r and (r["ours"][d][0] < r[pol][d][0] - 1e-6 or r["ours"][d][1] < r[pol][d][1] - 1e-6):
                    losses.append(f"{r['name']} seed {r['seed']} vs {pol}")
        out[d] = {"cases": len(rows), "ours_ge_eplb": len(rows) - len({x.rsplit(' vs ', 1)[0] for x in losses}),
                  "losses": losses}
    return out


def time_planners(L: int = 61, E: int = 256, G: int = 64, S: int = 5, nodes: int = 8, groups: int = 8,
                  repeats: int = 5, eplb_repeats: int = 3) -> dict:
    """Median wall time of ours (both dispatch models) and of EPLB's port, in the same run."""
    rng = np.random.default_rng(0)
    w = torch.from_numpy(_deepseek_like(L, E, groups, rng))

    def med(fn, n):
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)

    out = {"shape": f"{L}x{E}x{G}", "slots_per_device": S, "nodes": nodes, "threads": torch.get_num_threads()}
    out["ours_steered_ms"] = round(med(lambda: plan_placement(w, G, S, num_nodes=nodes, dispatch="steered"), repeats), 1)
    out["ours_uniform_ms"] = round(med(lambda: plan_placement(w, G, S, num_nodes=nodes, dispatch="uniform"), repeats), 1)
    out["eplb_hierarchical_ms"] = round(med(lambda: rebalance_experts(w, G * S, groups, nodes, G), eplb_repeats), 1)
    out["eplb_global_ms"] = round(med(lambda: rebalance_global(w, G * S, G), eplb_repeats), 1)
    fastest_eplb = min(out["eplb_hierarchical_ms"], out["eplb_global_ms"])
    out["ratio_steered_vs_fastest_eplb"] = round(out["ours_steered_ms"] / fastest_eplb, 3)
    out["ratio_uniform_vs_fastest_eplb"] = round(out["ours_uniform_ms"] / fastest_eplb, 3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    ap.add_argument("--quick", action="store_true", help="two seeds, no 64-device case, no scaling run")
    ap.add_argument("--out", help="also write the JSON result to this file")
    args = ap.parse_args(argv)
    rows = []
    for case in cases(args.quick):
        rows.append(compare_case(case))
        if not args.json:
            r = rows[-1]
            cols = " | ".join(f"{k} u {v['uniform'][0]:.4f}/{v['uniform'][1]:.4f} s {v['steered'][0]:.4f}/{v['steered'][1]:.4f}"
                              for k, v in r.items() if isinstance(v, dict))
            print(f"{r['name']} (seed {r['seed']}): {cols}", flush=True)
    verdict, timing = _verdict(rows), time_planners()
    result = {"benchmark": "plan_vs_eplb", "cases": rows, "verdict": verdict, "timing": timing,
              "targets": {"uniform_ge_eplb_every_matrix": not verdict["uniform"]["losses"],
                          "steered_ge_eplb_every_matrix": not verdict["steered"]["losses"],
                          "planner_ms_le_100": timing["ours_steered_ms"] <= 100,
                          "time_vs_eplb_le_0.5": timing["ratio_steered_vs_fastest_eplb"] <= 0.5}}
    if not args.quick:
        result["scaling"] = time_planners(L=61, E=384, G=128, S=4, nodes=16, groups=8, repeats=3, eplb_repeats=1)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result if args.json else {k: result[k] for k in ("verdict", "timing", "targets") if k in result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
