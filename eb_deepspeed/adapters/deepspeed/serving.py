"""Serving with the cross-layer view: `init_inference`, replicated MoE layers, re-planning between batches.

Shape legend: L MoE layers, E logical experts, G EP ranks, S slots per rank, P physical slots (G * S;
slot p lives on EP rank p // S), R replicas of one expert, H home experts per rank (E / G).

    engine = eb_deepspeed.init_inference(model, config="configs/infer_cpu_2rank.json")
    engine.serving.load_checkpoint("runs/main/ckpt")      # DeepSpeed's files; each slot reads its expert
    logits, l_aux = engine(tokens)                         # after each forward: tally -> view (-> re-plan)
    engine.easybalance.metrics()                           # the core Balancer
    engine.serving.placement, engine.serving.replans       # where the replicas are
    engine.serving.save_checkpoint("out", tag="served")    # DeepSpeed's layout, logical experts only

`deepspeed.init_inference` builds expert-parallel groups but never hands them to the MoE layers and
leaves the model in training mode; with unequal batches per rank that aborts the All-to-All. This
adapter calls it, then hands every layer its group, sets eval mode, and makes the EP ranks agree on
one capacity (drop_tokens=True: DeepSpeed never agrees; this gate does, from the most tokens on any rank).

With an enabled `easybalance` block each MoE layer gets `inference.replica_slots` (R) extra expert
modules per rank and a `ReplicaGate`; DeepSpeed's `MOELayer` then runs over P = G * S "experts" (its
All-to-All untouched), S = H for DeepSpeed's own layout (where serving starts) or H + R with replicas.
After every forward the serving side steps the balancer (one all-reduce of the [L, W] tally) and,
once the view is warm, at most every `replan_interval` batches, when a layer's expected slot load
max/mean passes `replan_threshold`, plans replicas for every slot and serves the cheaper of that
plan and DeepSpeed's layout if it beats the current one: DeepSpeed pads every slot to the capacity,
so extra slots pay only where they cut the largest slot load by more than they add slots.
A re-plan moves weights in two phases: every rank fetches the new slots' weights into staging
buffers (one `batch_isend_irecv`), the ranks agree that every fetch succeeded and that they all
planned the same placement, then every rank copies and flips its tables before the next forward.
A failure at any point of the move (preparing it, posting or waiting for a transfer, checking what arrived)
keeps the old placement on every rank: a rank whose transfer failed still completes the others, and posts a
stand-in for one it could not post (`_transfer`), so no peer is left waiting; the failure reaches every rank
in the agreement. A rank dying inside the transfers ends the job
as any failed collective does.
"""
from __future__ import annotations

import copy
import hashlib
import os
import time
import warnings
from typing import Optional

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from ...core.balancer import Balancer, check_agreement
from ...core.config import EasyBalanceConfig, strip_block
from ...core.record import NullLogger
from ...core.topology import resolve_topology
from ...observe.monitor import JsonlLogger
from ...planning.placement import (MAX_SLOTS, SPREAD_WEIGHT, Placement, check_plan_size, expected_padded_cost,
                                   expected_slot_ratio, plan_placement, prefix_placement, static_placement,
                                   with_prefix)
from ..common import dist_rank, dist_ready, gather_startup, join_startup_off, rank_to_node, reduce_over
from .engine import check_world_size, find_moe_layers
from .hooks import incomplete_problem, mark_complete, mark_incomplete, on_rank0_for_all, refuse
from .replicas import ReplicaGate, SlotTable

__all__ = ["init_inference", "Serving", "load_moe_checkpoint", "choose_placement"]

EXPERTS_PREFIX = ".deepspeed_moe.experts.deepspeed_experts."
# A new placement must be expected to cut the padded cost by this much: the expectation is of the EMA
# heat, while each batch's capacity is its own maximum (noise on every slot), and moving weights and
# the replica split cost time too. Measured on the example model: a 3 % expected gain was a loss.
MIN_GAIN = 0.10
# A layout trial keeps replicas when they served this much faster per token than the one-slot-per-expert
# prefix (DeepSpeed's cost), measured in the same batches interleaved: below it, the noise of a short trial.
TRIAL_GAIN = 0.02
# After a lost trial the next re-plan waits replan_interval x 2^(lost trials in a row), at most this power.
MAX_BACKOFF = 6


def _flat(module: torch.nn.Module) -> torch.Tensor:
    """An expert's whole state (parameters and persistent buffers, state_dict order) as one vector."""
    return torch.cat([t.detach().reshape(-1) for t in module.state_dict().values()])


def _unflatten_into(module: torch.nn.Module, flat: torch.Tensor) -> None:
    at = 0
    with torch.no_grad():
        for t in module.state_dict().values():     # views of the module's own tensors
            t.copy_(flat[at:at + t.numel()].view_as(t))
            at += t.numel()


