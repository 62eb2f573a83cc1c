"""eb_deepspeed: cross-layer load balancing (EasyBalance) for DeepSpeed Mixture-of-Experts models.

    import eb_deepspeed
    engine, optimizer, _, _ = eb_deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                      config="ds_config.json")
    engine.easybalance.metrics()

The `"easybalance"` block of the ds_config switches it on (README.md, docs/). Subpackages: `core`, `planning`,
`adapters`, `observe`, `tools`; the benchmarks live in the checkout's `benchmarks/`."""
from .core._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "metrics": ".core.metrics", "Balancer": ".core.balancer", "ConfigError": ".core.config",
    "EasyBalanceConfig": ".core.config", "LogConfig": ".core.config", "LoadView": ".core.view",
    "plan_placement": ".planning.placement", "steer": ".planning.steering", "load_trace": ".observe.traces",
    # the DeepSpeed-facing parts import deepspeed (slow)
    "initialize": ".adapters.deepspeed", "init_inference": ".adapters.serving",
    "patch_deepspeed": ".adapters.deepspeed",
    "load_moe_checkpoint": ".adapters.deepspeed", "swap_gates": ".adapters.deepspeed",
    "CrossLayerGate": ".adapters.deepspeed",
    # the subpackages, as attributes (`eb_deepspeed.planning.plan_placement`)
    "core": ".core", "planning": ".planning", "observe": ".observe", "adapters": ".adapters", "tools": ".tools",
}
__all__ = [*(k for k in _EXPORTS if not _EXPORTS[k].endswith("." + k) or k == "metrics"), "__version__"]
# Every name is imported on first use: `import eb_deepspeed` (and `eb --help`) does not load torch.
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
