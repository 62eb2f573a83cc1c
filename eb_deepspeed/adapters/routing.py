"""The route tables every gate with copies reads, serving's and training's alike: which physical slot each replica
of an expert is (`SlotTable`), how a batch's routes are split over them (`Routing`: evenly by the table's fractions,
`split_by_fraction`, or the exact split of every rank's counts, `exchange_counts` then `exact_routes`), and a gate's
table on its device (`ServedTable`).

Shape legend: E logical experts, G EP ranks, S slots per rank, P physical slots (G * S; slot p lives on EP rank
p // S), R replicas of one expert."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from ..planning.steering import Fill, fill_of, rank_share, split

__all__ = ["SlotTable", "Routing"]


@dataclass
class SlotTable:
    """One layer's placement as its gate uses it (every rank holds the same table).

    log2phy_ER: [E, R] physical slot of each replica (-1 padded); fraction_ER: [E, R] the share of
    the expert's routes each replica takes in `split="view"` (0 on padding, rows sum to 1); copies: what the
    exact split reads, per device (`copies_on`)."""
    log2phy_ER: torch.Tensor
    fraction_ER: torch.Tensor
    copies: dict = field(default_factory=dict, repr=False)

    def copies_on(self, S: int, G: int, device) -> tuple[torch.Tensor, Fill]:
        """The exact split's view of this table on `device` (built once, when a gate is given the table): each
        expert's slot on each rank slot_EG [E, G] (-1: no copy there) and what its split fills (`fill_of`)."""
        if device not in self.copies:
            E = self.log2phy_ER.shape[0]
            slot_EG = torch.full((E, G + 1), -1, dtype=torch.long)
            slot_EG.scatter_(1, torch.where(self.log2phy_ER >= 0, self.log2phy_ER // S, G), self.log2phy_ER)
            fill = fill_of(slot_EG[:, :G].T >= 0)
            self.copies[device] = (slot_EG[:, :G].to(device), fill._replace(flex_F=fill.flex_F.to(device)))
        return self.copies[device]

    @classmethod
    def even(cls, log2phy_ER: torch.Tensor) -> "SlotTable":
        valid_ER = log2phy_ER >= 0
        return cls(log2phy_ER, valid_ER.double() / valid_ER.sum(1, keepdim=True).clamp_min(1))


@dataclass
class Routing:
    """How a layer's gates split routes: by the exact split (`exact`, else evenly by the table), this rank's place
    in the EP group, whether the gates count routes for the view (`recording`). `tokens`: set to [] by the engine before each forward, then
    holds the most tokens on any EP rank in it, agreed by its first layer that needs it (None: every such layer
    agrees for itself)."""
    exact: bool = False
    rank: int = 0
    recording: bool = True
    tokens: Optional[list] = None


class ServedTable:
    """A served layer's gate: the table it serves (`set_table`) and its tensors on the router's device (`on_device`),
    copied at the batch boundary, not in a forward. The gate sets `G`, `routing` and `router_device`."""

    def set_table(self, table: SlotTable, slots_per_device: int) -> None:
        """Serve a placement from the next forward on (slots per rank may change with it)."""
        self.table, self.S = table, int(slots_per_device)
        self.P = self.G * self.S
        E, R = table.log2phy_ER.shape
        # one slot per expert: the runtime's own layout (expert e in slot e) or a permutation (a re-plan's prefix)
        self.one_each = self.P == E and R == 1
        self.home_layout = self.one_each and bool((table.log2phy_ER[:, 0] == torch.arange(E)).all())
        self._on_device = None
        self.on_device(self.router_device)
        if not self.one_each and self.routing.exact:     # the split's copies: now, not in a forward
            table.copies_on(self.S, self.G, self.router_device)

    def on_device(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(log2phy_ER, fraction_ER, [E] EP rank of each expert's first slot) on `device`, copied once per table."""
        if self._on_device is None or self._on_device[0] != device:
            log2phy_ER = self.table.log2phy_ER.to(device)
            self._on_device = (device, log2phy_ER, self.table.fraction_ER.to(device), log2phy_ER[:, 0] // self.S)
        return self._on_device[1:]


def split_by_fraction(counts_E: torch.Tensor, fraction_ER: torch.Tensor) -> torch.Tensor:
    """Routes per replica [E, R] from counts [E] and shares [E, R]: cumulative shares rounded, so the
    parts sum to the count exactly."""
    ends_ER = torch.round(fraction_ER.cumsum(1) * counts_E[:, None].double()).long()
    ends_ER[:, -1] = counts_E
    ends_ER = torch.minimum(ends_ER, counts_E[:, None])
    return torch.diff(ends_ER, dim=1, prepend=torch.zeros_like(ends_ER[:, :1]))


def exchange_counts(counts_E: torch.Tensor, G: int, ep_group) -> torch.Tensor:
    """Every EP rank's routes per expert this batch, counts_GE [G, E], from one all-to-all (as AutoEP's own count
    exchange is sent; gloo's all-gather is slower)."""
    if G == 1:
        return counts_E[None]
    counts_GE = torch.empty(G, *counts_E.shape, dtype=counts_E.dtype, device=counts_E.device)
    dist.all_to_all_single(counts_GE.view(-1), counts_E.repeat(G), group=ep_group)
    return counts_GE


def exact_routes(counts_GE: torch.Tensor, slot_EG: torch.Tensor, P: int, rank: int, fill: Fill = Fill(),
                 n_GE: Optional[torch.Tensor] = None):
    """The exact split of one batch (counts_GE [G, E]: `exchange_counts`) over the copies slot_EG [E, G] (each
    expert's physical slot on each rank, -1: none) on the device (`planning.steering.split`, or the given split
    n_GE [G, E]; every rank computes the same from the same integers; fill: `SlotTable.copies_on`'s), each
    rank filling its own copies first. Returns this rank's routes per copy [E, G] and every rank's routes per
    physical slot sends_GP [G, P] (row g: what rank g sends; column block g: what rank g receives)."""
    G = counts_GE.shape[0]
    if n_GE is None:
        n_GE = split(counts_GE.sum(0)[None], (slot_EG.T >= 0)[None], fill)[0]
    share_GEG = rank_share(counts_GE, n_GE.T, devices_ER=torch.where(slot_EG >= 0, torch.arange(G, device=slot_EG.device), -1))
    sends_GP = torch.zeros(G, P + 1, dtype=torch.long, device=counts_GE.device)
    sends_GP.scatter_add_(1, torch.where(slot_EG >= 0, slot_EG, P).reshape(1, -1).expand(G, -1), share_GEG.reshape(G, -1))
    return share_GEG[rank], sends_GP[:, :P]
