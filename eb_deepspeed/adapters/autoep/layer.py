"""`AutoEPBalance`: the balancer's gate for one of DeepSpeed's `AutoEPMoELayer`s (HF MoE models under AutoEP).

Shape legend: T tokens (batch x sequence, flattened), E experts, K top-k, G EP ranks.

AutoEP's layer is left as DeepSpeed built it (class, parameters, state-dict keys); two forward hooks on its
router do the rest:

  * `router.gate` (the linear layer): keep this forward's router logits [T, E];
  * `router` (`TokenChoiceTopKRouter`, output `(top_scores_TK, selected_TK, num_tokens_per_expert_E)`):
      - add the routes to the layer's tally (`TallyRecorder.record_routes`; padding tokens of the model's
        `attention_mask` left out), counted once per route: only in training forwards with autograd on,
        never in the re-run of activation checkpointing (non-reentrant: the first forward counted; reentrant:
        the first forward ran without autograd, so its re-run inside backward counts instead);
      - in `balance` mode, attach the balance loss to `top_scores_TK` (Megatron-Core's way: the activation is
        unchanged forward, and backward adds the loss's gradient), so the user's loss needs no extra term:
            loss_coeff x (aux_weight x expert-level loss + device_loss_weight x device-level loss),
        both 1.0 at balance (`core.losses.device_balance_loss`; expert level = one expert per "device"),
        on the router's probabilities (softmax, or sigmoid scores normalised per token), local to the rank;
  * the selection bias (`bias` policies) goes through AutoEP's own door, the router's `expert_bias` argument,
    which the router adds to its scores for the top-k choice only (the gate values come from the unbiased
    scores). Ours is in logit units, as on DeepSpeed-MoE and Megatron-Core (its rate means the same
    everywhere, and it moves a collapsed softmax as readily as a balanced one): a router pre-hook hands the
    router a [T, E] tensor that the gate hook fills, once the logits exist, with f(l + b) - f(l) — for
    sigmoid scores f = sigmoid; for softmax p * (exp(b) - 1), which ranks as l + b does — so the top-k is
    that of the biased logits. A DeepSeek model's pretrained `e_score_correction_bias` (score units) is
    added after it, as loaded: the two combine, neither is dropped or doubled. AutoEP's layer keeps its
    `expert_bias` of None; the bias is the balancer's (checkpointed in DeepSpeed's client_state).

The hazard of AutoEP's `tokens_per_expert` buffer (never reset; eval forwards and checkpoint re-runs add to it)
is why the tally comes from the router's output instead.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ...core.losses import sequence_balance_loss
from ...core.losses import device_balance_loss
from ...core.tally import TallyRecorder, in_backward, route_counts

__all__ = ["AutoEPBalance", "attach_loss"]


class _AttachLoss(torch.autograd.Function):
    """Forward: the activation as it is. Backward: its gradient, plus d(loss) x scale() for `loss`."""

    @staticmethod
    def forward(ctx, activation, loss, scale):
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return activation

    @staticmethod
    def backward(ctx, grad):
        loss, = ctx.saved_tensors
        return grad, torch.ones_like(loss) * ctx.scale(), None


def attach_loss(activation: torch.Tensor, loss: torch.Tensor, scale: Callable[[], float]) -> torch.Tensor:
    """`activation`, with `loss` joined to the backward pass as if the user's loss had `+ loss`; `scale()`
    (read during backward) is what the engine applies to the user's loss: 1 / gradient accumulation steps,
    times the fp16 loss scale."""
    return _AttachLoss.apply(activation, loss, scale)


class AutoEPBalance:
    """One AutoEP layer's tally and controls (the `core.balancer.BalancedGate` protocol), by hooks.

    layer: the `AutoEPMoELayer`; layer_index: its place among the model's MoE layers; expert_to_device_E:
    [E] EP rank (within the layer's group) of each expert; loss_coeff: the balance loss's coefficient;
    grad_scale: see `attach_loss`; balance: attach the loss and the bias (False: observe only).
    """

    def __init__(self, layer: torch.nn.Module, layer_index: int, expert_to_device_E: torch.Tensor, *,
                 loss_coeff: float, grad_scale: Callable[[], float], balance: bool):
        router = layer.router
        self.layer, self.layer_index = layer, layer_index
        self.num_experts, self.k = int(layer.num_experts), int(layer.top_k)
        self.score_func = router.score_func
        self.loss_coeff, self.grad_scale, self.balance = float(loss_coeff), grad_scale, balance
        self.tally = TallyRecorder(self.num_experts)
        self.aux_weight = 1.0
        self.device_loss_weight = 0.0
        self.expert_to_device_E = expert_to_device_E.long()
        self.num_devices = int(self.expert_to_device_E.max()) + 1
        self._identity_E = torch.arange(self.num_experts)       # the expert-level loss: one expert per "device"
        self.token_weights_T: Optional[torch.Tensor] = None     # sequence-length weighting, per forward
        self.valid_T: Optional[torch.Tensor] = None             # the model's attention mask, per forward
        self._logits_TE: Optional[torch.Tensor] = None
        self._uncounted = 0       # training forwards without autograd whose reentrant re-run has not come yet
        self.bias_E: Optional[torch.Tensor] = None              # the selection bias, logit units (None: off)
        self.batch_scope = "micro"                              # `aux.batch_scope` (core/losses.py)
        self.global_share: Optional[Callable[..., Optional[torch.Tensor]]] = None   # the global scopes' f_E
        self.seq_len: Optional[int] = None                      # tokens per sequence, per forward (model hook)
        self._bias_TE: Optional[torch.Tensor] = None            # this forward's bias in score units, to fill
        router.register_forward_pre_hook(self._before_router)
        router.gate.register_forward_hook(self._keep_logits)
        router.register_forward_hook(self._after_router)

    # ------------------------------------------------------------------ BalancedGate
    def take_tally(self, device: torch.device | str = "cpu") -> torch.Tensor:
        self._uncounted = 0
        return self.tally.take(device)

    def discard_tally(self, last_forward_only: bool = False) -> None:
        self.tally.discard(last_forward_only)
        if not last_forward_only:
            self._uncounted = 0

    def set_aux_weight(self, weight: float) -> None:
        self.aux_weight = float(weight)

    def set_device_loss(self, weight: float, expert_to_device_E: torch.Tensor) -> None:
        self.device_loss_weight = float(weight)
        self.expert_to_device_E = expert_to_device_E.to(self._identity_E.device, torch.long)
        self.num_devices = int(self.expert_to_device_E.max()) + 1

    def set_selection_bias(self, bias_E: Optional[torch.Tensor]) -> None:
        self.bias_E = None if bias_E is None else bias_E.to(self.layer.router.gate.weight.device, torch.float32)

    def set_token_weights(self, weights_T: Optional[torch.Tensor]) -> None:
        self.token_weights_T = weights_T

    def set_batch_scope(self, scope: str, share: Optional[Callable[..., Optional[torch.Tensor]]]) -> None:
        self.batch_scope, self.global_share = scope, share

    # ------------------------------------------------------------------ hooks
    def _before_router(self, router, args):
        """With a bias: the router's `expert_bias` argument becomes a [T, E] tensor that `_keep_logits` fills."""
        if self.bias_E is None:
            return None
        x_TH = args[0]
        self._bias_TE = torch.zeros(x_TH.shape[0], self.num_experts, dtype=torch.float32, device=x_TH.device)
        return (x_TH, self._bias_TE) + tuple(args[2:])

    def _keep_logits(self, gate, args, logits_TE) -> None:
        self._logits_TE = logits_TE
        bias_TE, self._bias_TE = self._bias_TE, None
        if bias_TE is not None:         # in score units, the logit bias's effect on the top-k (module doc)
            with torch.no_grad():
                logits_TE = logits_TE.float()
                if self.score_func == "sigmoid":
                    bias_TE.copy_(torch.sigmoid(logits_TE + self.bias_E) - torch.sigmoid(logits_TE))
                else:
                    bias_TE.copy_(F.softmax(logits_TE, dim=1) * torch.expm1(self.bias_E))

    def _counts_now(self) -> bool:
        """Whether this router forward's routes go into the tally (see the module doc)."""
        if not torch.is_grad_enabled():
            if not in_backward():
                self._uncounted += 1        # a reentrant checkpoint's first forward, or a no-grad forward
            return False
        if not in_backward():
            self._uncounted = 0
            return True
        if self._uncounted:                 # the re-run of a forward that ran without autograd
            self._uncounted -= 1
            return True
        return False                        # the re-run of a forward already counted

    def _after_router(self, router, args, output):
        logits_TE, self._logits_TE = self._logits_TE, None
        if not self.layer.training or logits_TE is None:
            return None
        top_scores_TK, selected_TK, tokens_E = output
        T = selected_TK.shape[0]
        valid_T = self.valid_T if self.valid_T is not None and self.valid_T.numel() == T else None
        counting = self._counts_now()
        attaching = self.balance and torch.is_grad_enabled() and self.loss_coeff > 0 and T > 0 and \
            (self.aux_weight > 0 or self.device_loss_weight > 0)
        if not counting and not attaching:
            return None
        with torch.set_grad_enabled(attaching):
            probs_TE = self._probs(logits_TE if valid_T is None else logits_TE[valid_T])
            routed_E = tokens_E.detach() if valid_T is None else \
                route_counts(torch.where(valid_T[:, None], selected_TK, -1), self.num_experts)
            if self._identity_E.device != routed_E.device:      # the maps move to the routes' device once
                self._identity_E = self._identity_E.to(routed_E.device)
                self.expert_to_device_E = self.expert_to_device_E.to(routed_E.device)
            l_aux = self._expert_loss(logits_TE, probs_TE, selected_TK, routed_E, valid_T, counting)
        if counting:
            self.tally.record_routes(selected_TK, routed_E=routed_E, logits_TE=logits_TE, l_aux=l_aux,
                                     token_weights_T=self.token_weights_T, valid_T=valid_T, layer=self.layer_index)
        if not attaching:
            return None
        loss = self.aux_weight * l_aux
        if self.device_loss_weight > 0:
            loss = loss + self.device_loss_weight * device_balance_loss(
                probs_TE, routed_E, self.expert_to_device_E, self.num_devices, self.k)
        return (attach_loss(top_scores_TK, self.loss_coeff * loss, self.grad_scale), selected_TK, tokens_E)

    def _expert_loss(self, logits_TE, probs_TE, selected_TK, routed_E, valid_T, first_run: bool) -> torch.Tensor:
        """The expert-level balance loss under `aux.batch_scope` (core/losses.py), 1 at balance: this
        forward's routes (micro), the global batch's f_E (global scopes; every rank's first run of a forward
        joins the exact scope's all-reduce), or sequence by sequence."""
        if self.batch_scope == "sequence":
            T = selected_TK.shape[0]
            seq_len = self.seq_len if self.seq_len and T % self.seq_len == 0 else T
            full_TE = probs_TE if valid_T is None else self._probs(logits_TE)
            return sequence_balance_loss(full_TE, selected_TK, seq_len, self.num_experts, valid_T)
        if self.global_share is not None:
            share_E = self.global_share(routed_E) if first_run else self.global_share(rerun=True)
            if share_E is not None:          # f_e of the global batch, as this forward's route counts
                routed_E = share_E.to(probs_TE.device) * (self.k * probs_TE.shape[0])
        return device_balance_loss(probs_TE, routed_E, self._identity_E, self.num_experts, self.k)

    def _probs(self, logits_TE: torch.Tensor) -> torch.Tensor:
        """The router's probabilities over experts [T, E] -> [T, E] (fp32): softmax, or sigmoid scores
        normalised per token (DeepSeek-V3's sequence-wise balance loss does the same)."""
        if self.score_func == "sigmoid":
            scores_TE = torch.sigmoid(logits_TE.float())
            return scores_TE / scores_TE.sum(1, keepdim=True).clamp_min(1e-20)
        return F.softmax(logits_TE.float(), dim=1)
