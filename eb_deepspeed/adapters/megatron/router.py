"""`EBRouter`: Megatron-Core's `TopKRouter` that feeds the cross-layer view and takes its controls.

Shape legend: T tokens (sequence x batch, flattened), E experts, K top-k, G EP ranks.

Routing, capacity dropping and the aux losses are Megatron's own (`TopKRouter.routing`). On top:

  * each training forward adds its routes (`routing_map`, padding excluded) to a per-layer tally
    (`core.tally.TallyRecorder`), no sync, no collective; a forward that activation recompute
    re-runs inside backward is not counted again (`core.tally.in_backward`);
  * `aux_weight` multiplies the coefficient Megatron reads for this layer's aux losses
    (`get_aux_loss_coeff`), so the layer's aux gradient scales by it (Megatron's
    `MoEAuxLossAutoScaler` scale is one global: per-layer weights must go through the coefficient);
  * `selection_bias_E` (the `bias` policy) selects the top-k on logits + bias (logit units, as on
    DeepSpeed, for softmax and sigmoid score functions alike); the probabilities that combine expert
    outputs and every aux loss come from the unbiased logits. It is this project's bias: Megatron's own `expert_bias`
    (`moe_router_enable_expert_bias`) must be off with it (`attach` refuses both);
  * `device_loss_weight` adds DeepSeek-V2's device-level balance loss (as the DeepSpeed gate does),
    with coefficient `device_loss_weight x moe_aux_loss_coeff`, through Megatron's own
    `attach_and_log_load_balancing_loss` (its gradient flows like the aux losses').

Swap it in with a spec (`MoESubmodules(router=EBRouter, ...)`) or let `adapters.megatron.attach`
turn the routers of a built model into EBRouters (their parameters and state-dict keys unchanged).
"""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.moe.router import TopKRouter

from ...core.losses import device_balance_loss
from ...core.tally import TallyRecorder, in_backward, routes_from_mask

__all__ = ["EBRouter"]


