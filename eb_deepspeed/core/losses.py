"""The balance losses the gates attach, and whose expert frequencies they take (`aux.batch_scope`).

Shape legend: E experts, T tokens, K top-k, B sequences, S sequence length, G devices.

`device_balance_loss` is DeepSeek-V2's device-level balance loss (with one expert per "device", the
expert-level one); `sequence_balance_loss` DeepSeek-V3's sequence-wise loss; `GlobalShares` the global
batch's expert frequencies.

The balance loss of one layer is l = E · Σ_e f_e · P_e (1 at balance): f_e the share of routes that went to
expert e, P_e the mean router probability of expert e over this forward's tokens (the only differentiable part).
The scope says over which tokens f is counted:

  * "micro": this micro-batch on this rank (DeepSpeed's l_aux, HF's loss; the framework's own);
  * "global_exact": every data-parallel rank, and every micro-batch of the optimizer step so far
    (arXiv 2501.11873; Megatron-Core's `global_aux_loss`): one all-reduce of [E] per layer per micro-batch;
  * "global_lagged": the whole global batch of the last optimizer step, from the view's reduced tally (no
    collective of its own; one step late);
  * "sequence": each sequence on its own, averaged over sequences (DeepSeek-V3's sequence-wise balance loss).

"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

__all__ = ["BATCH_SCOPES", "GlobalShares", "device_balance_loss", "sequence_balance_loss"]

BATCH_SCOPES = ("micro", "global_exact", "global_lagged", "sequence")


class GlobalShares:
    """The global batch's expert frequencies f_E of each layer, for the balance loss.

    Args:
        scope: "global_exact" or "global_lagged".
        experts_L: experts of each layer.
        all_reduce: sums a tensor in place over the data-parallel ranks (None: one rank).
        device: where the counts are reduced (the balancer's tally device: the process group's).
    """

    def __init__(self, scope: str, experts_L: Sequence[int], all_reduce: Optional[Callable] = None,
                 device: torch.device | str = "cpu"):
        if scope not in ("global_exact", "global_lagged"):
            raise ValueError(f"scope ({scope!r}) must be 'global_exact' or 'global_lagged'")
        self.scope = scope
        self.all_reduce = all_reduce
        self.routes_LE = [torch.zeros(int(e), dtype=torch.float64, device=device) for e in experts_L]   # exact: the step so far
        self.share_LE: list[Optional[torch.Tensor]] = [None] * len(self.routes_LE)        # the f handed out last

    def share(self, layer: int, routed_E: Optional[torch.Tensor] = None, rerun: bool = False) -> Optional[torch.Tensor]:
        """f_E (float32, summing to 1) for the loss of this forward of `layer`, or None (no routes yet: the
        forward's own).

        Args:
            routed_E: this forward's routes per expert (exact scope, first run of a forward). Every rank must
                call it for the same forwards: it is one all-reduce.
            rerun: the re-run of a forward (activation checkpointing): the first run's f, no collective.
        """
        if self.scope == "global_lagged" or rerun:
            return self.share_LE[layer]
        # a copy: the all-reduce works in place, and the gate's own counts must stay its own
        counts_E = routed_E.detach().to(self.routes_LE[layer].device, torch.float64, copy=True).reshape(-1)
        if self.all_reduce is not None:
            self.all_reduce(counts_E)
        self.routes_LE[layer] += counts_E
        total = float(self.routes_LE[layer].sum())
        self.share_LE[layer] = (self.routes_LE[layer] / total).float() if total > 0 else None
        return self.share_LE[layer]

    def new_step(self) -> None:
        """An optimizer step boundary (or a skipped step): the exact scope starts counting afresh."""
        if self.scope == "global_exact":
            for routes_E in self.routes_LE:
                routes_E.zero_()
            self.share_LE = [None] * len(self.routes_LE)

    def after_view(self, routed_LE: torch.Tensor, valid_L: torch.Tensor) -> None:
        """The lagged scope takes the view's reduced routes of the step just taken [L, >=E]; a layer the view
        did not take, or that saw no routes, goes back to each forward's own (None)."""
        if self.scope != "global_lagged":
            return
        for layer, routes_E in enumerate(self.routes_LE):
            row_E = routed_LE[layer, :routes_E.numel()].to(torch.float64)
            total = float(row_E.sum())
            self.share_LE[layer] = (row_E / total).float() if bool(valid_L[layer]) and total > 0 else None


def sequence_balance_loss(probs_TE: torch.Tensor, selected_TK: torch.Tensor, seq_len: int, num_experts: int,
                          valid_T: Optional[torch.Tensor] = None) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, 1 at balance: the mean over sequences of E · Σ_e f_e · P_e,
    with f_e = routes of the sequence to e / (K · its tokens), P_e = its tokens' mean probability of e.

    Args:
        probs_TE: router probabilities [T, E], tokens sequence-major (token t of sequence t // seq_len).
        selected_TK: chosen experts [T, K] (-1: no route).
        seq_len: tokens per sequence S (T must be a multiple of it).
        valid_T: real tokens [T] (False: padding, left out of both f and P); None: all.
    Returns:
        the loss, a scalar (0 when there are no tokens).
    """
    T, K = selected_TK.shape
    if T == 0:
        return probs_TE.sum() * 0.0
    if seq_len <= 0 or T % seq_len:
        raise ValueError(f"tokens ({T}) must be a multiple of the sequence length ({seq_len})")
    B = T // seq_len
    mask_T = torch.ones(T, dtype=probs_TE.dtype, device=probs_TE.device) if valid_T is None \
        else valid_T.to(probs_TE.dtype)
    hits_TE = F.one_hot(selected_TK.long().clamp_min(0), num_experts).to(probs_TE.dtype) \
        * (selected_TK >= 0).to(probs_TE.dtype)[..., None]
    counts_BE = (hits_TE.sum(1) * mask_T[:, None]).view(B, seq_len, num_experts).sum(1)
    tokens_B = mask_T.view(B, seq_len).sum(1)
    real_B = (tokens_B > 0).to(probs_TE.dtype)                  # a sequence of padding only has no loss
    f_BE = counts_BE / (K * tokens_B.clamp_min(1.0)[:, None])
    P_BE = (probs_TE * mask_T[:, None]).view(B, seq_len, num_experts).sum(1) / tokens_B.clamp_min(1.0)[:, None]
    per_sequence_B = num_experts * (f_BE.detach() * P_BE).sum(1)
    return (per_sequence_B * real_B).sum() / real_B.sum().clamp_min(1.0)


def device_balance_loss(probs_TE: torch.Tensor, routed_E: torch.Tensor, expert_to_device_E: torch.Tensor,
                        num_devices: int, k: int) -> torch.Tensor:
    """DeepSeek-V2's device-level balance loss of one forward (1.0 when devices are balanced).

    probs_TE: the router's unbiased probabilities over all experts; routed_E: routes per expert this
    forward (its top-k choices). f_e = routed_e * E / (k * T): expert e's share (1 = its fair share);
    P_e = mean over tokens of probs_e. Per device g: f'_g = mean of f_e over its experts, P'_g = sum
    of P_e over them; loss = sum_g f'_g * P'_g. The gradient flows through P only and moves mass off
    the devices that get more than their share, whichever of their experts the routes went to (the
    expert-level l_aux does not see that). Local to the rank, no collective. With top-1's
    `used_token` mask the masked tokens route nowhere and the loss sits below 1 at balance, as
    DeepSpeed's l_aux does. Both adapters' gates call it.
    """
    T, E = probs_TE.shape
    probs_E = probs_TE.mean(0)
    share_E = routed_E.to(probs_E.dtype) * (E / (k * max(T, 1)))
    experts_G = torch.bincount(expert_to_device_E, minlength=num_devices).clamp_min(1).to(probs_E.dtype)
    zeros_G = torch.zeros(num_devices, dtype=probs_E.dtype, device=probs_E.device)
    share_G = zeros_G.index_add(0, expert_to_device_E, share_E) / experts_G
    probs_G = zeros_G.index_add(0, expert_to_device_E, probs_E)
    return (share_G * probs_G).sum()
