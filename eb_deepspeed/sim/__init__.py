"""The cluster simulator: what placement and steering are worth before a runtime uses them.

    eb simulate                     # the EasyBalance article's table for a 32-layer MoE on 8 devices, + our rows
    eb simulate --json --workload drifting

`model` (cost model), `workloads` (synthetic and trace workloads), `traces` (importers, one
validation path), `strategies` (what is compared, and the table).
"""
from ..core._lazy import lazy_exports

_EXPORTS = {
    "Topology": "..core.topology", "TOPOLOGIES": "..core.topology", "ClusterModel": ".model",
    "SimConfig": ".strategies", "STRATEGIES": ".strategies", "STRATEGY_LABELS": ".strategies",
    "run_table": ".strategies", "evaluate_targets": ".strategies", "format_targets": ".strategies",
    "format_table": ".strategies",
    "simulate": ".strategies", "load_trace": ".traces", "Workload": ".workloads", "WORKLOADS": ".workloads",
    "synthetic_workload": ".workloads", "trace_workload": ".workloads",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)   # imported on first use
