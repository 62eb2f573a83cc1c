"""One MoE layer's training controls, as data: what the balancer decides and every gate or router reads.

Shape legend: E experts of the layer, G EP ranks of its group, T tokens, K top-k.

Each layer's gate (DeepSpeed's `CrossLayerGate`, AutoEP's `AutoEPBalance`, Megatron's `EBRouter`) holds a
`LayerControls` that the `Balancer` writes at step boundaries and the gate reads in every forward:

    ctl = gate.controls
    selection_TE = logits_TE if ctl.bias_E is None else logits_TE + ctl.bias_on(logits_TE.device)
    loss = l_aux + ctl.device_loss(probs_TE, routed_E, k)            # 0 when the policy has no device loss"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .losses import device_balance_loss

__all__ = ["LayerControls"]


@dataclass
class LayerControls:
    """The controls of one MoE layer (defaults: route and weigh as the framework does)."""
    num_experts: int
    bias_E: Optional[torch.Tensor] = None     # [E] logit units, added to the top-k scores only, never the gate values
    device_loss_weight: float = 0.0          # weight of the device-level balance loss on the layer's loss (0: off)
    expert_to_device_E: Optional[torch.Tensor] = None   # [E] EP rank of each expert in its group (the device loss)
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

    def _copy(self, name: str, value: Optional[torch.Tensor], device) -> Optional[torch.Tensor]:
        """`value` on `device`, copied once per value (a new value replaces the copy)."""
        if value is None:
            return None
        held = self._on_device.get(name)
        if held is None or held[0] is not value or held[1].device != torch.device(device):
            held = self._on_device[name] = (value, value.to(device))
        return held[1]
