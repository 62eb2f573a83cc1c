"""Planning: where replicas live and how routes are split among them (pure functions, no framework).

    plan = plan_placement(load_LE, num_devices, slots_per_device, num_nodes=..., previous=...)
    split_GER = steer(counts_GE, plan.expert_devices()[layer])"""
from .flows import steer_flows, steered_load
from .placement import (Placement, assign_replicas, expected_device_load, expected_padded_cost, expected_slot_ratio,
                        index_maps, plan_placement, replica_counts, static_placement)
from .steering import split, steer

__all__ = ["Placement", "plan_placement", "static_placement", "steer", "steered_load"]
