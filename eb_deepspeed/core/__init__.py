"""The framework-neutral core: config, tally, cross-layer view, metrics, control laws, the loop.

Imports torch (and the standard library) only, never deepspeed or megatron: every adapter builds
on it, and it runs in one CPU process. See docs/design.md for the layering.
"""
from ._lazy import lazy_exports

_EXPORTS = {
    "metrics": ".metrics", "Balancer": ".balancer", "BalancedGate": ".balancer", "ModelShape": ".balancer",
    "check_agreement": ".balancer", "LayerControls": ".controls", "BalanceLog": ".record",
    "EasyBalanceConfig": ".config", "ConfigError": ".config", "CostWeights": ".config", "LogConfig": ".config",
    "AuxConfig": ".config", "InferenceConfig": ".config", "POLICIES": ".policies", "AuxController": ".policies",
    "BalanceLogger": ".record", "NullLogger": ".record", "Tally": ".tally", "TallyLayout": ".tally",
    "LayerTally": ".tally", "TOPOLOGIES": ".topology", "Topology": ".topology", "hop_cost": ".topology",
    "node_map": ".topology", "resolve_topology": ".topology", "LoadView": ".view",
    "sequence_length_weights": ".view",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)   # imported on first use (torch is slow to load)
