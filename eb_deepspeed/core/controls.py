"""One MoE layer's training controls, as data: what the balancer decides and every gate or router reads.

Shape legend: E experts of the layer, G EP ranks of its group, T tokens, K top-k.

Each layer's gate (DeepSpeed's `CrossLayerGate`, AutoEP's `AutoEPBalance`, Megatron's `EBRouter`) holds a
`LayerControls` that the `Balancer` writes at step boundaries and the gate reads in every forward:

    ctl = gate.controls
    selection_TE = logits_TE if ctl.bias_E is None else logits_TE + ctl.bias_on(logits_TE.device)
    loss = l_aux + ctl.device_loss(probs_TE, routed_E, k)            # 0 when the policy has no device loss

The balance losses the gates attach. That of one layer is l = E · Σ_e f_e · P_e (1 at balance): f_e the share of this
micro-batch's routes on this rank that went to expert e (DeepSpeed's l_aux, HF's loss), P_e the mean router
probability of expert e over its tokens (the only differentiable part). Other scopes of f (global batch, per
sequence): docs/benchmarks.md, "batch scopes"; on Megatron-Core its own losses stay. `device_balance_loss` is
DeepSeek-V2's device-level balance loss (with one expert per "device", the expert-level one)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

__all__ = ["LayerControls", "expert_balance_loss", "device_balance_loss"]


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


def _mean_probs(probs_TE: torch.Tensor, valid_T: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | int]:
    """P_E, the mean router probability over the tokens that count [T, E] -> [E], and their number T (an int;
    with a mask, a 0-dim tensor: the mask is multiplied, never indexed, so nothing waits for the host)."""
    if valid_T is None:
        return probs_TE.mean(0), probs_TE.shape[0]
    mask_T1 = valid_T.reshape(-1, 1).to(probs_TE.dtype)
    return (probs_TE * mask_T1).sum(0) / mask_T1.sum().clamp_min(1.0), mask_T1.sum()


def _fair_shares(routed_E: torch.Tensor, E: int, k: int, T: torch.Tensor | int, dtype) -> torch.Tensor:
    """f_E = routed_E · E / (k · T): 1 = an expert's fair share of the k · T routes (T 0: f 0)."""
    if isinstance(T, int):
        return routed_E.to(dtype) * (E / (k * max(T, 1)))
    return routed_E.to(dtype) * (E / k) / T.clamp_min(1.0)


def expert_balance_loss(probs_TE: torch.Tensor, routed_E: torch.Tensor, k: int,
                        valid_T: Optional[torch.Tensor] = None) -> torch.Tensor:
    """E · Σ_e f_e · P_e, 1 at balance.

    Args:
        probs_TE: [T, E] router probabilities; P_E is the mean over the tokens that count.
        routed_E: [E] this forward's routes per expert: f_e = routed_e / (K · T).
        valid_T: [T] bool, the tokens that count (None: all; padding is False)."""
    probs_E, T = _mean_probs(probs_TE, valid_T)
    # the device-level loss with one expert per device, in its own order of operations
    return (_fair_shares(routed_E, probs_TE.shape[1], k, T, probs_TE.dtype) * probs_E).sum()


def device_balance_loss(probs_TE: torch.Tensor, routed_E: torch.Tensor, expert_to_device_E: torch.Tensor,
                        experts_G: torch.Tensor, k: int, valid_T: Optional[torch.Tensor] = None) -> torch.Tensor:
    """DeepSeek-V2's device-level balance loss of one forward (1.0 when devices are balanced).

    Args:
        probs_TE: [T, E] the router's unbiased probabilities over all experts.
        routed_E: [E] routes per expert this forward (its top-k choices).
        expert_to_device_E: [E] device of each expert; experts_G: [G] experts on each device (>= 1).
        valid_T: [T] bool, the tokens that count (None: all).
    Returns:
        Σ_g f'_g · P'_g with f_e = routed_e · E / (k · T) (1 = its fair share), f'_g the mean of f_e over the
        device's experts, P'_g the sum over them of P_e = mean over tokens of probs_e. The gradient flows
        through P only and moves mass off the devices that get more than their share, whichever of their
        experts the routes went to (the expert-level loss does not see that). Local to the rank, no collective,
        no host sync. With top-1's `used_token` mask the masked tokens route nowhere and the loss sits below 1
        at balance, as DeepSpeed's l_aux does."""
    probs_E, T = _mean_probs(probs_TE, valid_T)
    share_E = _fair_shares(routed_E, probs_TE.shape[1], k, T, probs_E.dtype)
    zeros_G = torch.zeros(experts_G.shape[0], dtype=probs_E.dtype, device=probs_E.device)
    share_G = zeros_G.index_add(0, expert_to_device_E, share_E) / experts_G.to(probs_E.dtype)
    probs_G = zeros_G.index_add(0, expert_to_device_E, probs_E)
    return (share_G * probs_G).sum()
