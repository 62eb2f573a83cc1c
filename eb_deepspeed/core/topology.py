"""Interconnect topologies: one table of the links a weight move crosses (`inference.topology`), and the node map.

Shape legend: G EP ranks (devices).

    topo = TOPOLOGIES["nvlink"]; topo.intra_bw, topo.inter_bw   # bytes/s inside a node, between nodes
    resolve_topology("pcie", explicit=False, num_nodes=2)        # -> ("multi_node", reason)

Serving and training placement price a weight copy at these bandwidths; the benchmarks' simulator reads its links
and latencies from here too."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Topology", "TOPOLOGIES"]


@dataclass(frozen=True)
class Topology:
    name: str
    devices_per_node: int                 # ranks sharing the fast links
    intra_bw: float                       # bytes/s inside a node
    inter_bw: float                       # bytes/s between nodes
    intra_lat: float                      # simulator: s per message inside a node
    inter_lat: float                      # simulator: s per message between nodes


# The order of this table is the order error messages list the choices in.
TOPOLOGIES: dict[str, Topology] = {
    "pcie": Topology("pcie", 8, 16e9, 16e9, 15e-6, 15e-6),
    "nvlink": Topology("nvlink", 8, 150e9, 150e9, 8e-6, 8e-6),
    "multi_node": Topology("multi_node", 4, 150e9, 12.5e9, 8e-6, 30e-6),
}


def node_map(hostnames: list[str]) -> list[int]:
    """Node index of each rank from its hostname, numbered in order of first appearance."""
    nodes: dict[str, int] = {}
    return [nodes.setdefault(h, len(nodes)) for h in hostnames]


def resolve_topology(name: str, *, explicit: bool, num_nodes: int) -> tuple[str, str | None]:
    """The topology to use for `num_nodes` nodes, and a warning when it was changed or looks wrong.

    A topology the user did not set follows the ranks: more than one node means `multi_node` (a weight copy
    between nodes crosses the network). One the user set is kept; a single-node preset on several nodes gets a
    warning."""
    if num_nodes <= 1 or name == "multi_node":
        return name, None
    if explicit:
        return name, (f"ranks span {num_nodes} nodes but topology is \"{name}\": weight copies between them are "
                      "priced at its one bandwidth (\"multi_node\" prices the network apart)")
    return "multi_node", f"ranks span {num_nodes} nodes: topology \"multi_node\" (was the default \"{name}\")"
