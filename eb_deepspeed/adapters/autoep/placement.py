"""Training-time expert placement for AutoEP (`easybalance.train_placement`): experts re-placed over the EP ranks
from the view, routing untouched (for fine-tuning, where the pretrained routing is the model's knowledge). This is
the lifecycle; the rows it moves are `state.ExpertState`, replicas compute through `fetch`.

Shape legend: L MoE layers, E experts, G EP ranks, H experts per rank (E / G), S = H + replica slots.

    "easybalance": {"mode": "observe", "train_placement": {"interval": 50, "replica_slots": 1}}

A dropless AutoEP layer takes as long as its busiest rank. At the first training forward after every `interval`-th
optimizer step the view's heat is planned as a permutation of each layer's experts (`SPLIT`: the exact split the
routes run) and moved with its optimizer state (`moves.Placer`: any failure anywhere keeps every rank's placement
and state) when `choose_placement` expects `TRAIN_MIN_GAIN` and the saving over the interval pays for the copies
(`moves.transfer_stall`). Routes go through `routes.AutoEPRoutes` (counting nothing): gate values and the tally
stay logical. With `replica_slots` R a rank also has R replica slots beside its H homes (AutoEP's own parameter
rows, which keep the optimizer state and checkpoints), filled every training micro-batch where a copy's routes pay
for its transfer (`fetch.LayerReplicas`). Exports are in AutoEP's layout: checkpoints go home and back
(`at_home`); a placed `state_dict()` is refused."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist

from ...planning.placement import DISPATCH, Placement, choose_placement, index_maps, plan_placement, static_placement
from ..common import dist_ready, shared_problem, torch_optimizer
from ..deepspeed.hooks import is_decoupled
from ..moves import Placer, RowMover, slot_moves, transfer_stall, warn_failed
from ..routing import Routing, SlotTable
from .fetch import LayerReplicas, with_replicas
from .routes import AutoEPRoutes
from .state import ELEMENTWISE_OPTIMIZERS, ExpertState, expert_params, state_bytes, state_keys

__all__ = ["TrainPlacement"]

# A training route costs forward and backward: 3 x the 2 FLOPs per expert parameter of a forward.
FLOPS_PER_PARAM = 6
# A re-plan must be expected to cut the layers' busiest-rank routes by this share. Lower than serving's MIN_GAIN:
# the heat is the EMA of whole optimizer steps' counts (every rank's micro-batches), and the copies are priced.
# With serving's 10 % one layer drifting back to 1.25x went unanswered for 180 steps (docs/benchmarks.md).
TRAIN_MIN_GAIN = 0.03
SPLIT = DISPATCH["steered"]      # the routes' split: each micro-batch's exact split over an expert's copies


class TrainPlacement(Placer):
    """The experts of every AutoEP layer of `engine` placed over its EP ranks: `resident` the home experts (AutoEP's
    own layout to start), `placement` what the routes use (the homes, or them with replicas), re-planned from
    `balancer`'s view every `interval` optimizer steps."""

    def __init__(self, engine, layers: list, gates: list, balancer, interval: int, topology: str = "pcie",
                 replica_slots: int = 0):
        _check_engine(engine, layers)
        self.engine, self.layers, self.balancer = engine, layers, balancer
        self.interval, self.topology = int(interval), topology
        self.L = len(layers)
        self.E, self.G = int(layers[0].num_experts), int(layers[0].ep_size)
        self.H = self.E // self.G
        self.R = int(replica_slots)
        self.S = self.H + self.R
        if self.R > self.E - self.H:
            raise ValueError(f"easybalance.train_placement.replica_slots ({self.R}) must be <= {self.E - self.H} for "
                             f"{self.E} experts over {self.G} EP ranks: a rank's replica slots hold experts homed "
                             "elsewhere, one copy each")
        if self.R and any(getattr(m, "async_split_plan", False) for m in layers):
            raise ValueError("easybalance.train_placement.replica_slots: the replicas' transfer sizes ride on AutoEP's "
                             "own read of its all-to-all sizes; set expert_parallel.async_split_plan false")
        home_LE = torch.arange(self.E).div(self.H, rounding_mode="floor").expand(self.L, -1)
        if not torch.equal(balancer.view.expert_to_device_LE, home_LE):
            raise ValueError("easybalance.train_placement: AutoEP placed experts other than contiguously "
                             f"({balancer.view.expert_to_device_LE.tolist()}); only its contiguous layout is re-placed")
        ep_group = layers[0].ep_group
        rank = dist.get_rank(ep_group) if self.G > 1 else 0
        self.device = layers[0].router.gate.weight.device
        ep_ranks = dist.get_process_group_ranks(ep_group) if self.G > 1 else [0]
        super().__init__(RowMover(rank, ep_ranks, ep_group, self.device), static_placement(self.L, self.E, self.G))
        self.node_G = [balancer.shape.rank_to_node[r] if r < len(balancer.shape.rank_to_node) else 0 for r in ep_ranks]
        self.placement = self.home      # what the routes use: the homes, in S slots a rank with replica slots
        self._home_depth = 0           # inside `at_home` (a checkpoint or an export): the layers' state is logical
        self._checked_step = None
        # each micro-batch's routes split over the copies by every rank's counts (the exact split, in place of
        # AutoEP's own count exchange); the balancer's hooks count the logical routes
        routing = Routing(exact=True, rank=rank, recording=False)
        self.routes = [AutoEPRoutes(m, i, self.G, self.H, table=SlotTable.even(self.home.log2phy[i]), routing=routing)
                       for i, m in enumerate(layers)]
        elem = next(layers[0].experts.parameters()).element_size()       # a copy: weights there, gradients back
        self.min_routes = transfer_stall([0], [1], 2 * elem, FLOPS_PER_PARAM, [0, int(len(set(self.node_G)) > 1)],
                                         topology, self.device.type)
        for m, routes, gate in zip(layers, self.routes, gates):
            m.eb_placement = self                          # what serving this engine's model must know of
            m.register_state_dict_pre_hook(self._refuse_placed_export)
            if self.R:
                gate.ranks_of = routes.ranks               # the balancer counts each route where it is computed
                routes.replicas = LayerReplicas(m, self.G, self.H, self.R, rank, self.min_routes)
                with_replicas(m.experts, routes.replicas)
                _wide_in_forward(m, self.S)
                m.tokens_per_expert = torch.zeros(self.G * self.S, dtype=torch.float32, device=self.device)
        if self.R:
            self._flip(self.home, False)
        engine.module.register_forward_pre_hook(self._before_forward)
        if self.R:
            self._check_before_step(engine)
        balancer.log.extra = lambda: {"replans": self.replans, "weight_moves": self.weight_moves,
                                      "moved_bytes": self.moved_bytes}
        self._wrap_exports(engine)

    # ------------------------------------------------------------------ the step boundary
    def _before_forward(self, module, args) -> None:
        """The first training forward after every `interval`-th optimizer step re-plans (every rank together)."""
        step = int(self.engine.global_steps)
        if not module.training or step == self._checked_step:
            return
        self._checked_step = step
        if step == 0 or step % self.interval or not self.balancer.view.ready:
            return
        # re-plan from the view's heat (per EP group) and move when it pays; every rank together
        heat_LE = self.balancer.view.heat_LE / max(1, dist.get_world_size() // self.G if dist_ready() else 1)
        choice = choose_placement(heat_LE, self.resident, self.home, 1.0, self.plan, dispatch=SPLIT,
                                  move_cost=self.move_cost, horizon=self.interval, min_gain=TRAIN_MIN_GAIN)
        if choice is not None and not torch.equal(choice.phy2log, self.resident.phy2log):
            self.apply(choice)

    def plan(self, heat_LE: torch.Tensor) -> Placement:
        """The homes for the view's heat: a permutation of each layer's experts over the ranks."""
        return plan_placement(heat_LE, self.G, self.H, previous=self.resident, dispatch=SPLIT)

    def move_cost(self, plan: Placement) -> float:
        """The stall of moving the home experts to `plan`'s, in routes the busiest rank could have trained meanwhile
        (`moves.transfer_stall`: each moved expert's whole state)."""
        per_param = state_bytes(self.layers[0], len(state_keys(self.engine))) / expert_params(self.layers[0])
        moves = slot_moves(self.resident, plan)
        return transfer_stall([m[3] for m in moves], [m[1] for m in moves], per_param, FLOPS_PER_PARAM, self.node_G,
                              self.topology, self.device.type)

    # ------------------------------------------------------------------ moves
    def apply(self, homes: Placement, replan: bool = True) -> bool:
        """Move every home expert whose slot changes, with its optimizer state, and flip every rank's route map to
        `homes` (a permutation of each layer's experts over the ranks); or, when any rank fails, keep the old
        placement and state everywhere (`moves.Placer`). `replan`: count it as a re-plan (a checkpoint's trip home
        and back is not)."""
        if homes.phy2log.shape != (self.L, self.E) or homes.num_devices != self.G or \
                bool((homes.logcnt != 1).any()):
            raise ValueError(f"a training placement holds each of the {self.E} experts of {self.L} layers once over "
                             f"{self.G} ranks x {self.H} slots, got {tuple(homes.phy2log.shape)} slots")
        changed = not torch.equal(self.resident.phy2log, homes.phy2log)
        return self.move(homes, self._rows, lambda: self._flip(homes, changed), replan=replan and changed,
                         row_bytes=state_bytes(self.layers[0], len(state_keys(self.engine))))

    def _rows(self) -> tuple[Optional[ExpertState], bool]:
        """This rank's expert state as rows, and whether preparing it went well (agreed before any collective of
        the move); a state that cannot move row by row on any rank makes every rank raise."""
        ok, rows = True, None
        try:        # rank-local
            rows = ExpertState(self.engine, self.layers)
        except Exception as e:   # noqa: BLE001
            ok = warn_failed("preparing to move experts", e)
        problem = shared_problem(None if rows is None else rows.unsupported())
        if problem:
            raise ValueError(f"easybalance.train_placement: {problem}")
        return rows, ok

    def _flip(self, homes: Placement, changed: bool) -> None:
        """Every layer's route map and grouped GEMM from the next forward: the `homes` moved in (with replica slots,
        laid out in S slots a rank: its homes, then R empty rows the micro-batches fill); the view follows the
        experts where they `changed`."""
        if torch.equal(homes.phy2log, self.home.phy2log):
            self.resident = homes = self.home
        L, G, H, S = self.L, self.G, self.H, self.S
        self.placement = homes if S == H else index_maps(torch.cat(
            [homes.phy2log.view(L, G, H), torch.full((L, G, S - H), -1, dtype=torch.long)], 2).view(L, -1),
            self.E, G, S)
        home_LE, row_LE = homes.log2phy[:, :, 0] // H, homes.log2phy[:, :, 0] % H
        for layer, (m, routes) in enumerate(zip(self.layers, self.routes)):
            routes.set_table(SlotTable.even(self.placement.log2phy[layer]), S)
            if routes.replicas is not None:
                routes.replicas.set_homes(home_LE[layer].to(self.device), row_LE[layer].to(self.device))
        if changed:
            self.balancer.move_experts(home_LE)

    def _check_before_step(self, engine) -> None:
        """Before every optimizer step (`engine.step()` at an accumulation boundary), before DeepSpeed changes
        anything: every rank learns whether a replica transfer failed on any rank since the last step (one
        all-reduce and one host read a step, none a micro-batch); if one did, every rank drops the step's gradients
        and routes and raises, its weights and optimizer state those of the step before (the next step trains on).
        DeepSpeed has no pre-step hook: the engine's method is wrapped."""
        step = engine.step

        def checked_step(*args, **kwargs):
            if engine.is_gradient_accumulation_boundary():
                failed = [f for routes in self.routes for f in routes.replicas.failed]
                for routes in self.routes:
                    routes.replicas.failed.clear()
                flag = torch.tensor([float(bool(failed))], device=self.device)
                if dist_ready():
                    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                if float(flag):
                    zero_grad = engine.optimizer.zero_grad if engine.bfloat16_enabled() or \
                        engine.zero_optimization() or engine.fp16_enabled() else engine.zero_grad
                    zero_grad()                               # as DeepSpeed's own step ends
                    self.balancer.discard_tally()
                    raise RuntimeError("easybalance.train_placement: a replica transfer failed ("
                                       f"{failed[0] if failed else 'on another rank: see its error'}); every rank "
                                       "stops before this optimizer step, with the weights and state of the step "
                                       "before, this step's gradients dropped")
            return step(*args, **kwargs)
        engine.step = checked_step

    # ------------------------------------------------------------------ checkpoints and exports
    @contextlib.contextmanager
    def at_home(self, when: str = "for an export"):
        """The experts in AutoEP's own layout inside the block (collective: every rank enters it), placed again
        after it."""
        placed = self.resident
        self.move_or_raise(self.home, f"home {when} (nothing was done)")
        self._home_depth += 1
        try:
            yield
        finally:
            self._home_depth -= 1
            self.move_or_raise(placed, f"back after {when} (what it wrote is whole)")

    def move_or_raise(self, plan: Placement, when: str) -> None:
        """`apply(plan)` (not a re-plan), or every rank raises when it failed anywhere."""
        if not self.apply(plan, replan=False):
            raise RuntimeError(f"easybalance.train_placement: moving the experts {when} failed on some rank (see its "
                               "warning); every rank keeps the placement and state it had before this move")

    def _refuse_placed_export(self, module, prefix, keep_vars) -> None:
        if self.resident is not self.home and not self._home_depth:
            raise RuntimeError("easybalance.train_placement: the experts are re-placed over the EP ranks, and this "
                               "state dict would hold them permuted under AutoEP's keys; on every rank, take it "
                               "inside `with engine.easybalance.placement.at_home():` (save_checkpoint and "
                               "save_16bit_model do so themselves, and so do the saves a Hugging Face Trainer "
                               "built after `eb_deepspeed.patch_deepspeed()` decides)")

    def _wrap_exports(self, engine) -> None:
        """DeepSpeed's files in the logical layout: `save_checkpoint` and `save_16bit_model` go home for the save
        and back; `load_checkpoint` goes home first (a checkpoint holds the logical layout; the next interval
        re-plans from the loaded view). DeepSpeed has no checkpoint hook: the engine's methods are wrapped."""
        for name in ("save_checkpoint", "save_16bit_model"):
            def save(*args, _save=getattr(engine, name), _name=name, **kwargs):
                with self.at_home(f"for {_name}"):
                    return _save(*args, **kwargs)
            setattr(engine, name, save)
        load = engine.load_checkpoint

        def load_checkpoint(*args, **kwargs):
            self.move_or_raise(self.home, "home before loading a checkpoint (nothing was loaded)")
            return load(*args, **kwargs)
        engine.load_checkpoint = load_checkpoint


def _wide_in_forward(layer, S: int) -> None:
    """The layer counts S local experts (homes and replica slots) inside its forward, and its H home experts
    everywhere else (DeepSpeed's checkpoint code reads `num_local_experts`); restored in a `finally`."""
    forward, H = layer._forward, layer.num_local_experts

    def wide(*args, **kwargs):
        layer.num_local_experts = layer.experts.num_experts = S
        try:
            return forward(*args, **kwargs)
        finally:
            layer.num_local_experts = layer.experts.num_experts = H
    layer._forward = wide


def _check_engine(engine, layers: list) -> None:
    """What training placement refuses, said before any move (at initialize)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    optimizer = getattr(engine, "optimizer", None)
    if not isinstance(optimizer, (torch.optim.Optimizer, DeepSpeedZeroOptimizer, BF16_Optimizer)):
        raise ValueError(f"easybalance.train_placement moves the state of a torch optimizer (fp32), of ZeRO 1/2 "
                         f"and of DeepSpeed's BF16_Optimizer; DeepSpeed wrapped this one in "
                         f"{type(optimizer).__name__}, whose fp32 master weights it cannot move: use ZeRO 1 or 2 "
                         "for bf16 or fp16 training")
    inner = torch_optimizer(optimizer)
    if inner is not None and type(inner).__name__ not in ELEMENTWISE_OPTIMIZERS:
        raise ValueError(f"easybalance.train_placement moves each expert row with its optimizer state, which keeps "
                         f"training the same only for an optimizer that updates every element from its own state; "
                         f"{type(inner).__name__} is not one eb_deepspeed knows to (a step from a whole tensor's "
                         f"norm or factored moments would change with the rows beside it). Supported: "
                         f"{', '.join(ELEMENTWISE_OPTIMIZERS)}; or set train_placement.enabled false")
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


