"""`AutoEPBalance`: the balancer's gate for one of DeepSpeed's `AutoEPMoELayer`s (HF MoE models under AutoEP).

Shape legend: T tokens (batch x sequence, flattened), E experts, K top-k, G EP ranks.

AutoEP's layer stays as DeepSpeed built it (class, parameters, state-dict keys); hooks on its router do the rest:
  * `router.gate` keeps the logits [T, E]; `router` (output `(top_scores_TK, selected_TK, tokens_E)`) adds the
    routes to the tally once per route (`_counts_now`: training forwards with autograd on, never an activation-
    checkpointing re-run), padding of the model's `attention_mask` left out; with training replicas on the rank that
    computes each route (`ranks_of`). AutoEP's `tokens_per_expert` is not read: eval forwards and re-runs add to it.
  * `balance` mode attaches loss_coeff x (expert-level + device_loss_weight x device-level loss), both 1.0 at
    balance, on the router's probabilities, to `top_scores_TK` (`attach_loss`: unchanged forward, the gradient added
    in backward, Megatron-Core's way): the user's loss needs no extra term.
  * the `controls`' selection bias (logit units, as on DeepSpeed-MoE and Megatron-Core) goes through the router's
    `expert_bias` argument as f(l + b) - f(l) in score units (sigmoid: f = sigmoid; softmax: p x (exp(b) - 1), which
    ranks as l + b does): the top-k of the biased logits, gate values unbiased; a pretrained `e_score_correction_bias`
    is added after it. The bias is the balancer's (in DeepSpeed's client_state); AutoEP's `expert_bias` stays None."""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ...core.controls import LayerControls, expert_balance_loss
from ...core.tally import LayerTally, in_backward, logit_sums, route_counts

__all__ = ["AutoEPBalance"]


def choice_sums(router, logits_TE: torch.Tensor) -> torch.Tensor:
    """Per-token sums [T] of what the router's top-k chooses on: the logits, plus its pretrained score correction
    bias (DeepSeek-V3's `e_score_correction_bias`) where it has one. A NaN or Inf in either makes every affected
    sum non-finite, so the tally counts those tokens as non-finite (the layer leaves the view, its controls hold,
    one warning) instead of learning from routes a NaN chose. No host sync."""
    sums_T = logit_sums(logits_TE)
    correction = getattr(router, "e_score_correction_bias", None)
    return sums_T if correction is None else sums_T + correction.detach().float().sum()


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
    """One AutoEP layer's tally and controls (`core.balancer.BalancedGate`), by hooks on its router.

    layer: the `AutoEPMoELayer`; layer_index: its place among the model's MoE layers; loss_coeff: the balance
    loss's coefficient; grad_scale: see `attach_loss`; balance: attach the loss and the bias (False: observe)."""

    def __init__(self, layer: torch.nn.Module, layer_index: int, *, loss_coeff: float,
                 grad_scale: Callable[[], float], balance: bool, num_devices: int = 0):
        router = layer.router
        self.layer, self.layer_index = layer, layer_index
        self.num_experts, self.k = int(layer.num_experts), int(layer.top_k)
        self.score_func = router.score_func
        self.loss_coeff, self.grad_scale, self.balance = float(loss_coeff), grad_scale, balance
        self.tally = LayerTally(self.num_experts, num_devices)     # with devices: each route's rank, from `ranks_of`
        self.ranks_of: Optional[Callable[[], Optional[torch.Tensor]]] = None
        self.controls = LayerControls(self.num_experts)
        self.valid_T: Optional[torch.Tensor] = None             # the model's attention mask, per forward
        self._logits_TE: Optional[torch.Tensor] = None
        self._uncounted = 0       # training forwards without autograd whose reentrant re-run has not come yet
        self._generation = 0      # the tally's generation `_uncounted` belongs to (a new step forgets them)
        self._bias_TE: Optional[torch.Tensor] = None            # this forward's bias in score units, to fill
        router.register_forward_pre_hook(self._before_router)
        router.gate.register_forward_hook(self._keep_logits)
        router.register_forward_hook(self._after_router)

    def _before_router(self, router, args):
        """With a bias: the router's `expert_bias` argument becomes a [T, E] tensor that `_keep_logits` fills."""
        if self.controls.bias_E is None:
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
                bias_E = self.controls.bias_on(logits_TE.device)
                if self.score_func == "sigmoid":
                    bias_TE.copy_(torch.sigmoid(logits_TE + bias_E) - torch.sigmoid(logits_TE))
                else:
                    bias_TE.copy_(F.softmax(logits_TE, dim=1) * torch.expm1(bias_E))

    def _counts_now(self) -> bool:
        """Whether this router forward's routes go into the tally (see the module doc)."""
        if self._generation != self.tally.generation:     # a step boundary (or a discard) since: forget them
            self._uncounted, self._generation = 0, self.tally.generation
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
        attaching = self.balance and torch.is_grad_enabled() and self.loss_coeff > 0 and T > 0
        ctl = self.controls
        if not counting and not attaching:
            return None
        with torch.set_grad_enabled(attaching):
            probs_TE = self._probs(logits_TE)      # padding is masked by valid_T, never indexed out (no host sync)
            routed_E = tokens_E.detach() if valid_T is None else \
                route_counts(torch.where(valid_T[:, None], selected_TK, -1), self.num_experts)
            l_aux = expert_balance_loss(probs_TE, routed_E, self.k, valid_T)
        if counting:
            self.tally.add_routes(selected_TK, routed_E=routed_E, logit_sums_T=choice_sums(router, logits_TE), l_aux=l_aux,
                                  valid_T=valid_T, device_TK=self.ranks_of() if self.ranks_of else None)
        if not attaching:
            return None
        loss = l_aux + ctl.device_loss(probs_TE, routed_E, self.k, valid_T)
        return (attach_loss(top_scores_TK, self.loss_coeff * loss, self.grad_scale), selected_TK, tokens_E)

    def _probs(self, logits_TE: torch.Tensor) -> torch.Tensor:
        """The router's probabilities over experts [T, E] -> [T, E] (fp32): softmax, or sigmoid scores
        normalised per token (DeepSeek-V3's sequence-wise balance loss does the same)."""
        if self.score_func == "sigmoid":
            scores_TE = torch.sigmoid(logits_TE.float())
            return scores_TE / scores_TE.sum(1, keepdim=True).clamp_min(1e-20)
        return F.softmax(logits_TE.float(), dim=1)


def find_autoep_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Every `AutoEPMoELayer` of a converted model, in module order (the order of layers)."""
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    return [(name, m) for name, m in model.named_modules() if isinstance(m, AutoEPMoELayer)]
