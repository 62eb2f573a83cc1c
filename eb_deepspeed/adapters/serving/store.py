"""What the serving engine asks of a runtime: a slot store, and how routes are split over replicas.

Shape legend: L MoE layers, E logical experts, G EP ranks, S slots per rank, P physical slots (G * S; slot p
lives on EP rank p // S), R replicas of one expert, H home experts per rank (E / G).

A runtime (DeepSpeed's `MOELayer`, AutoEP's dropless layer) is served through a `SlotStore`: S_max slots per
rank, each holding one expert's weights, and gates that put each logical route on a physical slot by a
`SlotTable`. The engine (`engine.py`) decides placements and moves weights; a store only reads and writes slots
and serves the tables it is given. Both gates split an expert's routes on this rank over its replicas the same
way: by the table's fractions (`split_by_fraction`, "view": no collective) or by the exact split of this batch's
counts of every rank (`exact_routes`, "exact": one exchange of [E] counts per layer in place of AutoEP's own, the
split on the device).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch
import torch.distributed as dist

from ...planning.placement import Placement
from ...planning.steering import Copies, rank_share

__all__ = ["SlotStore", "SlotTable", "Routing"]


@dataclass
class SlotTable:
    """One layer's placement as its gate uses it (every rank holds the same table).

    log2phy_ER: [E, R] physical slot of each replica (-1 padded); fraction_ER: [E, R] the share of
    the expert's routes each replica takes in `split="view"` (0 on padding, rows sum to 1); copies: what the
    exact split reads, per device (`copies_on`).
    """
    log2phy_ER: torch.Tensor
    fraction_ER: torch.Tensor
    copies: dict = field(default_factory=dict, repr=False)

    def copies_on(self, S: int, G: int, device) -> tuple[Copies, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The exact split's view of this table on `device` (built once, when a gate is given the table): the
        copies, the real replicas among the E * R (real_X) with their physical slots (slot_X), each copy's rank."""
        if device not in self.copies:
            real_X = torch.nonzero(self.log2phy_ER.reshape(-1) >= 0).flatten()
            devices_ER = torch.where(self.log2phy_ER >= 0, self.log2phy_ER // S, -1)
            self.copies[device] = (Copies(devices_ER, G, device), real_X.to(device),
                                   self.log2phy_ER.reshape(-1)[real_X].to(device), devices_ER.to(device))
        return self.copies[device]

    @classmethod
    def even(cls, log2phy_ER: torch.Tensor) -> "SlotTable":
        valid_ER = log2phy_ER >= 0
        return cls(log2phy_ER, valid_ER.double() / valid_ER.sum(1, keepdim=True).clamp_min(1))


@dataclass
class Routing:
    """How a store's gates split routes: `split` ("view" or "exact"), this rank's place in the EP group, whether
    the gates count routes for the view (`recording`). `tokens`: set to [] by the engine before each forward, then
    holds the most tokens on any EP rank in it, agreed by its first layer that needs it (None: every such layer
    agrees for itself)."""
    split: str = "view"
    rank: int = 0
    recording: bool = True
    tokens: Optional[list] = None


class SlotStore(Protocol):
    """A runtime's MoE layers as slots. Set at construction: `num_layers`, `num_experts`, `num_devices` (E, G of
    every layer), `top_k` (per layer), `ep_group`, `device` (where collectives run), `padded` (every slot is
    padded to the largest: DeepSpeed's MOELayer; else dropless); after `replicate`: `gates`
    (one per layer, each with a `tally`)."""
    gates: list

    def replicate(self, slots: int, placement: Placement, routing: Routing) -> None:
        """Give every layer `slots` (S_max) expert slots per rank, the home experts in the first H, and a gate
        serving `placement`."""

    def read_slot(self, layer: int, j: int) -> torch.Tensor:
        """The whole state of this rank's slot j of `layer` as one vector (what a weight move sends)."""

    def write_slot(self, layer: int, j: int, flat: torch.Tensor) -> None:
        """Load `read_slot`'s vector into slot j."""

    def serve(self, layer: int, placement: Placement) -> None:
        """Serve `placement` in `layer` from its next forward on (its weights already in place)."""

    def load_home(self, ckpt_dir: str, tag: Optional[str]) -> str:
        """Load a DeepSpeed checkpoint's experts into the home layout (slots 0 .. H - 1); returns its path."""

    def save_home(self, ckpt_dir: str, tag: str, homes: dict) -> str:
        """Write DeepSpeed's checkpoint layout with the logical experts ({(layer, e): vector} of this rank's home
        experts, `ServingEngine.home_states`); returns its path. Collective."""


def split_by_fraction(counts_E: torch.Tensor, fraction_ER: torch.Tensor) -> torch.Tensor:
    """Routes per replica [E, R] from counts [E] and shares [E, R]: cumulative shares rounded, so the
    parts sum to the count exactly."""
    ends_ER = torch.round(fraction_ER.cumsum(1) * counts_E[:, None].double()).long()
    ends_ER[:, -1] = counts_E
    ends_ER = torch.minimum(ends_ER, counts_E[:, None])
    return torch.diff(ends_ER, dim=1, prepend=torch.zeros_like(ends_ER[:, :1]))


def exact_routes(counts_E: torch.Tensor, table: SlotTable, S: int, G: int, ep_group, rank: int):
    """The `exact` split of one batch from one exchange over the EP group of every rank's routes per expert [E],
    split over the copies on the device (`planning.steering`; every rank computes the same split from the same
    integers). Returns this rank's routes per replica n_ER [E, R] and every rank's routes per physical slot
    sends_GP [G, P] (row g: what rank g sends; column block g: what rank g receives)."""
    if G > 1:      # an all-gather as AutoEP's own count exchange is sent: one all-to-all (gloo's all-gather is slower)
        counts_GE = torch.empty(G, *counts_E.shape, dtype=counts_E.dtype, device=counts_E.device)
        dist.all_to_all_single(counts_GE.view(-1), counts_E.repeat(G), group=ep_group)
    else:
        counts_GE = counts_E[None]
    copies, real_X, slot_X, devices_ER = table.copies_on(S, G, counts_E.device)
    share_GER = rank_share(counts_GE, copies.split(counts_GE.sum(0)), devices_ER=devices_ER)   # own copies first
    sends_GP = torch.zeros(G, G * S, dtype=torch.long, device=counts_E.device)
    sends_GP[:, slot_X] = share_GER.flatten(1)[:, real_X]
    return share_GER[rank], sends_GP
