"""Benchmarks that print ratios measured side by side in one run (absolute times here are noise).

    eb bench gate --json      # CrossLayerGate vs DeepSpeed's TopKGate, forward + backward

Shape legend: T tokens, M model dim, E experts, K top-k.
"""
from __future__ import annotations

import statistics
import time

import torch

__all__ = ["bench_gate"]


def _time_gate(gate, x_TM: torch.Tensor, seed: int) -> float:
    torch.manual_seed(seed)  # same Gumbel / RTS draws for both gates
    x_TM.grad = None
    gate.wg.weight.grad = None
    t0 = time.perf_counter()
    l_aux, _, _, _, _, gates_KT, _ = gate(x_TM, None, True, False)
    (l_aux + gates_KT.sum()).backward()
    return time.perf_counter() - t0


def bench_gate(tokens: int = 4096, hidden: int = 1024, experts=(16, 64), k: int = 2, repeats: int = 30,
               warmup: int = 3, progress: bool = False) -> dict[str, object]:
    """Time CrossLayerGate against TopKGate on the same weights and inputs, interleaved.

    Each repeat times both gates back to back (alternating which goes first); the ratio is
    median(ours) / median(DeepSpeed's), per expert count and overall (geometric mean).
    """
    from deepspeed.moe.sharded_moe import TopKGate
    from .gate import CrossLayerGate

    rows = []
    for num_experts in experts:
        torch.manual_seed(0)
        ds_gate = TopKGate(hidden, num_experts, k=k, capacity_factor=1.0, min_capacity=4).train()
        eb_gate = CrossLayerGate.from_topk_gate(ds_gate, layer_index=0).train()
        x_TM = torch.randn(tokens, hidden, requires_grad=True)
        times = {"deepspeed": [], "easybalance": []}
        for rep in range(warmup + repeats):
            order = [("deepspeed", ds_gate), ("easybalance", eb_gate)]
            if rep % 2:
                order.reverse()
            for name, gate in order:
                dt = _time_gate(gate, x_TM, seed=rep)
                if rep >= warmup:
                    times[name].append(dt)
            eb_gate.take_tally(torch.device("cpu"))  # the step boundary drains it
        ds_med, eb_med = statistics.median(times["deepspeed"]), statistics.median(times["easybalance"])
        rows.append({"tokens": tokens, "hidden": hidden, "experts": num_experts, "k": k,
                     "deepspeed_ms": round(ds_med * 1e3, 3), "easybalance_ms": round(eb_med * 1e3, 3),
                     "ratio": round(eb_med / ds_med, 4)})
        if progress:
            print(f"  E={num_experts}: TopKGate {ds_med * 1e3:.2f} ms, CrossLayerGate {eb_med * 1e3:.2f} ms, "
                  f"ratio {eb_med / ds_med:.3f}", flush=True)
    ratio = statistics.geometric_mean([r["ratio"] for r in rows])
    return {"benchmark": "gate", "mode": "forward+backward, sparse routes", "threads": torch.get_num_threads(),
            "repeats": repeats, "rows": rows, "ratio": round(ratio, 4), "target": 1.05}
