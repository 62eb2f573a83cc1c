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

With `replica_slots` R, each rank has S = H + R slots: its H home experts (rows of AutoEP's own parameters,
which hold the optimizer state, ZeRO partitions and checkpoints as before) and R replicas of hot experts homed
elsewhere (`plan_placement` with S slots; each expert's home is one of its copies, `owners`). A replica computes with
its home expert's current weights: a forward pre-hook on the layer's `GroupedExperts` gives it [S, ...] weights,
the home rows and the replica rows fetched from their homes (`Fetch`: one all-to-all per layer and forward), in
AutoEP's one grouped GEMM; in backward the replica rows' gradients go home the same way and are added into the home
gradients before anything of DeepSpeed's reduces them. Each micro-batch's routes to a replicated expert split over
its copies by every rank's counts so that the busiest rank takes the fewest (serving's `exact` split: one exchange
of counts per layer in place of AutoEP's own, no host read beyond its). A replica is placed only when the routes it
takes off the busiest rank beat its bytes per step (`replica_cost`, planned for the even split: a bound).

Checkpoints (`save_checkpoint`, `save_16bit_model`) are written in the logical layout: the experts go home for the
save, then back; `load_checkpoint` goes home first. `module.state_dict()` of a placed layer is refused (it would
give permuted rows under AutoEP's keys): `with engine.easybalance.placement.at_home(): ...` on every rank.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch
import torch.distributed as dist

from ...core.topology import TOPOLOGIES
from ...planning.placement import Placement, index_maps, plan_placement, static_placement
from ..common import dist_ready, torch_optimizer
from ..deepspeed.hooks import is_decoupled, shared_problem
from ..moves import DEVICE_FLOPS, RowMover, copy_stall, placement_key, slot_moves, warn_failed
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
        self.ep_ranks = dist.get_process_group_ranks(ep_group) if self.G > 1 else [0]
        self.device = layers[0].router.gate.weight.device
        self.mover = RowMover(rank, self.ep_ranks, ep_group, self.device)
        self.node_G = [balancer.shape.rank_to_node[r] if r < len(balancer.shape.rank_to_node) else 0
                       for r in self.ep_ranks]
        self.home = self.placement = static_placement(self.L, self.E, self.G)
        self.served = self.home          # what the routes use: `placement` (the homes), or it with replicas (S slots)
        self._fetch: list = [None] * self.L
        self.replans, self.weight_moves, self.moved_bytes, self.failed_moves = 0, 0, 0, 0
        self._home_depth = 0           # inside `at_home` (a checkpoint or an export): the layers' state is logical
        self._checked_step = None
        # each micro-batch's routes split over the copies by every rank's counts (serving's `exact`, in place of
        # AutoEP's own count exchange); the balancer's hooks count the logical routes
        routing = Routing(split="exact", rank=rank, recording=False)
        self.routes = [AutoEPRoutes(m, i, self.G, self.H, table=SlotTable.even(self.home.log2phy[i]), routing=routing)
                       for i, m in enumerate(layers)]
        for layer, m in enumerate(layers):
            m.register_state_dict_pre_hook(self._refuse_placed_export)
            m.experts.register_forward_pre_hook(functools.partial(self._with_replicas, layer))
            m.experts.register_forward_hook(self._without_replicas)
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
        model = DISPATCH[(False, "view")]          # a dropless layer: its busiest rank's routes

        def cost(heat_LE, plan):                   # per layer and step: the busiest rank's routes, and replicas' bytes
            return model.cost(heat_LE, plan) + self.replica_cost(plan)
        heat_LE = view.heat_LE / max(1, dist.get_world_size() // self.G if dist_ready() else 1)   # per EP group
        choice = choose_placement(heat_LE, self.served, self.home, 1.0, lambda h: self.plan(h, cost), cost=cost,
                                  ratio=model.ratio, move_cost=self.move_cost, horizon=self.interval,
                                  min_gain=TRAIN_MIN_GAIN)
        if choice is None or choice is self.served or torch.equal(choice.phy2log, self.served.phy2log):
            return False
        return self.apply(choice)

    def plan(self, heat_LE: torch.Tensor, cost) -> Placement:
        """The cheaper (by `cost`) of a permutation and, with replica slots, a placement with replicas whose
        first H rows on each rank are its home experts (`owners`)."""
        best = plan_placement(heat_LE, self.G, self.H, previous=self.placement, dispatch="uniform")
        if self.S > self.H:
            previous = self.served if self.served.slots_per_device == self.S else None
            replicated = owners(plan_placement(heat_LE, self.G, self.S, previous=previous, dispatch="uniform"),
                                self.placement, best, heat_LE)
            best = min((best, replicated), key=lambda p: float(cost(heat_LE, p).sum()))
        return best

    def replica_cost(self, plan: Placement) -> torch.Tensor:
        """[L] what a placement's replicas cost per optimizer step, in routes the busiest rank could have trained
        meanwhile: each micro-batch, the rank that sends or receives the most replica rows moves their weights
        one way and their gradients back at the topology's bandwidth."""
        if plan.slots_per_device == self.H:
            return torch.zeros(self.L, dtype=torch.float64)
        topo = TOPOLOGIES[self.topology]
        bw = topo.intra_bw if len(set(self.node_G)) == 1 else topo.inter_bw
        bytes_per_param = 2 * next(self.layers[0].experts.parameters()).element_size()
        row = DEVICE_FLOPS["cuda" if self.device.type == "cuda" else "cpu"] * bytes_per_param / (FLOPS_PER_PARAM * bw)
        rows_LG = torch.zeros(self.L, self.G, dtype=torch.float64)
        for layer in range(self.L):
            sends, receives = _replica_rows(plan, layer, self.H)
            rows_LG[layer] = torch.maximum(torch.tensor(sends, dtype=torch.float64),
                                           torch.tensor(receives, dtype=torch.float64))
        return rows_LG.max(1).values * row * self.engine.gradient_accumulation_steps()

    def move_cost(self, plan: Placement) -> float:
        """The stall of moving the home experts to `plan`'s, in routes the busiest receiving rank could have
        trained meanwhile (`moves.copy_stall`: each received expert's whole state, `FLOPS_PER_PARAM` per parameter
        per route); replicas are fetched every step anyway (`replica_cost`)."""
        per_param = _state_bytes(self.layers[0], len(_state_keys(self.engine))) / _params(self.layers[0])
        return copy_stall(slot_moves(self.placement, self.homes_of(plan)), per_param, FLOPS_PER_PARAM, self.node_G,
                          self.topology, self.device.type)

    def homes_of(self, plan: Placement) -> Placement:
        """The permutation of home experts in `plan`: each rank's first H rows."""
        if plan.slots_per_device == self.H:
            return plan
        phy2log = plan.phy2log.view(self.L, self.G, plan.slots_per_device)[:, :, :self.H].reshape(self.L, -1)
        return index_maps(phy2log, self.E, self.G, self.H)

    # ------------------------------------------------------------------ moves
    def apply(self, served: Placement, replan: bool = True) -> bool:
        """Move every home expert whose slot changes, with its optimizer state, and flip every rank's route map to
        `served` (a permutation, or with replicas: each rank's home experts in its first H rows); or, when any rank
        fails, keep the old placement and state everywhere (`moves.RowMover`). `replan`: count it as a re-plan (a
        checkpoint's trip home and back is not)."""
        if served.phy2log.shape[0] != self.L or served.slots_per_device not in (self.H, self.S) or \
                served.num_devices != self.G or bool((served.logcnt > 1).any()) and served.slots_per_device == self.H:
            raise ValueError(f"a training placement has {self.L} layers of {self.G} ranks x {self.H} home slots "
                             f"(+ {self.S - self.H} replica slots), got {tuple(served.phy2log.shape)}")
        plan = self.homes_of(served)
        if bool((plan.logcnt != 1).any()):
            raise ValueError("a training placement's first rows on each rank must hold every expert once (its home)")
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
        changed = bool(moves) or not torch.equal(self.served.phy2log, served.phy2log)     # other shape: not equal
        self.placement = self.home if torch.equal(plan.phy2log, self.home.phy2log) else plan
        self.served = self.placement if served.slots_per_device == self.H else served
        S = self.served.slots_per_device
        for layer, (m, routes) in enumerate(zip(self.layers, self.routes)):
            routes.set_table(SlotTable.even(self.served.log2phy[layer]), S)
            self._fetch[layer] = None if S == self.H else Fetch.plan(self.served, layer, self.H, self.mover.rank,
                                                                     m.ep_group, self.device)
            m.num_local_experts = m.experts.num_experts = S
            m.tokens_per_expert = torch.zeros(self.G * S, dtype=torch.float32, device=m.tokens_per_expert.device)
        if changed:
            self.balancer.move_experts(plan.log2phy[:, :, 0] // self.H, None if S == self.H else _shares(self.served))
        self.replans += int(replan and changed)
        self.weight_moves += len(moves)
        self.moved_bytes += sum(src != dst for _, dst, _, src, _ in moves) * \
            _state_bytes(self.layers[0], len(_state_keys(self.engine)))
        return True

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

    def _with_replicas(self, layer: int, experts, args) -> None:
        """The layer's grouped weights [H, ...] -> [S, ...] for this forward (home rows, then fetched replicas)."""
        fetch = self._fetch[layer]
        if fetch is not None:
            names = [n for n, _ in experts.named_parameters(recurse=False)]
            self._kept = {n: experts._parameters[n] for n in names}
            for name, full in zip(names, Fetch.apply(fetch, *self._kept.values())):
                experts._parameters[name] = full

    def _without_replicas(self, experts, args, output) -> None:
        kept, self._kept = getattr(self, "_kept", None), None
        if kept:
            experts._parameters.update(kept)

    # ------------------------------------------------------------------ checkpoints and exports
    @contextlib.contextmanager
    def at_home(self, when: str = "for an export"):
        """The experts in AutoEP's own layout inside the block (collective: every rank enters it), placed again
        after it."""
        placed = self.served
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


class Fetch(torch.autograd.Function):
    """A layer's grouped weights with replicas. Forward: each weight [H, ...] -> [S, ...], the home rows, then the
    rows of the replicas this rank holds, fetched from their homes (one all-to-all of all weights' rows). Backward:
    the replica rows' gradients go home the same way and are added into the home rows' gradients, so the
    optimizer, ZeRO and the expert-data-parallel reduction see the home parameters only."""

    @staticmethod
    def plan(served: Placement, layer: int, H: int, rank: int, group, device) -> dict:
        """What this rank sends (home rows, per destination rank) and receives (replica rows, per source rank)
        in `layer` of `served`: host-side splits, device-side indices."""
        S, G = served.slots_per_device, served.num_devices
        homes = served.phy2log[layer].view(G, S)[:, :H]
        home_of = {int(e): (g, j) for g in range(G) for j, e in enumerate(homes[g].tolist())}
        copies = [(g, j, home_of[int(e)]) for g in range(G) for j, e in enumerate(served.phy2log[layer].view(G, S)[g])
                  if j >= H and int(e) >= 0]
        send = [(g, r) for g, _, (o, r) in copies if o == rank]                      # by destination, then row
        receive = sorted((o, j) for g, j, (o, _) in copies if g == rank)              # by source, then row
        return {"send_rows": torch.tensor([r for _, r in send], dtype=torch.long, device=device),
                "send_splits": [sum(g == d for g, _ in send) for d in range(G)],
                "receive_rows": torch.tensor([j - H for _, j in receive], dtype=torch.long, device=device),
                "receive_splits": [sum(o == d for o, _ in receive) for d in range(G)],
                "H": H, "S": S, "group": group}

    @staticmethod
    def forward(ctx, fetch: dict, *weights):
        ctx.fetch, ctx.like = fetch, [(w.shape, w.dtype, w.device) for w in weights]
        rows = _guarded_rows(fetch, weights, fetch["send_rows"], "fetching replica weights")
        arrived = _exchange(rows, fetch["receive_splits"], fetch["send_splits"], fetch["group"])
        out, at = [], 0
        for w in weights:
            full = w.new_zeros((fetch["S"], ) + tuple(w.shape[1:]))
            full[:fetch["H"]] = w
            n = w[0].numel()
            full[fetch["H"] + fetch["receive_rows"]] = arrived[:, at:at + n].view(-1, *w.shape[1:])
            at += n
            out.append(full)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        fetch, H = ctx.fetch, ctx.fetch["H"]
        grads = [torch.zeros((fetch["S"], ) + tuple(shape[1:]), dtype=dtype, device=device) if g is None else g
                 for g, (shape, dtype, device) in zip(grads, ctx.like)]
        rows = _guarded_rows(fetch, grads, H + fetch["receive_rows"], "sending replica gradients home")
        back = _exchange(rows, fetch["send_splits"], fetch["receive_splits"], fetch["group"])
        out, at = [], 0
        for g in grads:
            n = g[0].numel()
            out.append(g[:H].clone().index_add_(0, fetch["send_rows"], back[:, at:at + n].view(-1, *g.shape[1:])))
            at += n
        return (None, *out)


def _rows(tensors: list, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` of every tensor [N, ...], side by side: [len(index), the tensors' row sizes summed]."""
    return torch.cat([t[index].reshape(len(index), t[0].numel()) for t in tensors], 1)


def _guarded_rows(fetch: dict, tensors: list, index: torch.Tensor, what: str) -> torch.Tensor:
    """`_rows`, or, when reading them fails on this rank, zeros of the planned shape, so that every rank still
    meets in the all-to-all (no hang); the failure is kept in `fetch` and every rank raises before the optimizer
    step (`TrainPlacement._agree_fetches`), so no rank steps on what a failed transfer computed."""
    try:
        return _rows(tensors, index)
    except Exception as e:   # noqa: BLE001 - any failure here, reported on every rank at the step
        fetch["failed"] = f"{what} failed on rank {dist.get_rank()}: {type(e).__name__}: {e}"
        width = sum(t[0].numel() for t in tensors)
        return torch.zeros((len(index), width), dtype=tensors[0].dtype, device=tensors[0].device)


def _exchange(rows: torch.Tensor, receive_splits: list, send_splits: list, group) -> torch.Tensor:
    """One all-to-all of rows (every rank of the EP group together, each with the splits it sends and receives)."""
    out = rows.new_empty((sum(receive_splits), rows.shape[1]))
    dist.all_to_all_single(out, rows.contiguous(), receive_splits, send_splits, group=group)
    return out


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


def _replica_rows(plan: Placement, layer: int, H: int) -> tuple[list[int], list[int]]:
    """Per rank, the replica rows it sends (copies of its home experts elsewhere) and receives, in `layer`."""
    G, S = plan.num_devices, plan.slots_per_device
    slots = plan.phy2log[layer].view(G, S)
    home_rank = {int(e): g for g in range(G) for e in slots[g, :H].tolist()}
    sends, receives = [0] * G, [0] * G
    for g in range(G):
        for e in slots[g, H:].tolist():
            if e >= 0:
                receives[g] += 1
                sends[home_rank[e]] += 1
    return sends, receives


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
