"""`ReplicaGate`: DeepSpeed's routing on the E logical experts, each route put on a physical slot.

Shape legend: T tokens, M model dim, E logical experts, K top-k, G EP ranks, S slots per rank, P physical slots
(G * S; slot p lives on rank p // S), R replicas of one expert, C capacity.

A replicated MoE layer is DeepSpeed's own `MOELayer` over P "experts" (its `Experts` holds S slots per rank, some
of them copies of hot experts); only the gate changes: it routes exactly as `TopKGate` on the E logical logits (same
gating, random draws and gate values), with no capacity limit, splits each expert's routes over its replicas by the
table (`view`), agrees on one capacity across the EP group (unequal batches never abort the All-to-All), and returns
DeepSpeed's sparse 7-tuple over the P slots, tallying logical counts. Without drops every token meets the same
experts with the same gate values as in the E-expert model: the same outputs."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from deepspeed.moe import sharded_moe as dsm

from ...core.tally import LayerTally, logit_sums
from ..routing import Routing, ServedTable, SlotTable, split_by_fraction
from .gate import CrossLayerGate

__all__ = ["ReplicaGate"]


class ReplicaGate(CrossLayerGate, ServedTable):
    """CrossLayerGate over physical slots: logical routing, replica split, one agreed capacity."""

    def __init__(self, *args, num_devices: int, slots_per_device: int, table: SlotTable,
                 routing: Optional[Routing] = None, **gate_kwargs):
        super().__init__(*args, **gate_kwargs)
        self.routing = routing or Routing()
        self.G = int(num_devices)
        self.set_table(table, slots_per_device)
        self.tally = LayerTally(self.num_experts, self.G)
        self.controls = None        # serving takes no training controls
        self._capacity_value = 0    # the capacity the EP group agreed on for the last batch (`last_capacity`)

    @property
    def router_device(self) -> torch.device:
        return self.wg.weight.device

    @classmethod
    def from_gate(cls, gate, num_devices: int, slots_per_device: int, *, table: SlotTable,
                  routing: Optional[Routing] = None) -> "ReplicaGate":
        """A replica gate sharing `gate`'s router weight (DeepSpeed's TopKGate or a CrossLayerGate), in eval mode."""
        new = cls.from_topk_gate(gate, getattr(gate, "layer_index", 0), num_devices=num_devices,
                                 slots_per_device=slots_per_device, table=table, routing=routing)
        new.on_device(new.wg.weight.device)
        return new.eval()

    def forward(self, input: torch.Tensor, used_token: torch.Tensor = None, sparse_routes: bool = False,
                use_tutel: bool = False):  # type: ignore[override]
        if self.training:
            raise ValueError(f"layer {self.layer_index}: a replicated MoE layer serves only; call model.eval()")
        if not sparse_routes or use_tutel:
            raise ValueError(f"layer {self.layer_index}: a replicated MoE layer needs DeepSpeed's sparse routes "
                             "(MOELayer in deepspeed >= 0.19.4, without Tutel)")
        logits_TE = F.linear(input.float(), weight=self.wg.weight.float(), bias=None)
        T, E, K = logits_TE.shape[0], self.num_experts, self.k
        # taken before gating: top-2 gating adds its Gumbel noise to the logits in place
        logit_sums_T = logit_sums(logits_TE) if self.routing.recording and T > 0 else None
        if self.one_each and not self.drop_tokens and self.k == 2:     # without drops DeepSpeed's gate is exact there
            return self._home_forward(logits_TE, used_token, logit_sums_T)
        if T == 0:
            l_aux = logits_TE.sum() * 0.0
            expert_KT = torch.zeros(K, 0, dtype=torch.long, device=logits_TE.device)
            position_KT = expert_KT.clone()
            gates_KT = torch.zeros(K, 0, device=logits_TE.device)
            counts_E = torch.zeros(E, dtype=torch.long, device=logits_TE.device)
        else:
            # 1. DeepSpeed's routing on the logical experts, no capacity limit (same draws as TopKGate)
            l_aux, _, _, expert_KT, position_KT, gates_KT, counts_E = self._logical_routes(logits_TE, used_token)
            expert_KT, position_KT = expert_KT.long(), position_KT.long()
        # 2. replicas: this rank's routes per replica, by the table's shares (`view`: measured faster here than
        # the exact split, docs/benchmarks.md)
        n_ER = split_by_fraction(counts_E.long(), self.on_device(counts_E.device)[1])
        # 3. one capacity for the EP group
        capacity = self._capacity(n_ER, T)
        slot_KT, location_KT, gates_KT = self._place(expert_KT, position_KT, gates_KT, n_ER, capacity)
        if self.routing.recording and T > 0:     # the kept routes' experts and EP ranks (slot -1: dropped, rank -1)
            self.tally.add_routes(torch.where(slot_KT >= 0, expert_KT, -1).t(), routed_E=counts_E,
                                  logit_sums_T=logit_sums_T, l_aux=l_aux, device_TK=(slot_KT // self.S).t(),
                                  tokens=used_token.sum() if used_token is not None else T)
        return (l_aux, capacity, self.P, slot_KT.int(), location_KT.int(), gates_KT, counts_E)

    def _home_forward(self, logits_TE, used_token, logit_sums_T):
        """One slot per expert without drops, top-2: DeepSpeed's own gating, which agrees on the capacity across
        the EP group itself (one all-reduce; an empty batch joins the same one), each route mapped to its expert's
        slot (outside DeepSpeed's own layout), plus the tally. (Not for top-1: DeepSpeed's top1gating clips the
        agreed capacity to the rank's own token count, which breaks the All-to-All on unequal batches.)"""
        if logits_TE.shape[0] == 0:
            out = self._empty_output(logits_TE, sparse_routes=True)
            self._capacity_value = out[1]
            return out
        out = self._logical_routes(logits_TE, used_token, ep_group=self.ep_group)
        l_aux, capacity, _, expert_KT, _, _, counts_E = out
        self._capacity_value = capacity
        if not self.home_layout:     # a prefix: expert e's routes go to its one slot
            slot_E = self.on_device(expert_KT.device)[0][:, 0]
            slot_KT = torch.where(expert_KT >= 0, slot_E[expert_KT.clamp_min(0).long()], -1).to(expert_KT.dtype)
            out = out[:3] + (slot_KT, ) + out[4:]
        if self.routing.recording:     # one slot each and no drops: kept = routed, every route of expert e on its slot's rank
            self.tally.add_routes(expert_KT.t(), routed_E=counts_E, kept_E=counts_E,
                                  device_E=self.on_device(counts_E.device)[2], logit_sums_T=logit_sums_T, l_aux=l_aux,
                                  tokens=used_token.sum() if used_token is not None else logits_TE.shape[0])
        return out

    def _logical_routes(self, logits_TE, used_token, ep_group=None):
        """DeepSpeed's gating on the logical experts without a capacity limit (with `ep_group`, the capacity is
        agreed across it as DeepSpeed does; without, its capacity is not used, so min_capacity 0: a rank with
        fewer tokens than min_capacity must not assert while its peers wait in a collective)."""
        return self._gating(logits_TE, self.eval_capacity_factor, self.min_capacity if ep_group is not None else 0,
                            used_token, False, ep_group, True)

    @property
    def last_capacity(self) -> int:
        """The capacity the EP group agreed on for the last batch (read lazily: a host sync)."""
        return int(self._capacity_value)

    def _capacity(self, n_ER, T: int) -> int:
        """The EP group's capacity. Without drops: the most routes any rank sends to any slot. With drops:
        DeepSpeed's ceil(T_max * k * capacity_factor / P), T_max the most tokens on any rank."""
        if self.drop_tokens:                # one all-reduce and host read per forward, not per layer
            tokens = self._agreed_tokens(T, n_ER.device)
            capacity = max(math.ceil(tokens * self.k * self.eval_capacity_factor / self.P), self.min_capacity, 1)
        else:                                 # one all-reduce, as DeepSpeed's own capacity
            log2phy_ER = self.on_device(n_ER.device)[0]
            mine = torch.zeros(self.P + 1, dtype=torch.long, device=n_ER.device)
            mine.index_add_(0, torch.where(log2phy_ER >= 0, log2phy_ER, self.P).reshape(-1), n_ER.reshape(-1))
            most = mine[:self.P].max().reshape(1)
            if self.G > 1:
                dsm.dist.all_reduce(most, op=dsm.dist.ReduceOp.MAX, group=self.ep_group)
            capacity = max(int(most.item()), 1)     # the host read replaces DeepSpeed's own int(C) when dropless
        self._capacity_value = capacity
        return capacity

    def _agreed_tokens(self, T: int, device) -> int:
        """The most tokens on any rank of the EP group in this forward: agreed by the first replicated layer
        (every rank runs the layers in the same order) and kept in `routing.tokens` for the rest."""
        if kept := self.routing.tokens:
            return kept[0]
        agreed = torch.full((1, ), T, dtype=torch.long, device=device)
        if self.G > 1:
            dsm.dist.all_reduce(agreed, op=dsm.dist.ReduceOp.MAX, group=self.ep_group)
        most = int(agreed.item())
        if kept is not None:
            kept.append(most)
        return most

    def _place(self, expert_KT, position_KT, gates_KT, n_ER, capacity: int):
        """Each route's slot and location there (-1: dropped by the capacity), gates renormalised over
        a token's kept routes for k > 1, as DeepSpeed does."""
        ends_ER = n_ER.cumsum(1).to(expert_KT.device)
        e_KT = expert_KT.clamp_min(0)
        replica_KT = (position_KT[..., None] >= ends_ER[e_KT]).sum(-1).clamp_max(ends_ER.shape[1] - 1)
        start_KT = (ends_ER - n_ER.to(ends_ER.device))[e_KT, replica_KT]
        slot_KT = self.on_device(expert_KT.device)[0][e_KT, replica_KT]
        location_KT = position_KT - start_KT
        kept_KT = (expert_KT >= 0) & (slot_KT >= 0) & (location_KT < capacity)
        slot_KT = torch.where(kept_KT, slot_KT, -1)
        location_KT = torch.where(kept_KT, location_KT, 0)
        if self.drop_tokens:   # a dropped route's gate is 0; a token's kept routes share its weight (k > 1)
            kept_gates_KT = gates_KT * kept_KT
            if self.k > 1:
                kept_gates_KT = kept_gates_KT / kept_gates_KT.sum(0, keepdim=True).clamp_min(
                    torch.finfo(gates_KT.dtype).eps)
            # tokens whose routes were all kept keep DeepSpeed's values bit for bit (no sync to ask)
            gates_KT = torch.where(kept_KT.all(0, keepdim=True), gates_KT, kept_gates_KT)
        return slot_KT, location_KT, gates_KT
