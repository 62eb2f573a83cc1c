"""The cluster simulator: what placement and steering are worth before a runtime uses them.

    python -m benchmarks simulate                  # the EasyBalance article's table for a 32-layer MoE on 8 devices
    python -m benchmarks simulate --json --workload drifting

`model` (cost model), `workloads` (synthetic and trace workloads), `strategies` (what is compared, and the
table). Traces are read by the package's own importer, `eb_deepspeed.observe.traces.load_trace`.
"""
from eb_deepspeed.core.topology import TOPOLOGIES, Topology
from eb_deepspeed.observe.traces import load_trace

from .model import ClusterModel, tally_of
from .strategies import (STRATEGIES, STRATEGY_LABELS, SimConfig, evaluate_targets, format_table, format_targets,
                         run_table, simulate)
from .workloads import WORKLOADS, Workload, synthetic_workload, trace_workload

__all__ = ["Topology", "TOPOLOGIES", "ClusterModel", "SimConfig", "STRATEGIES", "STRATEGY_LABELS", "run_table",
           "evaluate_targets", "format_targets", "format_table", "simulate", "load_trace", "Workload", "WORKLOADS",
           "synthetic_workload", "trace_workload", "tally_of"]
