"""The framework-neutral core: config, tally, cross-layer view, metrics, control laws, the loop.

Imports torch (and the standard library) only, never deepspeed or megatron: every adapter builds
on it, and it runs in one CPU process. See docs/design.md for the layering.
"""
from . import metrics
from .balancer import BalancedGate, Balancer, check_agreement
from .config import AuxConfig, ConfigError, CostWeights, EasyBalanceConfig, InferenceConfig, LogConfig
from .policies import POLICIES, AuxController
from .record import BalanceLogger, NullLogger
from .tally import Tally, TallyLayout, TallyRecorder
from .topology import TOPOLOGIES, Topology, hop_cost, node_map, resolve_topology
from .view import LoadView, sequence_length_weights

__all__ = ["metrics", "Balancer", "BalancedGate", "check_agreement", "EasyBalanceConfig", "ConfigError", "CostWeights",
           "LogConfig", "AuxConfig", "InferenceConfig", "POLICIES", "AuxController", "BalanceLogger", "NullLogger",
           "Tally", "TallyLayout", "TallyRecorder", "TOPOLOGIES", "Topology", "hop_cost", "node_map",
           "resolve_topology", "LoadView", "sequence_length_weights"]
