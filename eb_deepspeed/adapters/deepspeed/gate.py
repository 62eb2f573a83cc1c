"""`CrossLayerGate`: a drop-in for `deepspeed.moe.sharded_moe.TopKGate` that feeds the load view.

Shape legend: T tokens, M model dim, E experts, K top-k, C capacity, R routes (K*T), W packed tally width.

Routing is DeepSpeed's own: the gate computes the logits exactly as `TopKGate` does and calls
DeepSpeed's `top1gating` / `top2gating` / `topkgating`, so k = 1, 2 and > 2, capacity factors,
min capacity, `drop_tokens`, `use_rts`, the noisy policies (Jitter, RSample, 2nd-expert
sampling) and both return forms behave exactly as DeepSpeed's (the sparse 7-tuple
`gate(x, used_token, True, use_tutel)` that `MOELayer` uses since 0.19.4, and the dense 4-tuple
`gate(x)` of the legacy path). On top of that the gate

  * adds its routes to its tally without any host sync or collective; a forward that activation
    checkpointing re-runs during backward is not counted again (`core.tally.in_backward`);
  * reads its layer's `controls`: the selection bias (`bias` policies) chooses the top-k on logits + bias,
    DeepSpeed's gating does the rest and the gate values and l_aux are recomputed unbiased
    (`unbias_gate_output`); a device-loss weight > 0 adds that times DeepSeek-V2's device-level balance loss
    to l_aux (no collective). User code that sums `l_aux` keeps working;
  * returns a well-formed empty result for an empty batch (DeepSpeed's gate asserts).

    gate = CrossLayerGate.from_topk_gate(moe.deepspeed_moe.gate, layer_index=3)
    moe.deepspeed_moe.gate = gate"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from deepspeed.comm import pg_utils
from deepspeed.moe import sharded_moe as dsm
from deepspeed.moe.sharded_moe import TopKGate

from ...core.controls import LayerControls
from ...core.tally import LayerTally, in_backward, logit_sums, routes_from_mask

__all__ = ["CrossLayerGate"]


def unbias_gate_output(gate_output, logits_TE: torch.Tensor, selection_TE: torch.Tensor, k: int,
                       sparse_routes: bool):
    """Gate values and l_aux of an output routed on biased `selection_TE`, recomputed from `logits_TE`.

    The `bias` policy routes with DeepSpeed's own gating functions on `logits + bias` (so capacity,
    RTS, 2nd-expert sampling and both return forms are DeepSpeed's), then puts back what the bias
    must never touch: each kept route's gate value is the unbiased probability (raw for k = 1,
    normalised over the token's kept routes for k > 1, as DeepSpeed does), and l_aux uses the
    unbiased mean probabilities with DeepSpeed's formula for that k."""
    probs_TE = F.softmax(logits_TE, dim=1)
    T, E = probs_TE.shape
    me_E = probs_TE.mean(0)
    if k == 2:  # top2gating's ce counts first choices only
        ce_E = F.one_hot(selection_TE.argmax(1), num_classes=E).float().mean(0)
        l_aux = (me_E * ce_E).mean() * E * E
    else:       # top1gating / topkgating: ce from the (pre-capacity) routed counts
        ce_E = gate_output[-1].float() / T
        l_aux = (me_E * ce_E).sum() * E if k == 1 else (me_E * ce_E).mean() * E * E / k
    if sparse_routes:
        indices_KT = gate_output[3]
        kept_KT = indices_KT >= 0
        p_KT = probs_TE.gather(1, indices_KT.long().clamp_min(0).t()).t() * kept_KT
        if k > 1:
            p_KT = p_KT / p_KT.sum(0, keepdim=True).clamp_min(torch.finfo(p_KT.dtype).eps)
        return (l_aux, ) + tuple(gate_output[1:5]) + (p_KT, gate_output[6])
    dispatch_TEC = gate_output[2]
    p_TE = probs_TE * dispatch_TEC.any(2)
    if k > 1:
        p_TE = p_TE / p_TE.sum(1, keepdim=True).clamp_min(torch.finfo(p_TE.dtype).eps)
    return l_aux, dispatch_TEC * p_TE.unsqueeze(2), dispatch_TEC, gate_output[3]


