"""The Megatron-Core training adapter: router swap, the per-step hook, start-up agreement, state file.

Shape legend: L MoE layers, E experts per layer, G EP ranks, W packed tally width.

    from eb_deepspeed.adapters.megatron import attach, save_state, load_state
    balancer = attach(model, "ds_config.json", optimizer=optimizer)   # or a dict, or {"easybalance": {...}}
    ...train: forward, backward, finalize_model_grads, optimizer.step()   # the hook runs balancer.step()
    save_state(balancer, "ckpt/easybalance.pt"); load_state(balancer, "ckpt/easybalance.pt")

The loop is `core.Balancer`; this file connects it to Megatron-Core:

* every router is an `EBRouter`, in module order: the layer index. Build the model with
  `eb_router_spec(spec)` (Megatron's spec door); a plain `TopKRouter` of an already-built model is converted
  in place (its class becomes the subclass `EBRouter`, which adds no parameter or buffer: the optimizer's
  parameters, DDP's hooks and the state-dict keys stay the same objects);
* the **reduce** is one all-reduce per step of the stacked [L, W] tally over Megatron's tensor x data x
  context-parallel group, where Megatron reduces its own expert-bias counts (the expert-parallel ranks are
  inside it, so no second reduce);
* the **step hook** is a step post-hook on the torch optimizer inside Megatron's (`optimizer.optimizer`, the
  first of a `ChainedOptimizer`), after `finalize_model_grads`, once per global batch. A step Megatron skips
  (inf gradients) never steps it: call `balancer.discard_tally()` then. Without an optimizer, call
  `balancer.step()` after each optimizer step on every rank;
* one all-gather at start-up checks that every rank agrees on the config and the MoE shape.
Pipeline parallelism is not handled yet (a clear error): the view would need every stage's layers."""
from __future__ import annotations

import os
import pickle
from typing import Any, Optional

import torch
import torch.distributed as dist

from ...core.balancer import Balancer, ModelShape
from ...core.config import KEYS, EasyBalanceConfig, read_json
from ...core.policies import POLICIES
from .. import common
from ..common import join_startup_off, reduce_over, torch_optimizer, write_atomically
from .router import EBRouter

__all__ = ["attach", "save_state", "load_state"]


def find_routers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Every Megatron `TopKRouter` in `model` (the model, or a list of model chunks), in module order."""
    from megatron.core.transformer.moe.router import TopKRouter
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [(name, m) for chunk in chunks for name, m in chunk.named_modules() if isinstance(m, TopKRouter)]


def _config(config: Any) -> EasyBalanceConfig:
    """The block from a ds_config (dict or JSON path) holding "easybalance", or from the block itself
    (a dict or a standalone JSON file whose keys are the block's). A ds_config without the block is off."""
    if isinstance(config, (str, os.PathLike)):
        config = read_json(config)
    if isinstance(config, dict) and "easybalance" not in config and config:
        block_keys = {path.split(".")[0] for path in KEYS}
        if set(config) <= block_keys:
            return EasyBalanceConfig.from_block(config)
    return EasyBalanceConfig.from_ds_config(config)


def attach(model, config: Any, *, optimizer=None) -> Optional[Balancer]:
    """Turn the model's routers into EBRouters and build their balancer (None when the block is off).

    Checks everything (config, pipeline layout, Megatron's own expert bias, agreement across ranks)
    before any router changes. Sets `model.easybalance` (each chunk's, for a list of chunks)."""
    from megatron.core import parallel_state as ps
    cfg = _config(config)
    if not cfg.enabled:
        join_startup_off()              # a rank whose block is on waits for this rank in the start-up all-gather
        return None
    if cfg.train_placement.enabled:
        raise ValueError("easybalance.train_placement re-places the experts of DeepSpeed AutoEP layers; on "
                         "Megatron-Core set train_placement.enabled false. Nothing was changed")
    routers = [r for _, r in find_routers(model)]
    if not routers:
        raise ValueError("easybalance is enabled but the model has no Megatron-Core TopKRouter")
    if ps.get_pipeline_model_parallel_world_size() > 1:
        raise NotImplementedError("easybalance's Megatron adapter does not handle pipeline parallelism yet: the "
                                  "cross-layer view needs every stage's layers (use pipeline size 1)")
    if cfg.balance and POLICIES[cfg.aux.policy].uses_bias and \
            any(getattr(r, "expert_bias", None) is not None for r in routers):
        raise ValueError(f"easybalance.aux.policy {cfg.aux.policy!r} owns the selection bias: turn Megatron's "
                         "moe_router_enable_expert_bias off (two biases would fight)")
    inner = torch_optimizer(optimizer)
    if optimizer is not None and inner is None:
        raise ValueError(f"no torch optimizer inside {type(optimizer).__name__} to hook; pass optimizer=None and "
                         "call balancer.step() after each optimizer step")
    G = ps.get_expert_model_parallel_world_size()
    experts = sorted({int(r.config.num_moe_experts) for r in routers})

    def shape_of(gathered) -> ModelShape:
        if len(experts) > 1:
            raise ValueError(f"every MoE layer must have the same num_moe_experts for the cross-layer view, "
                             f"got {experts}")
        for router in routers:
            if not isinstance(router, EBRouter):
                router.__class__ = EBRouter
            router.eb_init()
        return ModelShape.uniform(len(routers), experts[0], G)

    def hook(balancer: Balancer) -> None:
        if inner is not None:
            inner.register_step_post_hook(lambda *_: balancer.step())

    device = routers[0].weight.device
    group = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
    return common.attach(cfg, routers, {"layers": len(routers), "devices": G, "experts": experts}, shape_of=shape_of,
                         reduce=reduce_over(group), device=device if device.type != "meta" else "cpu", hook=hook,
                         owners=list(model) if isinstance(model, (list, tuple)) else [model])


def save_state(balancer: Balancer, path: str) -> None:
    """Write the balancer state (view + controls) to `path` on rank 0 (every rank holds the same), atomically:
    a kill while it is written leaves the previous state file whole."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_atomically(path, balancer.state_dict())
    if dist.is_initialized():
        dist.barrier()


def load_state(balancer: Balancer, path: str) -> bool:
    """Restore a state written by `save_state` (read with weights_only=True); all-or-nothing."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise ValueError(f"{path}: not a readable balancer state (a torn or foreign file: "
                         f"{type(e).__name__}: {str(e)[:200]}); nothing was loaded") from e
    return balancer.load_state_dict(state)
