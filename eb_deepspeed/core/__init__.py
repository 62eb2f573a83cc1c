"""The framework-neutral core: config, tally, cross-layer view, metrics, control laws, the loop.

Imports torch (and the standard library) only, never deepspeed or megatron: every adapter builds
on it, and it runs in one CPU process. See docs/design.md for the layering."""
from ._lazy import lazy_exports

_EXPORTS = {
    "metrics": ".metrics", "Balancer": ".balancer", "ModelShape": ".balancer", "LayerControls": ".controls",
    "LayerTally": ".tally", "Tally": ".tally", "LoadView": ".view", "EasyBalanceConfig": ".config",
    "ConfigError": ".config", "POLICIES": ".policies",
}
__all__ = [k for k in _EXPORTS if k != "metrics"]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)   # imported on first use (torch is slow to load)
