"""The AutoEP training adapter: HF MoE models (Mixtral, Qwen2/3-MoE, Qwen3.5-MoE, DeepSeek-V2/V3) converted by
DeepSpeed's AutoEP (`"expert_parallel": {"enabled": true, ...}`) balanced by the same loop as DeepSpeed-MoE.

Shape legend: L MoE layers, E experts per layer, G EP ranks.

    engine, optimizer, _, _ = eb_deepspeed.initialize(model=hf_model, optimizer=..., config=ds_config)
    out = engine(input_ids=x, attention_mask=m, labels=y)    # unchanged: the balance loss rides on the routes
    engine.backward(out.loss); engine.step()                 # the step hook updates the view once per step

`eb_deepspeed.initialize` sends a config with an enabled `expert_parallel` section here. Everything is
checked before DeepSpeed touches the model (`check_versions`: the transformers/DeepSpeed pair);
`deepspeed.initialize` then converts the model, and `attach` finds
every `AutoEPMoELayer`, hooks an `AutoEPBalance` on each, and runs `core.Balancer` exactly as the DeepSpeed-MoE
adapter does (its step hook, reduce and checkpoint wrapping): one all-reduce per optimizer step."""
from __future__ import annotations

import re
import warnings
from typing import Any, Optional

import torch

from ...core.balancer import Balancer, ModelShape
from ...core.config import EasyBalanceConfig
from ...core.policies import POLICIES
from .. import common
from ..deepspeed.hooks import StepHook, reduce_for, wrap_checkpointing
from .layer import AutoEPBalance, find_autoep_layers
from .placement import TrainPlacement

__all__ = ["attach", "find_autoep_layers"]

# DeepSpeed's AutoEP breaks inside deepspeed.initialize with these transformers releases
# (`_CanRecordRegistry.get()` takes 2 positional arguments but 3 were given): (deepspeed up to, transformers from).
BROKEN_TRANSFORMERS = (("0.19.8", "5.23"), )


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def autoep_enabled(ds_config: Optional[dict]) -> bool:
    """The ds_config asks DeepSpeed for AutoEP (`expert_parallel.enabled` true)."""
    section = (ds_config or {}).get("expert_parallel")
    return isinstance(section, dict) and section.get("enabled") is True


def check_versions(deepspeed_version: Optional[str] = None, transformers_version: Optional[str] = None) -> None:
    """Refuse a DeepSpeed / transformers pair whose AutoEP is known to break, naming both versions."""
    if deepspeed_version is None:
        import deepspeed
        deepspeed_version = deepspeed.__version__
    if transformers_version is None:
        try:
            import transformers
        except ImportError:
            raise ImportError("AutoEP converts Hugging Face models: install transformers "
                              "(pip install -e .[hf] pins a release that works with DeepSpeed 0.19.8)") from None
        transformers_version = transformers.__version__
    for ds_upto, tf_from in BROKEN_TRANSFORMERS:
        if _version(deepspeed_version) <= _version(ds_upto) and _version(transformers_version) >= _version(tf_from):
            raise ImportError(f"DeepSpeed {deepspeed_version}'s AutoEP fails inside deepspeed.initialize with transformers "
                              f"{transformers_version} (>= {tf_from}: `_CanRecordRegistry.get()` takes 2 positional "
                              "arguments). Install transformers 5.22.2 (pip install 'transformers==5.22.2', or "
                              "pip install -e .[hf]) or a DeepSpeed release that supports your transformers")


def expert_to_device(layer) -> torch.Tensor:
    """[E] EP rank (within the layer's group) holding each expert, from the layer's placement descriptor."""
    descriptor = layer.expert_placement_descriptor
    E = int(descriptor["num_experts"])
    device_E = torch.full((E, ), -1, dtype=torch.long)
    for entry in descriptor["ranks"]:
        for expert in entry["experts"]:
            if device_E[expert] != -1:
                raise ValueError(f"AutoEP placement {descriptor}: expert {expert} on two ranks; the load view "
                                 "needs one home per expert")
            device_E[expert] = int(entry["rank"])
    if bool((device_E < 0).any()):
        raise ValueError(f"AutoEP placement {descriptor}: experts {(device_E < 0).nonzero().flatten().tolist()} "
                         "have no rank")
    return device_E


