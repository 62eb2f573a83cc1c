"""Training-time expert placement for AutoEP (`easybalance.train_placement`): experts re-placed over the EP ranks
from the view, routing untouched — for fine-tuning, where the pretrained routing is the model's knowledge. This
module is the lifecycle; the rows it moves are `state.ExpertState`, replicas compute through `fetch`.

Shape legend: L MoE layers, E experts, G EP ranks, H experts per rank (E / G), S = H + replica slots.

    "easybalance": {"mode": "observe", "train_placement": {"interval": 50}}

A dropless AutoEP layer takes as long as its busiest EP rank, so putting hot experts on different ranks removes
the device skew without changing a route. At the first training forward after every `interval`-th optimizer step
(a forward pre-hook: every rank together, the optimizer's step over) the view's heat is planned as a permutation
of each layer's experts over the ranks, by the split the routes run (`DISPATCH["steered"]`: each micro-batch's
exact split), and moved only when it cuts the busiest rank's expected routes by `TRAIN_MIN_GAIN` and the saving
over the interval pays for the copies (`choose_placement`, priced by `moves.transfer_stall`). The experts move with
their state (`moves.Placer` over `ExpertState`: weights, fp32 masters, optimizer moments): any failure on any rank
leaves every rank on the old placement and state, or every rank raising. The route map is serving's
(`AutoEPRoutes`, counting nothing): each route of the router's logical top-k goes to its expert's slot; gate
values and the tally stay logical, so AutoEP's all-to-all, grouped GEMMs and combine run as its own.

With `replica_slots` R, each rank has S = H + R slots: its H home experts (rows of AutoEP's own parameters,
which hold the optimizer state, ZeRO partitions and checkpoints as before) and R replicas of hot experts homed
elsewhere (`plan_placement` with S slots; each expert's home is one of its copies, `owners`). A replica computes
with its home expert's current weights (`fetch.Fetch`: fetched for each forward, gradients sent home in backward
before anything of DeepSpeed's reduces them). Each micro-batch's routes to a replicated expert split over its copies
by every rank's counts so that the busiest rank takes the fewest. A replica is placed only when the routes it takes
off the busiest rank beat its bytes per step (`replica_cost`).

Checkpoints (`save_checkpoint`, `save_16bit_model`) are written in the logical layout: the experts go home for the
save, then back; `load_checkpoint` goes home first. `module.state_dict()` of a placed layer is refused (it would
give permuted rows under AutoEP's keys): `with engine.easybalance.placement.at_home(): ...` on every rank.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ...planning.placement import DISPATCH, Placement, choose_placement, index_maps, plan_placement, static_placement
from ..common import dist_ready, torch_optimizer
from ..deepspeed.hooks import is_decoupled, shared_problem
from ..moves import Placer, RowMover, slot_moves, transfer_stall, warn_failed
from ..routing import Routing, SlotTable
from .fetch import Fetch, with_replicas
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

    def __init__(self, engine, layers: list, balancer, interval: int, topology: str = "pcie", replica_slots: int = 0):
        assert engine.zero_optimization_stage() < 3, "refused by initialize: ZeRO 3 partitions each expert's weights"
        _check_engine(engine, layers)
        self.engine, self.layers, self.balancer = engine, layers, balancer
        self.interval, self.topology = int(interval), topology
        self.L = len(layers)
        self.E, self.G = int(layers[0].num_experts), int(layers[0].ep_size)
        self.H = self.E // self.G
        self.S = self.H + int(replica_slots)
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
        self.placement = self.home
        self._fetch: list = [None] * self.L
        self._home_depth = 0           # inside `at_home` (a checkpoint or an export): the layers' state is logical
        self._checked_step = None
        # each micro-batch's routes split over the copies by every rank's counts (the exact split, in place of
        # AutoEP's own count exchange); the balancer's hooks count the logical routes
        routing = Routing(exact=True, rank=rank, recording=False)
        self.routes = [AutoEPRoutes(m, i, self.G, self.H, table=SlotTable.even(self.home.log2phy[i]), routing=routing)
                       for i, m in enumerate(layers)]
        for layer, m in enumerate(layers):
            m.register_state_dict_pre_hook(self._refuse_placed_export)
            with_replicas(m.experts, lambda layer=layer: self._fetch[layer])
        engine.module.register_forward_pre_hook(self._before_forward)
        optimizer = torch_optimizer(getattr(engine, "optimizer", None))
        if self.S > self.H and optimizer is not None:
            self._agreed_step = None
            optimizer.register_step_pre_hook(self._agree_fetches)
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
        heat_LE = view.heat_LE / max(1, dist.get_world_size() // self.G if dist_ready() else 1)   # per EP group
        priced = _Priced(SPLIT, self.replica_cost)
        choice = choose_placement(heat_LE, self.placement, self.home, 1.0, self.plan, dispatch=priced,
                                  move_cost=self.move_cost, horizon=self.interval, min_gain=TRAIN_MIN_GAIN)
        if choice is None or choice is self.placement or torch.equal(choice.phy2log, self.placement.phy2log):
            return False
        return self.apply(choice)

    def plan(self, heat_LE: torch.Tensor) -> Placement:
        """The cheaper (with replicas' bytes) of a permutation and, with replica slots, a placement with replicas
        whose first H rows on each rank are its home experts (`owners`)."""
        best = plan_placement(heat_LE, self.G, self.H, previous=self.resident, dispatch=SPLIT)
        if self.S > self.H:
            previous = self.placement if self.placement.slots_per_device == self.S else None
            replicated = owners(plan_placement(heat_LE, self.G, self.S, previous=previous, dispatch=SPLIT),
                                self.resident, best, heat_LE)
            best = min((best, replicated), key=lambda p: float(_Priced(SPLIT, self.replica_cost).cost(heat_LE, p).sum()))
        return best

    def replica_cost(self, plan: Placement) -> torch.Tensor:
        """[L] what a placement's replicas cost per optimizer step, in routes the busiest rank could have trained
        meanwhile: each micro-batch, each replica row's weights from its home and its gradients back
        (`moves.transfer_stall`, per layer)."""
        S = plan.slots_per_device
        if S == self.H:
            return torch.zeros(self.L, dtype=torch.float64)
        bytes_per_param = 2 * next(self.layers[0].experts.parameters()).element_size()   # weights there, grads back
        slots_LGS = plan.phy2log.view(self.L, self.G, S)
        out = torch.zeros(self.L, dtype=torch.float64)
        for layer in range(self.L):
            home_E = torch.empty(self.E, dtype=torch.long)
            home_E[slots_LGS[layer, :, :self.H].reshape(-1)] = torch.arange(self.G).repeat_interleave(self.H)
            rank_GR = torch.arange(self.G)[:, None].expand(self.G, S - self.H)
            held = slots_LGS[layer, :, self.H:] >= 0
            out[layer] = transfer_stall(home_E[slots_LGS[layer, :, self.H:][held]], rank_GR[held], bytes_per_param,
                                        FLOPS_PER_PARAM, self.node_G, self.topology, self.device.type)
        return out * self.engine.gradient_accumulation_steps()

    def move_cost(self, plan: Placement) -> float:
        """The stall of moving the home experts to `plan`'s, in routes the busiest rank could have trained meanwhile
        (`moves.transfer_stall`: each moved expert's whole state); replicas are fetched every step anyway
        (`replica_cost`)."""
        per_param = state_bytes(self.layers[0], len(state_keys(self.engine))) / expert_params(self.layers[0])
        moves = slot_moves(self.resident, self.homes_of(plan))
        return transfer_stall([m[3] for m in moves], [m[1] for m in moves], per_param, FLOPS_PER_PARAM, self.node_G,
                              self.topology, self.device.type)

    def homes_of(self, plan: Placement) -> Placement:
        """The permutation of home experts in `plan`: each rank's first H rows."""
        if plan.slots_per_device == self.H:
            return plan
        phy2log = plan.phy2log.view(self.L, self.G, plan.slots_per_device)[:, :, :self.H].reshape(self.L, -1)
        return index_maps(phy2log, self.E, self.G, self.H)

    # ------------------------------------------------------------------ moves
    def apply(self, placement: Placement, replan: bool = True) -> bool:
        """Move every home expert whose slot changes, with its optimizer state, and flip every rank's route map to
        `placement` (a permutation, or with replicas: each rank's home experts in its first H rows); or, when any rank
        fails, keep the old placement and state everywhere (`moves.Placer`). `replan`: count it as a re-plan (a
        checkpoint's trip home and back is not)."""
        if placement.phy2log.shape[0] != self.L or placement.slots_per_device not in (self.H, self.S) or \
                placement.num_devices != self.G or \
                bool((placement.logcnt > 1).any()) and placement.slots_per_device == self.H:
            raise ValueError(f"a training placement has {self.L} layers of {self.G} ranks x {self.H} home slots "
                             f"(+ {self.S - self.H} replica slots), got {tuple(placement.phy2log.shape)}")
        homes = self.homes_of(placement)
        if bool((homes.logcnt != 1).any()):
            raise ValueError("a training placement's first rows on each rank must hold every expert once (its home)")
        changed = not torch.equal(self.resident.phy2log, homes.phy2log) or \
            not torch.equal(self.placement.phy2log, placement.phy2log)          # another shape: not equal
        row_bytes = state_bytes(self.layers[0], len(state_keys(self.engine)))
        return self.move(homes, self._rows, lambda: self._flip(homes, placement, changed), replan=replan and changed,
                         row_bytes=row_bytes)

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

    def _flip(self, homes: Placement, placement: Placement, changed: bool) -> None:
        """Every layer's route map and grouped GEMM from the next forward: `placement` (homes moved in already); the
        view follows the experts where they `changed`."""
        if torch.equal(homes.phy2log, self.home.phy2log):
            self.resident = homes = self.home
        self.placement = homes if placement.slots_per_device == self.H else placement
        S = self.placement.slots_per_device
        for layer, (m, routes) in enumerate(zip(self.layers, self.routes)):
            routes.set_table(SlotTable.even(self.placement.log2phy[layer]), S)
            self._fetch[layer] = None if S == self.H else Fetch.plan(self.placement, layer, self.H, self.mover.rank,
                                                                     m.ep_group, self.device)
            m.num_local_experts = m.experts.num_experts = S
            m.tokens_per_expert = torch.zeros(self.G * S, dtype=torch.float32, device=m.tokens_per_expert.device)
        if changed:
            self.balancer.move_experts(homes.log2phy[:, :, 0] // self.H, None if S == self.H else _shares(self.placement))

    # ------------------------------------------------------------------ replicas in the grouped GEMM
    def _agree_fetches(self, optimizer, args, kwargs) -> None:
        """Before each optimizer step with replicas served: every rank learns whether a replica transfer failed on
        any rank this step (one all-reduce and one host read a step, none a micro-batch) and then all raise, so
        that no rank steps on what a failed transfer computed."""
        step = int(self.engine.global_steps)
        if step == self._agreed_step or all(f is None for f in self._fetch):    # ZeRO: once per parameter group
            return
        self._agreed_step = step
        failed = [f.pop("failed") for f in self._fetch if f is not None and "failed" in f]
        flag = torch.tensor([float(bool(failed))], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if float(flag):
            raise RuntimeError("easybalance.train_placement: a replica transfer failed "
                               f"({failed[0] if failed else 'on another rank: see its error'}); every rank stops "
                               "before this optimizer step, with the weights and state of the step before")

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
        if self.resident is not self.home and not self._home_depth:
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


@dataclass(frozen=True)
class _Priced:
    """A split's model with what a placement's replicas cost per step added to each layer's cost."""
    split: object
    replica_cost: object

    def cost(self, heat_LE, plan):
        return self.split.cost(heat_LE, plan) + self.replica_cost(plan)

    def ratio(self, heat_LE, plan):
        return self.split.ratio(heat_LE, plan)


def owners(replicated: Placement, previous: Placement, fallback: Placement, load_LE: torch.Tensor) -> Placement:
    """`replicated` (S slots a rank, every expert at least once) with each rank's first H rows its home experts:
    every expert's home is one of its copies, H on each rank, where `previous` (a permutation) had it when it can
    be (a home that stays is not moved), in the row it had there. A rank whose single-copy experts are more than H
    has no such homes: each of its coldest ones trades places with a replica elsewhere (`_trade`, by `load_LE`)
    first. A layer still without homes takes `fallback`'s permutation, without replicas."""
    L, G, S, H = replicated.phy2log.shape[0], replicated.num_devices, replicated.slots_per_device, \
        previous.slots_per_device
    rows = torch.full((L, G, S), -1, dtype=torch.long)
    for layer in range(L):
        slots = replicated.phy2log[layer].view(G, S).clone()
        was = previous.phy2log[layer].view(G, H)
        before = {int(e): (g, j) for g in range(G) for j, e in enumerate(was[g].tolist())}
        home = None
        for _ in range(G * S):
            ranks_of = {}
            for g in range(G):
                for e in slots[g].tolist():
                    if e >= 0:
                        ranks_of.setdefault(e, []).append(g)
            home = _match(ranks_of, {e: before[e][0] for e in ranks_of}, G, H)
            if home is not None or not _trade(slots, ranks_of, load_LE[layer], H):
                break
        if home is None:
            rows[layer, :, :H] = fallback.phy2log[layer].view(G, H)
            continue
        for g in range(G):
            mine = [e for e, h in home.items() if h == g]
            kept = {before[e][1]: e for e in mine if before[e][0] == g}
            free = iter(sorted(set(range(H)) - set(kept)))
            for e in sorted(e for e in mine if before[e][0] != g):
                kept[next(free)] = e
            rows[layer, g, :H] = torch.tensor([kept[j] for j in range(H)])
            extra = [e for e in slots[g].tolist() if e >= 0 and home[e] != g]
            rows[layer, g, H:H + len(extra)] = torch.tensor(extra, dtype=torch.long)
    return index_maps(rows.view(L, G * S), replicated.num_experts, G, S)


def _trade(slots_GS: torch.Tensor, ranks_of: dict, load_E: torch.Tensor, H: int) -> bool:
    """One trade towards homes for every expert: the coldest single-copy expert of the rank with the most of them
    (more than H) swaps slots with a copy of a replicated expert on a rank with fewer than H, the pair that leaves
    the busiest rank least loaded (an even split over copies). False when no rank has too many or no trade fits."""
    G, rows = slots_GS.shape[0], slots_GS.tolist()
    single = [[e for e in rows[g] if e >= 0 and len(ranks_of[e]) == 1] for g in range(G)]
    g0 = max(range(G), key=lambda g: len(single[g]))
    if len(single[g0]) <= H:
        return False
    x = min(single[g0], key=lambda e: float(load_E[e]))
    share = {e: float(load_E[e]) / len(r) for e, r in ranks_of.items()}
    rank_load = [sum(share[e] for e in rows[g] if e >= 0) for g in range(G)]
    best = None
    for g1 in range(G):
        if len(single[g1]) >= H or x in rows[g1]:
            continue
        for j, y in enumerate(rows[g1]):
            if y < 0 or len(ranks_of[y]) < 2 or y in rows[g0]:
                continue
            delta = share[x] - share[y]
            peak = max(max(rank_load[g] for g in range(G) if g not in (g0, g1)) if G > 2 else 0.0,
                       rank_load[g0] - delta, rank_load[g1] + delta)
            if best is None or peak < best[0]:
                best = (peak, g1, j)
    if best is None:
        return False
    _, g1, j = best
    slots_GS[g0, rows[g0].index(x)], slots_GS[g1, j] = rows[g1][j], x
    return True


def _match(ranks_of: dict, preferred: dict, G: int, H: int) -> Optional[dict]:
    """A home rank for every expert among the ranks of its copies, H experts a rank (augmenting paths, each expert
    trying its `preferred` rank first), or None when there is none."""
    home, held = {}, {g: [] for g in range(G)}

    def place(e, seen) -> bool:
        for g in sorted(ranks_of[e], key=lambda g: g != preferred[e]):
            if g in seen:
                continue
            seen.add(g)
            if len(held[g]) < H:
                held[g].append(e)
                home[e] = g
                return True
            for other in list(held[g]):
                if place(other, seen):
                    held[g].remove(other)
                    held[g].append(e)
                    home[e] = g
                    return True
        return False
    for e in sorted(ranks_of, key=lambda e: len(ranks_of[e])):
        if not place(e, set()):
            return None
    return home


def _shares(plan: Placement) -> torch.Tensor:
    """[L, E, G] the share of each expert's routes each EP rank computes under the even split over its copies."""
    L, G, S = plan.phy2log.shape[0], plan.num_devices, plan.slots_per_device
    rank_P = torch.arange(G * S).div(S, rounding_mode="floor").expand(L, -1)
    valid = plan.phy2log >= 0
    share = torch.zeros(L, plan.num_experts * G, dtype=torch.float64)
    share.scatter_add_(1, torch.where(valid, plan.phy2log * G + rank_P, 0), valid.to(torch.float64))   # -1: adds 0
    return share.view(L, plan.num_experts, G) / plan.logcnt.to(torch.float64)[:, :, None]


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


