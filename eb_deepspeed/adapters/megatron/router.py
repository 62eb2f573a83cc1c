"""`EBRouter`: Megatron-Core's `TopKRouter` that feeds the cross-layer view and takes its controls.

Shape legend: T tokens (sequence x batch, flattened), E experts, K top-k, G EP ranks.

Routing, capacity dropping and the aux losses are Megatron's own (`TopKRouter.routing`). On top:

  * each training forward adds its routes (`routing_map`, padding excluded) to its tally, no sync, no
    collective; a forward that activation recompute re-runs inside backward is not counted again
    (`core.tally.in_backward`);
  * the selection bias of its `controls` (the `bias` policies) chooses the top-k on logits + bias through
    Megatron's top-k door (`_LogitBiasTopK`); Megatron's own `expert_bias` (`moe_router_enable_expert_bias`)
    must be off with it (`attach` refuses both);
  * a device-loss weight adds DeepSeek-V2's device-level balance loss, with coefficient `device_loss_weight x
    moe_aux_loss_coeff`, through Megatron's `attach_and_log_load_balancing_loss`; its own aux losses keep theirs.

Build it with the model (`eb_router_spec(spec)`); a model of plain `TopKRouter`s is converted in place by `attach`."""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.moe.router import TopKRouter

from ...core.controls import LayerControls
from ...core.tally import LayerTally, in_backward, logit_sums, routes_from_mask

__all__ = ["EBRouter", "eb_router_spec"]


def eb_router_spec(spec):
    """A copy of a Megatron module spec (a `ModuleSpec`, a block's `TransformerBlockSubmodules`, a list of
    layer specs, ...) with `EBRouter` as the router of every MoE layer in it.

    Args:
        spec: e.g. `get_gpt_layer_local_spec(num_experts=8)` or `get_moe_module_spec(...)`.
    Returns:
        The spec, copied, every `MoESubmodules.router` replaced; ValueError when it holds no MoE layer."""
    import copy
    import dataclasses

    from megatron.core.transformer.moe.moe_layer import MoESubmodules
    found = []

    def visit(node):
        if isinstance(node, MoESubmodules):
            node.router = EBRouter
            found.append(node)
        if isinstance(node, (list, tuple, dict)):
            for item in (node.values() if isinstance(node, dict) else node):
                visit(item)
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            for f in dataclasses.fields(node):
                visit(getattr(node, f.name))
    spec = copy.deepcopy(spec)
    visit(spec)
    if not found:
        raise ValueError(f"eb_router_spec: {type(spec).__name__} holds no MoE layer (no MoESubmodules)")
    return spec


