"""Training-time expert placement for AutoEP (`easybalance.train_placement`): experts re-placed over the EP ranks
from the view, routing untouched — for fine-tuning, where the pretrained routing is the model's knowledge.

Shape legend: L MoE layers, E experts, G EP ranks, H experts per rank (E / G), T tokens, K top-k.

    "easybalance": {"mode": "observe", "train_placement": {"enabled": true, "interval": 50}}

A dropless AutoEP layer takes as long as its busiest EP rank, so putting hot experts on different ranks removes
the device skew without changing a route. Every `interval` optimizer steps (`engine.step`'s boundary, every rank
together) the view's heat is planned as a permutation of each layer's experts over the ranks (`plan_placement`
with H slots per rank: no replicas; `choose_placement`: only when it cuts the busiest rank's expected routes by
`MIN_GAIN` and the saving over the interval pays for the move, `move_cost`). A move is two-phase, as serving's:

  1. every rank reads the state of the experts it sends (model weights, fp32 master weights and optimizer
     moments: DeepSpeed's `safe_get_full_fp32_param` / `safe_get_full_optimizer_state` under ZeRO 1/2 and bf16,
     the torch optimizer's own state under ZeRO 0), sends it, receives what it gets into staging, checks it is
     finite; one all-reduce agrees that every rank succeeded and planned the same permutation;
  2. only then is staging written into the rows (`safe_set_full_*`), and every rank flips its route map.

A failure anywhere in phase 1 leaves every rank on the old placement with its state untouched. The route map is a
forward hook on each router, after the balancer's: the router's logical top-k (`selected_TK`) becomes each
expert's slot, its counts the slots' counts; gate values and the tally stay logical, so the layer's all-to-all,
grouped GEMMs and combine run as AutoEP's own over the permuted rows. Checkpoints are written in the logical
layout (the experts moved home for the save, then back), so they load into plain AutoEP and back into any
placement. AutoEP's `tokens_per_expert` buffer counts per slot.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from ...planning.placement import Placement, plan_placement, static_placement
from ..common import dist_ready, torch_optimizer
from ..deepspeed.hooks import is_decoupled
from ..serving.engine import DEVICE_FLOPS, DISPATCH, agree, choose_placement, placement_key, transfer, \
    verify_finite, warn_failed
from ...core.topology import TOPOLOGIES

__all__ = ["TrainPlacement"]

# A training route costs forward and backward: 3 x the 2 FLOPs per expert parameter of a forward.
FLOPS_PER_PARAM = 6
# A re-plan must be expected to cut the layers' busiest-rank routes by this share. Lower than serving's MIN_GAIN:
# the heat is the EMA of whole optimizer steps' counts (every rank's micro-batches), and the copies are priced
# (`move_cost`). With serving's 10 % one layer drifting back to 1.25x went unanswered for 180 steps
# (docs/benchmarks.md, training-time placement).
TRAIN_MIN_GAIN = 0.03


class TrainPlacement:
    """The experts of every AutoEP layer of `engine` placed over its EP ranks as `placement` says (AutoEP's own
    layout to start), re-planned from `balancer`'s view every `interval` optimizer steps."""

    def __init__(self, engine, layers: list, balancer, interval: int, topology: str = "pcie"):
        assert engine.zero_optimization_stage() < 3, "refused by initialize: ZeRO 3 partitions each expert's weights"
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
        optimizer = getattr(engine, "optimizer", None)
        if not isinstance(optimizer, (torch.optim.Optimizer, DeepSpeedZeroOptimizer, BF16_Optimizer)):
            raise ValueError(f"easybalance.train_placement moves the state of a torch optimizer (fp32), of ZeRO 1/2 "
                             f"and of DeepSpeed's BF16_Optimizer; DeepSpeed wrapped this one in "
                             f"{type(optimizer).__name__}, whose fp32 master weights it cannot move: use ZeRO 1 or 2 "
                             "for bf16 or fp16 training")
        if is_decoupled(engine):
            raise ValueError("easybalance.train_placement writes checkpoints in AutoEP's layout by moving the experts "
                             "home for the save; an asynchronous (decoupled) checkpoint engine would write them after "
                             "they moved back: use a synchronous checkpoint engine")
        for m in layers:
            folded = m.folding_group_handles is not None and m.folding_group_handles.spec.tp_size > 1
            if folded or getattr(m, "comm_backend", "comm") != "comm":
                raise ValueError("easybalance.train_placement needs AutoEP's all-to-all (expert_parallel.comm_backend "
                                 '"comm") without tensor-parallel folding')
            if getattr(m, "expert_bias", None) is not None:
                raise ValueError("easybalance.train_placement: AutoEP's own expert_bias (load_balance_coeff) counts "
                                 "tokens per slot; set load_balance_coeff to null to re-place experts")
        self.engine, self.layers, self.balancer = engine, layers, balancer
        self.interval, self.topology = int(interval), TOPOLOGIES[topology]
        self.L = len(layers)
        self.E, self.G = int(layers[0].num_experts), int(layers[0].ep_size)
        self.H = self.E // self.G
        home_LE = torch.arange(self.E).div(self.H, rounding_mode="floor").expand(self.L, -1)
        if not torch.equal(balancer.view.expert_to_device_LE, home_LE):
            raise ValueError("easybalance.train_placement: AutoEP placed experts other than contiguously "
                             f"({balancer.view.expert_to_device_LE.tolist()}); only its contiguous layout is re-placed")
        self.ep_group = layers[0].ep_group
        self.rank = dist.get_rank(self.ep_group) if self.G > 1 else 0
        self.ep_ranks = dist.get_process_group_ranks(self.ep_group) if self.G > 1 else [0]
        self.home = static_placement(self.L, self.E, self.G)
        self.placement = self.home
        self.replans, self.weight_moves, self.moved_bytes, self.failed_moves = 0, 0, 0, 0
        self._slots: dict = {}          # device -> [L, E] slot of each expert there
        for index, m in enumerate(layers):
            m.router.register_forward_hook(self._router_hook(index))
        balancer.log.extra = lambda: {"replans": self.replans, "weight_moves": self.weight_moves,
                                      "moved_bytes": self.moved_bytes}
        self._wrap(engine)

    # ------------------------------------------------------------------ routes
    def _router_hook(self, layer: int):
        def hook(router, args, output):
            if self.placement is self.home:
                return None
            top_scores_TK, selected_TK, counts_E = output
            slot_E = self._slot_map(counts_E.device)[layer]
            counts_P = torch.zeros_like(counts_E).index_copy_(0, slot_E, counts_E)
            return top_scores_TK, slot_E[selected_TK.long()].to(selected_TK.dtype), counts_P
        return hook

    def _slot_map(self, device) -> torch.Tensor:
        if device not in self._slots:
            self._slots[device] = self.placement.log2phy[:, :, 0].to(device)
        return self._slots[device]

    # ------------------------------------------------------------------ the step boundary
    def _wrap(self, engine) -> None:
        step, save, load = engine.step, engine.save_checkpoint, engine.load_checkpoint

        def wrapped_step(*args, **kwargs):
            before = int(engine.global_steps)
            out = step(*args, **kwargs)
            now = int(engine.global_steps)
            if now != before and now % self.interval == 0:
                self.maybe_move()
            return out

        def wrapped_save(*args, **kwargs):
            """DeepSpeed's files in the logical layout: the experts go home for the save, then back."""
            placed = self.placement
            self._must_apply(self.home, "home before saving a checkpoint (nothing was saved)")
            try:
                return save(*args, **kwargs)
            finally:
                self._must_apply(placed, "back after saving a checkpoint (the checkpoint is whole)")

        def wrapped_load(*args, **kwargs):
            """A checkpoint holds the logical layout: the experts go home first (a load that fails leaves a
            consistent model), the next interval re-plans from the loaded view."""
            self._must_apply(self.home, "home before loading a checkpoint (nothing was loaded)")
            return load(*args, **kwargs)

        engine.step, engine.save_checkpoint, engine.load_checkpoint = wrapped_step, wrapped_save, wrapped_load

    def _must_apply(self, plan: Placement, when: str) -> None:
        if not self.apply(plan, replan=False):
            raise RuntimeError(f"easybalance.train_placement: moving the experts {when} failed on some rank (see its "
                               "warning); every rank keeps the placement and state it had before this move")

    def maybe_move(self) -> bool:
        """Re-plan from the view (warmed up) and move when it pays; every rank together. True when it moved."""
        view = self.balancer.view
        if not view.ready:
            return False
        model = DISPATCH[(False, "view")]          # a dropless layer: its busiest rank's routes
        heat_LE = view.heat_LE / max(1, dist.get_world_size() // self.G if dist_ready() else 1)   # per EP group
        choice = choose_placement(
            heat_LE, self.placement, self.home, 1.0,
            lambda h: plan_placement(h, self.G, self.H, previous=self.placement, dispatch="uniform"),
            cost=model.cost, ratio=model.ratio, move_cost=self.move_cost, horizon=self.interval,
            min_gain=TRAIN_MIN_GAIN)
        if choice is None or choice is self.placement or torch.equal(choice.phy2log, self.placement.phy2log):
            return False
        return self.apply(choice)

    def move_cost(self, plan: Placement) -> float:
        """The stall of moving to `plan`, in routes the busiest receiving rank could have trained meanwhile: each
        received expert's state (weights, fp32 masters, moments) at the topology's bandwidth, against
        `FLOPS_PER_PARAM` per parameter per route at `DEVICE_FLOPS`."""
        flops = DEVICE_FLOPS["cuda" if self.layers[0].router.gate.weight.device.type == "cuda" else "cpu"]
        per_param = self._expert_bytes() / sum(p[0].numel() for p in self.layers[0].experts.parameters())
        received = [0] * self.G
        for _, dst, _, src, _ in self._moves(plan):
            received[dst] += src != dst
        bw = self.topology.intra_bw if self.G <= self.topology.devices_per_node else self.topology.inter_bw
        return max(received) * flops * per_param / (FLOPS_PER_PARAM * bw)

    def _expert_bytes(self) -> int:
        """Bytes of one expert's state: each weight, its fp32 master (ZeRO 1/2, bf16), its fp32 moments."""
        keys = len(self._state_keys())
        return sum(p[0].numel() * (p.element_size() + 4 * (keys + hasattr(p, "_hp_mapping")))
                   for p in self.layers[0].experts.parameters())

    # ------------------------------------------------------------------ moves
    def _moves(self, plan: Placement) -> list[tuple[int, int, int, int, int]]:
        """(layer, destination rank, its row, source rank, its row) of every expert whose slot changes."""
        old_LE, new_LE = self.placement.log2phy[:, :, 0], plan.log2phy[:, :, 0]
        moves = []
        for layer, e in (old_LE != new_LE).nonzero().tolist():
            old, new = int(old_LE[layer, e]), int(new_LE[layer, e])
            moves.append((layer, new // self.H, new % self.H, old // self.H, old % self.H))
        return moves

    def apply(self, plan: Placement, replan: bool = True) -> bool:
        """Move every expert whose slot changes, with its optimizer state, and flip every rank's route map to
        `plan`; or, when any rank fails, keep the old placement and state everywhere (module doc). `replan`: count
        it as a re-plan (a checkpoint's trip home and back is not)."""
        if plan.phy2log.shape != (self.L, self.E) or plan.slots_per_device != self.H:
            raise ValueError(f"a training placement is a permutation of {self.E} experts over {self.G} ranks x "
                             f"{self.H} slots in each of {self.L} layers, got {tuple(plan.phy2log.shape)}")
        moves = self._moves(plan)
        if not moves:
            self.placement, self._slots = plan, {}
            return True
        key, device = placement_key(plan.phy2log), self.layers[0].router.gate.weight.device
        ok = True
        try:   # what every rank checks alone, agreed before any collective of the move (a rank that fails in
            keys = self._state_keys()        # the middle of the expert-state reads would leave its peers waiting)
            self._link_optimizer_state(keys)
        except Exception as e:   # noqa: BLE001
            ok = warn_failed("preparing to move experts", e)
        if not agree(ok, key, device):
            self.failed_moves += 1
            return False
        staging: dict[tuple[int, int], torch.Tensor] = {}
        for layer in sorted({m[0] for m in moves}):      # one layer's full state in memory at a time
            # a rank that failed goes on matching its peers' transfers (NaNs for what it could not read, which the
            # receiver refuses), so that every rank reaches the agreement
            try:
                ops = self._prepare(layer, [m for m in moves if m[0] == layer], staging, keys)
                transfer(ops)
                verify_finite({k: v for k, v in staging.items() if k[0] == layer})
                for k in [k for k in staging if k[0] == layer]:
                    staging[k] = staging[k].cpu()                # held on the host until every rank agrees
            except Exception as e:   # noqa: BLE001 - any failure must reach the agreement, not hang the peers
                ok = ok and warn_failed(f"moving the experts of layer {layer} with their optimizer state", e)
        if not agree(ok, key, device):
            self.failed_moves += 1
            return False
        for layer in sorted({layer for layer, _ in staging}):
            self._write(layer, {j: flat for (l, j), flat in staging.items() if l == layer}, keys)
        self.placement, self._slots = plan, {}
        self.balancer.move_experts(plan.log2phy[:, :, 0] // self.H)
        self.replans += int(replan)
        self.weight_moves += len(moves)
        self.moved_bytes += sum(src != dst for _, dst, _, src, _ in moves) * self._expert_bytes()
        return True

    def _prepare(self, layer: int, moves, staging, keys: list[str]) -> list:
        """One layer's transfers: staging for the rows this rank receives, the sends of the rows it gives; a row
        that stays on this rank is copied into staging (all reads before any write: a cycle of rows is safe).
        Every rank that receives in a layer also sends in it, so the expert-state reads (collective over each
        expert's data-parallel peers, which play the same part) happen on all of them or none."""
        device = self.layers[0].router.gate.weight.device
        width = sum(p[0].numel() * (1 + hasattr(p, "_hp_mapping") + len(keys))
                    for p in self.layers[layer].experts.parameters())
        tensors = None
        if any(src == self.rank for *_, src, _ in moves):
            try:
                tensors = self._tensors_of(layer, keys)
            except Exception as e:   # noqa: BLE001 - its sends go as NaNs (below), its peers' receives complete
                warn_failed(f"reading the expert state of layer {layer}", e)
        ops = []
        for _, dst, dst_j, src, src_j in moves:
            if tensors is None and src == self.rank:
                row = torch.full((width, ), float("nan"), device=device)
                if dst == self.rank:
                    staging[(layer, dst_j)] = row
                else:
                    ops.append(dist.P2POp(dist.isend, row, self.ep_ranks[dst], self.ep_group))
            elif dst == self.rank and src == self.rank:
                staging[(layer, dst_j)] = _row(tensors, src_j).clone()
            elif dst == self.rank:
                staging[(layer, dst_j)] = torch.empty(width, dtype=torch.float32, device=device)
                ops.append(dist.P2POp(dist.irecv, staging[(layer, dst_j)], self.ep_ranks[src], self.ep_group))
            elif src == self.rank:
                ops.append(dist.P2POp(dist.isend, _row(tensors, src_j), self.ep_ranks[dst], self.ep_group))
        return ops

    def _state_keys(self) -> list[str]:
        """The optimizer's per-element state (Adam: exp_avg, exp_avg_sq); none before its first step."""
        optimizer = torch_optimizer(getattr(self.engine, "optimizer", None))
        if optimizer is None:
            return []
        return sorted({k for state in optimizer.state.values() for k, v in state.items()
                       if torch.is_tensor(v) and v.dim() > 0 and v.numel() > 1})

    def _link_optimizer_state(self, keys: list[str]) -> None:
        """DeepSpeed links each parameter to its optimizer state after the first optimizer step of its first
        parameter group, before the other groups (AutoEP's expert groups) have state: link them all again (local,
        cheap; the same on every rank)."""
        owner = getattr(self.engine, "optimizer", None)
        if keys and hasattr(owner, "_hp_optimizer_states_linked"):
            owner._hp_optimizer_states_linked = False
            owner._lazy_init_hp_params_optimizer_state()

    def _tensors_of(self, layer: int, keys: list[str]) -> list[tuple[torch.Tensor, Optional[Callable]]]:
        """Every [H, ...] tensor of the layer's expert state in a fixed order (each weight, its fp32 master under ZeRO
        1/2 and bf16, its optimizer moments), each with the setter that stores a full copy back (None: the tensor is
        the state itself). Reading the master or moments under ZeRO is collective."""
        from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_optimizer_state,
                                     safe_set_full_fp32_param, safe_set_full_optimizer_state)
        optimizer = torch_optimizer(getattr(self.engine, "optimizer", None))
        out = []
        for param in self.layers[layer].experts.parameters():
            out.append((param.data, None))
            if hasattr(param, "_hp_mapping"):
                out.append((safe_get_full_fp32_param(param), lambda t, p=param: safe_set_full_fp32_param(p, t)))
                out += [(safe_get_full_optimizer_state(param, k),
                         lambda t, p=param, k=k: safe_set_full_optimizer_state(p, t, k)) for k in keys]
            else:
                state = optimizer.state.get(param, {}) if optimizer is not None else {}
                out += [(state[k] if k in state else torch.zeros_like(param.data, dtype=torch.float32), None)
                        for k in keys]
        return out

    def _write(self, layer: int, rows: dict[int, torch.Tensor], keys: list[str]) -> None:
        """Phase 2: the received rows into every tensor of the layer's state (DeepSpeed's setters under ZeRO)."""
        pairs = self._tensors_of(layer, keys)
        for j, flat in rows.items():
            unflatten_row([t for t, _ in pairs], j, flat)
        for t, store in pairs:
            if store is not None:
                store(t)


def _row(pairs: list, j: int) -> torch.Tensor:
    """Row j of every tensor of `_tensors_of` as one fp32 vector (bf16 weights widen exactly; `unflatten_row`'s
    order)."""
    return torch.cat([t[j].reshape(-1).float() for t, _ in pairs])


def unflatten_row(weights: list, j: int, flat: torch.Tensor) -> None:
    """Row j of each grouped weight [S, ...] from one vector (`_row`'s and `AutoEPStore.read_slot`'s order)."""
    at = 0
    with torch.no_grad():
        for w in weights:
            n = w[j].numel()
            w[j].copy_(flat[at:at + n].view_as(w[j]))
            at += n
