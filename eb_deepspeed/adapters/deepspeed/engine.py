"""The DeepSpeed training adapter: gate swap, the per-step hook, checkpoint state, start-up agreement.

Shape legend: L MoE layers (the whole model's), E experts per layer, G EP ranks, W packed tally width.

    engine, optimizer, _, _ = eb_deepspeed.initialize(model=model, model_parameters=params,
                                                      config="ds_config.json")
    engine.easybalance               # the core Balancer: .view, .metrics()

The loop is `core.Balancer`; this file swaps the gates (`CrossLayerGate`) and runs the start-up all-gather (every
rank agrees on model and config, learns the pipeline layout and node map); the step hook, reduce and checkpoint
state are `hooks.py`. World size 1: no communication."""
from __future__ import annotations

import copy
import functools
import inspect
import os
import warnings
from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist

from ...core.balancer import Balancer, ModelShape
from ...core.config import EasyBalanceConfig, read_json, strip_block
from .. import common
from ..common import dist_ready, join_startup_off
from .gate import CrossLayerGate
from .hooks import StepHook, is_pipeline, reduce_for, wrap_checkpointing

__all__ = ["initialize", "patch_deepspeed", "swap_gates", "find_moe_layers", "attach"]


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


def check_world_size(model: torch.nn.Module) -> None:
    """Refuse, before DeepSpeed builds its expert-parallel groups (which assert `world % ep_size == 0` on every
    rank), MoE layers whose ep_size does not divide the job's world size (the process group's, else the
    launcher's WORLD_SIZE; unknown: no check)."""
    world = dist.get_world_size() if dist_ready() else int(os.environ.get("WORLD_SIZE", "0") or 0)
    bad = [(name, int(m.ep_size)) for name, m in find_moe_layers(model) if world and world % int(m.ep_size)]
    if bad:
        fits = [d for d in range(1, world + 1) if world % d == 0]
        layers = ", ".join(f"{name}: ep_size {e}" for name, e in bad[:4]) + (" ..." if len(bad) > 4 else "")
        raise ValueError(f"MoE ep_size must divide the world size ({world} ranks): {layers}. With {world} ranks "
                         f"ep_size can be one of {fits}; or launch a multiple of the ep_size ranks. Nothing was "
                         "changed")


def swap_gates(model: torch.nn.Module) -> list[CrossLayerGate]:
    """Replace each MoE layer's TopKGate by a CrossLayerGate sharing its `wg` parameter.

    Call before `deepspeed.initialize` (DeepSpeed then hands the gates their EP group).
    Parameter names, values and objects are unchanged, so optimizers and checkpoints see the
    same model, and no random number is drawn. Already-swapped gates are kept."""
    gates = []
    for index, (_, moe) in enumerate(find_moe_layers(model)):
        gate = moe.deepspeed_moe.gate
        if not isinstance(gate, CrossLayerGate):
            gate = CrossLayerGate.from_topk_gate(gate, layer_index=index)
            moe.deepspeed_moe.gate = gate
        gate.layer_index = index
        gates.append(gate)
    return gates


def _summary(engine, gates: list[CrossLayerGate]) -> dict[str, Any]:
    """This rank's MoE layers for the start-up all-gather: its pipeline stage, each gate's top-k and (experts,
    ep_size), and for layers whose EP group is smaller than the largest the view device each gate's experts sit
    on (`_copy_devices`)."""
    check_shapes(engine.module)               # `attach` called directly: the same refusal as `initialize`'s
    ep_of = {id(m.deepspeed_moe.gate): int(m.ep_size) for _, m in find_moe_layers(engine.module)}
    shapes = [(int(g.num_experts), ep_of.get(id(g), 1)) for g in gates]
    largest = max((e for _, e in shapes), default=0)          # 0: this rank holds no MoE layer
    copies = _copy_devices(gates, shapes, largest) if largest > 1 else None
    return {"stage": int(engine.stage_id) if is_pipeline(engine) else 0, "top_k": [g.k for g in gates],
            "shapes": shapes, "largest": largest, "nested": largest <= 1 or copies is not None,
            "copies": None if copies is None else [c.tolist() for c in copies]}


