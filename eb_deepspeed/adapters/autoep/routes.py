"""`AutoEPRoutes`: an AutoEP layer's routes put on physical slots (replicas and moved experts), for serving and for
training placement alike: the router's logical top-k and gate values kept, each route on a slot by the layer's
`routing.Routing`; the layer's `num_local_experts` is S, so AutoEP's all-to-all, grouped GEMMs and combine run over
the P slots unchanged.

Shape legend: E logical experts, K top-k, T tokens, N routes (T x K), G EP ranks, S slots per rank, P physical slots
(G * S; slot p lives on EP rank p // S), R replicas of one expert."""
from __future__ import annotations

import types
from typing import Optional

import torch

from ...core.tally import LayerTally
from ..routing import Routing, ServedTable, SlotTable, exact_routes, exchange_counts, split_by_fraction
from .layer import choice_sums

__all__ = ["AutoEPRoutes"]


class AutoEPRoutes(ServedTable):
    """One served AutoEP layer's route -> slot map and tally (`core.balancer.BalancedGate`; no controls).

    layer: the `AutoEPMoELayer`; G EP ranks; table/S: the placement serving now (`set_table`); routing: the split
    and this rank's place (`adapters.routing.Routing`). Serving's gate, and training placement's route map."""

    controls = None       # serving takes no training controls

    def __init__(self, layer: torch.nn.Module, layer_index: int, G: int, S: int, *, table: SlotTable,
                 routing: Routing):
        self.layer, self.layer_index = layer, layer_index
        self.num_experts, self.k = int(layer.num_experts), int(layer.top_k)
        self.G, self.routing = int(G), routing
        self.tally = LayerTally(self.num_experts, self.G)
        self._logit_sums_T: Optional[torch.Tensor] = None
        self._splits = self._routed = None
        self.replicas = None      # training replicas chosen per micro-batch (`fetch.LayerReplicas`), set by its owner
        self.set_table(table, S)
        if routing.exact:
            _take_over_count_exchange(layer, self)
        layer.router.gate.register_forward_hook(self._keep_logits)
        # the slots are decided before any other hook of the router (a balancer's gate reads their ranks: `ranks`)
        # and handed to AutoEP after them all (the gate's loss rides on the scores it returns)
        layer.router.register_forward_hook(self._route, prepend=True)
        layer.router.register_forward_hook(self._hand_over)

    @property
    def router_device(self) -> torch.device:
        return self.layer.router.gate.weight.device

    def _keep_logits(self, gate, args, logits_TE) -> None:
        if self.routing.recording and logits_TE.shape[0] > 0:
            self._logit_sums_T = choice_sums(self.layer.router, logits_TE)

    def _route(self, router, args, output) -> None:
        """The slot of each route of the router's (top_scores_TK, selected_TK, counts_E): kept for `_hand_over`."""
        top_scores_TK, selected_TK, counts_E = output
        logit_sums_T, self._logit_sums_T = self._logit_sums_T, None
        T, home = selected_TK.shape[0], self.home_layout      # home: AutoEP's own layout, its routes as they are
        self._splits = None
        slot_TK, counts_P = (None, None) if home else self.slots(selected_TK, counts_E)
        if self.routing.recording and T > 0:
            ranks = {"device_E": self.on_device(counts_E.device)[2]} if home else {"device_TK": slot_TK // self.S}
            self.tally.add_routes(selected_TK, routed_E=counts_E, kept_E=counts_E, logit_sums_T=logit_sums_T,
                                  tokens=T, **ranks)
        self._routed = None if home else (slot_TK, counts_P)

    def _hand_over(self, router, args, output):
        """(top_scores_TK, selected_TK, counts_E) -> (top_scores_TK, slot_TK, counts_P): AutoEP's all-to-all and
        grouped GEMM run over the physical slots."""
        routed, self._routed = self._routed, None
        if routed is None:
            return None
        top_scores_TK, selected_TK, counts_E = output
        return top_scores_TK, routed[0].to(selected_TK.dtype), routed[1].to(counts_E.dtype)

    def ranks(self) -> Optional[torch.Tensor]:
        """The EP rank computing each route of this forward [T, K] (None: AutoEP's own layout)."""
        return None if self._routed is None else self._routed[0] // self.S

    def slots(self, selected_TK: torch.Tensor, counts_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each route's physical slot [T, K] and the routes per slot [P]: an expert's routes on this rank,
        in token order, fill its replicas one after another in the split's numbers."""
        expert_N = selected_TK.reshape(-1).long()
        counts_E = counts_E.long()
        if self.one_each:
            log2phy_ER = self.on_device(selected_TK.device)[0]
            slot_N = log2phy_ER[:, 0][expert_N]
            counts_P = torch.zeros(self.P, dtype=torch.long, device=counts_E.device)
            counts_P[log2phy_ER[:, 0]] = counts_E
            return slot_N.view_as(selected_TK), counts_P
        log2phy_ER, n_ER, counts_P = self._split(counts_E)
        N = expert_N.numel()
        order_N = torch.argsort(expert_N, stable=True)
        start_E = counts_E.cumsum(0) - counts_E
        position_N = torch.empty_like(expert_N)
        position_N[order_N] = torch.arange(N, device=expert_N.device) - start_E[expert_N[order_N]]
        ends_ER = n_ER.cumsum(1)
        replica_N = (position_N[:, None] >= ends_ER[expert_N]).sum(1).clamp_max(ends_ER.shape[1] - 1)
        slot_N = log2phy_ER[expert_N, replica_N]
        if counts_P is None:
            counts_P = torch.zeros(self.P, dtype=torch.long, device=slot_N.device).index_add_(
                0, slot_N, torch.ones_like(slot_N))          # bincount would read its max on the host
        return slot_N.view_as(selected_TK), counts_P

    def _split(self, counts_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """The physical slot of each copy [E, R], this rank's routes per copy [E, R] and, for `exact`, per physical
        slot [P] (else None). `exact` also keeps what AutoEP's count exchange would have given (`_splits`: the
        routes this rank sends to and receives from each rank [2, G], with training replicas also the replica rows
        it sends and receives [2, G]; and the routes it receives per source rank and local slot [G, S]), from the
        split's own exchange; in a training forward with replica slots, the copies are chosen from it."""
        log2phy_ER, fraction_ER, _ = self.on_device(counts_E.device)
        if not self.routing.exact:
            return log2phy_ER, split_by_fraction(counts_E, fraction_ER), None
        G, S, rank = self.G, self.S, self.routing.rank
        counts_GE = exchange_counts(counts_E, G, self.layer.ep_group)
        if self.replicas is not None and self.layer.training:
            log2phy_ER, n_GE, rows_2G = self.replicas.route(counts_GE)
            n_ER, sends_GP = exact_routes(counts_GE, log2phy_ER, G * S, rank, n_GE=n_GE)
        else:
            log2phy_ER, fill = self.table.copies_on(S, G, counts_E.device)
            (n_ER, sends_GP), rows_2G = exact_routes(counts_GE, log2phy_ER, G * S, rank, fill), None
        received_GS = sends_GP[:, rank * S:(rank + 1) * S]
        sizes = torch.stack((sends_GP[rank].view(G, S).sum(1), received_GS.sum(1)))
        self._splits = (sizes if rows_2G is None else torch.cat((sizes, rows_2G)), received_GS)
        return log2phy_ER, n_ER, sends_GP[rank]


def _take_over_count_exchange(layer: torch.nn.Module, routes: AutoEPRoutes) -> None:
    """AutoEP's layer asks its module's `compute_split_plan` for the all-to-all sizes (one all-to-all of every rank's
    [G, S] counts, then one host read). Under the exact split those sizes are known from the split's own exchange:
    this layer's forward runs AutoEP's own `_forward` code with `compute_split_plan` bound to `routes`, which hands it
    the sizes `routes` kept for this forward (the host read stays, one per layer as plain's) and otherwise calls
    DeepSpeed's. The one call site of this one layer: DeepSpeed's module, its class and every other layer are
    untouched, and nothing is left to undo when a forward raises. The same read carries the sizes of the replica
    weights' transfer, which starts there, before AutoEP's token all-to-all (`fetch.LayerReplicas.start`). (A
    DeepSpeed whose layer does not call it, CUDA's `async_split_plan`, runs its own exchange as well: correct, one
    collective more; it is refused with training replicas, whose transfer sizes ride on this read.)"""
    from deepspeed.module_inject import auto_ep_layer
    original = auto_ep_layer.compute_split_plan

    def compute_split_plan(*args, **kwargs):
        splits, routes._splits = routes._splits, None
        if splits is None:
            return original(*args, **kwargs)
        counts = kwargs.get("num_tokens_per_expert", args[5] if len(args) > 5 else None)
        sizes_XG, received_GS = splits
        input_splits, output_splits, *rows = sizes_XG.cpu().tolist()    # the one host read, as plain's
        if rows:                                   # training replicas: their weights' transfer starts now
            routes.replicas.start(*rows)
        return auto_ep_layer.SplitPlan(input_splits, output_splits, received_GS.to(counts.dtype))
    forward = type(layer)._forward
    code = types.FunctionType(forward.__code__, dict(forward.__globals__, compute_split_plan=compute_split_plan),
                              forward.__name__, forward.__defaults__, forward.__closure__)
    layer._forward = types.MethodType(code, layer)
