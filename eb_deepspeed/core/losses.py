"""The balance losses the gates attach.

Shape legend: E experts, T tokens, K top-k, G devices.

The balance loss of one layer is l = E · Σ_e f_e · P_e (1 at balance): f_e the share of this micro-batch's routes
on this rank that went to expert e (DeepSpeed's l_aux, HF's loss), P_e the mean router probability of expert e
over its tokens (the only differentiable part). Other scopes of f (global batch, per sequence): docs/benchmarks.md,
"batch scopes"; on Megatron-Core its own losses stay.

`device_balance_loss` is DeepSeek-V2's device-level balance loss (with one expert per "device", the expert-level
one). `core.controls.LayerControls` is where gates call it from."""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["expert_balance_loss", "device_balance_loss"]


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