def _shape(gathered: list[dict[str, Any]], rank: int, gates: list[CrossLayerGate]) -> ModelShape:
    """The model's layers from every rank's summary: pipeline stages in order give the global indices. Every
    rank evaluates the same gathered data, so a disagreement raises the same error everywhere. For EP groups
    of different sizes each gate then tallies the view device of its routes."""
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
    if any(e != num_devices for _, e in model_shapes):   # every rank holding MoE layers needs its own copy of each
        bad = [r for r, g in enumerate(gathered) if g["largest"] and (g["largest"] != num_devices or not g["nested"])]
        if bad:
            raise ValueError(f"easybalance: on ranks {bad} a smaller MoE layer's EP group does not lie, in order, "
                             f"inside the rank's group of the largest ep_size ({num_devices}), or the rank holds no "
                             "layer of that size (a pipeline stage); the cross-layer view needs DeepSpeed's "
                             "contiguous expert-parallel groups and a layer of the largest ep_size on every rank")
        for gate, device_E in zip(gates, gathered[rank]["copies"] or []):
            gate.count_devices(num_devices, torch.tensor(device_E))
    mine = gathered[rank]
    return ModelShape([e for e, _ in model_shapes], [d for _, d in model_shapes],
                      local_layers=[offset[mine["stage"]] + i for i in range(len(gates))])


def _copy_devices(gates: list[CrossLayerGate], shapes: list[tuple[int, int]],
                  largest: int) -> Optional[list[torch.Tensor]]:
    """For each local gate, the view device [E_l] of each of its experts, as this rank's tokens reach them.

    The view spans the G ranks of the largest EP group; a layer with a smaller group (ep_size e) is one of
    G / e copies inside it, copy c holding group-local rank j on view device c * e + j. This rank's tokens
    go to its own copy. None when a group does not lie in order inside this rank's largest group (a layout
    other than DeepSpeed's contiguous one). largest: the largest ep_size among `gates` (> 1)."""
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


def attach(engine, config: EasyBalanceConfig, gates: list[CrossLayerGate]) -> Balancer:
    """Build the balancer for an initialized engine whose MoE gates are `gates`, and hook it in."""
    from deepspeed.accelerator import get_accelerator
    rank = dist.get_rank() if dist_ready() else 0

    def hook(balancer: Balancer) -> None:
        for gate, layer in zip(gates, balancer.layers):
            gate.layer_index = layer                  # the model's layer, not the pipeline stage's
        wrap_checkpointing(engine, balancer, StepHook(engine, balancer))

    return common.attach(config, gates, _summary(engine, gates), shape_of=lambda g: _shape(g, rank, gates),
                         reduce=reduce_for(engine), device=get_accelerator().current_device_name(), hook=hook,
                         owners=[engine, engine.module], monitor=getattr(engine, "monitor", None), agree_on_all=False)


