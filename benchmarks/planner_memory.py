"""The planner's time and peak memory, one plan per process (so each peak RSS is that plan's own).

    DS_ACCELERATOR=cpu python -m benchmarks.planner_memory            # the cases of docs/benchmarks.md
    DS_ACCELERATOR=cpu python -m benchmarks.planner_memory 1 16384 16384 1

Each case: `plan_placement` on a log-normal load (seed 0) of L layers x E experts over G devices x S
slots; prints the time, the process's peak RSS, and the plan's mean expected slot max/mean (the quality,
so a faster planner is seen to plan the same). Run it on two checkouts to compare them side by side.
"""
from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

CASES = ((1, 16384, 16384, 1), (1, 65536, 65536, 1), (1, 16384, 2, 8192), (58, 256, 32, 9), (256, 256, 256, 256))


def one(L: int, E: int, G: int, S: int) -> dict:
    import torch

    from eb_deepspeed.planning.placement import expected_slot_ratio, plan_placement
    torch.manual_seed(0)
    load_LE = torch.exp(torch.randn(L, E, dtype=torch.float64)) * 100
    start = time.perf_counter()
    plan = plan_placement(load_LE, G, S)
    seconds = time.perf_counter() - start
    return {"case": [L, E, G, S], "seconds": round(seconds, 2),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "slot_ratio_mean": round(float(expected_slot_ratio(load_LE, plan).mean()), 6)}


# What issue 23 asked: memory linear in what is planned. Stated here as: every case plans, and a single layer
# at up to 65536 slots stays under 512 MiB of peak RSS (the interpreter and torch take ~240 MiB of it).
SINGLE_LAYER_MIB = 512


def main() -> None:
    if len(sys.argv) == 5:
        print(json.dumps(one(*(int(a) for a in sys.argv[1:]))))
        return
    results = []
    for case in CASES:
        proc = subprocess.run([sys.executable, __file__, *map(str, case)], capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        results.append(json.loads(lines[-1]) if proc.returncode == 0 and lines else {"case": list(case), "failed": True})
        print(json.dumps(results[-1]), flush=True)
    single = [r for r in results if r["case"][0] == 1]
    print(json.dumps({"targets": {
        "every_case_plans": all(not r.get("failed") for r in results),
        f"single_layer_peak_rss_le_{SINGLE_LAYER_MIB}_mib": all(r.get("peak_rss_mib", 1e9) <= SINGLE_LAYER_MIB
                                                                 for r in single)}}))


if __name__ == "__main__":
    main()
