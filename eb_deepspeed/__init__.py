"""eb_deepspeed: cross-layer load balancing (EasyBalance) for DeepSpeed Mixture-of-Experts models.

    import eb_deepspeed
    engine, optimizer, _, _ = eb_deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                      config="ds_config.json")
    engine.easybalance.metrics()

The `"easybalance"` block of the ds_config switches it on; see README.md and docs/.
"""
from . import metrics
from .config import ConfigError, CostWeights, EasyBalanceConfig, LogConfig
from .load_view import LoadView, sequence_length_weights

__version__ = "0.1.0"

__all__ = ["initialize", "EasyBalance", "CrossLayerGate", "swap_gates", "ConfigError", "CostWeights",
           "EasyBalanceConfig", "LogConfig", "LoadView", "sequence_length_weights", "metrics", "__version__"]


def __getattr__(name):
    # The DeepSpeed-facing parts import deepspeed (slow); the pure parts above do not.
    if name in ("initialize", "EasyBalance", "swap_gates"):
        from . import deepspeed_hook
        return getattr(deepspeed_hook, name)
    if name == "CrossLayerGate":
        from .gate import CrossLayerGate
        return CrossLayerGate
    raise AttributeError(f"module 'eb_deepspeed' has no attribute {name!r}")
