"""The DeepSpeed training adapter: gate swap, the per-step hook, checkpoint state, start-up agreement.

Shape legend: L MoE layers (the whole model's), E experts per layer, G EP ranks, W packed tally width.

    engine, optimizer, _, _ = eb_deepspeed.initialize(model=model, model_parameters=params,
                                                      config="ds_config.json")
    engine.easybalance               # the core Balancer: .view, .metrics(), .set_sequence_lengths(...)

The balancing loop itself is `core.Balancer`; this file only connects it to a DeepSpeed engine:

* the **step hook** is a torch optimizer step post-hook on the innermost `torch.optim.Optimizer`
  (a public door), run once per value of `engine.global_steps`: DeepSpeed steps that optimizer
  once per gradient-accumulation boundary, or once per parameter group under ZeRO, through
  `_take_model_step` in both `DeepSpeedEngine.step` and `PipelineEngine.train_batch`. A step that
  DeepSpeed skips (fp16 overflow, an inf gradient under the torch_autocast scaler) does not step
  the optimizer; a forward pre-hook sees `global_steps` move past it and drops its routes, so the
  view holds only batches that reached a step. A batch the user skips (no `engine.step()`) is
  dropped with `engine.easybalance.discard_tally()`.
* the **reduce** is one all-reduce per step of the stacked [L, W] tally: over DeepSpeed's
  data-parallel group (every EP x DP rank) for a plain engine; over every rank for a pipeline,
  where each stage fills the rows of its own layers (one rank per tensor-parallel slice), so every
  rank holds the whole model's view;
* one **all-gather at start-up** checks that every rank agrees on the model and config (a rank
  that disagrees would hang the per-step reduce) and learns the pipeline layout and node map;
* the balancer state rides in DeepSpeed's checkpoint `client_state` (`save_checkpoint` and
  `load_checkpoint` are wrapped on the instance: DeepSpeed has no checkpoint hook).
With world size 1 there is no communication at all.
"""
from __future__ import annotations

import copy
import inspect
import os
import pickle
import socket
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist

from ...core.balancer import Balancer, check_agreement
from ...core.config import EasyBalanceConfig, strip_block
from ...core.record import BalanceLogger, NullLogger
from ...core.topology import node_map
from ...observe.monitor import DeepSpeedMonitorLogger, JsonlLogger, MultiLogger
from .gate import CrossLayerGate

__all__ = ["initialize", "swap_gates", "find_moe_layers", "attach", "check_shapes", "STATE_KEY"]

STATE_KEY = "easybalance"  # key of the balancer state in DeepSpeed's checkpoint client_state


