"""The serving engine, framework-neutral: the view, re-planning and weight moves, over a slot store.

Shape legend: L MoE layers, E logical experts, G EP ranks, S slots per rank, P physical slots (G * S; slot p
lives on EP rank p // S), H home experts per rank (E / G).

    engine = ServingEngine(store, config)       # the store: DeepSpeed's MOELayers or AutoEP's layers (`SlotStore`)
    ...forward...; engine.after_batch()         # every view_interval batches: tally -> view (-> re-plan)
    engine.placement, engine.replans, engine.save_checkpoint("out"), engine.load_checkpoint("ckpt")

Serving starts in the runtime's own layout (H home experts per rank); an enabled block gives each layer R =
`inference.replica_slots` extra slots a rank. Every `view_interval` batches the view steps (one all-reduce of the
[L, W] tally, posted in the background) and, once warm, at most every `replan_interval` batches, when a layer's
expected skew passes `replan_threshold`, the cheaper of a plan with replicas and the home layout replaces the current
placement if it beats it by the runtime's `Dispatch` (`choose_placement`); the weights move by `moves.Placer`
(a failure anywhere keeps every rank's placement), then every rank's gates flip their tables.

A runtime is served through a `SlotStore`: S_max slots a rank, each one expert's weights, and gates that put each
logical route on a physical slot by a `routing.SlotTable`; a store only reads and writes slots and serves the tables
it is given."""
from __future__ import annotations

import atexit
import contextlib
import datetime
import warnings
import weakref
from typing import Optional, Protocol

import torch
import torch.distributed as dist

from ...core.balancer import Balancer, ModelShape, check_agreement
from ...core.config import EasyBalanceConfig
from ...core.record import NullLogger
from ...core.topology import node_map, resolve_topology
from ...observe.monitor import JsonlLogger
from ...planning.placement import (MAX_LAYER_SLOTS, MAX_SCAN, MAX_SLOTS, Placement, check_plan_size,
                                   choose_placement, plan_placement, prefix_placement, runtime_dispatch,
                                   static_placement, with_prefix)
from ..common import dist_rank, dist_ready, gather_startup, join_startup_off, shared_problem
from ..moves import Placer, RowMover, slot_moves, transfer, transfer_stall
from ..routing import Routing

__all__ = ["ServingEngine", "SlotStore"]

EXIT_WAIT_S = 30     # at exit, how long a view step in flight may wait for its reduce (its peers may be gone)


class SlotStore(Protocol):
    """A runtime's MoE layers as slots. Set at construction: `num_layers`, `num_experts`, `num_devices` (E, G of
    every layer), `top_k` (per layer), `ep_group`, `device` (where collectives run), `padded` (every slot is
    padded to the largest: DeepSpeed's MOELayer; else dropless); after `replicate`: `gates`
    (one per layer, each with a `tally`)."""
    gates: list

    def replicate(self, slots: int, placement: Placement, routing: Routing) -> None:
        """Give every layer `slots` (S_max) expert slots per rank, the home experts in the first H, and a gate
        serving `placement`."""

    def read_slot(self, layer: int, j: int) -> torch.Tensor:
        """The whole state of this rank's slot j of `layer` as one vector (what a weight move sends)."""

    def write_slot(self, layer: int, j: int, flat: torch.Tensor) -> None:
        """Load `read_slot`'s vector into slot j."""

    def serve(self, layer: int, placement: Placement) -> None:
        """Serve `placement` in `layer` from its next forward on (its weights already in place)."""

    def load_home(self, ckpt_dir: str, tag: Optional[str]) -> str:
        """Load a DeepSpeed checkpoint's experts into the home layout (slots 0 .. H - 1); returns its path."""

    def save_home(self, ckpt_dir: str, tag: str, homes: dict) -> str:
        """Write DeepSpeed's checkpoint layout with the logical experts ({(layer, e): vector} of this rank's home
        experts, `ServingEngine.home_states`); returns its path. Collective."""


