"""Serving DeepSpeed-MoE models with the cross-layer view: `init_inference`, and the slot store of `MOELayer`.

Shape legend: L MoE layers, E logical experts, G EP ranks, S slots per rank, P physical slots (G * S;
slot p lives on EP rank p // S), H home experts per rank (E / G).

    engine = eb_deepspeed.init_inference(model, config="configs/infer_cpu_2rank.json")
    engine.serving.load_checkpoint("runs/main/ckpt")      # DeepSpeed's files
    logits, l_aux = engine(tokens)                         # after each forward: tally -> view (-> re-plan)
    engine.easybalance.metrics()                           # the core Balancer
    engine.serving.placement, engine.serving.replans       # where the replicas are (`adapters.serving.engine`)
    engine.serving.save_checkpoint("out", tag="served")    # DeepSpeed's layout, logical experts only

`deepspeed.init_inference` builds expert-parallel groups but never hands them to the MoE layers and leaves the
model in training mode; with unequal batches per rank that aborts the All-to-All. This adapter calls it, then hands
every layer its group, sets eval mode, and makes the EP ranks agree on one capacity (drop_tokens=True: DeepSpeed
never agrees; the `ReplicaGate` does, from the most tokens on any rank).

`MoEStore` is the serving engine's slot store of these layers: each layer's `Experts` holds S_max expert modules
per rank (the home experts first, replicas after them) and its gate is a `ReplicaGate`; DeepSpeed's `MOELayer`
then runs over P = G * S "experts" (its All-to-All untouched), padding every slot to the capacity."""
from __future__ import annotations

import copy
import os
import warnings
from typing import Optional

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from ...core.config import EasyBalanceConfig, strip_block
from ...planning.placement import Placement
from ..common import dist_rank, dist_ready
from ..routing import Routing, SlotTable
from ..serving.engine import ServingEngine, agreed_load, flat_state, unflatten_into
from .engine import check_world_size, find_moe_layers
from .hooks import incomplete_problem, latest_tag, mark_complete, mark_incomplete, on_rank0_for_all, refuse
from .replicas import ReplicaGate

__all__ = ["init_inference", "MoEStore", "load_moe_checkpoint"]

EXPERTS_PREFIX = ".deepspeed_moe.experts.deepspeed_experts."


