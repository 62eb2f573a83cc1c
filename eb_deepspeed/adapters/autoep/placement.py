"""Training-time expert placement for AutoEP (`easybalance.train_placement`): experts re-placed over the EP ranks
from the view, routing untouched — for fine-tuning, where the pretrained routing is the model's knowledge.

Shape legend: L MoE layers, E experts, G EP ranks, H experts per rank (E / G).

    "easybalance": {"mode": "observe", "train_placement": {"interval": 50}}

A dropless AutoEP layer takes as long as its busiest EP rank, so putting hot experts on different ranks removes
the device skew without changing a route. At the first training forward after every `interval`-th optimizer step
(a forward pre-hook: every rank together, the optimizer's step over) the view's heat is planned as a permutation
of each layer's experts over the ranks (`plan_placement` with H slots per rank: no replicas; `choose_placement`:
only when it cuts the busiest rank's expected routes by `TRAIN_MIN_GAIN` and the saving over the interval pays for
the copies). The experts move with their state (`ExpertState`: weights, fp32 masters, optimizer moments) by
`adapters.moves.RowMover`: any failure on any rank leaves every rank on the old placement and state, or every rank
raising. The route map is serving's (`AutoEPRoutes`, counting nothing): each route of the router's logical top-k
goes to its expert's slot; gate values and the tally stay logical, so AutoEP's all-to-all, grouped GEMMs and
combine run as its own over the permuted rows.

Checkpoints (`save_checkpoint`, `save_16bit_model`) are written in the logical layout: the experts go home for the
save, then back; `load_checkpoint` goes home first. `module.state_dict()` of a placed layer is refused (it would
give permuted rows under AutoEP's keys): `with engine.easybalance.placement.at_home(): ...` on every rank.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist

from ...planning.placement import Placement, plan_placement, static_placement
from ..common import dist_ready, torch_optimizer
from ..deepspeed.hooks import is_decoupled, shared_problem
from ..moves import RowMover, copy_stall, placement_key, slot_moves, warn_failed
from ..serving.engine import DISPATCH, choose_placement
from ..serving.store import Routing, SlotTable
from .serving import AutoEPRoutes

__all__ = ["TrainPlacement"]

# A training route costs forward and backward: 3 x the 2 FLOPs per expert parameter of a forward.
FLOPS_PER_PARAM = 6
# A re-plan must be expected to cut the layers' busiest-rank routes by this share. Lower than serving's MIN_GAIN:
# the heat is the EMA of whole optimizer steps' counts (every rank's micro-batches), and the copies are priced.
# With serving's 10 % one layer drifting back to 1.25x went unanswered for 180 steps (docs/benchmarks.md).
TRAIN_MIN_GAIN = 0.03
# Optimizers whose update of an element reads that element's own state alone (and per-tensor scalars such as the
# step count): moving a row with its state is then the same training. Adafactor, LAMB, LARS, Muon and others
# compute a step from a whole tensor (its norm, its factored moments): a row moved to another rank's tensor would
# change the steps of its neighbours. By class name (no import of DeepSpeed's ops).
ELEMENTWISE_OPTIMIZERS = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop",
                          "FusedAdam", "DeepSpeedCPUAdam", "FusedLion", "DeepSpeedCPULion", "DeepSpeedCPUAdagrad")


class TrainPlacement:
    """The experts of every AutoEP layer of `engine` placed over its EP ranks as `placement` says (AutoEP's own
    layout to start), re-planned from `balancer`'s view every `interval` optimizer steps."""

    def __init__(self, engine, layers: list, balancer, interval: int, topology: str = "pcie"):
        assert engine.zero_optimization_stage() < 3, "refused by initialize: ZeRO 3 partitions each expert's weights"
        _check_engine(engine, layers)
        self.engine, self.layers, self.balancer = engine, layers, balancer
        self.interval, self.topology = int(interval), topology
        self.L = len(layers)
        self.E, self.G = int(layers[0].num_experts), int(layers[0].ep_size)
        self.H = self.E // self.G
        home_LE = torch.arange(self.E).div(self.H, rounding_mode="floor").expand(self.L, -1)
        if not torch.equal(balancer.view.expert_to_device_LE, home_LE):
            raise ValueError("easybalance.train_placement: AutoEP placed experts other than contiguously "
                             f"({balancer.view.expert_to_device_LE.tolist()}); only its contiguous layout is re-placed")
        ep_group = layers[0].ep_group
        rank = dist.get_rank(ep_group) if self.G > 1 else 0
        self.ep_ranks = dist.get_process_group_ranks(ep_group) if self.G > 1 else [0]
        self.device = layers[0].router.gate.weight.device
        self.mover = RowMover(rank, self.ep_ranks, ep_group, self.device)
        self.node_G = [balancer.shape.rank_to_node[r] if r < len(balancer.shape.rank_to_node) else 0
                       for r in self.ep_ranks]
        self.home = self.placement = static_placement(self.L, self.E, self.G)
        self.replans, self.weight_moves, self.moved_bytes, self.failed_moves = 0, 0, 0, 0
        self._home_depth = 0           # inside `at_home` (a checkpoint or an export): the layers' state is logical
        self._checked_step = None
        routing = Routing(recording=False)          # the balancer's hooks count the logical routes
        self.routes = [AutoEPRoutes(m, i, self.G, self.H, table=SlotTable.even(self.home.log2phy[i]), routing=routing)
                       for i, m in enumerate(layers)]
        for m in layers:
            m.register_state_dict_pre_hook(self._refuse_placed_export)
        engine.module.register_forward_pre_hook(self._before_forward)
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
        if step > 0 and step % self.interval == 0:
            self.maybe_move()

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
        """The stall of moving to `plan`, in routes the busiest receiving rank could have trained meanwhile
        (`moves.copy_stall`: each received expert's whole state, `FLOPS_PER_PARAM` per parameter per route)."""
        per_param = _state_bytes(self.layers[0], len(_state_keys(self.engine))) / _params(self.layers[0])
        return copy_stall(slot_moves(self.placement, plan), per_param, FLOPS_PER_PARAM, self.node_G, self.topology,
                          self.device.type)

    # ------------------------------------------------------------------ moves
    def apply(self, plan: Placement, replan: bool = True) -> bool:
        """Move every expert whose slot changes, with its optimizer state, and flip every rank's route map to
        `plan`; or, when any rank fails, keep the old placement and state everywhere (`moves.RowMover`). `replan`:
        count it as a re-plan (a checkpoint's trip home and back is not)."""
        if plan.phy2log.shape != (self.L, self.E) or plan.slots_per_device != self.H:
            raise ValueError(f"a training placement is a permutation of {self.E} experts over {self.G} ranks x "
                             f"{self.H} slots in each of {self.L} layers, got {tuple(plan.phy2log.shape)}")
        moves = slot_moves(self.placement, plan)
        if moves:
            ok, rows = True, None
            try:        # rank-local, agreed before any collective of the move
                rows = ExpertState(self.engine, self.layers)
            except Exception as e:   # noqa: BLE001
                ok = warn_failed("preparing to move experts", e)
            problem = shared_problem(None if rows is None else rows.unsupported())
            if problem:
                raise ValueError(f"easybalance.train_placement: {problem}")
            if not self.mover.move(moves, placement_key(plan.phy2log), rows, ok):
                self.failed_moves += 1
                return False
        self.placement = self.home if torch.equal(plan.phy2log, self.home.phy2log) else plan
        for layer, routes in enumerate(self.routes):
            routes.set_table(SlotTable.even(plan.log2phy[layer]), self.H)
        if moves:
            self.balancer.move_experts(plan.log2phy[:, :, 0] // self.H)
        self.replans += int(replan and bool(moves))
        self.weight_moves += len(moves)
        self.moved_bytes += sum(src != dst for _, dst, _, src, _ in moves) * \
            _state_bytes(self.layers[0], len(_state_keys(self.engine)))
        return True

    # ------------------------------------------------------------------ checkpoints and exports
    @contextlib.contextmanager
    def at_home(self, when: str = "for an export"):
        """The experts in AutoEP's own layout inside the block (collective: every rank enters it), placed again
        after it."""
        placed = self.placement
        self._must_apply(self.home, f"home {when} (nothing was done)")
        self._home_depth += 1
        try:
            yield
        finally:
            self._home_depth -= 1
            self._must_apply(placed, f"back after {when} (what it wrote is whole)")

    def _must_apply(self, plan: Placement, when: str) -> None:
        if not self.apply(plan, replan=False):
            raise RuntimeError(f"easybalance.train_placement: moving the experts {when} failed on some rank (see its "
                               "warning); every rank keeps the placement and state it had before this move")

    def _refuse_placed_export(self, module, prefix, keep_vars) -> None:
        if self.placement is not self.home and not self._home_depth:
            raise RuntimeError("easybalance.train_placement: the experts are re-placed over the EP ranks, and this "
                               "state dict would hold them permuted under AutoEP's keys; on every rank, take it "
                               "inside `with engine.easybalance.placement.at_home():` (save_checkpoint and "
                               "save_16bit_model do so themselves)")

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
            self._must_apply(self.home, "home before loading a checkpoint (nothing was loaded)")
            return load(*args, **kwargs)
        engine.load_checkpoint = load_checkpoint


class ExpertState:
    """Every AutoEP layer's expert state as rows (`moves.Rows`): row j of each weight [H, ...], of its fp32 master
    and of each optimizer moment, widened to fp32, as one vector. Under ZeRO 1/2 (and bf16) the master and the
    moments are partitioned over the expert's data-parallel peers: a read gathers them with one all-reduce each
    into buffers allocated by `prepare` (as DeepSpeed's `safe_get_full_*` do, but with nothing to allocate after
    the ranks agreed), a write stores this rank's fragment only (local, as `safe_set_full_*`); at ZeRO 0 they are
    the torch optimizer's own state."""

    def __init__(self, engine, layers: list):
        self.layers, self.keys = layers, _state_keys(engine)
        self.optimizer = torch_optimizer(getattr(engine, "optimizer", None))
        owner = getattr(engine, "optimizer", None)
        if self.keys and hasattr(owner, "_hp_optimizer_states_linked"):
            # DeepSpeed links each parameter to its optimizer state after the first step of its first parameter
            # group, before AutoEP's expert groups have state: link them all again (local, the same on every rank)
            owner._hp_optimizer_states_linked = False
            owner._lazy_init_hp_params_optimizer_state()
        self._full: dict = {}

    def unsupported(self) -> Optional[str]:
        """Why a state tensor of the experts cannot move row by row (None: every one can)."""
        for m in self.layers:
            for param in m.experts.parameters():
                mapping = getattr(param, "_hp_mapping", None)
                for key in self.keys:
                    if mapping is not None:
                        have = mapping.optim_fragment or {}
                        if key not in have or have[key].numel() != mapping.lp_fragment_address.numel:
                            return f"the optimizer state {key!r} does not follow its parameter's elements"
                    elif self.optimizer is not None and key in self.optimizer.state.get(param, {}) and \
                            self.optimizer.state[param][key].shape != param.shape:
                        return (f"the optimizer state {key!r} has shape {tuple(self.optimizer.state[param][key].shape)}"
                                f", its parameter {tuple(param.shape)}: it cannot move row by row")
        return None

    def _slots(self, layer: int) -> list[tuple[torch.nn.Parameter, Optional[str]]]:
        """(parameter, what of it) for each tensor of a row, in order: "data", then under ZeRO None (the fp32
        master) and the moment keys, else the moment keys of the torch optimizer's state."""
        out = []
        for param in self.layers[layer].experts.parameters():
            out.append((param, "data"))
            out += [(param, None)] * hasattr(param, "_hp_mapping") + [(param, key) for key in self.keys]
        return out

    def prepare(self, layer: int) -> None:
        self._full = {(id(p), k): torch.empty(p.numel(), dtype=torch.float32, device=p.device)
                      for p, k in self._slots(layer) if k != "data" and hasattr(p, "_hp_mapping")}
        self._width = sum(p[0].numel() for p, _ in self._slots(layer))

    def row_like(self, layer: int) -> torch.Tensor:
        return torch.empty(self._width, dtype=torch.float32, device=self.layers[layer].router.gate.weight.device)

    def read(self, layer: int, rows: list[int]) -> dict[int, torch.Tensor]:
        if not rows:             # the data-parallel peers of this rank have no rows in this layer either
            return {}
        tensors = [self._whole(p, k) for p, k in self._slots(layer)]
        return {j: torch.cat([t[j].reshape(-1).float() for t in tensors]) for j in rows}

    def _whole(self, param, key) -> torch.Tensor:
        """The whole tensor [H, ...] of `param`'s `key` (collective under ZeRO)."""
        if key == "data":
            return param.data
        if not hasattr(param, "_hp_mapping"):
            state = self.optimizer.state.get(param, {}) if self.optimizer is not None else {}
            return state[key] if key in state else torch.zeros_like(param.data, dtype=torch.float32)
        full = self._full[(id(param), key)].zero_()
        if param._hp_mapping is not None:
            at = param._hp_mapping.lp_fragment_address
            full[at.start:at.start + at.numel].copy_(param._hp_mapping.get_hp_fragment(key).reshape(-1))
        dist.all_reduce(full, group=param._dp_group)
        return full.view(param.shape)

    def write(self, layer: int, rows: dict[int, torch.Tensor]) -> None:
        at = 0
        with torch.no_grad():
            for param, key in self._slots(layer):
                n = param[0].numel()
                values = {j: flat[at:at + n] for j, flat in rows.items()}
                at += n
                if key == "data" or not hasattr(param, "_hp_mapping"):
                    target = param.data if key == "data" else self._whole(param, key)
                    for j, value in values.items():
                        target[j].copy_(value.view_as(target[j]))
                elif param._hp_mapping is not None:   # this rank's fragment of the flat tensor
                    fragment = param._hp_mapping.get_hp_fragment(key).reshape(-1)
                    start = param._hp_mapping.lp_fragment_address.start
                    for j, value in values.items():
                        lo, hi = max(j * n, start), min((j + 1) * n, start + fragment.numel())
                        if lo < hi:
                            fragment[lo - start:hi - start].copy_(value[lo - j * n:hi - j * n])


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


def _state_keys(engine) -> list[str]:
    """The optimizer's per-element state (Adam: exp_avg, exp_avg_sq); none before its first step."""
    optimizer = torch_optimizer(getattr(engine, "optimizer", None))
    if optimizer is None:
        return []
    return sorted({k for state in optimizer.state.values() for k, v in state.items()
                   if torch.is_tensor(v) and v.dim() > 0 and v.numel() > 1})


def _params(layer) -> int:
    """Parameters of one expert of an AutoEP layer."""
    return sum(p[0].numel() for p in layer.experts.parameters())


def _state_bytes(layer, keys: int) -> int:
    """Bytes of one expert's state: each weight, its fp32 master (ZeRO 1/2, bf16), its fp32 moments."""
    return sum(p[0].numel() * (p.element_size() + 4 * (keys + hasattr(p, "_hp_mapping")))
               for p in layer.experts.parameters())
