"""eb_deepspeed: cross-layer load balancing (EasyBalance) for DeepSpeed Mixture-of-Experts models.

    import eb_deepspeed
    engine, optimizer, _, _ = eb_deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                      config="ds_config.json")
    engine.easybalance.metrics()

The `"easybalance"` block of the ds_config switches it on; see README.md and docs/. Layout:
`core` (framework-neutral loop), `planning` (placement, steering), `adapters.deepspeed`,
`observe` (logs, W&B, plots), `sim` (cluster simulator), `tools` (the `eb` CLI, benchmarks).
"""
from .core import metrics
from .core.balancer import Balancer
from .core.config import ConfigError, CostWeights, EasyBalanceConfig, LogConfig
from .core.view import LoadView, sequence_length_weights
from .planning.placement import plan_placement
from .planning.steering import steer
from .sim.traces import load_trace

__version__ = "0.1.0"

__all__ = ["initialize", "init_inference", "load_moe_checkpoint", "CrossLayerGate", "swap_gates", "Balancer", "ConfigError", "CostWeights",
           "EasyBalanceConfig", "LogConfig", "LoadView", "sequence_length_weights", "metrics", "plan_placement",
           "steer", "load_trace", "__version__"]

_DEEPSPEED_NAMES = ("initialize", "init_inference", "load_moe_checkpoint", "swap_gates", "CrossLayerGate")


def __getattr__(name):
    # The DeepSpeed-facing parts import deepspeed (slow); the pure parts above do not.
    if name in _DEEPSPEED_NAMES:
        from .adapters import deepspeed as adapter
        return getattr(adapter, name)
    raise AttributeError(f"module 'eb_deepspeed' has no attribute {name!r}")
