"""The simulator's cost model: one MoE layer's time per device, and a step's wall time.

Shape legend: L layers, G devices (= source ranks).

Cost of one layer on device d (seconds):
    compute   = routes processed on d * route_s       (* padded capacity instead, with `padded`)
    all2all   = 2 * max(intra bytes / intra_bw, inter bytes / inter_bw) + messages * latency
                (dispatch and combine; bytes = tokens sent to other ranks * hidden * 2)
    decisions = routes decided on d / decision_batch * decision_s   (the EasyBalance article's 2-3 ms per layer
                per-token cost against 0.3 ms batched is what decision_s and decision_batch model)
              + steer_s per layer for per-batch exact steering (its all-gather of counts and the host's split;
                0 by default, as the article has it: `python -m benchmarks infer --framework autoep` measured 4-15 ms)
Execution is synchronised per layer (a layer takes its slowest device), or with bounded run-ahead:
a device may start layer l once every device has finished layer l - run_ahead. Links, latencies and
devices per node come from the one topology table, `core.topology.TOPOLOGIES`; the article's cost weights and
hop costs (§3.3 / §5.1), which only the simulated re-routing reads, from `ARTICLE_WEIGHTS` and `NODE_HOP`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eb_deepspeed.core.tally import Tally
from eb_deepspeed.core.topology import TOPOLOGIES, Topology

__all__ = ["tally_of", "ClusterModel", "ARTICLE_WEIGHTS", "hop_cost"]

# The EasyBalance article's (intra, cross, comm) cost weights per topology (§3.3 / §5.1: 0.3 / 0.5 / 0.2 the usual
# start; NVLink lowers comm to ~0.1; across a network comm >= 0.4) and a hop inside a node against one across (1).
ARTICLE_WEIGHTS = {"pcie": (0.3, 0.5, 0.2), "nvlink": (0.3, 0.6, 0.1), "multi_node": (0.2, 0.4, 0.4)}
NODE_HOP = {"pcie": 0.3, "nvlink": 0.1, "multi_node": 0.2}


def hop_cost(node_G: torch.Tensor, topology: str) -> torch.Tensor:
    """[G, G] cost of sending from rank s to rank d: 0 same rank, the topology's `NODE_HOP` same node, 1 otherwise."""
    same_node_GG = node_G[:, None] == node_G[None, :]
    cost_GG = torch.full(same_node_GG.shape, 1.0, dtype=torch.float64).masked_fill_(same_node_GG, NODE_HOP[topology])
    return cost_GG.fill_diagonal_(0.0)


@dataclass(frozen=True)
class ClusterModel:
    topology: Topology = TOPOLOGIES["pcie"]
    hidden: int = 4096
    bytes_per_elem: int = 2
    route_s: float = 0.6e-6        # expert compute per routed token (8192 routes/device ~ 4.9 ms)
    decision_s: float = 0.3e-6     # one steering decision (per-token: ~2.5 ms per layer at 4096 x 2)
    padded: bool = False           # compute ~ padded capacity (DeepSpeed drop_tokens=False) instead of tokens
    run_ahead: int = 1             # 1 = synchronised per layer; w > 1 = bounded run-ahead (layers)
    steer_s: float = 0.0           # exact steering's cost per layer (`fixed_s` of `layer_times`)

    def node_of(self, G: int) -> torch.Tensor:
        return torch.arange(G) // min(G, self.topology.devices_per_node)

    def layer_times(self, traffic_GG: torch.Tensor, compute_G: torch.Tensor, messages_G: torch.Tensor,
                    decisions_G: torch.Tensor, fixed_s: float = 0.0) -> torch.Tensor:
        """Per-device time of one layer [G] from tokens sent s->d [G, G] (weighted), routes processed [G],
        messages sent [G], steering decisions made [G] and a fixed cost on every device (seconds)."""
        G = traffic_GG.shape[0]
        node = self.node_of(G)
        same = node[:, None] == node[None, :]
        off = ~torch.eye(G, dtype=torch.bool)
        tok_bytes = self.hidden * self.bytes_per_elem
        t = self.topology
        intra_send = (traffic_GG * (same & off)).sum(1) * tok_bytes / t.intra_bw
        inter_send = (traffic_GG * ~same).sum(1) * tok_bytes / t.inter_bw
        intra_recv = (traffic_GG * (same & off)).sum(0) * tok_bytes / t.intra_bw
        inter_recv = (traffic_GG * ~same).sum(0) * tok_bytes / t.inter_bw
        lat = t.inter_lat if int(node.max()) > 0 else t.intra_lat
        a2a = 2 * torch.maximum(torch.maximum(intra_send, inter_send), torch.maximum(intra_recv, inter_recv)) \
            + messages_G * lat
        return compute_G * self.route_s + a2a + decisions_G * self.decision_s + fixed_s

    def step_time(self, times_LG: torch.Tensor) -> float:
        """Wall time of one step from per-layer per-device times [L, G]."""
        if self.run_ahead <= 1:
            return float(times_LG.amax(1).sum())
        L, G = times_LG.shape
        finish = torch.zeros(L, G, dtype=torch.float64)
        for l in range(L):  # layers, not tokens
            ready = finish[l - 1] if l else torch.zeros(G, dtype=torch.float64)
            if l - self.run_ahead >= 0:
                ready = torch.maximum(ready, finish[l - self.run_ahead].max().expand(G))
            finish[l] = ready + times_LG[l]
        return float(finish[-1].max())


def tally_of(routed_LE, kept_LE=None, tokens_L=None, nonfinite_L=None, aux_L=None, forwards_L=None,
             device_LG=None) -> Tally:
    """A tally from readable parts (for the simulator and tests, which count elsewhere): kept defaults to routed,
    tokens to routed / 2 (top-2), forwards to 1, the rest to 0."""
    def f64(v):
        return torch.as_tensor(v, dtype=torch.float64)
    routed_LE = torch.atleast_2d(f64(routed_LE))
    L = routed_LE.shape[0]

    def per_layer(v, default):
        return f64(default if v is None else v).expand(L).clone()
    kept_LE = routed_LE if kept_LE is None else f64(kept_LE).reshape(L, -1)
    device_LG = None if device_LG is None else f64(device_LG).reshape(L, -1).clone()
    return Tally(routed_LE.clone(), kept_LE.clone(), per_layer(tokens_L, routed_LE.sum(1) / 2),
                 per_layer(nonfinite_L, 0.0), per_layer(aux_L, 0.0), per_layer(forwards_L, 1.0), device_LG)