def find_moe_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Every `deepspeed.moe.layer.MoE` in `model`, in module order (the order of layers)."""
    from deepspeed.moe.layer import MoE
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def check_shapes(model: torch.nn.Module) -> None:
    """Refuse, before the gates are swapped and DeepSpeed initializes, MoE layers whose EP sizes do not nest:
    layers may differ in num_experts and ep_size (PR-MoE), but every ep_size must divide the largest, so
    that each smaller EP group lies inside one group of the largest (DeepSpeed's contiguous groups)."""
    moes = find_moe_layers(model)
    sizes = sorted({int(m.ep_size) for _, m in moes})
    if sizes and any(sizes[-1] % e for e in sizes):
        layers = ", ".join(f"{name}: {m.num_experts} experts, ep_size {m.ep_size}" for name, m in moes)
        raise ValueError(f"easybalance: every MoE layer's ep_size must divide the largest ({sizes[-1]}) for the "
                         f"cross-layer view, got {layers}. Nothing was changed; with \"easybalance\": "
                         f"{{\"enabled\": false}} the model trains with plain DeepSpeed")


def swap_gates(model: torch.nn.Module) -> list[CrossLayerGate]:
    """Replace each MoE layer's TopKGate by a CrossLayerGate sharing its `wg` parameter.

    Call before `deepspeed.initialize` (DeepSpeed then hands the gates their EP group).
    Parameter names, values and objects are unchanged, so optimizers and checkpoints see the
    same model, and no random number is drawn. Already-swapped gates are kept.
    """
    gates = []
    for index, (_, moe) in enumerate(find_moe_layers(model)):
        gate = moe.deepspeed_moe.gate
        if not isinstance(gate, CrossLayerGate):
            gate = CrossLayerGate.from_topk_gate(gate, layer_index=index)
            moe.deepspeed_moe.gate = gate
        gate.layer_index = index
        gates.append(gate)
    return gates


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def _is_pipeline(engine) -> bool:
    from deepspeed.runtime.pipe.engine import PipelineEngine
    return isinstance(engine, PipelineEngine)


def _layout(engine, config: EasyBalanceConfig, gates: list[CrossLayerGate]) -> dict[str, Any]:
    """One all-gather: check that every rank agrees, and learn the pipeline layout and node map.

    Returns the global index of each local gate, the model's layer count, E and G per layer (layers may
    differ: PR-MoE), rank -> node, and for layers whose EP group is smaller than the largest the view
    device each local gate's experts sit on (see `_copy_devices`). Every rank evaluates the same gathered
    data, so a disagreement raises the same error everywhere.
    """
    check_shapes(engine.module)               # `attach` called directly: the same refusal as `initialize`'s
    ep_of = {id(m.deepspeed_moe.gate): int(m.ep_size) for _, m in find_moe_layers(engine.module)}
    shapes = [(int(g.num_experts), ep_of.get(id(g), 1)) for g in gates]
    stage = int(engine.stage_id) if _is_pipeline(engine) else 0
    largest = max((e for _, e in shapes), default=0)          # 0: this rank holds no MoE layer
    copies = _copy_devices(gates, shapes, largest) if largest > 1 else None
    mine = {"stage": stage, "top_k": [g.k for g in gates], "shapes": shapes, "config": config.to_dict(),
            "host": socket.gethostname(), "largest": largest, "nested": largest <= 1 or copies is not None}
    if _dist_ready() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        rank = dist.get_rank()
    else:
        gathered, rank = [mine], 0
    check_agreement([{"config": g["config"]} for g in gathered], rank)
    # Per pipeline stage: the same layers on every rank of the stage; stages in order give global indices.
    first_of_stage: dict[int, int] = {}
    for r, g in enumerate(gathered):
        first = first_of_stage.setdefault(g["stage"], r)
        for key, what in (("top_k", "top-k"), ("shapes", "(num_experts, ep_size)")):
            if g[key] != gathered[first][key]:
                raise ValueError(f"rank {r} disagrees with rank {first} (pipeline stage {g['stage']}) on its MoE "
                                 f"layers' {what}: {g[key]} vs {gathered[first][key]}")
    stages = sorted(first_of_stage)
    offset = {s: sum(len(gathered[first_of_stage[t]]["top_k"]) for t in stages if t < s) for s in stages}
    model_shapes = [tuple(x) for s in stages for x in gathered[first_of_stage[s]]["shapes"]]
    if not model_shapes:
        raise ValueError("easybalance is enabled but the model has no deepspeed.moe.layer.MoE layers")
    num_devices = max(e for _, e in model_shapes)
    mixed = any(e != num_devices for _, e in model_shapes)
    if mixed:       # every rank holding MoE layers needs its own copy of each: known from the one all-gather
        bad = [r for r, g in enumerate(gathered) if g["largest"] and (g["largest"] != num_devices or not g["nested"])]
        if bad:
            raise ValueError(f"easybalance: on ranks {bad} a smaller MoE layer's EP group does not lie, in order, "
                             f"inside the rank's group of the largest ep_size ({num_devices}), or the rank holds no layer of "
                             "that size (a pipeline stage); the cross-layer view needs DeepSpeed's contiguous "
                             "expert-parallel groups and a layer of the largest ep_size on every rank")
    return {"layers": [offset[stage] + i for i in range(len(gates))], "num_layers": len(model_shapes),
            "experts": [e for e, _ in model_shapes], "devices": [d for _, d in model_shapes],
            "copy_devices": copies if mixed else None, "rank_to_node": node_map([g["host"] for g in gathered])}


def _copy_devices(gates: list[CrossLayerGate], shapes: list[tuple[int, int]],
                  largest: int) -> Optional[list[torch.Tensor]]:
    """For each local gate, the view device [E_l] of each of its experts, as this rank's tokens reach them.

    The view spans the G ranks of the largest EP group; a layer with a smaller group (ep_size e) is one of
    G / e copies inside it, copy c holding group-local rank j on view device c * e + j. This rank's tokens
    go to its own copy. None when a group does not lie in order inside this rank's largest group (a layout
    other than DeepSpeed's contiguous one). largest: the largest ep_size among `gates` (> 1).
    """
    big = next(g for g, (_, e) in zip(gates, shapes) if e == largest)
    big_ranks = dist.get_process_group_ranks(big.ep_group)
    out = []
    for gate, (experts, e) in zip(gates, shapes):
        ranks = dist.get_process_group_ranks(gate.ep_group) if e > 1 else [dist.get_rank()]
        if not set(ranks) <= set(big_ranks):
            return None
        at = [big_ranks.index(r) for r in ranks]
        if at != list(range(at[0], at[0] + e)) or at[0] % e:
            return None
        out.append(at[0] + torch.arange(experts) // (experts // e))
    return out


def _reduce_fn(engine):
    """The per-step all-reduce (None for world size 1). See the module doc for the groups."""
    if not _dist_ready() or dist.get_world_size() == 1:
        return None
    if _is_pipeline(engine):
        # every rank, so every stage's rows reach every rank; one copy per tensor-parallel slice
        contributes = engine.grid.get_slice_parallel_rank() == 0

        def reduce(packed_LW: torch.Tensor) -> None:
            if not contributes:
                packed_LW.zero_()
            dist.all_reduce(packed_LW)
        return reduce
    # the ranks that see different tokens of the same layers: data parallel (x expert parallel), and the
    # sequence-parallel split too when that is on (DeepSpeed's own group for gradient reduction)
    group = engine.seq_data_parallel_group
    if dist.get_world_size(group) == 1:
        return None
    return lambda packed_LW: dist.all_reduce(packed_LW, group=group)


def _innermost_torch_optimizer(optimizer) -> Optional[torch.optim.Optimizer]:
    """The torch optimizer inside DeepSpeed's wrappers (FP16/BF16, ZeRO), or None."""
    seen = 0
    while optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer) and seen < 8:
        optimizer, seen = getattr(optimizer, "optimizer", None), seen + 1
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


class _StepHook:
    """Runs `balancer.step()` once per optimizer step of `engine` (see the module doc), and drops the
    routes of a step DeepSpeed skipped (its optimizer never stepped) before the next one counts."""

    def __init__(self, engine, balancer: Balancer):
        self.engine, self.balancer = engine, balancer
        self.last_step: Optional[int] = None
        self.last_skipped = 0
        self.warned_missed = False
        self.open_step: Optional[int] = None    # global_steps of the forwards tallied since the last step
        self.discarded_steps = 0
        self.handle = None
        engine.module.register_forward_pre_hook(self.before_forward)
        optimizer = _innermost_torch_optimizer(getattr(engine, "optimizer", None))
        if optimizer is None:
            warnings.warn("easybalance: the engine has no torch optimizer to hook; call engine.easybalance.step() "
                          "on every rank after each optimizer step yourself")
        else:
            self.handle = optimizer.register_step_post_hook(self)

    def __call__(self, optimizer, args, kwargs) -> None:
        step = int(self.engine.global_steps)       # DeepSpeed increments it after the optimizer step
        if step == self.last_step:                  # ZeRO steps the optimizer once per parameter group
            return
        skipped = int(getattr(self.engine, "skipped_steps", 0))
        accounted = max(skipped - self.last_skipped, self.discarded_steps)   # skipped steps, routes dropped
        missed = 0 if self.last_step is None else step - self.last_step - 1 - accounted
        if missed > 0 and not self.warned_missed:  # a DeepSpeed path that stepped another optimizer
            self.warned_missed = True
            warnings.warn(f"easybalance: {missed} optimizer step(s) before step {step} did not reach the step hook "
                          "(an optimizer DeepSpeed steps outside the hooked one?); their routes count with this step")
        self.last_step, self.last_skipped, self.discarded_steps = step, skipped, 0
        self.balancer.samples = int(self.engine.global_samples) + int(self.engine.train_batch_size())
        self.balancer.step()
        self.open_step = None

    def before_forward(self, module, args) -> None:
        """A training forward after a boundary that never reached the optimizer (DeepSpeed skipped the
        step: fp16 overflow, an inf gradient under torch_autocast's scaler): that step's routes go."""
        if not module.training:
            return
        step = int(self.engine.global_steps)
        if self.open_step is not None and step != self.open_step:
            self.balancer.discard_tally()
            self.discarded_steps += step - self.open_step
        self.open_step = step

    def reset(self) -> None:
        """After a checkpoint load `global_steps` may repeat a value already seen, and routes tallied
        before the load belong to the history it replaced."""
        self.last_step, self.open_step = None, None
        self.balancer.discard_tally()


def _wrap_checkpointing(engine, balancer: Balancer, hook: _StepHook) -> None:
    """Save the balancer state in DeepSpeed's client_state; restore it on load.

    Stored in client_state rather than in module buffers so that model state dicts stay exactly
    DeepSpeed's (checkpoints load both ways between plain DeepSpeed and eb_deepspeed). Before DeepSpeed
    loads anything, the saved balancer state is read and checked against this model: one that does
    not fit (another EP size, expert or layer count) stops the load with the model untouched, or,
    with `easybalance.checkpoint: "ignore_mismatch"`, is dropped with a warning after the model loads.
    """
    original_save, original_load = engine.save_checkpoint, engine.load_checkpoint
    save_sig, load_sig = inspect.signature(original_save), inspect.signature(original_load)
    mode = balancer.config.checkpoint

    def save_checkpoint(*args, **kwargs):
        bound = save_sig.bind(*args, **kwargs)
        client_state = dict(bound.arguments.get("client_state") or {})
        client_state[STATE_KEY] = balancer.state_dict()
        bound.arguments["client_state"] = client_state
        return original_save(*bound.args, **bound.kwargs)

    def load_checkpoint(*args, **kwargs):
        bound = load_sig.bind(*args, **kwargs)
        path, state = _saved_state(engine, bound.arguments["load_dir"], bound.arguments.get("tag"))
        problem = None if state is None else balancer.state_problem(state)
        if problem is not None and mode == "strict":
            raise ValueError(f"easybalance: {path}: {problem}. Nothing was loaded. To load the model and drop this "
                             'balancer state, set "easybalance": {"checkpoint": "ignore_mismatch"}')
        load_path, client_state = original_load(*args, **kwargs)
        if load_path is None or client_state is None:
            return load_path, client_state
        hook.reset()
        state = client_state.pop(STATE_KEY, None)
        problem = None if state is None else balancer.state_problem(state)
        if state is None:
            warnings.warn(f"easybalance: checkpoint {load_path} holds no balancer state; the load view starts cold")
        elif problem is not None and mode == "ignore_mismatch":
            warnings.warn(f"easybalance: {load_path}: {problem}; easybalance.checkpoint is \"ignore_mismatch\": the "
                          "model was loaded, the balancer keeps its own state")
        elif problem is not None:      # the file could not be read ahead (an unusual layout): DeepSpeed loaded it
            raise ValueError(f"easybalance: {load_path}: {problem}. The model was loaded, the balancer state was not; "
                             'set "easybalance": {"checkpoint": "ignore_mismatch"} to go on without it')
        elif not balancer.load_state_dict(state):
            warnings.warn(f"easybalance: checkpoint {load_path} holds balancer state of an older format "
                          f"({state.get('version')}); the load view starts cold")
        return load_path, client_state

    engine.save_checkpoint = save_checkpoint
    engine.load_checkpoint = load_checkpoint


def _saved_state(engine, load_dir: str, tag: Optional[str]) -> tuple[Optional[str], Any]:
    """(file, balancer state) of the checkpoint DeepSpeed is about to load, read without loading it
    (memory-mapped, weights only); (None, None) when the file cannot be found or read ahead."""
    if tag is None:
        latest = os.path.join(load_dir, "latest_universal" if _universal(engine) else "latest")
        if not os.path.isfile(latest):
            return None, None
        with open(latest) as f:
            tag = f.read().strip()
    try:
        path = engine._get_ckpt_name(load_dir, tag)
    except (AttributeError, TypeError, RuntimeError):     # a DeepSpeed without it, or no process group yet
        return None, None
    if not os.path.isfile(path):
        return None, None
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (OSError, RuntimeError, ValueError, pickle.UnpicklingError):   # DeepSpeed will say what is wrong
        return None, None
    return path, saved.get(STATE_KEY) if isinstance(saved, dict) else None


def _universal(engine) -> bool:
    check = getattr(engine, "load_universal_checkpoint", None)
    return bool(check()) if callable(check) else False


def _make_logger(cfg: EasyBalanceConfig, engine) -> BalanceLogger:
    if _dist_ready() and dist.get_rank() != 0:
        return NullLogger()
    loggers: list[BalanceLogger] = [JsonlLogger(cfg.log.dir, cfg.log.max_mb)]
    monitor = getattr(engine, "monitor", None)
    if cfg.log.wandb and monitor is not None and getattr(monitor, "enabled", False):
        loggers.append(DeepSpeedMonitorLogger(monitor))
    return MultiLogger(loggers)


def attach(engine, config: EasyBalanceConfig, gates: list[CrossLayerGate]) -> Balancer:
    """Build the balancer for an initialized engine whose MoE gates are `gates`, and hook it in."""
    from deepspeed.accelerator import get_accelerator
    layout = _layout(engine, config, gates)
    copies = layout["copy_devices"]
    if copies is not None:          # EP groups of different sizes: each gate tallies the view device of its routes
        for gate, device_E in zip(gates, copies):
            gate.tally_devices(max(layout["devices"]), device_E)
    balancer = Balancer(config, gates, layout["devices"], reduce=_reduce_fn(engine), layers=layout["layers"],
                        num_layers=layout["num_layers"], num_experts=layout["experts"],
                        rank_to_node=layout["rank_to_node"], device_tally=copies is not None,
                        tally_device=get_accelerator().current_device_name())
    balancer.logger = _make_logger(config, engine)
    for gate, layer in zip(gates, layout["layers"]):
        gate.layer_index = layer                  # the model's layer, not the pipeline stage's
    hook = _StepHook(engine, balancer)
    _wrap_checkpointing(engine, balancer, hook)
    engine.easybalance = balancer
    return balancer


def initialize(args=None, model: Optional[torch.nn.Module] = None, *, config=None, config_params=None,
               **kwargs):
    """`deepspeed.initialize`, plus the `easybalance` block of the same config.

    Takes every argument `deepspeed.initialize` takes and returns the same 4-tuple
    `(engine, optimizer, dataloader, lr_scheduler)`. With no block, or `"enabled": false`, this
    is plain `deepspeed.initialize` (the block is only removed from a copy of the config).
    Otherwise each `MoE` layer's gate becomes a `CrossLayerGate`, and `engine.easybalance`
    holds the balancer (view, metrics, checkpoint state), stepped once per optimizer step.
    """
    import deepspeed
    from deepspeed.pipe import PipelineModule

    if config is None and config_params is not None:
        config = config_params
    if config is None and args is not None and getattr(args, "deepspeed_config", None) is not None:
        config = args.deepspeed_config
        args = copy.copy(args)
        args.deepspeed_config = None  # handed over as `config` below; DeepSpeed refuses both
    eb_config = EasyBalanceConfig.from_ds_config(config)
    ds_config = strip_block(config)

    if not eb_config.enabled:
        return deepspeed.initialize(args=args, model=model, config=ds_config, **kwargs)
    if model is None:
        raise ValueError("eb_deepspeed.initialize needs `model` when easybalance is enabled")
    where = f'mode "{eb_config.mode}"' + (f', aux.policy "{eb_config.aux.policy}"' if eb_config.mode == "balance" else "")
    for path in eb_config.ignored_options("train"):
        warnings.warn(f"{path} has no effect in training ({where})")

    check_shapes(model)                     # before anything changes: the model and DeepSpeed untouched
    gates = swap_gates(model)
    if not gates and not isinstance(model, PipelineModule):   # a pipeline stage may hold none; checked across ranks
        raise ValueError("easybalance is enabled but the model has no deepspeed.moe.layer.MoE layers")
    out = deepspeed.initialize(args=args, model=model, config=ds_config, **kwargs)
    attach(out[0], eb_config, gates)
    return out
