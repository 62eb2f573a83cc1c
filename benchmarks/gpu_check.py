"""One accelerator check, one JSON: the numbers that need a GPU to mean anything.

    python -m benchmarks.gpu_check --device cuda --out gpu_check.json     # on a CUDA machine
    python -m benchmarks.gpu_check --device cpu --quick                   # the same code on CPU

Measured on `--device`, side by side in one run:
  * gate overhead: CrossLayerGate / DeepSpeed's TopKGate, forward + backward (target <= 1.05);
  * steering cost (on the host) / one DeepSpeed MoE layer forward (on the device) at 4096 tokens,
    ep_size 1 (target <= 0.02);
  * bf16 gate parity: in bfloat16 the swapped gate routes exactly as DeepSpeed's (same experts, same
    locations, same capacity) and its gate values and l_aux equal DeepSpeed's.
`launch/gpu_check.sh` sets up and runs it (`--cpu` for this machine).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

__all__ = ["gpu_check"]


def bf16_parity(device: str, tokens: int = 4096, hidden: int = 1024, experts: int = 64, k: int = 2) -> dict:
    """Route the same bf16 tokens through DeepSpeed's TopKGate and the swapped CrossLayerGate."""
    from deepspeed.moe.sharded_moe import TopKGate

    from eb_deepspeed.adapters.deepspeed.gate import CrossLayerGate
    torch.manual_seed(0)
    ds = TopKGate(hidden, experts, k=k, min_capacity=4).to(device, torch.bfloat16).train()
    eb = CrossLayerGate.from_topk_gate(ds, layer_index=0).train()
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    out = {}
    for name, gate in (("deepspeed", ds), ("easybalance", eb)):
        torch.manual_seed(1)
        out[name] = gate(x, None, True, False)
    a, b = out["deepspeed"], out["easybalance"]
    same_routes = all(torch.equal(u, v) for u, v in zip(a[3:5], b[3:5])) and int(a[1]) == int(b[1])
    same_values = torch.equal(a[5], b[5]) and torch.equal(a[0], b[0]) and torch.equal(a[6], b[6])
    return {"tokens": tokens, "hidden": hidden, "experts": experts, "k": k, "same_routes": bool(same_routes),
            "same_gate_values": bool(same_values)}


def gpu_check(device: str = "cuda", quick: bool = False) -> dict:
    from .bench import bench_gate, bench_steering
    t0 = time.time()
    tokens = 512 if quick else 4096
    hidden = 128 if quick else 1024
    info = {"device": device, "torch": torch.__version__}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    gate = bench_gate(tokens=tokens, hidden=hidden, experts=(16, 64), repeats=5 if quick else 30, device=device)
    steering = bench_steering(tokens=tokens, hidden=hidden, repeats=3 if quick else 7, device=device)
    parity = bf16_parity(device, tokens=tokens, hidden=hidden)
    return {"benchmark": "gpu_check", **info, "quick": quick, "gate": gate, "steering": steering, "bf16": parity,
            "seconds": round(time.time() - t0, 1),
            "targets": {"gate_ratio_le_1.05": gate["targets"]["gate_ratio_le_1.05"],
                        "steering_ratio_le_0.02": bool(steering["ratio"] <= 0.02),
                        "bf16_parity": parity["same_routes"] and parity["same_gate_values"]}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run of the same code)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run with --device cpu (or launch/gpu_check.sh --cpu)", file=sys.stderr)
        return 2
    result = gpu_check(args.device, args.quick)
    text = json.dumps(result)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