class EBRouter(TopKRouter):
    """TopKRouter plus per-layer route tallies, an aux weight, a selection bias and a device loss."""

    # Class defaults: TopKRouter.__init__ already calls get_aux_loss_coeff, before eb_init runs.
    aux_weight = 1.0
    selection_bias_E: Optional[torch.Tensor] = None
    device_loss_weight = 0.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.eb_init()

    def eb_init(self, layer_index: int = 0) -> None:
        """Give a router (built as TopKRouter or EBRouter) the balancer's state."""
        self.num_experts = int(self.config.num_moe_experts)
        self.layer_index = layer_index
        self.aux_weight = 1.0
        self.selection_bias_E = None
        self.device_loss_weight = 0.0
        self.expert_to_device_E: Optional[torch.Tensor] = None
        self.num_devices = 1
        self.token_weights_T: Optional[torch.Tensor] = None
        self.tally = TallyRecorder(self.num_experts)

    # ------------------------------------------------------------------ BalancedGate
    def take_tally(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return self.tally.take(device)

    def discard_tally(self, last_forward_only: bool = False) -> None:
        self.tally.discard(last_forward_only)

    def set_aux_weight(self, weight: float) -> None:
        self.aux_weight = float(weight)

    def set_selection_bias(self, bias_E: Optional[torch.Tensor]) -> None:
        self.selection_bias_E = None if bias_E is None else bias_E.to(self.weight.device, torch.float32)

    def set_device_loss(self, weight: float, expert_to_device_E: torch.Tensor) -> None:
        self.device_loss_weight = float(weight)
        self.expert_to_device_E = expert_to_device_E.to(self.weight.device, torch.long)
        self.num_devices = int(expert_to_device_E.max()) + 1

    def set_token_weights(self, weights_T: Optional[torch.Tensor]) -> None:
        self.token_weights_T = weights_T

    # ------------------------------------------------------------------ Megatron's router
    def get_aux_loss_coeff(self, aux_loss_type: str) -> float:
        return super().get_aux_loss_coeff(aux_loss_type) * self.aux_weight

    def routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        if self.selection_bias_E is None:
            probs, routing_map = super().routing(logits, padding_mask)
        else:
            probs, routing_map = self._biased_routing(logits, padding_mask)
        flat = logits.reshape(-1, self.num_experts)
        if self.device_loss_weight > 0 and self.training and torch.is_grad_enabled():
            probs = self._attach_device_loss(flat, probs, routing_map, padding_mask)
        if self.training and not in_backward():
            self._record(flat, routing_map, padding_mask)
        return probs, routing_map

    def _demand(self, logits_TE: torch.Tensor) -> torch.Tensor:
        """The top-k choice before capacity dropping [T, E] bool (what the tally calls routed), with
        whichever selection bias is in use (ours on the logits, or Megatron's expert_bias for sigmoid)."""
        with torch.no_grad():
            if self.selection_bias_E is not None:               # ours: on the logits
                scores = logits_TE.float() + self.selection_bias_E.float()
            elif self.expert_bias is not None:                  # Megatron's (sigmoid): on the sigmoid scores
                scores = torch.sigmoid(logits_TE.float()) + self.expert_bias.float()
            else:
                scores = logits_TE.float()
            top_TK = scores.topk(self.topk, dim=1).indices
            return torch.zeros_like(logits_TE, dtype=torch.bool).scatter(1, top_TK, True)

    def _record(self, logits_TE, routing_map_TE, padding_mask) -> None:
        with torch.no_grad():
            valid_T = None if padding_mask is None else ~padding_mask.reshape(-1).to(torch.bool)
            # with capacity dropping the routing map holds the kept routes; the demand is the top-k choice
            demand_TE = routing_map_TE if self.config.moe_expert_capacity_factor is None else self._demand(logits_TE)
            if valid_T is not None:
                demand_TE = demand_TE & valid_T[:, None]
            # Megatron attaches its aux losses to the probabilities; the tally's aux field stays 0 here
            self.tally.record_routes(routes_from_mask(routing_map_TE, self.topk), routed_E=demand_TE.sum(0),
                                     logits_TE=logits_TE, valid_T=valid_T, token_weights_T=self.token_weights_T,
                                     layer=self.layer_index)

    def _biased_routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor]):
        """Megatron's routing with the top-k chosen on scores + bias (its z-loss, capacity dropping and
        aux losses unchanged; they read the unbiased logits)."""
        from megatron.core.transformer.moe.moe_utils import (apply_router_token_dropping,
                                                            compute_routing_scores_for_aux_loss)
        cfg = self.config
        if cfg.moe_router_num_groups or self.routing_type == "sinkhorn" or self.expert_bias is not None:
            raise ValueError("the easybalance selection bias needs ungrouped top-k routing without Megatron's own "
                             "expert bias (moe_router_num_groups, sinkhorn and moe_router_enable_expert_bias are off)")
        seq_length, bsz = logits.shape[:2]
        logits = logits.view(-1, self.num_experts)
        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1)
        logits = self.apply_z_loss(logits, padding_mask=padding_mask)
        if self.score_function == "softmax":
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
        else:
            scores = torch.sigmoid(logits.float()).type_as(logits)
        # The bias is in logit units for both score functions, as on DeepSpeed (its rate means the same
        # everywhere); softmax and sigmoid are monotone, so the unbiased top-k is Megatron's.
        top_TK = torch.topk(logits + self.selection_bias_E.to(logits.dtype), k=self.topk, dim=1).indices
        if self.score_function == "softmax" and not cfg.moe_router_pre_softmax:
            weights_TK = torch.softmax(logits.gather(1, top_TK), dim=-1, dtype=torch.float32).type_as(logits)
        else:
            weights_TK = scores.gather(1, top_TK)
            if self.score_function == "sigmoid" and self.topk > 1:
                weights_TK = weights_TK / (weights_TK.sum(-1, keepdim=True) + 1e-20)
        if cfg.moe_router_topk_scaling_factor:
            weights_TK = weights_TK * cfg.moe_router_topk_scaling_factor
        probs = torch.zeros_like(logits).scatter(1, top_TK, weights_TK)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_TK, True)
        if cfg.moe_expert_capacity_factor is not None:
            probs, routing_map = apply_router_token_dropping(
                probs, routing_map, router_topk=self.topk, capacity_factor=cfg.moe_expert_capacity_factor,
                drop_policy=cfg.moe_token_drop_policy, pad_to_capacity=cfg.moe_pad_expert_input_to_capacity)
        if self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled():
            aux_map, aux_scores = compute_routing_scores_for_aux_loss(
                logits, self.topk, self.score_function, fused=cfg.moe_router_fusion, padding_mask=padding_mask)
            with_mask = padding_mask is not None
            probs = self._apply_aux_loss(probs, aux_scores, aux_map, with_padding_mask=with_mask)
            probs = self._apply_seq_aux_loss(probs, aux_scores, aux_map, seq_length, bsz, with_padding_mask=with_mask)
            probs = self._apply_global_aux_loss(probs, aux_scores, aux_map, with_padding_mask=with_mask)
        return probs, routing_map

    def _attach_device_loss(self, logits_TE, probs, routing_map_TE, padding_mask):
        valid_T = None if padding_mask is None else ~padding_mask.reshape(-1).to(torch.bool)
        probs_TE = torch.softmax(logits_TE.float(), dim=-1) if self.score_function == "softmax" \
            else torch.sigmoid(logits_TE.float())
        kept = routing_map_TE if valid_T is None else routing_map_TE & valid_T[:, None]
        if valid_T is not None:
            probs_TE = probs_TE[valid_T]
        base = self.config.moe_aux_loss_coeff
        base = float(base[0] if isinstance(base, (list, tuple)) else base)
        coeff = self.device_loss_weight * base   # relative to the model's aux coefficient, as on DeepSpeed
        if coeff == 0:
            return probs
        loss = device_balance_loss(probs_TE, kept.sum(0).detach(), self.expert_to_device_E, self.num_devices,
                                   self.topk)
        # Megatron's convention: the loss handed over already carries its coefficient
        return self.attach_and_log_load_balancing_loss(probs, coeff, coeff * loss, "device_balance_loss",
                                                       self.tp_cp_group)
