"""The cluster simulator: what placement and steering are worth before a runtime uses them.

    eb simulate                     # seed 000's table for a 32-layer MoE on 8 devices, + our rows
    eb simulate --json --workload drifting

`model` (cost model), `workloads` (synthetic and trace workloads), `traces` (importers, one
validation path), `strategies` (what is compared, and the table).
"""
from ..core.topology import TOPOLOGIES, Topology
from .model import ClusterModel
from .strategies import STRATEGIES, STRATEGY_LABELS, SimConfig, evaluate_targets, format_table, run_table, simulate
from .traces import load_trace
from .workloads import WORKLOADS, Workload, synthetic_workload, trace_workload, uniform_workload

__all__ = ["Topology", "TOPOLOGIES", "ClusterModel", "SimConfig", "Workload", "synthetic_workload", "uniform_workload",
           "load_trace", "trace_workload", "simulate", "STRATEGIES", "STRATEGY_LABELS", "run_table", "evaluate_targets",
           "format_table", "WORKLOADS"]