class Serving:
    """The serving side of one model: its replicated layers, placement, view, re-plans and checkpoints.

    Every rank's MoE layer has `S_max` = H + R expert modules; a placement uses the first S of them
    (S = H: DeepSpeed's own layout, no replicas; S = S_max: replicas in every slot), so a layer never
    pays for slots it does not use: DeepSpeed pads every active slot to the capacity.
    """

    # How the layer splits and pads an expert's routes over its replicas, as the planner models it
    # (`plan_placement(dispatch=)`): DeepSpeed's MOELayer pads every slot to the capacity.
    dispatch = "padded"

    def __init__(self, module: torch.nn.Module, config: Optional[EasyBalanceConfig]):
        self.module = module
        self.config = config
        self.moes = self._find_layers(module)
        (self.E, self.G), = {self._layer_shape(m) for m in self.moes}
        self.L, self.H = len(self.moes), self.E // self.G
        enabled = config is not None and config.enabled
        self.R = config.inference.replica_slots if enabled and config.mode == "balance" else 0
        self.S_max = self.H + self.R
        if self.G * self.S_max > MAX_SLOTS:      # before any expert is copied
            raise ValueError(f"easybalance.inference.replica_slots ({self.R}): {self.G} ranks x ({self.H} home + "
                             f"{self.R} replica slots) is more than the planner's {MAX_SLOTS} slots a layer; use at "
                             f"most {MAX_SLOTS // self.G - self.H}")
        try:
            check_plan_size(self.L, self.G * self.S_max, self.G)     # what a re-plan would refuse mid-serving
        except ValueError as e:
            raise ValueError(f"easybalance.inference.replica_slots ({self.R}): {e}") from None
        self.ep_group = self._layer_ep_group(self.moes[0])
        self.rank = dist.get_rank(self.ep_group) if dist_ready() and self.G > 1 else 0
        # global ranks of this rank's EP group (ep_size 1: the rank itself)
        self.ep_ranks = dist.get_process_group_ranks(self.ep_group) if dist_ready() and self.G > 1 else [dist_rank()]
        # collectives on the accelerator (NCCL takes no host tensors)
        self.device = torch.device(get_accelerator().current_device_name())
        self.replans, self.weight_moves, self.failed_moves = 0, 0, 0
        self.batches, self.last_plan_batch = 0, None
        self.home = static_placement(self.L, self.E, self.G)       # DeepSpeed's layout: S = H, no replicas
        self.placement = self.home      # what the gates' tables serve
        self.resident = self.home       # what the expert modules hold (`placement`, or a plan whose prefix serves)
        self.trials: list[dict] = []    # the layout trials run (`_end_trial`)
        self._trial: Optional[dict] = None
        self._lost_trials = 0
        self.node_G = torch.zeros(self.G, dtype=torch.long)
        self.rank_to_node, self.topology = [0], "pcie"
        self.balancer: Optional[Balancer] = None
        if enabled:
            self._agree_at_start_up()
        else:
            join_startup_off()          # a rank whose block is on waits for this rank in the start-up all-gather
        self.gates: list[ReplicaGate] = []
        for layer, moe in enumerate(self.moes):
            self._replicate(layer, moe, record=enabled)
        if enabled:
            self.balancer = Balancer(config, self.gates, self.G, reduce=reduce_over(), device_tally=True,
                                     train_controls=False, rank_to_node=self.rank_to_node, tally_device=self.device,
                                     logger=self._logger,
                                     extra_metrics=lambda: {"replans": self.replans, "weight_moves": self.weight_moves})

    @property
    def S(self) -> int:
        """Slots per rank of the placement serving now."""
        return self.placement.slots_per_device

    @property
    def P(self) -> int:
        return self.G * self.S

    @property
    def on_trial(self) -> bool:
        """A layout trial is running: replicas and their prefix serve in turns (`_start_trial`)."""
        return self._trial is not None

    # ------------------------------------------------------------------ set-up
    def _agree_at_start_up(self) -> None:
        log = self.config.log
        gathered, rank, self._logger = gather_startup(
            {"config": self.config.to_dict(), "experts": self.E, "devices": self.G, "layers": self.L,
             "top_k": [self._layer_top_k(m) for m in self.moes]},
            prepare=lambda: JsonlLogger(log.dir, log.max_mb) if dist_rank() == 0 else NullLogger())
        check_agreement([{k: v for k, v in g.items() if k != "host"} for g in gathered], rank)
        self.rank_to_node = rank_to_node(gathered)
        self.node_G = torch.tensor([self.rank_to_node[r] for r in self.ep_ranks])
        num_nodes = int(self.node_G.max()) + 1
        self.topology, note = resolve_topology(self.config.inference.topology,
                                               explicit="topology" in self.config.inference.explicit,
                                               num_nodes=num_nodes)
        if note and dist_rank() == 0:
            warnings.warn(f"easybalance.inference.topology: {note}")

    # ------------------------------------------------------------------ the framework's layer (a subclass's part)
    @staticmethod
    def _find_layers(module: torch.nn.Module) -> list:
        """The model's MoE layers, in layer order, checked to share one serving shape."""
        moes = [m for _, m in find_moe_layers(module)]
        if not moes:
            raise ValueError("init_inference: the model has no deepspeed.moe.layer.MoE layers")
        check_one_serving_shape(module)
        return moes

    @staticmethod
    def _layer_shape(moe) -> tuple[int, int]:
        """(logical experts, EP ranks) of a layer."""
        return moe.num_experts, moe.ep_size

    @staticmethod
    def _layer_ep_group(moe):
        return moe.deepspeed_moe.ep_group

    @staticmethod
    def _layer_top_k(moe) -> int:
        return moe.deepspeed_moe.gate.k

    def _slot_state(self, layer: int, j: int) -> torch.Tensor:
        """The whole state of this rank's local slot j of a layer, as one vector (what a weight move sends)."""
        return _flat(self.expert_module(layer, j))

    def _load_slot(self, layer: int, j: int, flat: torch.Tensor) -> None:
        _unflatten_into(self.expert_module(layer, j), flat)

    def _set_tables(self, layer: int, placement: Placement) -> None:
        """Serve `placement` in one layer from its next forward on (its weights already in place)."""
        moe, gate = self.moes[layer], self.gates[layer]
        moe.deepspeed_moe.experts.num_local_experts = placement.slots_per_device
        moe.deepspeed_moe.num_local_experts = placement.slots_per_device
        gate.set_table(SlotTable.even(placement.log2phy[layer]), placement.slots_per_device)

    def _replicate(self, layer: int, moe, record: bool) -> None:
        """Give the layer S_max expert modules per rank (R empty ones after its home experts; the home
        placement uses the first H) and a ReplicaGate."""
        experts = moe.deepspeed_moe.experts
        if self.R:
            extra = [copy.deepcopy(experts.deepspeed_experts[0]) for _ in range(self.R)]
            for slot in extra:
                for p in slot.parameters():
                    p.data.zero_()                      # an empty slot until a placement fills it
                    p.allreduce, p.group_name = False, moe.expert_group_name
            experts.deepspeed_experts.extend(extra)
        inf = self.config.inference if self.config is not None else None
        steer_options = {} if inf is None else {"weights": inf.weights.as_tuple(), "topology": self.topology,
                                                "decision_batch": inf.decision_batch}
        gate = ReplicaGate.from_gate(moe.deepspeed_moe.gate, self.G, self.S, rank=self.rank,
                                     table=SlotTable.even(self.placement.log2phy[layer]),
                                     split="view" if inf is None else inf.split, node_G=self.node_G,
                                     steer_options=steer_options)
        gate.layer_index = layer
        gate.recording = record
        moe.deepspeed_moe.gate = gate
        self.gates.append(gate)


    def expert_module(self, layer: int, j: int) -> torch.nn.Module:
        """This rank's j-th expert module of a layer (the module behind local slot j)."""
        return self.moes[layer].deepspeed_moe.experts.deepspeed_experts[j]

    def expert_in_slot(self, plan: Placement, layer: int, rank: int, j: int) -> int:
        """The logical expert in rank's local slot j under `plan` (-1: empty, or not a slot of the plan)."""
        S = plan.slots_per_device
        return int(plan.phy2log[layer, rank * S + j]) if j < S else -1

    # ------------------------------------------------------------------ per batch
    def before_batch(self, inputs: tuple) -> None:
        """During a layout trial: start the clock of this forward (after the accelerator's queued work)."""
        if self._trial is not None:
            get_accelerator().synchronize()
            x = next((t for t in inputs if isinstance(t, torch.Tensor)), None)
            tokens = 1 if x is None else (x.numel() // x.shape[-1] if x.is_floating_point() and x.dim() else x.numel())
            self._trial["started"] = (time.perf_counter(), max(tokens, 1))

    def after_batch(self) -> None:
        """Every `view_interval` batches: step the balancer (one all-reduce of the tallies the gates
        gathered since, posted in the background: no rank waits for the others after its forward); one
        batch later the view takes that step and serving re-plans if it says so. During a layout trial,
        time the forward."""
        if self.balancer is None:
            return
        self.batches += 1
        if self._trial is not None:
            self._time_trial_batch()
        if self.balancer.in_flight:        # posted after an earlier forward: done by now, or nearly
            self.balancer.settle()
            self._after_view_step()
        if self.batches % self.config.inference.view_interval == 0:
            self.balancer.step_async(self._post_reduce)

    def _after_view_step(self) -> None:
        """The view took a step: the gates get its cross-layer pressure; re-plan if the view says so."""
        view = self.balancer.view_so_far
        cross_LG = view.cross_layer_pressure() if view.steps else None
        for layer, gate in enumerate(self.gates):
            gate.set_pressure(None if cross_LG is None else cross_LG[layer])
        if self.R and self._trial is None:
            self.maybe_replan()

    @staticmethod
    def _post_reduce(packed_LW: torch.Tensor):
        """The view step's all-reduce, posted (async_op): no rank waits for the others after its forward."""
        if not dist_ready() or dist.get_world_size() == 1:
            return None
        return dist.all_reduce(packed_LW, async_op=True)

    def maybe_replan(self) -> bool:
        """Once the view is warm, at most every `replan_interval` batches (longer after lost layout trials),
        choose a placement (`choose_placement`) and move to it if it differs from the serving one; replicas that
        replace a one-slot-per-expert layout serve on trial (`_start_trial`; a re-plan of replicas that won
        their trial does not). Returns whether a new placement serves."""
        inf, view = self.config.inference, self.balancer.view_so_far
        if not view.ready:
            return False
        wait = inf.replan_interval * 2 ** min(self._lost_trials, MAX_BACKOFF)
        if self.last_plan_batch is not None and self.batches - self.last_plan_batch < wait:
            return False
        choice = choose_placement(view.heat_LE, self.placement, self.home, inf.replan_threshold, plan=self._plan,
                                  cost=self._cost, ratio=self._ratio)
        if choice is None:
            return False
        self.last_plan_batch = self.batches
        if choice is self.placement:
            return False
        if choice is self.home and self._prefix(self.resident) is not None:
            self._serve(self._prefix(self.resident))        # DeepSpeed's cost without moving a weight
            return True
        switching = self.placement.slots_per_device == self.H     # from one slot per expert to replicas
        if not self.apply(choice):
            return False
        # with drops, replicas change which tokens are kept (fewer drops): not a matter of time alone
        dropless = not any(getattr(gate, "drop_tokens", False) for gate in self.gates)
        if switching and dropless and self._prefix(choice) is not None and inf.trial_batches:
            self._start_trial(choice)
        return True

    def _plan(self, heat_LE: torch.Tensor) -> Placement:
        """Replicas for every slot (S_max per rank) from the view's heat, in the layer's dispatch model."""
        num_nodes = int(self.node_G.max()) + 1
        # DeepSpeed pads every slot to the largest (`expected_padded_cost`, the choice): plan for that
        # ("padded": the largest share as small as it gets), under either split. Node spread only pays where
        # routes can stay on their node: with the `exact` split, which steers them there.
        spread = SPREAD_WEIGHT if self.config.inference.split == "exact" else False
        planned = plan_placement(heat_LE, self.G, self.S_max, num_nodes=num_nodes, previous=self.resident,
                                 dispatch=self.dispatch, node_spread=spread)
        # the same counts laid over a one-slot-per-expert prefix (the same padded cost): the layout trial
        # flips between them
        return with_prefix(planned, previous=self.resident, node_G=self.node_G.numpy() if spread else None) \
            or planned

    @staticmethod
    def _cost(heat_LE: torch.Tensor, plan: Placement) -> torch.Tensor:
        """[L] what a layer costs under `plan` in the layer's dispatch model (routes computed and sent)."""
        return expected_padded_cost(heat_LE, plan)

    @staticmethod
    def _ratio(heat_LE: torch.Tensor, plan: Placement) -> torch.Tensor:
        """[L] the skew `replan_threshold` is compared with: the expected largest slot load over the mean."""
        return expected_slot_ratio(heat_LE, plan)

    @staticmethod
    def _prefix(plan: Placement) -> Optional[Placement]:
        """The one-slot-per-expert layout resident in `plan`'s first slots, or None (see `with_prefix`)."""
        if plan.slots_per_device * plan.num_devices == plan.num_experts:
            return None
        prefix = prefix_placement(plan)
        return prefix if bool((prefix.logcnt == 1).all()) else None

    # ------------------------------------------------------------------ layout trial
    def _start_trial(self, plan: Placement) -> None:
        """Serve `plan` and its prefix (DeepSpeed's cost) in turns, ABBA, for `trial_batches` batches; then keep
        the one that served faster per token on every rank together (`_end_trial`). The padded-cost model
        chose the plan from the view; the trial checks it against the forward time it actually gives."""
        self._trial = {"plan": plan, "base": self._prefix(plan), "times": {"plan": [0.0, 0], "base": [0.0, 0]},
                       "batch": 0, "started": None}

    def _trial_layout(self, i: int) -> str:
        return "plan" if i % 4 in (0, 3) else "base"

    def _time_trial_batch(self) -> None:
        trial = self._trial
        if trial["started"] is not None:
            get_accelerator().synchronize()
            t0, tokens = trial["started"]
            spent = trial["times"][self._trial_layout(trial["batch"])]
            spent[0] += time.perf_counter() - t0
            spent[1] += tokens
            trial["started"] = None
        trial["batch"] += 1
        if trial["batch"] >= self.config.inference.trial_batches:
            self._end_trial()
        else:
            self._serve(trial[self._trial_layout(trial["batch"])])

    def _end_trial(self) -> None:
        trial, self._trial = self._trial, None
        times = torch.tensor([*trial["times"]["plan"], *trial["times"]["base"]], dtype=torch.float64,
                             device=self.device)
        if dist_ready() and dist.get_world_size() > 1:
            dist.all_reduce(times)           # every rank decides on the same sums
        plan_s, plan_tokens, base_s, base_tokens = times.tolist()
        per_plan, per_base = plan_s / max(plan_tokens, 1), base_s / max(base_tokens, 1)
        kept = per_plan > 0 and per_base > 0 and per_plan < (1 - TRIAL_GAIN) * per_base
        self._lost_trials = 0 if kept else self._lost_trials + 1
        self.trials.append({"batch": self.batches, "us_per_token_replicas": round(1e6 * per_plan, 3),
                            "us_per_token_deepspeed_cost": round(1e6 * per_base, 3), "replicas_kept": kept})
        self._serve(trial["plan"] if kept else trial["base"])

    def _serve(self, placement: Placement) -> None:
        """Flip every layer's tables to `placement`, whose weights the modules hold (`resident` or its prefix)."""
        self.placement = placement
        for layer in range(self.L):
            self._set_tables(layer, placement)

    # ------------------------------------------------------------------ weight moves
    def _moves(self, plan: Placement) -> list[tuple[int, int, int, int, int]]:
        """(layer, destination rank, its module, source rank, its module) for every slot of `plan` whose
        module holds another expert now: the source is a module that holds the expert (`resident`), on the
        destination's rank when there is one."""
        old, S_old, S_new = self.resident, self.resident.slots_per_device, plan.slots_per_device
        moves = []
        for layer in range(self.L):
            for p in range(self.G * S_new):
                e, rank, j = int(plan.phy2log[layer, p]), p // S_new, p % S_new
                if e < 0 or self.expert_in_slot(old, layer, rank, j) == e:
                    continue
                holders = [(q // S_old, q % S_old) for q in torch.nonzero(old.phy2log[layer] == e).flatten().tolist()]
                local = [h for h in holders if h[0] == rank]
                src_rank, src_j = (local or holders)[0]
                moves.append((layer, rank, j, src_rank, src_j))
        return moves

    def apply(self, plan: Placement) -> bool:
        """Move weights for `plan` and flip every rank to it, or keep the old placement everywhere."""
        if plan.phy2log.shape[0] != self.L or plan.num_experts != self.E or plan.num_devices != self.G \
                or plan.slots_per_device > self.S_max:
            raise ValueError(f"a placement of {tuple(plan.phy2log.shape)} slots ({plan.slots_per_device} per rank) "
                             f"does not fit {self.L} layers x {self.G} ranks x at most {self.S_max} slots")
        if self._trial is not None:         # a placement set from outside ends the trial: the tables are its
            self._trial = None
        key = int(hashlib.sha1(plan.phy2log.numpy().tobytes()).hexdigest()[:15], 16)
        moves = self._moves(plan)
        staging: dict[tuple[int, int], torch.Tensor] = {}
        ops, ok = [], True
        try:   # phase 1a: staging buffers for our destination modules, the transfers to post
            ops = self._prepare(moves, staging)
        except Exception as e:   # noqa: BLE001 - any failure must reach the agreement, not hang the peers
            ok = self._failed("preparing the weight moves", e)
        if not self._agree(ok, key):
            self.failed_moves += 1
            return False
        try:   # phase 1b: every transfer, then a check of what arrived
            _transfer(ops)
            self._verify(staging)
        except Exception as e:   # noqa: BLE001
            ok = self._failed("moving expert weights", e)
        if not self._agree(ok, key):
            self.failed_moves += 1
            return False
        # phase 2: every rank got every weight: copy them in and flip the tables before the next forward
        for (layer, j), flat in staging.items():
            self._load_slot(layer, j, flat)
        self.resident = plan
        self._serve(plan)
        self.replans += 1
        self.weight_moves += len(moves)
        return True

    def _prepare(self, moves, staging) -> list:
        ops = []
        for layer, dst, dst_j, src, src_j in moves:
            if dst == self.rank:
                staging[(layer, dst_j)] = torch.empty_like(self._slot_state(layer, dst_j))
                if src == self.rank:
                    staging[(layer, dst_j)].copy_(self._slot_state(layer, src_j))
                else:
                    ops.append(dist.P2POp(dist.irecv, staging[(layer, dst_j)], self.ep_ranks[src]))
            elif src == self.rank:
                ops.append(dist.P2POp(dist.isend, self._slot_state(layer, src_j), self.ep_ranks[dst]))
        return ops

    def _verify(self, staging) -> None:
        """What arrived must be finite (a weight move never loads garbage into a serving slot)."""
        for (layer, j), flat in staging.items():
            if not bool(torch.isfinite(flat).all()):
                raise ValueError(f"layer {layer} module {j}: received non-finite expert weights")

    def _failed(self, what: str, error: Exception) -> bool:
        warnings.warn(f"easybalance: {what} failed on rank {dist_rank()} ({type(error).__name__}: {error}); "
                      "the old placement keeps serving")
        return False

    def _agree(self, ok: bool, key: int) -> bool:
        """Every rank succeeded, and every rank planned the same placement (the view is identical)."""
        flags = torch.tensor([int(ok), key, -key], dtype=torch.long, device=self.device)
        if dist_ready() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        if int(flags[1]) != -int(flags[2]):
            raise RuntimeError("easybalance: ranks planned different placements from what should be the same view")
        return bool(flags[0])

    # ------------------------------------------------------------------ checkpoints (DeepSpeed's file layout)
    def load_checkpoint(self, ckpt_dir: str, tag: Optional[str] = None) -> str:
        """Load a DeepSpeed MoE checkpoint (a training engine's, or `save_checkpoint`'s): every local slot
        reads the file of the expert it holds, so replicas are filled without communication."""
        return load_moe_checkpoint(self.module, ckpt_dir, tag,
                                   expert_in_slot=lambda layer, j: self.expert_in_slot(self.resident, layer, self.rank, j))

    def home_states(self) -> dict[tuple[int, int], torch.Tensor]:
        """{(layer, expert): its state as one vector} for the home experts of this rank (expert e's home is
        EP rank e // H, as DeepSpeed lays them out). A home expert that moved is fetched from a slot that
        holds it, on its home rank when there is one (one batch of transfers); a replica is never sent twice.
        Collective over the EP group."""
        S = self.S
        flats: dict[tuple[int, int], torch.Tensor] = {}
        ops = []
        for layer in range(self.L):
            for e in range(self.E):
                holders = [(q // S, q % S) for q in torch.nonzero(self.placement.phy2log[layer] == e).flatten().tolist()]
                home = e // self.H
                src, src_j = ([h for h in holders if h[0] == home] or holders)[0]
                if home == self.rank:
                    source = self._slot_state(layer, src_j if src == self.rank else 0)
                    flats[(layer, e)] = source if src == self.rank else torch.empty_like(source)
                    if src != self.rank:
                        ops.append(dist.P2POp(dist.irecv, flats[(layer, e)], self.ep_ranks[src]))
                elif src == self.rank:
                    ops.append(dist.P2POp(dist.isend, self._slot_state(layer, src_j), self.ep_ranks[home]))
        _transfer(ops)
        return flats

    def logical_state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """The home experts of this rank ({file name: expert state with global ids}, `home_states`) and, under
        the key "module", the non-expert weights: what DeepSpeed writes. Collective."""
        names = self._moe_names()
        out: dict[str, dict[str, torch.Tensor]] = {}
        for (layer, e), flat in self.home_states().items():
            shapes = [(n, t.shape) for n, t in self.expert_module(layer, 0).state_dict().items()]
            parts = torch.split(flat, [s.numel() for _, s in shapes])
            out[f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt"] = {
                f"{names[layer]}{EXPERTS_PREFIX}{e}.{n}": part.view(shape).clone()
                for (n, shape), part in zip(shapes, parts)}
        out["module"] = {k: v.clone() for k, v in self.module.state_dict().items() if EXPERTS_PREFIX not in k}
        return out

    def save_checkpoint(self, ckpt_dir: str, tag: str = "served") -> str:
        """Write DeepSpeed's MoE checkpoint layout with the logical experts (every rank of the first EP group
        its home experts; global rank 0 the non-expert weights and `latest`). Collective.

        A DeepSpeed engine of the same model loads it with `load_checkpoint(dir, load_module_only=True)`, or
        with `load_optimizer_states=False, load_lr_scheduler_states=False` (then its step count starts at 0):
        serving holds no optimizer or scheduler state, so a default `load_checkpoint` (optimizer states on)
        fails on the missing optimizer file."""
        state = self.logical_state_dict()
        folder = os.path.join(ckpt_dir, tag)
        # as the training save does: a kill never passes for a checkpoint (the all-gather is the barrier)
        on_rank0_for_all(lambda: mark_incomplete(folder), "marking the checkpoint incomplete")
        if 0 in self.ep_ranks:                 # the first EP group writes (every EP group holds the same)
            for name, tensors in state.items():
                if name != "module":
                    torch.save(tensors, os.path.join(folder, name))
        if dist_rank() == 0:    # the keys a DeepSpeed engine reads with load_module_only=True (or without
            # optimizer and scheduler states): weights only, no optimizer, scheduler or step count is served
            world = dist.get_world_size() if dist_ready() else 1
            torch.save({"module": state["module"], "num_experts": [self.E] * self.L, "dp_world_size": world,
                        "mp_world_size": 1, "global_steps": 0, "global_samples": 0, "skipped_steps": 0,
                        "optimizer": None, "lr_scheduler": None}, os.path.join(folder, "mp_rank_00_model_states.pt"))
        if dist_ready():
            dist.barrier()                                      # every rank has written its files
        on_rank0_for_all(lambda: mark_complete(ckpt_dir, tag), "completing the checkpoint")
        return folder

    def _moe_names(self) -> list[str]:
        return [name for name, _ in find_moe_layers(self.module)]



def _post(op: "dist.P2POp"):
    """Post one transfer (non-blocking); its work object."""
    return op.op(op.tensor, op.peer, op.group, op.tag)


def _transfer(ops: list) -> None:
    """Post every transfer of a weight move and wait for each, so that no peer is left in a `wait()` that
    nothing will answer. On NCCL the ops go as one group (posted one by one, a swap deadlocks) and a failure
    there is the communicator's. On gloo (which posts them one at a time anyway) each is posted on its own:
    one this rank fails to post is replaced by a stand-in of the same shape (a send of NaNs, which the
    receiver's check refuses; a receive into scratch), so the peer's matching operation completes; a wait
    that fails does not stop the others. Then the first error is raised, and reaches the agreement."""
    if not ops:
        return
    if dist.get_backend(ops[0].group) != "gloo":
        requests, errors = dist.batch_isend_irecv(ops), []
    else:
        requests, errors = [], []
        for op in ops:
            try:
                requests.append(_post(op))
            except Exception as e:   # noqa: BLE001 - whatever failed, the peer's operation must still be matched
                errors.append(e)
                sends = op.op is dist.isend
                stand_in = torch.full_like(op.tensor, float("nan")) if sends else torch.empty_like(op.tensor)
                requests.append(_post(dist.P2POp(op.op, stand_in, op.peer, op.group, op.tag)))
    for request in requests:
        try:
            request.wait()
        except Exception as e:   # noqa: BLE001
            errors.append(e)
    if errors:
        raise errors[0]


def load_moe_checkpoint(module: torch.nn.Module, ckpt_dir: str, tag: Optional[str] = None,
                        expert_in_slot=None) -> str:
    """Load DeepSpeed's MoE checkpoint layout into `module` on this rank: the non-expert weights from
    `mp_rank_00_model_states.pt`, and each local expert module j of MoE layer l from the file of the
    expert it holds, `layer_{l}_expert_{e}_mp_rank_00_model_states.pt` (read with weights_only=True).

    expert_in_slot(l, j) -> logical expert in local module j (-1: none); default DeepSpeed's layout, expert
    EP-rank * local experts + j. Works for a plain DeepSpeed model whose layers have their EP groups.
    """
    problem = incomplete_problem(ckpt_dir, tag)
    if problem:
        raise refuse(ckpt_dir, problem)
    tag = _tag(ckpt_dir, tag)
    folder = os.path.join(ckpt_dir, tag)
    moes = find_moe_layers(module)
    if expert_in_slot is None:
        def expert_in_slot(layer, j):
            moe = moes[layer][1]
            group = moe.deepspeed_moe.ep_group
            ep_rank = dist.get_rank(group) if dist_ready() and moe.ep_size > 1 else 0
            return ep_rank * moe.num_local_experts + j if j < moe.num_local_experts else -1
    state = torch.load(os.path.join(folder, "mp_rank_00_model_states.pt"), map_location="cpu",
                       weights_only=True)["module"]
    empty = set()
    for layer, (name, moe) in enumerate(moes):
        prefix = f"{name}{EXPERTS_PREFIX}"
        for j in range(len(moe.deepspeed_moe.experts.deepspeed_experts)):
            e = expert_in_slot(layer, j)
            if e < 0:
                empty.add(f"{prefix}{j}.")
                continue
            expert = torch.load(os.path.join(folder, f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt"),
                                map_location="cpu", weights_only=True)
            for key, value in expert.items():
                state[key.replace(f"{prefix}{e}.", f"{prefix}{j}.")] = value
    wanted = module.state_dict()
    missing = sorted(k for k in wanted if k not in state and not any(k.startswith(p) for p in empty))
    unexpected = sorted(k for k in state if k not in wanted)
    if missing or unexpected:
        raise ValueError(f"{folder}: checkpoint does not fit this model (missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]})")
    module.load_state_dict(state, strict=False)
    return folder


def choose_placement(heat_LE: torch.Tensor, current: Placement, home: Placement, threshold: float,
                     plan, cost=expected_padded_cost, ratio=expected_slot_ratio) -> Optional[Placement]:
    """The placement to serve next, or None when the view gives no reason to plan (pure).

    Plan (`plan(heat_LE)`: replicas for every slot) when a layer's skew under the current placement
    (`ratio(heat_LE, plan)` [L]) passes `threshold`, or when DeepSpeed's layout (`home`) would cost
    `MIN_GAIN` less than the current one (replicas traffic no longer needs). `cost(heat_LE, plan)` [L]:
    what each layer computes and sends. Defaults, DeepSpeed's padded MOELayer: the expected slot max/mean,
    and slots x the largest expected slot load (`expected_padded_cost`; extra slots pay only where they
    cut that load by more than they add slots). Of the plan and the home layout the cheaper is chosen; it
    replaces the current placement when it costs `MIN_GAIN` less, else the current one is returned
    (planned, nothing to move).
    """
    def total(p: Placement) -> float:
        return float(cost(heat_LE, p).sum())

    skewed = float(ratio(heat_LE, current).max()) > threshold
    unneeded = current is not home and total(home) < (1 - MIN_GAIN) * total(current)
    if not (skewed or unneeded):
        return None
    best = min((plan(heat_LE), home), key=total)
    return best if total(best) < (1 - MIN_GAIN) * total(current) else current


def _tag(ckpt_dir: str, tag: Optional[str]) -> str:
    if tag is not None:
        return str(tag)
    latest = os.path.join(ckpt_dir, "latest")
    if not os.path.exists(latest):
        raise FileNotFoundError(f"{ckpt_dir}: no `latest` file; pass tag=")
    with open(latest, encoding="utf-8") as f:
        return f.read().strip()


def check_one_serving_shape(model: torch.nn.Module) -> None:
    """Serving plans one slot layout for all layers: refuse MoE layers that differ in num_experts or ep_size
    (PR-MoE) with a clear error. `init_inference` calls it before any DeepSpeed state is touched."""
    moes = find_moe_layers(model)
    if len({(m.num_experts, m.ep_size) for _, m in moes}) > 1:
        layers = ", ".join(f"{name}: {m.num_experts} experts, ep_size {m.ep_size}" for name, m in moes)
        raise ValueError(f"init_inference: serving needs every MoE layer to have the same num_experts and ep_size "
                         f"(one replica-slot layout for all layers), got {layers}. Nothing was changed; such a "
                         "model trains with eb_deepspeed.initialize, and serves with deepspeed.init_inference")


# Top-level ds_config sections of training that DeepSpeed's runtime reads beyond `deepspeed.runtime.constants`
TRAINING_SECTIONS = ("zero_optimization", "activation_checkpointing", "flops_profiler", "wandb", "tensorboard",
                     "csv_monitor", "comet", "expert_parallel", "aio", "compression_training", "data_efficiency",
                     "autotuning", "elasticity", "nebula", "curriculum_learning", "sparse_attention", "pipeline",
                     "hybrid_engine", "timers", "compile", "amp", "progressive_layer_drop", "eigenvalue",
                     "quantize_training")


def _inference_keys(ds_config: dict) -> dict:
    """The ds_config without the training settings DeepSpeed's inference config refuses
    (`train_micro_batch_size_per_gpu`, `optimizer`, `zero_optimization`, ...), named once in a warning: the
    config a user trains with (where the block lives) serves as it is. A key that is neither an inference
    nor a training setting stays, so DeepSpeed refuses it as it would (a misspelled key is never dropped)."""
    from deepspeed.inference.config import DeepSpeedInferenceConfig
    from deepspeed.runtime import constants
    fields = DeepSpeedInferenceConfig.model_fields
    accepted = set(fields) | {f.alias for f in fields.values() if f.alias}
    training = {v for k, v in vars(constants).items() if k.isupper() and isinstance(v, str)} | set(TRAINING_SECTIONS)
    dropped = sorted(k for k in ds_config if k not in accepted and k in training)
    if dropped:
        warnings.warn(f"init_inference: left out of DeepSpeed's inference config the training settings it does "
                      f"not take: {', '.join(dropped)}")
    return {k: v for k, v in ds_config.items() if k not in dropped}


def init_inference(model: torch.nn.Module, config=None, **kwargs):
    """`deepspeed.init_inference` for models built from `deepspeed.moe.layer.MoE`, made correct for
    expert parallelism, with the `easybalance` block of the same config.

    config: DeepSpeed's inference config (dict or JSON path) that may hold an `"easybalance"` block; the
    ds_config one trains with works too (its training-only keys are left out, with one warning);
    kwargs go to `deepspeed.init_inference` as they are, except that without a `dtype` the model keeps
    its own (DeepSpeed would cast to fp16). Returns DeepSpeed's `InferenceEngine` with
    `engine.serving` (placement, checkpoints) and, with an enabled block, `engine.easybalance` (the
    Balancer). Every EP rank must call forward together, as DeepSpeed's All-to-All requires.

    `eb_deepspeed.init_inference` (`adapters.serving`) sends AutoEP-converted models to
    `adapters.autoep.serving` instead, and others here.
    """
    import deepspeed

    from ..autoep.engine import find_autoep_layers
    if find_autoep_layers(getattr(model, "module", model)):
        raise ValueError("init_inference: an AutoEP-converted model; eb_deepspeed.init_inference serves it in "
                         "AutoEP's own layers (this one builds on deepspeed.init_inference, which has no AutoEP path)")
    eb_config = EasyBalanceConfig.from_ds_config(config)
    ds_config = _inference_keys(strip_block(config) or {})
    if eb_config.enabled:
        where = f'mode "{eb_config.mode}"'
        for path in eb_config.ignored_options("inference"):
            warnings.warn(f"{path} has no effect in serving ({where})")
    check_one_serving_shape(model)      # before DeepSpeed (and its process group) is touched
    check_world_size(model)
    if not dist_ready():
        deepspeed.init_distributed()
    if "dtype" not in ds_config and "dtype" not in kwargs:
        # deepspeed.init_inference would cast to fp16 by default; serving keeps the weights as they are
        kwargs["dtype"] = next(model.parameters()).dtype
    engine = deepspeed.init_inference(model, config=ds_config, **kwargs)
    module = engine.module
    for _, moe in find_moe_layers(module):
        if moe.deepspeed_moe.ep_group is None:
            moe.set_deepspeed_parallelism()   # the groups deepspeed.init_inference never hands over
    module.eval()
    serving = Serving(module, eb_config if eb_config.enabled else None)
    engine.serving = serving
    if serving.balancer is not None:
        engine.easybalance = serving.balancer
        module.register_forward_pre_hook(lambda mod, args: serving.before_batch(args))
        module.register_forward_hook(lambda mod, args, output: serving.after_batch())
    return engine