def initialize(args=None, model: Optional[torch.nn.Module] = None, *, config=None, config_params=None,
               **kwargs):
    """`deepspeed.initialize`, plus the `easybalance` block of the same config.

    Takes every argument `deepspeed.initialize` takes and returns the same 4-tuple
    `(engine, optimizer, dataloader, lr_scheduler)`. With no block, or `"enabled": false`, this
    is plain `deepspeed.initialize` (the block is only removed from a copy of the config) plus one
    start-up all-gather in which every rank confirms its block is off too.
    Otherwise each `MoE` layer's gate becomes a `CrossLayerGate`, and `engine.easybalance`
    holds the balancer (view, metrics, checkpoint state), stepped once per optimizer step."""
    from deepspeed.pipe import PipelineModule

    deepspeed_initialize = _plain_initialize()
    if config is None and config_params is not None:
        config = config_params
    if config is None and args is not None and getattr(args, "deepspeed_config", None) is not None:
        config = args.deepspeed_config
        args = copy.copy(args)
        args.deepspeed_config = None  # handed over as `config` below; DeepSpeed refuses both
    eb_config = EasyBalanceConfig.from_ds_config(config)
    ds_config = strip_block(config)
    if model is not None:
        check_world_size(model)             # DeepSpeed's own check is a bare assertion on every rank

    if not eb_config.enabled:
        out = deepspeed_initialize(args=args, model=model, config=ds_config, **kwargs)
        join_startup_off()              # a rank whose block is on waits for this rank in the start-up all-gather
        return out
    if model is None:
        raise ValueError("eb_deepspeed.initialize needs `model` when easybalance is enabled")
    where = f'mode "{eb_config.mode}"' + (f', aux.policy "{eb_config.aux.policy}"' if eb_config.balance else "")
    for path in eb_config.ignored_options("train"):
        warnings.warn(f"{path} has no effect in training ({where})")

    from ..autoep.engine import autoep_enabled
    if autoep_enabled(ds_config):           # a Hugging Face model that DeepSpeed's AutoEP converts
        from .. import autoep
        autoep.check_versions()
        if find_moe_layers(model):
            raise ValueError("easybalance: the model has deepspeed.moe.layer.MoE layers and an enabled "
                             "expert_parallel (AutoEP) section; use one of the two. Nothing was changed")
        stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
        half = any((ds_config.get(k) or {}).get("enabled") for k in ("bf16", "bfloat16", "fp16"))
        if eb_config.train_placement.enabled and stage == 0 and half:
            raise ValueError("easybalance.train_placement at ZeRO 0 moves a torch optimizer's state; with bf16 or fp16 "
                             "DeepSpeed keeps fp32 master weights there that it cannot move: use ZeRO 1 or 2 for "
                             "bf16 or fp16 training. Nothing was changed")
        if eb_config.train_placement.enabled and stage == 3:
            raise ValueError("easybalance.train_placement supports ZeRO stages 0-2 (ZeRO 3 partitions each expert's "
                             "weights over ranks: moving them is not built); set zero_optimization.stage <= 2 or "
                             "train_placement.enabled false. Nothing was changed")
        out = deepspeed_initialize(args=args, model=model, config=ds_config, **kwargs)
        autoep.attach(out[0], eb_config)
        return out
    if eb_config.train_placement.enabled:
        raise ValueError("easybalance.train_placement re-places the experts of AutoEP layers (an enabled "
                         "expert_parallel section); deepspeed.moe.layer.MoE models keep DeepSpeed's layout: set "
                         "train_placement.enabled false. Nothing was changed")
    if "aux.loss_coeff" in eb_config.changed():
        warnings.warn("easybalance.aux.loss_coeff has no effect on deepspeed.moe.layer.MoE models (their l_aux "
                      "keeps your own coefficient); it weighs the loss easybalance attaches to AutoEP models")
    check_shapes(model)                     # before anything changes: the model and DeepSpeed untouched
    gates = swap_gates(model)
    if not gates and not isinstance(model, PipelineModule):   # a pipeline stage may hold none; checked across ranks
        raise ValueError("easybalance is enabled but the model has no deepspeed.moe.layer.MoE layers")
    out = deepspeed_initialize(args=args, model=model, config=ds_config, **kwargs)
    attach(out[0], eb_config, gates)
    return out


def _plain_initialize():
    """DeepSpeed's own `initialize` (under `patch_deepspeed`, the one it wrapped)."""
    import deepspeed
    return getattr(deepspeed.initialize, "__wrapped__", deepspeed.initialize)


def patch_deepspeed() -> None:
    """From now on every `deepspeed.initialize` in the process applies its config's `easybalance` block as
    `eb_deepspeed.initialize` does, whoever calls it (Hugging Face Trainer and TRL through Accelerate, Lightning, a
    script's own); a config without the block is DeepSpeed's call plus the start-up all-gather in which every rank
    confirms its block is off (a rank with a block would wait for it). With transformers installed, its
    Trainers (from then on) also log the balance curves and save placed experts in AutoEP's layout
    (`trainer.BalanceCallback`). Idempotent."""
    import deepspeed
    if getattr(deepspeed.initialize, "easybalance", False):
        return
    plain = deepspeed.initialize
    names = list(inspect.signature(plain).parameters)

    @functools.wraps(plain)
    def balanced_initialize(*args, **kwargs):
        given = dict(zip(names, args), **kwargs)
        config = next((given[k] for k in ("config", "config_params") if given.get(k) is not None),
                      getattr(given.get("args"), "deepspeed_config", None))
        try:
            config = read_json(config) if config is not None else None
        except ValueError:              # DeepSpeed reads it, and says what is wrong
            config = None
        return (initialize if isinstance(config, Mapping) else plain)(**given)
    balanced_initialize.easybalance = True
    deepspeed.initialize = balanced_initialize
    try:
        from transformers import trainer
    except ImportError:
        return
    from .trainer import BalanceCallback
    if BalanceCallback not in trainer.DEFAULT_CALLBACKS:
        trainer.DEFAULT_CALLBACKS.append(BalanceCallback)