def flat_state(tensors) -> torch.Tensor:
    """A slot's tensors as one vector (what `read_slot` returns and a weight move sends)."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflatten_into(tensors, flat: torch.Tensor) -> None:
    """`flat_state`'s vector back into `tensors`, in place."""
    at = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[at:at + t.numel()].view_as(t))
            at += t.numel()


class ServingEngine(Placer):
    """The serving side of one model: its store's slots, the placement, the view, re-plans and checkpoints.

    Every rank's layer has S_max = H + R slots; a placement uses the first S of them (S = H: the runtime's own
    layout, no replicas; S = S_max: replicas in every slot), so a layer never pays for slots it does not use.
    config: the `easybalance` block (None or disabled: the runtime's layout, no view, no replicas)."""

    def __init__(self, store: SlotStore, config: Optional[EasyBalanceConfig]):
        self.store, self.config = store, config
        self.L, self.E, self.G = store.num_layers, store.num_experts, store.num_devices
        self.H = self.E // self.G
        enabled = config is not None and config.enabled
        for path in config.ignored_options("serve") if enabled else ():
            warnings.warn(f'{path} has no effect in serving (mode "{config.mode}")')
        self.R = config.inference.replica_slots if enabled and config.balance else 0
        self.S_max = self.H + self.R
        try:        # before any expert is copied: what a re-plan would refuse mid-serving
            check_plan_size(self.L, self.G * self.S_max, self.G)
        except ValueError as e:
            fits = min(MAX_SLOTS, MAX_LAYER_SLOTS // self.L, MAX_SCAN // (self.L * self.G)) // self.G - self.H
            raise ValueError(f"easybalance.inference.replica_slots ({self.R}): {e}; use at most {fits}") from None
        grouped = dist_ready() and self.G > 1
        self.rank = dist.get_rank(store.ep_group) if grouped else 0
        self.ep_ranks = dist.get_process_group_ranks(store.ep_group) if grouped else [dist_rank()]
        # the runtime's layout (S = H, no replicas) to start; `resident`: what the slots hold (`placement`, or a plan
        # whose prefix serves)
        super().__init__(RowMover(self.rank, self.ep_ranks, store.ep_group, store.device),
                         static_placement(self.L, self.E, self.G))
        self.batches, self.last_plan_batch, self.placed_batch = 0, None, 0
        self.placement = self.home      # what the gates' tables serve
        self._in_flight: Optional[torch.Tensor] = None      # a view step's tally whose reduce was posted
        self._check_due = False                              # a step posted: the next batch checks for a re-plan
        self._posted: list = []                              # its work object
        self.node_G = torch.zeros(self.G, dtype=torch.long)
        self.rank_to_node, self.topology, logger = [0], "pcie", None
        if enabled:
            logger = self._agree_at_start_up()
        else:
            join_startup_off()          # a rank whose block is on waits for this rank in the start-up all-gather
        inf = config.inference if enabled else None
        self.model = runtime_dispatch(store.padded, "view" if inf is None else inf.split)  # padded: `view` (measured)
        if inf is not None and store.padded and "inference.split" in config.explicit and inf.split == "exact" \
                and dist_rank() == 0:
            warnings.warn('easybalance.inference.split "exact" has no effect on DeepSpeed-MoE\'s padded layer, which '
                          'serves "view" (measured faster there: docs/benchmarks.md)')
        self.routing = Routing(exact=self.model.steered, rank=self.rank, recording=enabled)
        store.replicate(self.S_max, self.placement, self.routing)
        self.balancer: Optional[Balancer] = None
        if enabled:
            shape = ModelShape.uniform(self.L, self.E, self.G, rank_to_node=self.rank_to_node)
            self.balancer = Balancer(config, store.gates, shape, logger=logger, device=store.device, train=False)
            # the balancer outlives a dropped engine until exit (its last record is written then): weak references
            me = weakref.ref(self)
            self.balancer.log.extra = lambda: {"replans": me().replans, "weight_moves": me().weight_moves} if me() else {}
            self.balancer.settle = lambda: me() and me().settle()     # a read of the view takes the step in flight
            weakref.finalize(self, _wait_posted, self._posted)   # no reduce of ours in flight when the group goes
            atexit.register(_settle_at_exit, weakref.ref(self))  # the step in flight reaches the view and the log

    @property
    def S(self) -> int:
        """Slots per rank of the placement serving now."""
        return self.placement.slots_per_device

    @property
    def P(self) -> int:
        return self.G * self.S

    @property
    def gates(self) -> list:
        return self.store.gates

    def attach(self, module: torch.nn.Module, holder) -> None:
        """Run `before_batch` / `after_batch` (an enabled block) around every forward of `module`; `holder.serving`
        is this engine and, with an enabled block, `holder.easybalance` its Balancer."""
        holder.serving = self
        module.register_forward_pre_hook(lambda mod, args: self.before_batch(args))
        if self.balancer is not None:
            holder.easybalance = self.balancer
            module.register_forward_hook(lambda mod, args, output: self.after_batch())

    def _agree_at_start_up(self):
        gathered, rank, logger = gather_startup(
            {"config": self.config.to_dict(), "experts": self.E, "devices": self.G, "layers": self.L,
             "top_k": list(self.store.top_k)},
            prepare=lambda: JsonlLogger(self.config.log.dir) if dist_rank() == 0 else NullLogger())
        check_agreement([{k: v for k, v in g.items() if k != "host"} for g in gathered], rank)
        self.rank_to_node = node_map([g["host"] for g in gathered])
        self.node_G = torch.tensor([self.rank_to_node[r] for r in self.ep_ranks])
        self.topology, note = resolve_topology(self.config.inference.topology,
                                               explicit="inference.topology" in self.config.explicit,
                                               num_nodes=int(self.node_G.max()) + 1)
        if note and dist_rank() == 0:
            warnings.warn(f"easybalance.inference.topology: {note}")
        return logger

    def before_batch(self, inputs: tuple) -> None:
        """A new forward: the gates agree on its tokens again."""
        self.routing.tokens = []

    def after_batch(self) -> None:
        """Every `view_interval` batches: drain the gates' tallies and post their all-reduce in the background;
        one batch later the view takes that step and serving re-plans if it says so."""
        if self.balancer is None:
            return
        self.batches += 1
        if self._check_due:        # posted after an earlier forward (taken by a read of the view, or now)
            self._check_due = False
            self.settle()
            if self.R:
                self.maybe_replan()
        if self.batches % self.config.inference.view_interval == 0:
            packed_LW = self.balancer.gather()
            if dist_ready() and dist.get_world_size() > 1:
                self._posted.append(dist.all_reduce(packed_LW, async_op=True))
            self._in_flight, self._check_due = packed_LW, True

    def settle(self) -> None:
        """The view takes the step in flight (its reduce waited for), if any."""
        if self._in_flight is not None:
            packed_LW, self._in_flight = self._in_flight, None
            while self._posted:
                self._posted.pop().wait()
            self.balancer.take(packed_LW)

    def maybe_replan(self) -> bool:
        """Once the view is warm, at most every `replan_interval` batches, choose a placement (`choose_placement`)
        and move to it if it differs from the serving one. Returns whether a new placement serves."""
        inf, view = self.config.inference, self.balancer.view
        if not view.ready:
            return False
        if self.last_plan_batch is not None and self.batches - self.last_plan_batch < inf.replan_interval:
            return False
        # the new placement is expected to serve as long as the one serving has (at least until the next re-plan)
        horizon = max(inf.replan_interval, self.batches - self.placed_batch) / inf.view_interval
        choice = choose_placement(view.heat_LE, self.placement, self.home, inf.replan_threshold, plan=self._plan,
                                  dispatch=self.model, move_cost=self.move_cost, horizon=horizon)
        if choice is None:
            return False
        self.last_plan_batch = self.batches
        if choice is self.placement:
            return False
        if choice is self.home and (prefix := _prefix(self.resident)) is not None:
            self._serve(prefix)        # the home layout's cost without moving a weight
            self.placed_batch = self.batches
            return True
        return self.apply(choice)

    def move_cost(self, plan: Placement) -> float:
        """The time moving to `plan` stalls the busiest rank, in routes it could have computed meanwhile
        (`moves.transfer_stall`: a serving route takes 2 FLOPs per parameter). A plan whose slots are already resident
        (a prefix of what serves) costs nothing."""
        moves = slot_moves(self.resident, plan)
        return transfer_stall([m[3] for m in moves], [m[1] for m in moves], self.store.read_slot(0, 0).element_size(),
                              2, self.node_G, self.topology, self.store.device.type)

    def _plan(self, heat_LE: torch.Tensor) -> Placement:
        """Replicas for every slot (S_max per rank) from the view's heat (an even split: and its swings) in the
        runtime's dispatch model; its counts laid over a one-slot-per-expert prefix (the home layout's cost, served
        without a move when the home layout is chosen) when that costs no more."""
        model = self.model
        planned = plan_placement(heat_LE, self.G, self.S_max, num_nodes=int(self.node_G.max()) + 1,
                                 previous=self.resident, dispatch=model,
                                 swing_LE=None if model.steered else self.balancer.view.swing_LE)
        prefixed = with_prefix(planned, previous=self.resident, node_G=None if model.padded else self.node_G.numpy())
        if prefixed is not None and float(model.cost(heat_LE, prefixed).sum()) <= float(model.cost(heat_LE, planned).sum()):
            return prefixed
        return planned

    def _serve(self, placement: Placement) -> None:
        """Flip every layer's tables to `placement`, whose weights the slots hold (`resident` or its prefix)."""
        self.placement = placement
        for layer in range(self.L):
            self.store.serve(layer, placement)

    def apply(self, plan: Placement) -> bool:
        """Move weights for `plan` and flip every rank to it, or keep the old placement everywhere."""
        if plan.phy2log.shape[0] != self.L or plan.num_experts != self.E or plan.num_devices != self.G \
                or plan.slots_per_device > self.S_max:
            raise ValueError(f"a placement of {tuple(plan.phy2log.shape)} slots ({plan.slots_per_device} per rank) "
                             f"does not fit {self.L} layers x {self.G} ranks x at most {self.S_max} slots")
        if not self.move(plan, lambda: (_SlotRows(self.store), True), lambda: self._serve(plan)):
            return False
        self.placed_batch = self.batches
        return True

    # ------------------------------------------------------------------ checkpoints (DeepSpeed's file layout)
    def home_states(self) -> dict[tuple[int, int], torch.Tensor]:
        """{(layer, expert): its state as one vector} for the home experts of this rank (expert e's home is EP rank
        e // H, as DeepSpeed lays them out). A home expert that moved is fetched from a slot that holds it, on its
        home rank when there is one (one batch of transfers, none twice). Collective over the EP group."""
        S = self.S
        flats: dict[tuple[int, int], torch.Tensor] = {}
        ops = []
        for layer in range(self.L):
            for e in range(self.E):
                holders = [(q // S, q % S) for q in torch.nonzero(self.placement.phy2log[layer] == e).flatten().tolist()]
                home = e // self.H
                src, src_j = ([h for h in holders if h[0] == home] or holders)[0]
                if home == self.rank:
                    source = self.store.read_slot(layer, src_j if src == self.rank else 0)
                    flats[(layer, e)] = source if src == self.rank else torch.empty_like(source)
                    if src != self.rank:
                        ops.append(dist.P2POp(dist.irecv, flats[(layer, e)], self.ep_ranks[src]))
                elif src == self.rank:
                    ops.append(dist.P2POp(dist.isend, self.store.read_slot(layer, src_j), self.ep_ranks[home]))
        transfer(ops)
        return flats

    def save_checkpoint(self, ckpt_dir: str, tag: str = "served") -> str:
        """Write DeepSpeed's checkpoint layout with the logical experts (each home expert fetched from wherever it
        serves), which a DeepSpeed engine of the same model loads (`load_module_only=True`). Collective."""
        return self.store.save_home(ckpt_dir, tag, self.home_states())

    def load_checkpoint(self, ckpt_dir: str, tag: Optional[str] = None) -> str:
        """Load a DeepSpeed checkpoint of the same model (a training engine's, or `save_checkpoint`'s): the home
        experts into the home layout, then the replicas and moved experts of the placement serving before are
        fetched from them (a weight move, every rank together). Returns the checkpoint's path. Collective."""
        serving, resident = self.placement, self.resident
        self._serve(self.home)
        try:
            path = self.store.load_home(ckpt_dir, tag)
        except BaseException:
            self._serve(serving)               # the weights as they were
            raise
        self.resident = self.home
        if resident is not self.home and self.apply(resident) and serving is not resident:
            self._serve(serving)                   # the prefix that served, resident again
        return path


@contextlib.contextmanager
def agreed_load():
    """Around a checkpoint load's reading, before anything is written: every rank read its part, or every rank
    raises, this one its own error, the others one naming it (one all-gather), and none goes on to write."""
    error = None
    try:
        yield
    except Exception as e:   # noqa: BLE001 -- every rank hears of it, then it is raised
        error = e
    problem = shared_problem(None if error is None else f"rank {dist_rank()}: {type(error).__name__}: {error}")
    if error is not None:
        raise error
    if problem:
        raise RuntimeError(f"easybalance: loading the checkpoint failed on {problem}; this rank keeps the weights "
                           "it served")


def _prefix(plan: Placement) -> Optional[Placement]:
    """The one-slot-per-expert layout resident in `plan`'s first slots, or None (see `with_prefix`)."""
    if plan.slots_per_device * plan.num_devices == plan.num_experts:
        return None
    prefix = prefix_placement(plan)
    return prefix if bool((prefix.logcnt == 1).all()) else None


def _wait_posted(posted: list) -> None:
    """Wait (at most EXIT_WAIT_S) for a view reduce still posted and let its work object go, so that no
    collective of ours is in flight while the process group is torn down: its peers posted the same reduce."""
    while posted:
        work = posted.pop()
        try:
            work.wait(timeout=datetime.timedelta(seconds=EXIT_WAIT_S))
        except Exception as e:   # noqa: BLE001 - a gone peer at exit must not turn a clean exit into a traceback
            warnings.warn(f"easybalance: a balance reduce in flight did not complete ({e})")


def _settle_at_exit(ref: "weakref.ref[ServingEngine]") -> None:
    """At interpreter exit: the view takes the step in flight (its reduce waited for at most EXIT_WAIT_S)."""
    engine = ref()
    if engine is None or engine._in_flight is None:
        return
    _wait_posted(engine._posted)
    try:
        engine.settle()
    except Exception as e:   # noqa: BLE001 - the process is ending: a warning, not a traceback
        warnings.warn(f"easybalance: the last view step could not be taken at exit ({e})")


class _SlotRows:
    """The store's slots as the rows a move moves (`moves.Rows`): each slot's weights, local."""

    def __init__(self, store: SlotStore):
        self.store = store

    def prepare(self, layer: int) -> None:
        pass

    def row_like(self, layer: int) -> torch.Tensor:
        return torch.empty_like(self.store.read_slot(layer, 0))

    def read(self, layer: int, rows: list[int]) -> dict[int, torch.Tensor]:
        return {j: self.store.read_slot(layer, j) for j in rows}

    def write(self, layer: int, rows: dict[int, torch.Tensor]) -> None:
        for j, flat in rows.items():
            self.store.write_slot(layer, j, flat)
