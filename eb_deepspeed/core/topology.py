"""Interconnect topologies: one table for the cost weights, the hop cost and the simulator's links.

Shape legend: G EP ranks (devices).

    topo = TOPOLOGIES["pcie"]
    topo.weights                      # (intra, cross, comm) cost weights of the EasyBalance article, §3.3 / §5.1
    hop_cost(node_G, topo.node_hop)   # [G, G] cost of sending from rank s to rank d
    resolve_topology("pcie", explicit=False, num_nodes=2)   # -> ("multi_node", reason)

Every other module reads topologies from here: the config's presets, steering's hop cost and the
simulator's bandwidths and latencies.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["Topology", "TOPOLOGIES"]


@dataclass(frozen=True)
class Topology:
    name: str
    weights: tuple[float, float, float]   # (intra, cross, comm): weights of the steering cost terms
    node_hop: float                       # cost of a hop inside a node, relative to one across nodes (1.0)
    devices_per_node: int                 # simulator: ranks sharing the fast links
    intra_bw: float                       # simulator: bytes/s inside a node
    inter_bw: float                       # simulator: bytes/s between nodes
    intra_lat: float                      # simulator: s per message inside a node
    inter_lat: float                      # simulator: s per message between nodes


# The EasyBalance article, §3.3 / §5.1: 0.3 / 0.5 / 0.2 is the usual starting point (PCIe); all-to-all NVLink lowers
# comm to ~0.1 and raises cross to ~0.6; across a network comm must be >= 0.4. The order of this
# table is the order error messages list the choices in.
TOPOLOGIES: dict[str, Topology] = {
    "pcie": Topology("pcie", (0.3, 0.5, 0.2), 0.3, 8, 16e9, 16e9, 15e-6, 15e-6),
    "nvlink": Topology("nvlink", (0.3, 0.6, 0.1), 0.1, 8, 150e9, 150e9, 8e-6, 8e-6),
    "multi_node": Topology("multi_node", (0.2, 0.4, 0.4), 0.2, 4, 150e9, 12.5e9, 8e-6, 30e-6),
}


def hop_cost(node_G: torch.Tensor, node_hop: float) -> torch.Tensor:
    """[G, G] cost of sending from rank s to rank d: 0 same rank, `node_hop` same node, 1 otherwise.

    node_G: [G] node of each rank.
    """
    import torch     # here, not at the top: the CLI reads TOPOLOGIES without loading torch
    node_G = torch.as_tensor(node_G)
    same_node_GG = node_G[:, None] == node_G[None, :]
    cost_GG = torch.full(same_node_GG.shape, 1.0, dtype=torch.float64).masked_fill_(same_node_GG, node_hop)
    return cost_GG.fill_diagonal_(0.0)


def node_map(hostnames: list[str]) -> list[int]:
    """Node index of each rank from its hostname, numbered in order of first appearance."""
    nodes: dict[str, int] = {}
    return [nodes.setdefault(h, len(nodes)) for h in hostnames]


def resolve_topology(name: str, *, explicit: bool, num_nodes: int) -> tuple[str, str | None]:
    """The topology to use for `num_nodes` nodes, and a warning when it was changed or looks wrong.

    A topology the user did not set follows the ranks: more than one node means `multi_node`
    (comm >= 0.4). One the user set is kept; a single-node preset on several nodes gets a warning.
    """
    if num_nodes <= 1 or name == "multi_node":
        return name, None
    if explicit:
        return name, (f"ranks span {num_nodes} nodes but topology is \"{name}\"; across a network the "
                      "communication weight should be >= 0.4 (\"multi_node\", the EasyBalance article, §3.3)")
    return "multi_node", f"ranks span {num_nodes} nodes: topology \"multi_node\" (was the default \"{name}\")"
