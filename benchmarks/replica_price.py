"""What a training-time replica costs and what it saves, per optimizer step (issue 50, point 4).

    python -m benchmarks.replica_price [--json]

A replica computes with its home expert's weights and sends its gradient home: its bytes per optimizer step are
the weights out and the gradient back (once per step under gradient accumulation: the weights do not change
between micro-batches, the gradient accumulates where it is computed). What it saves: the routes it takes off the
busiest EP rank, each worth a forward and backward through one expert at the device's FLOPs (the engine's
`DEVICE_FLOPS`). A replica pays where the routes it saves per step exceed `break_even_routes`.

The expert is Qwen3-30B-A3B's (hidden 2048, expert FFN 768, gate/up/down, 128 experts, top-8) at EP 32 (4 experts
a rank); the routes saved come from the held-out balancedness of `benchmarks.replay --permutation` on
DeepSeek-V2-Lite's fine-tuning counts at EP 32 (a permutation 0.460, one replica slot per rank 0.947).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from eb_deepspeed.adapters.moves import DEVICE_FLOPS
from eb_deepspeed.core.topology import TOPOLOGIES

HIDDEN, FFN, EXPERTS, TOP_K, EP = 2048, 768, 128, 8, 32
PARAMS = 3 * HIDDEN * FFN                      # one expert: gate, up, down
WEIGHT_BYTES, GRAD_BYTES = 2, 4                # bf16 weights out, fp32 gradient back (DeepSpeed's bf16 default)
FLOPS_PER_ROUTE = 6 * PARAMS                   # forward 2, backward 4 per parameter and route
TOKENS_PER_RANK = 4096                         # one micro-batch of one sequence of 4096 tokens a rank
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "permutation_esft.json")) as _f:
    _EP32 = json.load(_f)[str(EP)]          # benchmarks.replay --counts ...esft... --permutation (docs/benchmarks.md)
BALANCEDNESS = {"permutation": _EP32["same_task"], "1 replica slot": _EP32["same_task_r1"]}
LINKS = {"NVLink (one node)": TOPOLOGIES["nvlink"].intra_bw,
         "InfiniBand 400 Gb/s": 50e9,
         "between nodes, the engine's multi_node": TOPOLOGIES["multi_node"].inter_bw}


def price(micro_batches: int = 1) -> dict:
    flops = DEVICE_FLOPS["cuda"]
    route_s = FLOPS_PER_ROUTE / flops
    step_bytes = PARAMS * (WEIGHT_BYTES + GRAD_BYTES)
    mean_routes = TOKENS_PER_RANK * TOP_K * micro_batches            # a rank's routes per layer and optimizer step
    busiest = {k: mean_routes / b for k, b in BALANCEDNESS.items()}
    saved = busiest["permutation"] - busiest["1 replica slot"]        # off the busiest rank, per layer and step
    links = {}
    for name, bw in LINKS.items():
        transfer_s = step_bytes / bw
        links[name] = {"bytes_per_step": step_bytes, "transfer_ms": round(1e3 * transfer_s, 3),
                       "break_even_routes": round(transfer_s / route_s),
                       "saved_over_cost": round(saved * route_s / transfer_s, 2)}
    return {"expert_params": PARAMS, "route_us": round(1e6 * route_s, 4), "micro_batches": micro_batches,
            "mean_routes_per_rank": mean_routes, "busiest_routes": {k: round(v) for k, v in busiest.items()},
            "routes_saved": round(saved), "compute_saved_ms": round(1e3 * saved * route_s, 3), "links": links}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rows = [price(m) for m in (1, 8)]
    # the claim to check: one replica slot pays for its bytes on NVLink and on InfiniBand at one micro-batch
    targets = {f"pays_on_{key}_one_micro_batch": rows[0]["links"][name]["saved_over_cost"] > 1
               for key, name in (("nvlink", "NVLink (one node)"), ("infiniband", "InfiniBand 400 Gb/s"))}
    if args.json:
        print(json.dumps({"rows": rows, "targets": targets}, indent=1))
        return 0
    print(f"Qwen3-30B-A3B expert ({PARAMS / 1e6:.2f} M params, {PARAMS * (WEIGHT_BYTES + GRAD_BYTES) / 1e6:.1f} MB "
          f"weights out + gradient back per step), EP {EP}, {TOKENS_PER_RANK} tokens a rank per micro-batch")
    print("| micro-batches per step | link | transfer ms | compute saved ms | break-even routes | saved / cost |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        for name, link in r["links"].items():
            print(f"| {r['micro_batches']} | {name} | {link['transfer_ms']} | {r['compute_saved_ms']} | "
                  f"{link['break_even_routes']} | {link['saved_over_cost']} |")
    print("targets:", json.dumps(targets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