class MoEStore:
    """The slot store (`adapters.serving.engine.SlotStore`) of a model's `deepspeed.moe.layer.MoE` layers."""

    padded = True       # DeepSpeed's MOELayer pads every slot to the capacity

    def __init__(self, module: torch.nn.Module):
        self.module = module
        named = find_moe_layers(module)
        check_one_serving_shape(module)
        self.names = [name for name, _ in named]
        self.moes = [m for _, m in named]
        self.num_layers = len(self.moes)
        self.num_experts, self.num_devices = self.moes[0].num_experts, self.moes[0].ep_size
        self.top_k = [m.deepspeed_moe.gate.k for m in self.moes]
        self.ep_group = self.moes[0].deepspeed_moe.ep_group
        self.device = torch.device(get_accelerator().current_device_name())   # collectives (NCCL takes no host tensors)
        self.gates: list[ReplicaGate] = []

    def expert_module(self, layer: int, j: int) -> torch.nn.Module:
        """This rank's j-th expert module of a layer (the module behind local slot j)."""
        return self.moes[layer].deepspeed_moe.experts.deepspeed_experts[j]

    def replicate(self, slots: int, placement: Placement, routing: Routing) -> None:
        H = self.num_experts // self.num_devices
        for layer, moe in enumerate(self.moes):
            experts = moe.deepspeed_moe.experts
            extra = [copy.deepcopy(experts.deepspeed_experts[0]) for _ in range(slots - H)]
            for slot in extra:
                for p in slot.parameters():
                    p.data.zero_()                      # an empty slot until a placement fills it
                    p.allreduce, p.group_name = False, moe.expert_group_name
            experts.deepspeed_experts.extend(extra)
            gate = ReplicaGate.from_gate(moe.deepspeed_moe.gate, self.num_devices, placement.slots_per_device,
                                         table=SlotTable.even(placement.log2phy[layer]), routing=routing)
            gate.layer_index = layer
            moe.deepspeed_moe.gate = gate
            self.gates.append(gate)

    def read_slot(self, layer: int, j: int) -> torch.Tensor:
        """The expert's whole state: parameters and persistent buffers, state_dict order."""
        return flat_state(self.expert_module(layer, j).state_dict().values())

    def write_slot(self, layer: int, j: int, flat: torch.Tensor) -> None:
        unflatten_into(self.expert_module(layer, j).state_dict().values(), flat)    # views of the module's tensors

    def serve(self, layer: int, placement: Placement) -> None:
        S, moe = placement.slots_per_device, self.moes[layer].deepspeed_moe
        moe.experts.num_local_experts = moe.num_local_experts = S
        self.gates[layer].set_table(SlotTable.even(placement.log2phy[layer]), S)

    def load_home(self, ckpt_dir: str, tag: Optional[str]) -> str:
        with agreed_load():                 # every rank read its experts' files, or none loads
            folder, state = _read_moe_checkpoint(self.module, ckpt_dir, tag)
        self.module.load_state_dict(state, strict=False)
        return folder

    def save_home(self, ckpt_dir: str, tag: str, homes: dict) -> str:
        """DeepSpeed's MoE checkpoint layout with the logical experts: every rank of the first EP group its home
        experts, global rank 0 the non-expert weights and `latest`. A DeepSpeed engine of the same model loads it
        with `load_checkpoint(dir, load_module_only=True)` or `load_optimizer_states=False,
        load_lr_scheduler_states=False` (its step count then starts at 0); a default `load_checkpoint` fails on the
        missing optimizer file (serving holds no optimizer or scheduler state). Collective."""
        folder = os.path.join(ckpt_dir, tag)
        # as the training save does: a kill never passes for a checkpoint (the all-gather is the barrier)
        on_rank0_for_all(lambda: mark_incomplete(folder), "marking the checkpoint incomplete")
        ep_ranks = dist.get_process_group_ranks(self.ep_group) if dist_ready() and self.num_devices > 1 \
            else [dist_rank()]
        if 0 in ep_ranks:                 # the first EP group writes (every EP group holds the same)
            for (layer, e), flat in homes.items():
                shapes = [(n, t.shape) for n, t in self.expert_module(layer, 0).state_dict().items()]
                parts = torch.split(flat, [s.numel() for _, s in shapes])
                torch.save({f"{self.names[layer]}{EXPERTS_PREFIX}{e}.{n}": part.view(shape).clone()
                            for (n, shape), part in zip(shapes, parts)},
                           os.path.join(folder, f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt"))
        if dist_rank() == 0:    # the keys a DeepSpeed engine reads with load_module_only=True (or without
            # optimizer and scheduler states): weights only, no optimizer, scheduler or step count is served
            module = {k: v.clone() for k, v in self.module.state_dict().items() if EXPERTS_PREFIX not in k}
            world = dist.get_world_size() if dist_ready() else 1
            torch.save({"module": module, "num_experts": [self.num_experts] * self.num_layers,
                        "dp_world_size": world, "mp_world_size": 1, "global_steps": 0, "global_samples": 0,
                        "skipped_steps": 0, "optimizer": None, "lr_scheduler": None},
                       os.path.join(folder, "mp_rank_00_model_states.pt"))
        if dist_ready():
            dist.barrier()                                      # every rank has written its files
        on_rank0_for_all(lambda: mark_complete(ckpt_dir, tag), "completing the checkpoint")
        return folder


def load_moe_checkpoint(module: torch.nn.Module, ckpt_dir: str, tag: Optional[str] = None) -> str:
    """Load DeepSpeed's MoE checkpoint layout into `module` on this rank: the non-expert weights from
    `mp_rank_00_model_states.pt`, and each local expert module j of MoE layer l from the file of the expert it holds,
    `layer_{l}_expert_{e}_mp_rank_00_model_states.pt` (read with weights_only=True): DeepSpeed's layout, expert
    EP-rank * local experts + j. Works for a plain DeepSpeed model whose layers have their EP groups."""
    folder, state = _read_moe_checkpoint(module, ckpt_dir, tag)
    module.load_state_dict(state, strict=False)
    return folder


def _read_moe_checkpoint(module: torch.nn.Module, ckpt_dir: str, tag: Optional[str]) -> tuple[str, dict]:
    """`load_moe_checkpoint`'s reading: the checkpoint's folder and the state to load, every shape checked."""
    if problem := incomplete_problem(ckpt_dir, tag):
        raise refuse(ckpt_dir, problem)
    tag = str(tag) if tag is not None else latest_tag(ckpt_dir)
    if tag is None:
        raise FileNotFoundError(f"{ckpt_dir}: no `latest` file; pass tag=")
    folder = os.path.join(ckpt_dir, tag)
    state = torch.load(os.path.join(folder, "mp_rank_00_model_states.pt"), map_location="cpu",
                       weights_only=True)["module"]
    empty = set()
    for layer, (name, moe) in enumerate(find_moe_layers(module)):
        prefix = f"{name}{EXPERTS_PREFIX}"
        ep_rank = dist.get_rank(moe.deepspeed_moe.ep_group) if dist_ready() and moe.ep_size > 1 else 0
        for j in range(len(moe.deepspeed_moe.experts.deepspeed_experts)):
            if j >= moe.num_local_experts:          # a replica slot: in no file
                empty.add(f"{prefix}{j}.")
                continue
            e = ep_rank * moe.num_local_experts + j
            expert = torch.load(os.path.join(folder, f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt"),
                                map_location="cpu", weights_only=True)
            for key, value in expert.items():
                state[key.replace(f"{prefix}{e}.", f"{prefix}{j}.")] = value
    wanted = module.state_dict()
    missing = sorted(k for k in wanted if k not in state and not any(k.startswith(p) for p in empty))
    unexpected = sorted(k for k in state if k not in wanted)
    # torch copies tensor by tensor and raises at the end: every shape is checked first, so a load is whole or none
    resized = sorted(k for k, v in state.items() if k in wanted and tuple(v.shape) != tuple(wanted[k].shape))
    if missing or unexpected or resized:
        raise ValueError(f"{folder}: checkpoint does not fit this model (missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}, of another size {resized[:4]}); nothing was loaded")
    return folder, state


def check_one_serving_shape(model: torch.nn.Module) -> None:
    """One slot layout serves all layers: refuse a model without MoE layers, or whose MoE layers differ in
    num_experts or ep_size (PR-MoE)."""
    moes = find_moe_layers(model)
    if not moes:
        raise ValueError("init_inference: the model has no deepspeed.moe.layer.MoE layers (an AutoEP-converted model "
                         "is served by eb_deepspeed.init_inference, in AutoEP's own layers)")
    if len({(m.num_experts, m.ep_size) for _, m in moes}) > 1:
        layers = ", ".join(f"{name}: {m.num_experts} experts, ep_size {m.ep_size}" for name, m in moes)
        raise ValueError(f"init_inference: serving needs every MoE layer to have the same num_experts and ep_size "
                         f"(one replica-slot layout for all layers), got {layers}. Nothing was changed; such a "
                         "model trains with eb_deepspeed.initialize, and serves with deepspeed.init_inference")


# Top-level ds_config sections of training that DeepSpeed's runtime reads beyond `deepspeed.runtime.constants`
TRAINING_SECTIONS = ("zero_optimization", "activation_checkpointing", "flops_profiler", "wandb", "tensorboard",
                     "csv_monitor", "comet", "expert_parallel", "aio", "compression_training", "data_efficiency",
                     "autotuning", "elasticity", "nebula", "curriculum_learning", "sparse_attention", "pipeline",
                     "hybrid_engine", "timers", "compile", "amp", "progressive_layer_drop", "eigenvalue",
                     "quantize_training")


def _inference_keys(ds_config: dict) -> dict:
    """The ds_config without the training settings DeepSpeed's inference config refuses
    (`train_micro_batch_size_per_gpu`, `optimizer`, `zero_optimization`, ...), named once in a warning: the
    config a user trains with (where the block lives) serves as it is. A key that is neither an inference
    nor a training setting stays, so DeepSpeed refuses it as it would (a misspelled key is never dropped)."""
    from deepspeed.inference.config import DeepSpeedInferenceConfig
    from deepspeed.runtime import constants
    fields = DeepSpeedInferenceConfig.model_fields
    accepted = set(fields) | {f.alias for f in fields.values() if f.alias}
    training = {v for k, v in vars(constants).items() if k.isupper() and isinstance(v, str)} | set(TRAINING_SECTIONS)
    if dropped := sorted(k for k in ds_config if k not in accepted and k in training):
        warnings.warn(f"init_inference: left out of DeepSpeed's inference config the training settings it does "
                      f"not take: {', '.join(dropped)}")
    return {k: v for k, v in ds_config.items() if k not in dropped}


def init_inference(model: torch.nn.Module, config=None, **kwargs):
    """`deepspeed.init_inference` for models built from `deepspeed.moe.layer.MoE`, made correct for expert
    parallelism, with the `easybalance` block of the same config.

    config: DeepSpeed's inference config (dict or JSON path) that may hold an `"easybalance"` block; the ds_config
    one trains with works too (its training-only keys are left out, with one warning); kwargs go to
    `deepspeed.init_inference` as they are, except that without a `dtype` the model keeps its own (DeepSpeed would
    cast to fp16). Returns DeepSpeed's `InferenceEngine` with `engine.serving` (placement, checkpoints) and, with an
    enabled block, `engine.easybalance` (the Balancer). Every EP rank must call forward together, as DeepSpeed's
    All-to-All requires. (`eb_deepspeed.init_inference` sends AutoEP-converted models elsewhere, the rest here.)"""
    import deepspeed

    eb_config = EasyBalanceConfig.from_ds_config(config)
    ds_config = _inference_keys(strip_block(config) or {})
    check_one_serving_shape(model)      # before DeepSpeed (and its process group) is touched
    check_world_size(model)
    if not dist_ready():
        deepspeed.init_distributed()
    if "dtype" not in ds_config and "dtype" not in kwargs:      # DeepSpeed would cast to fp16
        kwargs["dtype"] = next(model.parameters()).dtype
    engine = deepspeed.init_inference(model, config=ds_config, **kwargs)
    module = engine.module
    for _, moe in find_moe_layers(module):
        if moe.deepspeed_moe.ep_group is None:
            moe.set_deepspeed_parallelism()   # the groups deepspeed.init_inference never hands over
    module.eval()
    ServingEngine(MoEStore(module), eb_config if eb_config.enabled else None).attach(module, engine)
    return engine
