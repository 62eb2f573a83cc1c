"""The balancer's cost at DeepSeek-V3's shape: host time per optimizer step and per recorded forward, the reduce's
bytes, peak memory; side by side with one plain AutoEP MoE layer's forward on this machine.

    python -m benchmarks scale [--json] [--layers 61 --experts 256 --devices 64 --tokens 4096 --k 8 --policy P]

On a GPU the host only launches work: what stalls a step is host time. On CPU every op also computes, so the
device-side half of the balancer (the gates' tally folds, the stacking of rows) runs on the `meta` device, which
dispatches each op as a GPU's host would and computes nothing; the host-side half (the view and the control law,
which run on the host anyway) runs as it is. Both are timed in one run, medians of `repeats`.

    step_ms     gather (meta: fold every layer's forwards, stack [L, W]) + take (host: view, policy, controls)
    record_ms   per layer per forward: `LayerTally.add_routes` of T x K routes (what a gate's hook adds)
    ops         torch ops dispatched (kernel launches on a GPU) per step and per recorded forward
"""
from __future__ import annotations

import resource
import statistics
import time

import torch

from eb_deepspeed.core.balancer import Balancer, ModelShape
from eb_deepspeed.core.config import EasyBalanceConfig
from eb_deepspeed.core.controls import LayerControls
from eb_deepspeed.core.tally import LayerTally
from .sim.model import tally_of

__all__ = ["bench_scale"]

TARGET_STEP_MS = 5.0
TARGET_RECORD_MS = 0.05


class _Gate:
    def __init__(self, experts: int, device):
        self.tally = LayerTally(experts)
        self.controls = LayerControls(experts)
        self.device = device


class OpCount(torch.overrides.TorchFunctionMode):
    """Counts the torch calls made inside it (`n`): the ops a piece of host code launches."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _plain_autoep_forward_ms(tokens: int, experts: int, k: int, hidden: int, repeats: int) -> float:
    """One forward of DeepSpeed's AutoEP router (fp32, CPU; the layer's experts cost more), the reference beside the
    numbers above."""
    from deepspeed.moe.ep_router import TokenChoiceTopKRouter
    router = TokenChoiceTopKRouter(hidden, experts, None, None, k, score_func="softmax", route_norm=True,
                                   route_scale=1.0, gate_bias=False)
    x = torch.randn(tokens, hidden)
    with torch.no_grad():
        router(x)
        return _median_ms(lambda: router(x), repeats)


def bench_scale(layers: int = 61, experts: int = 256, devices: int = 64, tokens: int = 4096, k: int = 8,
                policy: str | None = None, repeats: int = 20, hidden: int = 1024) -> dict:
    """The numbers of the module doc, for the default policy (or `policy`)."""
    cfg_block = {"mode": "balance", "warmup_batches": 1, "log": {"interval": 10**6}}
    if policy:
        cfg_block["aux"] = {"policy": policy}
    config = EasyBalanceConfig.from_ds_config({"easybalance": cfg_block})
    meta = torch.device("meta")
    gates = [_Gate(experts, meta) for _ in range(layers)]
    balancer = Balancer(config, gates, ModelShape.uniform(layers, experts, devices), device=meta)
    g = torch.Generator().manual_seed(0)
    # a skewed routing, the same shape on meta (what the hooks hand over) and on the host (to feed the view)
    expert_TK = torch.randint(0, experts, (tokens, k), generator=g).to(meta)
    counts_LE = torch.distributions.Dirichlet(torch.full((experts, ), 0.3)).sample((layers, )) * tokens * k
    host_packed_LW = tally_of(counts_LE.to(torch.float64), tokens_L=torch.full((layers, ), float(tokens))).pack()

    routed_E = torch.zeros(experts, device=meta)       # what the gates hand over with the routes
    sums_T, l_aux = torch.zeros(tokens, device=meta), torch.zeros((), device=meta)

    def record():
        for gate in gates:
            gate.tally.add_routes(expert_TK, routed_E=routed_E, logit_sums_T=sums_T, l_aux=l_aux, layer=0)

    def step():
        balancer.gather()                     # meta: what the accelerator's host thread dispatches
        balancer.take(host_packed_LW.clone())  # host: the view, the policy, the controls

    for _ in range(3):
        record()
        step()
    record_ms = _median_ms(record, repeats) / layers
    for gate in gates:                         # one forward pending per layer, as in a step
        gate.tally.discard()
    samples = []
    for _ in range(repeats):
        record()
        t0 = time.perf_counter()
        step()
        samples.append((time.perf_counter() - t0) * 1e3)
    step_ms = statistics.median(samples)
    ops = OpCount()
    with ops:
        record()
    record_ops = ops.n / layers
    ops = OpCount()
    with ops:
        step()
    width = balancer.gather().shape[1]
    reference_ms = _plain_autoep_forward_ms(tokens, experts, k, hidden, max(3, repeats // 4))
    return {"benchmark": "scale", "layers": layers, "experts": experts, "devices": devices, "tokens": tokens, "k": k,
            "policy": config.aux.policy, "step_ms": round(step_ms, 3), "record_ms_per_layer": round(record_ms, 4),
            "ops_per_step": ops.n, "ops_per_forward_per_layer": record_ops,
            "reduce_bytes": layers * width * 8, "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                                                      / 1024, 1),
            "plain_autoep_router_forward_ms": round(reference_ms, 3),
            "record_over_router_forward": round(record_ms / reference_ms, 4),
            "targets": {"step_ms_le_5": step_ms <= TARGET_STEP_MS,
                        "record_ms_per_layer_le_0.05": record_ms <= TARGET_RECORD_MS}}
