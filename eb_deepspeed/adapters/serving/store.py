"""What the serving engine asks of a runtime: a slot store (`SlotStore`), each slot one expert's weights.

Shape legend: L MoE layers, E logical experts, G EP ranks, S slots per rank, P physical slots (G * S; slot p
lives on EP rank p // S), H home experts per rank (E / G).

A runtime (DeepSpeed's `MOELayer`, AutoEP's dropless layer) is served through a `SlotStore`: S_max slots per
rank, each holding one expert's weights, and gates that put each logical route on a physical slot by a
`routing.SlotTable`. The engine (`engine.py`) decides placements and moves weights; a store only reads and writes
slots and serves the tables it is given."""
from __future__ import annotations

from typing import Optional, Protocol

import torch

from ...planning.placement import Placement
from ..routing import Routing

__all__ = ["SlotStore"]


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


def flat_state(tensors) -> torch.Tensor:
    """A slot's tensors as one vector (what `read_slot` returns and a weight move sends)."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflatten_into(tensors, flat: torch.Tensor) -> None:
    """`flat_state`'s vector back into `tensors`, in place."""
    at = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[at:at + t.numel()].view_as(t))
            at += t.numel()
