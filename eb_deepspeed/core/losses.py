"""The balance losses the gates attach, and whose expert frequencies they take (`aux.batch_scope`).

Shape legend: E experts, T tokens, K top-k, B sequences, S sequence length, G devices.

The balance loss of one layer is l = E · Σ_e f_e · P_e (1 at balance): f_e the share of routes that went to
expert e, P_e the mean router probability of expert e over this forward's tokens (the only differentiable part).
The scope says over which tokens f is counted:

  * "micro": this micro-batch on this rank (DeepSpeed's l_aux, HF's loss; the framework's own);
  * "global_exact": every data-parallel rank, and every micro-batch of the optimizer step so far
    (arXiv 2501.11873; Megatron-Core's `global_aux_loss`): one all-reduce of [E] per layer per micro-batch;
  * "sequence": each sequence on its own, averaged over sequences (DeepSeek-V3's sequence-wise balance loss).

`device_balance_loss` is DeepSeek-V2's device-level balance loss (with one expert per "device", the expert-level
one). `core.controls.LayerControls` is where gates call them from.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

__all__ = ["GlobalShares", "expert_balance_loss", "device_balance_loss", "sequence_balance_loss"]

BATCH_SCOPES = ("micro", "global_exact", "sequence")


class GlobalShares:
    """The global batch's expert frequencies f_E of each layer (the "global_exact" scope), for the balance loss.

    Args:
        experts_L: experts of each local layer.
        all_reduce: sums a tensor in place over the data-parallel ranks (None: one rank).
        device: where the counts are reduced (the process group's device).
    """

    def __init__(self, experts_L: Sequence[int], all_reduce: Optional[Callable] = None,
                 device: torch.device | str = "cpu"):
        self.all_reduce = all_reduce
        self.routes_LE = [torch.zeros(int(e), dtype=torch.float64, device=device) for e in experts_L]   # the step so far
        self.share_LE: list[Optional[torch.Tensor]] = [None] * len(self.routes_LE)        # the f handed out last

    def share(self, layer: int, routed_E: Optional[torch.Tensor] = None, rerun: bool = False) -> Optional[torch.Tensor]:
        """f_E (float32, summing to 1) for the loss of this forward of `layer`, or None (no routes yet: the
        forward's own).

        Args:
            routed_E: this forward's routes per expert (first run of a forward). Every rank must call it for
                the same forwards: it is one all-reduce.
            rerun: the re-run of a forward (activation checkpointing): the first run's f, no collective.
        """
        if rerun:
            return self.share_LE[layer]
        # a copy: the all-reduce works in place, and the gate's own counts must stay its own
        counts_E = routed_E.detach().to(self.routes_LE[layer].device, torch.float64, copy=True).reshape(-1)
        if self.all_reduce is not None:
            self.all_reduce(counts_E)
        self.routes_LE[layer] += counts_E
        # no host read of the total: with no route anywhere yet the share is all zeros, and so is the loss
        # (as this forward's own, which has no route either)
        routes_E = self.routes_LE[layer]
        self.share_LE[layer] = (routes_E / routes_E.sum().clamp_min(1.0)).float()
        return self.share_LE[layer]

    def new_step(self) -> None:
        """An optimizer step boundary (or a skipped step): counting starts afresh."""
        for routes_E in self.routes_LE:
            routes_E.zero_()
        self.share_LE = [None] * len(self.routes_LE)


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
                        share_E: Optional[torch.Tensor] = None, valid_T: Optional[torch.Tensor] = None) -> torch.Tensor:
    """E · Σ_e f_e · P_e, 1 at balance.

    Args:
        probs_TE: [T, E] router probabilities; P_E is the mean over the tokens that count.
        routed_E: [E] this forward's routes per expert: f_e = routed_e / (K · T) (the "micro" scope).
        share_E: [E] f of the global batch instead (summing to 1), or None.
        valid_T: [T] bool, the tokens that count (None: all; padding is False).
    """
    E = probs_TE.shape[1]
    probs_E, T = _mean_probs(probs_TE, valid_T)
    if share_E is not None:
        routed_E = share_E.to(probs_TE.device) * (k * T)
    # the device-level loss with one expert per device, in its own order of operations
    return (_fair_shares(routed_E, E, k, T, probs_TE.dtype) * probs_E).sum()


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
        at balance, as DeepSpeed's l_aux does.
    """
    E = probs_TE.shape[1]
    probs_E, T = _mean_probs(probs_TE, valid_T)
    share_E = _fair_shares(routed_E, E, k, T, probs_E.dtype)
    zeros_G = torch.zeros(experts_G.shape[0], dtype=probs_E.dtype, device=probs_E.device)
    share_G = zeros_G.index_add(0, expert_to_device_E, share_E) / experts_G.to(probs_E.dtype)
    probs_G = zeros_G.index_add(0, expert_to_device_E, probs_E)
    return (share_G * probs_G).sum()
