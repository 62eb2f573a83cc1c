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

With an enabled `easybalance` block each MoE layer gets `inference.replica_slots` extra slots per rank
(`MOELayer` over P = E + R * G "experts", DeepSpeed's All-to-All untouched) and a `ReplicaGate`. The
slots start as DeepSpeed's layout (home experts) plus empty extras. After every forward the serving
side steps the balancer (one all-reduce of the [L, W] tally) and, once the view is warm, at most
every `replan_interval` batches, re-plans when a layer's expected slot load max/mean (capacity over
ideal, what sets DeepSpeed's padded compute and All-to-All bytes) passes `replan_threshold`.
A re-plan moves weights in two phases: every rank fetches the new slots' weights into staging
buffers (one `batch_isend_irecv`), the ranks agree that every fetch succeeded and that they all
planned the same placement, then every rank copies and flips its tables before the next forward;
a failure anywhere keeps the old placement on every rank.
"""
from __future__ import annotations

import copy
import hashlib
import os
import socket
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist

from ...core.balancer import Balancer, check_agreement
from ...core.config import EasyBalanceConfig, strip_block
from ...core.record import NullLogger
from ...core.topology import node_map, resolve_topology
from ...observe.monitor import JsonlLogger
from ...planning.placement import Placement, index_maps, plan_placement
from .engine import find_moe_layers
from .replicas import ReplicaGate, SlotTable

__all__ = ["init_inference", "Serving", "expected_slot_ratio"]

EXPERTS_PREFIX = ".deepspeed_moe.experts.deepspeed_experts."


def expected_slot_ratio(heat_LE: torch.Tensor, plan: Placement) -> torch.Tensor:
    """[L] max / mean of the expected load per physical slot when each expert's routes split evenly
    over its replicas (DeepSpeed pads every slot to the largest, so this is capacity over ideal)."""
    heat_LE = torch.as_tensor(heat_LE, dtype=torch.float64)
    L, P = plan.phy2log.shape
    per_replica_LE = heat_LE / plan.logcnt.clamp_min(1)
    slot_LP = torch.where(plan.phy2log >= 0, per_replica_LE.gather(1, plan.phy2log.clamp_min(0)), 0.0)
    mean_L = heat_LE.sum(1) / P
    return torch.where(mean_L > 0, slot_LP.amax(1) / mean_L.clamp_min(1e-300), torch.ones(L, dtype=torch.float64))


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def _flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _unflatten_into(module: torch.nn.Module, flat: torch.Tensor) -> None:
    at = 0
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(flat[at:at + p.numel()].view_as(p))
            at += p.numel()


class Serving:
    """The serving side of one model: its replicated layers, placement, view, re-plans and checkpoints."""

    def __init__(self, module: torch.nn.Module, config: Optional[EasyBalanceConfig]):
        self.module = module
        self.config = config
        self.moes = [m for _, m in find_moe_layers(module)]
        if not self.moes:
            raise ValueError("init_inference: the model has no deepspeed.moe.layer.MoE layers")
        shapes = {(m.num_experts, m.ep_size) for m in self.moes}
        if len(shapes) != 1:
            raise ValueError(f"every MoE layer must have the same (num_experts, ep_size), got {sorted(shapes)}")
        (self.E, self.G), = shapes
        self.L, self.H = len(self.moes), self.E // self.G
        enabled = config is not None and config.enabled
        self.R = config.inference.replica_slots if enabled and config.mode == "balance" else 0
        self.S = self.H + self.R
        self.P = self.G * self.S
        self.ep_group = self.moes[0].deepspeed_moe.ep_group
        self.rank = dist.get_rank(self.ep_group) if _dist_ready() and self.G > 1 else 0
        self.ep_ranks = dist.get_process_group_ranks(self.ep_group) if _dist_ready() and self.G > 1 else [0]
        self.replans, self.weight_moves, self.failed_moves = 0, 0, 0
        self.batches, self.last_plan_batch = 0, None
        home_P = torch.arange(self.P)
        home_P = torch.where(home_P % self.S < self.H, home_P // self.S * self.H + home_P % self.S, -1)
        self.placement = index_maps(home_P.expand(self.L, self.P).clone(), self.E, self.G, self.S)
        self.node_G = torch.zeros(self.G, dtype=torch.long)
        self.rank_to_node, self.topology = [0], "pcie"
        self.balancer: Optional[Balancer] = None
        if enabled:
            self._agree_at_start_up()
        self.gates: list[ReplicaGate] = []
        for layer, moe in enumerate(self.moes):
            self._replicate(layer, moe, record=enabled)
        if enabled:
            self.balancer = Balancer(config, self.gates, self.G, reduce=self._reduce_fn(), device_tally=True,
                                     rank_to_node=self.rank_to_node,
                                     logger=JsonlLogger(config.log.dir) if dist_rank() == 0 else NullLogger())
            self.balancer.extra_metrics = lambda: {"replans": self.replans, "weight_moves": self.weight_moves}

    # ------------------------------------------------------------------ set-up
    def _agree_at_start_up(self) -> None:
        mine = {"config": self.config.to_dict(), "experts": self.E, "devices": self.G, "layers": self.L,
                "top_k": [m.deepspeed_moe.gate.k for m in self.moes]}
        host = socket.gethostname()
        if _dist_ready() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (mine, host))
        else:
            gathered = [(mine, host)]
        check_agreement([g for g, _ in gathered], dist_rank())
        self.rank_to_node = node_map([h for _, h in gathered])
        self.node_G = torch.tensor([self.rank_to_node[r] for r in self.ep_ranks])
        num_nodes = int(self.node_G.max()) + 1
        self.topology, note = resolve_topology(self.config.inference.topology,
                                               explicit="topology" in self.config.inference.explicit,
                                               num_nodes=num_nodes)
        if note and dist_rank() == 0:
            warnings.warn(f"easybalance.inference.topology: {note}")

    def _replicate(self, layer: int, moe, record: bool) -> None:
        """Give the layer S slots per rank (R empty extras after its home experts) and a ReplicaGate."""
        experts = moe.deepspeed_moe.experts
        if self.R:
            extra = [copy.deepcopy(experts.deepspeed_experts[0]) for _ in range(self.R)]
            for slot in extra:
                for p in slot.parameters():
                    p.data.zero_()                      # an empty slot: no token reaches it
                    p.allreduce, p.group_name = False, moe.expert_group_name
            experts.deepspeed_experts.extend(extra)
            experts.num_local_experts = self.S
            moe.deepspeed_moe.num_local_experts = self.S
        inf = self.config.inference if self.config is not None else None
        steer_options = {} if inf is None else {"weights": inf.weights.as_tuple(), "topology": self.topology,
                                                "decision_batch": inf.decision_batch}
        gate = ReplicaGate.from_gate(moe.deepspeed_moe.gate, self.G, self.S, rank=self.rank,
                                     table=self._table(layer), split="view" if inf is None else inf.split,
                                     node_G=self.node_G, steer_options=steer_options)
        gate.layer_index = layer
        gate.recording = record
        moe.deepspeed_moe.gate = gate
        self.gates.append(gate)

    def _table(self, layer: int) -> SlotTable:
        return SlotTable.even(self.placement.log2phy[layer])

    def _reduce_fn(self):
        if not _dist_ready() or dist.get_world_size() == 1:
            return None
        return lambda packed_LW: dist.all_reduce(packed_LW)

    def slot(self, layer: int, p: int) -> torch.nn.Module:
        """The expert module of physical slot p (on this rank)."""
        assert p // self.S == self.rank, f"slot {p} lives on EP rank {p // self.S}, not {self.rank}"
        return self.moes[layer].deepspeed_moe.experts.deepspeed_experts[p % self.S]

    # ------------------------------------------------------------------ per batch
    def after_batch(self) -> None:
        """Step the balancer (one all-reduce), then re-plan if the view says so."""
        if self.balancer is None:
            return
        self.balancer.step()
        self.batches += 1
        cross_LG = self.balancer.view.cross_layer_pressure() if self.balancer.view.steps else None
        for layer, gate in enumerate(self.gates):
            gate.pressure_G = None if cross_LG is None else cross_LG[layer]
        if self.R:
            self.maybe_replan()

    def maybe_replan(self) -> bool:
        """Re-plan when the view is warm, the last plan is `replan_interval` batches old and a layer's
        expected slot max/mean passes `replan_threshold`; returns whether a new placement serves."""
        inf, view = self.config.inference, self.balancer.view
        if not view.ready:
            return False
        if self.last_plan_batch is not None and self.batches - self.last_plan_batch < inf.replan_interval:
            return False
        heat_LE = view.heat_LE
        now = float(expected_slot_ratio(heat_LE, self.placement).max())
        if now <= inf.replan_threshold:
            return False
        self.last_plan_batch = self.batches
        plan = plan_placement(heat_LE, self.G, self.S, num_nodes=int(self.node_G.max()) + 1, previous=self.placement)
        if float(expected_slot_ratio(heat_LE, plan).max()) >= now * (1 - 1e-9):
            return False
        return self.apply(plan)

    # ------------------------------------------------------------------ weight moves
    def _moves(self, new_LP: torch.Tensor) -> list[tuple[int, int, int]]:
        """(layer, destination slot, source slot) for every slot whose expert changes: the source is a
        slot of the old placement holding that expert, on the destination's rank when there is one."""
        old_LP = self.placement.phy2log
        moves = []
        for layer, p in torch.nonzero((new_LP != old_LP) & (new_LP >= 0)).tolist():
            holders = torch.nonzero(old_LP[layer] == new_LP[layer, p]).flatten().tolist()
            local = [q for q in holders if q // self.S == p // self.S]
            moves.append((layer, p, (local or holders)[0]))
        return moves

    def apply(self, plan: Placement) -> bool:
        """Move weights for `plan` and flip every rank to it, or keep the old placement everywhere."""
        new_LP = plan.phy2log
        if new_LP.shape != self.placement.phy2log.shape:
            raise ValueError(f"a placement of {tuple(new_LP.shape)} slots for a model of "
                             f"{tuple(self.placement.phy2log.shape)}")
        key = int(hashlib.sha1(new_LP.numpy().tobytes()).hexdigest()[:15], 16)
        moves = self._moves(new_LP)
        staging: dict[tuple[int, int], torch.Tensor] = {}
        ops, ok = [], True
        try:   # phase 1a: staging buffers for our destination slots, the transfers to post
            ops = self._prepare(moves, staging)
        except Exception as e:   # noqa: BLE001 - any failure must reach the agreement, not hang the peers
            ok = self._failed("preparing the weight moves", e)
        if not self._agree(ok, key):
            self.failed_moves += 1
            return False
        try:   # phase 1b: every transfer, then a check of what arrived
            if ops:
                for request in dist.batch_isend_irecv(ops):
                    request.wait()
            self._verify(staging)
        except Exception as e:   # noqa: BLE001
            ok = self._failed("moving expert weights", e)
        if not self._agree(ok, key):
            self.failed_moves += 1
            return False
        # phase 2: every rank got every weight: copy them in and flip the tables before the next forward
        for (layer, p), flat in staging.items():
            _unflatten_into(self.slot(layer, p), flat)
        self.placement = plan
        for layer, gate in enumerate(self.gates):
            gate.table = self._table(layer)
        self.replans += 1
        self.weight_moves += len(moves)
        return True

    def _prepare(self, moves, staging) -> list:
        ops = []
        for layer, p, q in moves:
            dst, src = p // self.S, q // self.S
            if dst == self.rank:
                staging[(layer, p)] = torch.empty_like(_flat(self.slot(layer, p)))
                if src == self.rank:
                    staging[(layer, p)].copy_(_flat(self.slot(layer, q)))
                else:
                    ops.append(dist.P2POp(dist.irecv, staging[(layer, p)], self.ep_ranks[src]))
            elif src == self.rank:
                ops.append(dist.P2POp(dist.isend, _flat(self.slot(layer, q)), self.ep_ranks[dst]))
        return ops

    def _verify(self, staging) -> None:
        """What arrived must be finite (a weight move never loads garbage into a serving slot)."""
        for (layer, p), flat in staging.items():
            if not bool(torch.isfinite(flat).all()):
                raise ValueError(f"layer {layer} slot {p}: received non-finite expert weights")

    def _failed(self, what: str, error: Exception) -> bool:
        warnings.warn(f"easybalance: {what} failed on rank {dist_rank()} ({type(error).__name__}: {error}); "
                      "the old placement keeps serving")
        return False

    def _agree(self, ok: bool, key: int) -> bool:
        """Every rank succeeded, and every rank planned the same placement (the view is identical)."""
        flags = torch.tensor([int(ok), key, -key], dtype=torch.long)
        if _dist_ready() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        if int(flags[1]) != -int(flags[2]):
            raise RuntimeError("easybalance: ranks planned different placements from what should be the same view")
        return bool(flags[0])

    # ------------------------------------------------------------------ checkpoints (DeepSpeed's file layout)
    def load_checkpoint(self, ckpt_dir: str, tag: Optional[str] = None) -> str:
        """Load a DeepSpeed MoE checkpoint (a training engine's, or `save_checkpoint`'s): the non-expert
        weights from `mp_rank_00_model_states.pt`, and every local slot from the file of the expert it
        holds (`layer_{l}_expert_{e}_...`), so replicas are filled without communication."""
        tag = _tag(ckpt_dir, tag)
        folder = os.path.join(ckpt_dir, tag)
        state = torch.load(os.path.join(folder, "mp_rank_00_model_states.pt"), map_location="cpu",
                           weights_only=True)["module"]
        names = self._moe_names()
        for layer, name in enumerate(names):
            for p in range(self.rank * self.S, (self.rank + 1) * self.S):
                e = int(self.placement.phy2log[layer, p])
                if e < 0:
                    continue
                expert = torch.load(os.path.join(folder, f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt"),
                                    map_location="cpu", weights_only=True)
                prefix = f"{name}{EXPERTS_PREFIX}"
                for key, value in expert.items():
                    state[key.replace(f"{prefix}{e}.", f"{prefix}{p % self.S}.")] = value
        empty = {k for k in self.module.state_dict() if k not in state}
        unexpected = [k for k in state if k not in self.module.state_dict()]
        if unexpected or any(not self._is_empty_slot_key(k) for k in empty):
            raise ValueError(f"{folder}: checkpoint does not fit this model (missing "
                             f"{sorted(k for k in empty if not self._is_empty_slot_key(k))[:4]}, unexpected "
                             f"{unexpected[:4]})")
        self.module.load_state_dict(state, strict=False)
        return os.path.join(ckpt_dir, tag)

    def logical_state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """The home experts of this rank ({file name: expert state with global ids}) and, under the key
        "module", the non-expert weights: what DeepSpeed writes. A home expert that moved is fetched from
        a slot that holds it (one batch_isend_irecv); a replica is never saved twice."""
        names = self._moe_names()
        wanted = []   # (layer, expert, holder slot)
        for layer in range(self.L):
            for e in range(self.E):
                holders = torch.nonzero(self.placement.phy2log[layer] == e).flatten().tolist()
                home = e // self.H
                local = [q for q in holders if q // self.S == home]
                wanted.append((layer, e, (local or holders)[0]))
        flats: dict[tuple[int, int], torch.Tensor] = {}
        ops = []
        for layer, e, q in wanted:
            home, src = e // self.H, q // self.S
            if home == self.rank:
                flats[(layer, e)] = _flat(self.slot(layer, q)) if src == self.rank else \
                    torch.empty_like(_flat(self.slot(layer, self.rank * self.S)))
                if src != self.rank:
                    ops.append(dist.P2POp(dist.irecv, flats[(layer, e)], self.ep_ranks[src]))
            elif src == self.rank:
                ops.append(dist.P2POp(dist.isend, _flat(self.slot(layer, q)), self.ep_ranks[home]))
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        out: dict[str, dict[str, torch.Tensor]] = {}
        for (layer, e), flat in flats.items():
            shapes = [(n, p.shape) for n, p in self.slot(layer, self.rank * self.S).named_parameters()]
            parts = torch.split(flat, [s.numel() for _, s in shapes])
            out[f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt"] = {
                f"{names[layer]}{EXPERTS_PREFIX}{e}.{n}": part.view(shape).clone() for (n, shape), part in zip(shapes, parts)}
        out["module"] = {k: v.clone() for k, v in self.module.state_dict().items() if EXPERTS_PREFIX not in k}
        return out

    def save_checkpoint(self, ckpt_dir: str, tag: str = "served") -> str:
        """Write DeepSpeed's MoE checkpoint layout with the logical experts (every rank its home experts;
        EP rank 0 of data-parallel replica 0 the non-expert weights and `latest`). Collective."""
        state = self.logical_state_dict()
        folder = os.path.join(ckpt_dir, tag)
        os.makedirs(folder, exist_ok=True)
        writer = 0 in self.ep_ranks            # the first EP group writes (every EP group holds the same)
        if writer:
            for name, tensors in state.items():
                if name != "module":
                    torch.save(tensors, os.path.join(folder, name))
        if dist_rank() == 0:
            torch.save({"module": state["module"], "num_experts": [self.E] * self.L},
                       os.path.join(folder, "mp_rank_00_model_states.pt"))
            with open(os.path.join(ckpt_dir, "latest"), "w") as f:
                f.write(tag)
        if _dist_ready():
            dist.barrier()
        return folder

    def _moe_names(self) -> list[str]:
        return [name for name, _ in find_moe_layers(self.module)]

    def _is_empty_slot_key(self, key: str) -> bool:
        for layer, name in enumerate(self._moe_names()):
            prefix = f"{name}{EXPERTS_PREFIX}"
            if key.startswith(prefix):
                local = int(key[len(prefix):].split(".", 1)[0])
                return int(self.placement.phy2log[layer, self.rank * self.S + local]) < 0
        return False


def dist_rank() -> int:
    return dist.get_rank() if _dist_ready() else 0


def _tag(ckpt_dir: str, tag: Optional[str]) -> str:
    if tag is not None:
        return str(tag)
    latest = os.path.join(ckpt_dir, "latest")
    if not os.path.exists(latest):
        raise FileNotFoundError(f"{ckpt_dir}: no `latest` file; pass tag=")
    with open(latest, encoding="utf-8") as f:
        return f.read().strip()


def init_inference(model: torch.nn.Module, config=None, **kwargs):
    """`deepspeed.init_inference` for models built from `deepspeed.moe.layer.MoE`, made correct for
    expert parallelism, with the `easybalance` block of the same config.

    config: DeepSpeed's inference config (dict or JSON path) that may hold an `"easybalance"` block;
    kwargs go to `deepspeed.init_inference` as they are, except that without a `dtype` the model keeps
    its own (DeepSpeed would cast to fp16). Returns DeepSpeed's `InferenceEngine` with
    `engine.serving` (placement, checkpoints) and, with an enabled block, `engine.easybalance` (the
    Balancer). Every EP rank must call forward together, as DeepSpeed's All-to-All requires.
    """
    import deepspeed

    eb_config = EasyBalanceConfig.from_ds_config(config)
    ds_config = strip_block(config) or {}
    if eb_config.enabled:
        where = f'mode "{eb_config.mode}"'
        for path in eb_config.ignored_options("inference"):
            warnings.warn(f"{path} has no effect in serving ({where})")
    if not _dist_ready():
        deepspeed.init_distributed()
    if "dtype" not in ds_config and "dtype" not in kwargs:
        # deepspeed.init_inference would cast to fp16 by default; serving keeps the weights as they are
        kwargs["dtype"] = next(model.parameters()).dtype
    engine = deepspeed.init_inference(model, config=ds_config, **kwargs)
    module = engine.module
    for _, moe in find_moe_layers(module):
        moe.set_deepspeed_parallelism()       # the groups deepspeed.init_inference never hands over
    module.eval()
    serving = Serving(module, eb_config if eb_config.enabled else None)
    engine.serving = serving
    if serving.balancer is not None:
        engine.easybalance = serving.balancer
        module.register_forward_hook(lambda mod, args, output: serving.after_batch())
    return engine