class EBRouter(TopKRouter):
    """TopKRouter plus a route tally and the layer's controls (`core.balancer.BalancedGate`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.eb_init()

    def eb_init(self) -> None:
        """Give a router (built as TopKRouter or EBRouter) its tally and controls."""
        self.num_experts = int(self.config.num_moe_experts)
        self.tally = LayerTally(self.num_experts)
        self.controls = LayerControls(self.num_experts)

    def routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        if self.controls.bias_E is None:
            probs, routing_map = super().routing(logits, padding_mask)
        else:
            probs, routing_map = self._biased_routing(logits, padding_mask)
        flat = logits.reshape(-1, self.num_experts)
        # the tokens that count (padding: False), for the tally and the device loss of a training forward
        valid_T = None if padding_mask is None or not self.training else ~padding_mask.reshape(-1).to(torch.bool)
        if self.controls.device_loss_weight > 0 and self.training and torch.is_grad_enabled():
            probs = self._attach_device_loss(flat, probs, routing_map, valid_T)
        if self.training and not in_backward():
            self._record(flat, routing_map, valid_T)
        return probs, routing_map

    def _demand(self, logits_TE: torch.Tensor) -> torch.Tensor:
        """The top-k choice before capacity dropping [T, E] bool (what the tally calls routed), with
        whichever selection bias is in use (ours on the logits, or Megatron's expert_bias for sigmoid)."""
        with torch.no_grad():
            if self.controls.bias_E is not None:                # ours: on the logits
                scores = logits_TE.float() + self.controls.bias_on(logits_TE.device)
            elif self.expert_bias is not None:                  # Megatron's (sigmoid): on the sigmoid scores
                scores = torch.sigmoid(logits_TE.float()) + self.expert_bias.float()
            else:
                scores = logits_TE.float()
            top_TK = scores.topk(self.topk, dim=1).indices
            return torch.zeros_like(logits_TE, dtype=torch.bool).scatter(1, top_TK, True)

    def _record(self, logits_TE, routing_map_TE, valid_T) -> None:
        with torch.no_grad():
            # with capacity dropping the routing map holds the kept routes; the demand is the top-k choice
            demand_TE = routing_map_TE if self.config.moe_expert_capacity_factor is None else self._demand(logits_TE)
            if valid_T is not None:
                demand_TE = demand_TE & valid_T[:, None]
            # Megatron attaches its aux losses to the probabilities; the tally's aux field stays 0 here
            self.tally.add_routes(routes_from_mask(routing_map_TE, self.topk), routed_E=demand_TE.sum(0),
                                  logit_sums_T=logit_sums(logits_TE), valid_T=valid_T)

    def _biased_routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor]):
        """Megatron's own routing (`TopKRouter.routing`: z-loss, score function, scaling, capacity dropping, aux
        losses) with the top-k chosen on logits + bias: the choice goes through Megatron's top-k door, the
        `router_replay` object its routing asks for the top-k (`_LogitBiasTopK`), for this call only."""
        cfg = self.config
        if cfg.moe_router_num_groups or self.routing_type == "sinkhorn" or self.expert_bias is not None \
                or self.router_replay is not None or cfg.moe_router_fusion:
            raise ValueError("the easybalance selection bias needs ungrouped, unfused top-k routing without "
                             "Megatron's own expert bias or routing replay (moe_router_num_groups, sinkhorn, "
                             "moe_router_enable_expert_bias, moe_enable_routing_replay and moe_router_fusion off)")
        flat_TE = logits.reshape(-1, self.num_experts)
        self.router_replay = _LogitBiasTopK(flat_TE, self.controls.bias_on(flat_TE.device))
        try:
            return super().routing(logits, padding_mask)
        finally:
            self.router_replay = None

    def _attach_device_loss(self, logits_TE, probs, routing_map_TE, valid_T):
        probs_TE = torch.softmax(logits_TE.float(), dim=-1) if self.score_function == "softmax" \
            else torch.sigmoid(logits_TE.float())
        kept = routing_map_TE if valid_T is None else routing_map_TE & valid_T[:, None]
        base = self.config.moe_aux_loss_coeff
        base = float(base[0] if isinstance(base, (list, tuple)) else base)
        if base == 0:
            return probs
        weighted = self.controls.device_loss(probs_TE, kept.sum(0).detach(), self.topk, valid_T)   # weight x loss
        # relative to the model's aux coefficient, as on DeepSpeed; Megatron's convention: the loss handed over
        # already carries its coefficient
        return self.attach_and_log_load_balancing_loss(probs, self.controls.device_loss_weight * base, base * weighted,
                                                       "device_balance_loss", self.tp_cp_group)


class _LogitBiasTopK:
    """Megatron's top-k door (the `RouterReplay.get_replay_topk` protocol): the experts are chosen on the
    logits + bias (logit units, as on DeepSpeed, for softmax and sigmoid alike; both are monotone, so without a
    bias the choice is Megatron's), the values returned are the unbiased scores at the chosen experts. So the
    probabilities that combine expert outputs, and every aux loss, come from the unbiased logits."""

    def __init__(self, logits_TE: torch.Tensor, bias_E: torch.Tensor):
        self.logits_TE, self.bias_E = logits_TE, bias_E

    def get_replay_topk(self, scores_TE, topk: int, num_groups=None, group_topk=None, default_compute_topk=None):
        with torch.no_grad():
            top_TK = torch.topk(self.logits_TE + self.bias_E.to(self.logits_TE.dtype), k=topk, dim=1).indices
        return scores_TE.gather(1, top_TK), top_TK