class CrossLayerGate(TopKGate):
    """TopKGate plus a route tally and the layer's controls (`core.balancer.BalancedGate`)."""

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: Optional[str] = None,
                 drop_tokens: bool = True, use_rts: bool = True, ep_group=None,
                 top2_2nd_expert_sampling: bool = True, *, layer_index: int = 0) -> None:
        super().__init__(model_dim, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                         noisy_gate_policy, drop_tokens, use_rts, ep_group, top2_2nd_expert_sampling)
        self.num_experts = num_experts
        self.layer_index = layer_index
        self.tally = LayerTally(num_experts)
        self.controls = LayerControls(num_experts)
        # View device of each expert's copy that this rank's tokens reach ([E]), when the model's EP groups
        # differ in size and the view tallies devices; None: the view sums experts onto devices itself.
        self.route_device_E: Optional[torch.Tensor] = None

    @classmethod
    def from_topk_gate(cls, gate: TopKGate, layer_index: int, **extra) -> "CrossLayerGate":
        """Wrap an existing TopKGate, sharing its `wg` parameter (same object, same name in checkpoints).

        Building the new gate initialises a throw-away `wg` inside a forked RNG, so swapping gates
        leaves every later random draw (dropout, RTS, noise) exactly as plain DeepSpeed's."""
        if not isinstance(gate, TopKGate):
            raise TypeError(f"expected deepspeed TopKGate, got {type(gate).__name__}")
        num_experts, model_dim = gate.wg.weight.shape
        with torch.random.fork_rng(devices=[]):
            new = cls(model_dim, num_experts, gate.k, gate.capacity_factor, gate.eval_capacity_factor,
                      gate.min_capacity, gate.noisy_gate_policy, gate.drop_tokens, gate.use_rts, gate.ep_group,
                      getattr(gate, "top2_2nd_expert_sampling", True), layer_index=layer_index, **extra)
        new.wg = gate.wg
        new.wall_clock_breakdown = gate.wall_clock_breakdown
        new.train(gate.training)
        return new

    def count_devices(self, num_devices: int, route_device_E: torch.Tensor) -> None:
        """Also tally kept routes per view device (`Tally.device_LG`): expert e's routes from this rank land
        on view device route_device_E[e] (a layer whose EP group is smaller than the view's). Call before
        the first forward; routes tallied so far are dropped."""
        self.tally = LayerTally(self.num_experts, num_devices)
        self.route_device_E = torch.as_tensor(route_device_E, dtype=torch.long).to(self.wg.weight.device)

    def forward(self, input: torch.Tensor, used_token: torch.Tensor = None, sparse_routes: bool = False,
                use_tutel: bool = False):  # type: ignore[override]
        if self.wall_clock_breakdown:
            self.timers(dsm.TOPK_GATE_TIMER).start()

        # Logits exactly as TopKGate computes them (same RNG use for the Jitter policy).
        input_fp32 = input.float()
        if self.noisy_gate_policy == 'Jitter' and self.training:
            input_fp32 = dsm.multiplicative_jitter(input_fp32, device=input.device)
        logits_TE = F.linear(input_fp32, weight=self.wg.weight.float(), bias=None)
        T = logits_TE.shape[0]

        ctl = self.controls
        if T == 0:
            gate_output = self._empty_output(logits_TE, sparse_routes)   # its l_aux is 0 under any weight
        else:
            recording = self.training and not in_backward()
            # Counted before gating (top2gating adds Gumbel noise to the logits in place), with no autograd node
            # (checkpointing compares saved tensors with the re-run).
            sums_T = logit_sums(logits_TE) if recording else None
            capacity_factor = self.capacity_factor if self.training else self.eval_capacity_factor
            # Softmax is monotone: top-k of logits + b is top-k of softmax(logits + b).
            biased = ctl.bias_E is not None
            selection_TE = logits_TE + ctl.bias_on(logits_TE.device) if biased else logits_TE
            device_loss = ctl.device_loss_weight > 0 and self.training
            if device_loss:     # before gating: top2gating adds Gumbel noise to selection_TE in place
                clean_TE = logits_TE.clone() if selection_TE is logits_TE and self.k == 2 else logits_TE
            # top2gating adds its Gumbel noise to the logits in place: hand it a copy when biased
            gate_output = self._gating(selection_TE.clone() if biased and self.k == 2 else selection_TE,
                                       capacity_factor, self.min_capacity, used_token, self.drop_tokens, self.ep_group,
                                       sparse_routes, use_tutel, self.noisy_gate_policy if self.training else None)
            if biased:
                gate_output = unbias_gate_output(gate_output, logits_TE, selection_TE, self.k, sparse_routes)
            if recording:
                self._record_output(gate_output, sparse_routes, T, used_token, sums_T)

            if device_loss:
                probs_TE = F.softmax(clean_TE, dim=1)
                routed_E = gate_output[6] if sparse_routes else gate_output[3]
                gate_output = (gate_output[0] + ctl.device_loss(probs_TE, routed_E, self.k), ) + tuple(gate_output[1:])

        if self.wall_clock_breakdown:
            self.timers(dsm.TOPK_GATE_TIMER).stop()
            self.gate_time = self.timers(dsm.TOPK_GATE_TIMER).elapsed(reset=False)
        return gate_output

    def _gating(self, selection_TE, capacity_factor, min_capacity, used_token, drop_tokens, ep_group, sparse_routes,
                use_tutel=False, noisy=None):
        """DeepSpeed's own gating function for this k."""
        if self.k == 1:
            return dsm.top1gating(selection_TE, capacity_factor, min_capacity, used_token, noisy, drop_tokens,
                                  self.use_rts, ep_group, sparse_routes, use_tutel)
        if self.k == 2:
            return dsm.top2gating(selection_TE, capacity_factor, min_capacity, drop_tokens, ep_group,
                                  self.top2_2nd_expert_sampling, sparse_routes)
        return dsm.topkgating(selection_TE, self.k, capacity_factor, min_capacity, drop_tokens, ep_group,
                              sparse_routes=sparse_routes)

    def _record_output(self, gate_output, sparse_routes: bool, T: int, used_token, sums_T) -> None:
        if sparse_routes:
            # (l_aux, capacity, E, indices_KT, locations_KT, gates_KT, exp_counts_E); -1 = dropped route.
            expert_TK, exp_counts_E = gate_output[3].t(), gate_output[6]
        else:
            # (l_aux, combine_weights_TEC, dispatch_mask_TEC, exp_counts_E): the dispatched (token, expert)
            # pairs (the legacy path; not on the training hot path).
            expert_TK, exp_counts_E = routes_from_mask(gate_output[2].any(dim=2), self.k), gate_output[3]
        device_TK = None
        if self.route_device_E is not None:     # -1 (dropped) stays -1: it lands on the scratch slot
            device_TK = torch.where(expert_TK >= 0, self.route_device_E[expert_TK.long().clamp_min(0)], -1)
        self.tally.add_routes(expert_TK, routed_E=exp_counts_E, logit_sums_T=sums_T, l_aux=gate_output[0],
                              tokens=used_token.sum() if used_token is not None else T, device_TK=device_TK)

    def _empty_output(self, logits_TE: torch.Tensor, sparse_routes: bool):
        """A well-formed gate result for zero tokens (DeepSpeed's gating asserts on it)."""
        dev, E, K = logits_TE.device, self.num_experts, self.k
        l_aux = logits_TE.sum() * 0.0  # keeps the autograd graph connected to wg
        exp_counts_E = torch.zeros(E, dtype=torch.long, device=dev)
        if self.drop_tokens:
            capacity = torch.tensor(self.min_capacity, dtype=torch.long, device=dev)
        else:
            # Other EP ranks all-reduce their capacity inside DeepSpeed's gating; join them.
            capacity = torch.zeros((), dtype=torch.long, device=dev)
            if pg_utils.is_parallel(self.ep_group):
                dsm.dist.all_reduce(capacity, op=dsm.dist.ReduceOp.MAX, group=self.ep_group)
        if sparse_routes:
            empty_KT = torch.zeros(K, 0, dtype=torch.int32, device=dev)
            return (l_aux, capacity, E, empty_KT, empty_KT.clone(), torch.zeros(K, 0, device=dev), exp_counts_E)
        combine_TEC = torch.zeros(0, E, int(capacity), device=dev)
        return l_aux, combine_TEC, combine_TEC.bool(), exp_counts_E
