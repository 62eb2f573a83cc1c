"""One MoE layer's training controls, as data: what the balancer decides and every gate or router reads.

Shape legend: E experts of the layer, G EP ranks of its group, T tokens, K top-k.

torchtitan's MoE reads its `expert_bias` buffer in forward and nobody calls a setter on it; here each layer's
gate (DeepSpeed's `CrossLayerGate`, AutoEP's `AutoEPBalance`, Megatron's `EBRouter`) holds a `LayerControls`
that the `Balancer` writes at step boundaries and the gate reads in every forward:

    ctl = gate.controls
    selection_TE = logits_TE if ctl.bias_E is None else logits_TE + ctl.bias_on(logits_TE.device)
    loss = l_aux + ctl.device_loss(probs_TE, routed_E, k)            # 0 when the policy has no device loss

`balance_loss` is the expert-level loss of `aux.batch_scope` (written once, for every adapter that computes it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .losses import GlobalShares, device_balance_loss, expert_balance_loss, sequence_balance_loss

__all__ = ["LayerControls"]


@dataclass
class LayerControls:
    """The controls of one MoE layer (defaults: route and weigh as the framework does).

    bias_E: [E] selection bias in logit units (added to the scores that choose the top-k, never to the gate
        values); None: no bias. device_loss_weight: weight of the device-level balance loss added to the layer's
        loss (0: not computed). expert_to_device_E: [E] EP rank of each expert within the layer's group (for
        the device loss). batch_scope: over which tokens the expert-level loss counts its frequencies
        (`core.losses`); global_shares/layer: the exact global scope's shared counts and this layer's row.
        seq_len: tokens per sequence of the next forward (the "sequence" scope; None: one sequence).
    """
    num_experts: int
    bias_E: Optional[torch.Tensor] = None
    device_loss_weight: float = 0.0
    expert_to_device_E: Optional[torch.Tensor] = None
    batch_scope: str = "micro"
    global_shares: Optional[GlobalShares] = None
    layer: int = 0
    seq_len: Optional[int] = None
    experts_per_device_G: Optional[torch.Tensor] = field(default=None, repr=False)   # from the map, on the host
    _on_device: dict = field(default_factory=dict, repr=False)    # name -> (host value, its copy on a device)

    # ------------------------------------------------------------------ written by the balancer
    def set_device_map(self, expert_to_device_E: torch.Tensor, device: torch.device | str = "cpu") -> None:
        """The layer's expert -> EP rank map [E] (group-local ranks), kept on `device` (the gates' device: copied
        when the map changes, never in a forward)."""
        map_E = torch.as_tensor(expert_to_device_E, dtype=torch.long).cpu()
        self.expert_to_device_E = map_E.to(device, copy=True)
        self.experts_per_device_G = torch.bincount(map_E).clamp_min(1).to(device)    # on the host, once

    def set_bias(self, bias_E: Optional[torch.Tensor]) -> None:
        """The selection bias [E], held as float32; a float32 tensor without autograd is held as given, with no op
        (the balancer hands every layer a view of one fresh [L, E] tensor per step, on the gates' device)."""
        if bias_E is not None and (bias_E.dtype != torch.float32 or bias_E.requires_grad):
            bias_E = bias_E.detach().to(torch.float32)
        self.bias_E = bias_E

    # ------------------------------------------------------------------ read by gates
    def bias_on(self, device) -> torch.Tensor:
        """bias_E [E] (float32) on `device`, copied once per value."""
        return self._copy("bias", self.bias_E, device)

    def device_loss(self, probs_TE: torch.Tensor, routed_E: torch.Tensor, k: int,
                    valid_T: Optional[torch.Tensor] = None) -> torch.Tensor | float:
        """device_loss_weight x DeepSeek-V2's device-level balance loss of this forward (0.0 when off).

        probs_TE [T, E]: the router's unbiased probabilities; routed_E [E]: routes per expert this forward;
        valid_T [T]: the tokens that count (None: all)."""
        if self.device_loss_weight <= 0:
            return 0.0
        map_E = self._copy("map", self.expert_to_device_E, probs_TE.device)
        experts_G = self._copy("experts_G", self.experts_per_device_G, probs_TE.device)
        return self.device_loss_weight * device_balance_loss(probs_TE, routed_E, map_E, experts_G, k, valid_T)

    def balance_loss(self, probs_TE: torch.Tensor, routed_E: torch.Tensor, k: int, *, selected_TK: torch.Tensor,
                     first_run: bool, valid_T: Optional[torch.Tensor] = None,
                     own: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The expert-level balance loss of this forward under `batch_scope`, 1 at balance.

        Args:
            probs_TE: [T, E] the router's probabilities (P counts the tokens of valid_T).
            routed_E: [E] this forward's routes per expert (padding left out).
            selected_TK: [T, K] chosen experts of every token (the "sequence" scope reads it; -1: no route).
            first_run: the first run of this forward (not activation checkpointing's re-run): the exact
                global scope's all-reduce runs then, on every rank for the same forwards.
            valid_T: [T] real tokens (None: all).
            own: the framework's own loss of this forward, kept while the global scope has no frequencies yet
                (None: this forward's own frequencies).
        """
        if self.batch_scope == "sequence":
            T = selected_TK.shape[0]
            seq_len = self.seq_len if self.seq_len and T % self.seq_len == 0 else T
            return sequence_balance_loss(probs_TE, selected_TK, seq_len, self.num_experts, valid_T)
        share_E = None
        if self.global_shares is not None:
            share_E = self.global_shares.share(self.layer, routed_E if first_run else None, rerun=not first_run)
            if share_E is None and own is not None:
                return own
        return expert_balance_loss(probs_TE, routed_E, k, share_E, valid_T)

    # ------------------------------------------------------------------ helpers
    def _copy(self, name: str, value: Optional[torch.Tensor], device) -> Optional[torch.Tensor]:
        """`value` on `device`, copied once per value (a new value replaces the copy)."""
        if value is None:
            return None
        held = self._on_device.get(name)
        if held is None or held[0] is not value or held[1].device != torch.device(device):
            held = self._on_device[name] = (value, value.to(device))
        return held[1]