def _loss_scale(engine) -> float:
    """1 / gradient accumulation steps, times the fp16 loss scale: what engine.backward applies to the loss."""
    scale = 1.0 / engine.gradient_accumulation_steps()
    if engine.fp16_enabled():
        current = getattr(engine, "_get_optimizer_loss_scale", lambda: None)()
        scale *= float(current) if current is not None else 1.0
    return scale


def _warn_hf_aux_loss(model: torch.nn.Module, config: EasyBalanceConfig) -> None:
    hf = getattr(model, "config", None)
    coef = getattr(hf, "router_aux_loss_coef", 0.0) or 0.0
    if config.balance and getattr(hf, "output_router_logits", False) and coef > 0:
        warnings.warn(f"easybalance: the model's own load-balancing loss is on too (config.output_router_logits true, "
                      f"router_aux_loss_coef {coef}): balance is then pushed twice; set output_router_logits false "
                      "(or router_aux_loss_coef 0) to leave it to easybalance")


def attach(engine, config: EasyBalanceConfig) -> Balancer:
    """Build the balancer for an engine whose model AutoEP converted, and hook it in (`engine.easybalance`)."""
    from deepspeed.accelerator import get_accelerator
    named = find_autoep_layers(engine.module)
    layers = [m for _, m in named]
    shapes = [(int(m.num_experts), int(m.ep_size), int(m.top_k), m.router.score_func) for m in layers]
    maps = [expert_to_device(m).tolist() for m in layers]

    def shape_of(gathered) -> ModelShape:
        if not layers:
            raise ValueError("easybalance is enabled but DeepSpeed's AutoEP converted no MoE layer of the model "
                             "(expert_parallel.preset_model, moe_layer_pattern?)")
        if len({s[:2] for s in shapes}) > 1:
            raise ValueError("easybalance: AutoEP layers of different shapes (num_experts, ep_size): "
                             + ", ".join(f"{n}: {s[:2]}" for (n, _), s in zip(named, shapes)))
        return ModelShape.uniform(len(layers), shapes[0][0], shapes[0][1], expert_to_device_LE=torch.tensor(maps))

    balance = config.balance
    if balance and any(getattr(m, "expert_bias", None) is not None for m in layers) and \
            POLICIES[config.aux.policy].uses_bias:
        raise ValueError(f"easybalance.aux.policy {config.aux.policy!r} owns the selection bias, but AutoEP's layers "
                         "already carry their own expert_bias (load_balance_coeff): two biases would fight")
    _warn_hf_aux_loss(engine.module, config)
    placing = config.train_placement.enabled and bool(layers) and int(layers[0].ep_size) > 1
    ranks = int(layers[0].ep_size) if placing and config.train_placement.replica_slots else 0   # routes off their homes
    gates = [AutoEPBalance(m, index, loss_coeff=config.aux.loss_coeff, grad_scale=lambda: _loss_scale(engine),
                           balance=balance, num_devices=ranks) for index, m in enumerate(layers)]
    if config.train_placement.enabled and not placing:
        warnings.warn("easybalance.train_placement: the AutoEP layers have one EP rank (autoep_size 1): nothing to "
                      "re-place")

    def hook(balancer: Balancer) -> None:
        engine.module.register_forward_pre_hook(_padding_hook(gates), with_kwargs=True)
        wrap_checkpointing(engine, balancer, StepHook(engine, balancer))
        if placing:
            balancer.placement = TrainPlacement(engine, layers, gates, balancer, config.train_placement.interval,
                                                config.inference.topology, config.train_placement.replica_slots)

    return common.attach(config, gates, {"shapes": shapes, "maps": maps}, shape_of=shape_of,
                         reduce=reduce_for(engine), device=get_accelerator().current_device_name(), hook=hook,
                         owners=[engine, engine.module], monitor=getattr(engine, "monitor", None))


def _padding_hook(gates: list[AutoEPBalance]):
    """A forward pre-hook on the HF model: its `attention_mask` [B, S] (1 = a real token) tells every layer
    which tokens are padding, so that their routes stay out of the tally and the balance loss."""
    def hook(module, args, kwargs: dict[str, Any]):
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        valid_T = None
        if module.training and isinstance(mask, torch.Tensor) and mask.dim() == 2:
            valid_T = mask.reshape(-1) != 0       # kept on the device: no host sync to ask whether any is padding
        for gate in gates:
            gate.valid_T = valid_T
    return hook
