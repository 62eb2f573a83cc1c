"""Serving Hugging Face MoE models converted by DeepSpeed's AutoEP with replicas and per-batch steering.

Shape legend: L MoE layers, E logical experts, K top-k, T tokens, N routes (T x K), G EP ranks, S slots per rank,
P physical slots (G * S; slot p lives on EP rank p // S), R replicas of one expert, H home experts per rank (E / G).

    engine, _, _, _ = deepspeed.initialize(model=hf_model, config=ds_config)   # AutoEP converts the model
    model = eb_deepspeed.init_inference(engine, config=ds_config)             # the same call as DeepSpeed-MoE's
    logits = model(input_ids=ids).logits          # or model.generate(...): every EP rank together, as AutoEP needs
    model.serving.placement, model.serving.replans, model.easybalance.metrics()

AutoEP's layer is dropless: a layer takes as long as its busiest rank. A served layer is AutoEP's own, its grouped
experts (w1, w2, w3 [S, ...]) views of the first S rows of a [S_max = H + R, ...] store (the homes first, as AutoEP
placed them; S = H or S_max), its routes put on slots by `routes.AutoEPRoutes` (`split` "exact" or "view"). Every
route meets its expert's weights with its own gate value: the outputs are plain AutoEP's up to the rounding of GEMMs
over differently grouped rows. `AutoEPStore` is the serving engine's slot store of these layers."""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import torch.distributed as dist

from ...core.config import EasyBalanceConfig
from ...planning.placement import Placement
from ..common import dist_ready
from ..routing import Routing, SlotTable
from ..serving.engine import ServingEngine, agreed_load, flat_state, unflatten_into
from .layer import find_autoep_layers
from .routes import AutoEPRoutes

__all__ = ["init_autoep_inference"]


def has_autoep_layers(model: torch.nn.Module) -> bool:
    """The model (or a DeepSpeed engine's module) holds layers AutoEP converted."""
    try:
        return bool(find_autoep_layers(getattr(model, "module", model)))
    except ImportError:          # a DeepSpeed without AutoEP
        return False


class AutoEPStore:
    """The slot store (`adapters.serving.engine.SlotStore`) of a model's AutoEP layers.

    engine: the DeepSpeed engine whose checkpoint code reads and writes AutoEP's files (None: no checkpoints)."""

    padded = False          # dropless: a layer takes as long as its busiest rank

    def __init__(self, module: torch.nn.Module, engine=None):
        self.module, self.engine = module, engine
        layers = [m for _, m in find_autoep_layers(module)]
        if not layers:
            raise ValueError("init_inference: the model has no AutoEP layers (deepspeed.initialize with an enabled "
                             "expert_parallel section converts them)")
        shapes = {(int(m.num_experts), int(m.ep_size)) for m in layers}
        if len(shapes) > 1:
            raise ValueError(f"init_inference: serving needs every AutoEP layer to have the same num_experts and "
                             f"ep_size (one slot layout for all layers), got {sorted(shapes)}")
        for m in layers:
            folded = m.folding_group_handles is not None and m.folding_group_handles.spec.tp_size > 1
            if folded or getattr(m, "comm_backend", "comm") != "comm" or m.ep_group is None and m.ep_size > 1:
                raise ValueError("init_inference: easybalance serves AutoEP layers with DeepSpeed's all-to-all "
                                 "(expert_parallel.comm_backend \"comm\"), without tensor-parallel folding, after "
                                 "deepspeed.initialize handed them their EP group; set "
                                 '"easybalance": {"enabled": false} to serve this model as AutoEP does')
        self.moes = layers
        self.num_layers = len(layers)
        (self.num_experts, self.num_devices), = shapes
        self.H = self.num_experts // self.num_devices
        self.top_k = [int(m.top_k) for m in layers]
        self.ep_group = layers[0].ep_group
        self.device = next(module.parameters()).device
        self.gates: list[AutoEPRoutes] = []
        self._stores: list[dict[str, torch.Tensor]] = []     # per layer, the [S_max, ...] rows of each weight

    def replicate(self, slots: int, placement: Placement, routing: Routing) -> None:
        """S_max slots per rank: a [S_max, ...] store behind each grouped weight (the home experts in the first
        H rows, zeros after them), the parameters views of its first S rows; and the route map."""
        for layer, moe in enumerate(self.moes):
            store = {}
            for name, param in moe.experts.named_parameters(recurse=False):
                if param.shape[0] != self.H:
                    raise ValueError(f"AutoEP layer {layer}: expert weight {name} {tuple(param.shape)} has no leading "
                                     f"dimension of its {self.H} local experts")
                full = torch.zeros((slots, ) + tuple(param.shape[1:]), dtype=param.dtype, device=param.device)
                full[:self.H].copy_(param.detach())
                param.requires_grad_(False)
                store[name] = full
            self._stores.append(store)
            S = placement.slots_per_device
            self.gates.append(AutoEPRoutes(moe, layer, self.num_devices, S,
                                           table=SlotTable.even(placement.log2phy[layer]), routing=routing))
            self._point(layer, S)

    def _point(self, layer: int, S: int, weights: Optional[dict] = None) -> None:
        """The layer's expert parameters: `weights` ({name: [S, ...]}), by default the first S rows of its store."""
        moe = self.moes[layer]
        for name, param in moe.experts.named_parameters(recurse=False):
            param.data = self._stores[layer][name][:S] if weights is None else weights[name]
        moe.num_local_experts = moe.experts.num_experts = S
        # AutoEP adds every forward's routes per slot to this buffer (never reset, never saved): its shape follows
        moe.tokens_per_expert = torch.zeros(self.num_devices * S, dtype=torch.float32,
                                            device=moe.tokens_per_expert.device)

    def read_slot(self, layer: int, j: int) -> torch.Tensor:
        return flat_state(w[j] for w in self._stores[layer].values())

    def write_slot(self, layer: int, j: int, flat: torch.Tensor) -> None:
        unflatten_into([w[j] for w in self._stores[layer].values()], flat)

    def serve(self, layer: int, placement: Placement) -> None:
        self._point(layer, placement.slots_per_device)
        self.gates[layer].set_table(SlotTable.even(placement.log2phy[layer]), placement.slots_per_device)

    # ------------------------------------------------------------------ checkpoints (the engine's own files)
    def save_home(self, ckpt_dir: str, tag: str, homes: dict) -> str:
        """The DeepSpeed engine's checkpoint (AutoEP's layout: rank g's home experts g*H .. g*H+H-1): each layer's
        parameters point at its home experts while the engine saves, then at the serving slots again."""
        engine = self._engine("save_checkpoint")
        S = [m.num_local_experts for m in self.moes]
        self._point_home(homes)
        try:
            engine.save_checkpoint(ckpt_dir, tag=tag)
        finally:
            for layer, s in enumerate(S):
                self._point(layer, s)
        return os.path.join(ckpt_dir, str(tag))

    def load_home(self, ckpt_dir: str, tag: Optional[str]) -> str:
        """The engine loads the checkpoint (`load_module_only`) into fresh home-layout parameters, whose rows
        then go into the first H slots."""
        engine = self._engine("load_checkpoint")
        S = [m.num_local_experts for m in self.moes]
        # DeepSpeed copies tensor by tensor and may raise half way (a checkpoint of another shape): what it had
        # overwritten is put back from this copy (the experts live in the stores, which a load never touches)
        kept = {k: t.detach().to("cpu", copy=True) for k, t in self.module.state_dict().items()}
        self._point_home(None)
        try:
            with agreed_load():             # every rank loaded, or every rank puts back what it had
                path, _ = engine.load_checkpoint(ckpt_dir, tag=tag, load_module_only=True)
                if path is None:
                    raise FileNotFoundError(f"{ckpt_dir}: DeepSpeed found no checkpoint to load (tag {tag!r})")
        except BaseException:
            for layer, s in enumerate(S):
                self._point(layer, s)
            with torch.no_grad():
                for key, t in self.module.state_dict().items():
                    if key in kept and kept[key].shape == t.shape:
                        t.copy_(kept[key])
            raise
        with torch.no_grad():
            for layer, moe in enumerate(self.moes):
                for name, param in moe.experts.named_parameters(recurse=False):
                    self._stores[layer][name][:self.H].copy_(param.detach())
                self._point(layer, S[layer])
        return path

    def _engine(self, what: str):
        if self.engine is None:
            raise ValueError(f"serving.{what}: pass init_inference the DeepSpeed engine (deepspeed.initialize's), "
                             "not its module: its checkpoint code reads and writes AutoEP's files")
        return self.engine

    def _point_home(self, homes: Optional[dict]) -> None:
        """Every layer's expert parameters: fresh [H, ...] tensors in AutoEP's own layout, filled with this
        rank's home experts (`ServingEngine.home_states`) or left for a load to fill (None)."""
        rank = dist.get_rank(self.ep_group) if dist_ready() and self.num_devices > 1 else 0
        for layer, store in enumerate(self._stores):
            fresh = {name: torch.empty((self.H, ) + tuple(w.shape[1:]), dtype=w.dtype, device=w.device)
                     for name, w in store.items()}
            if homes is not None:
                for j in range(self.H):
                    unflatten_into([w[j] for w in fresh.values()], homes[(layer, rank * self.H + j)])
            self._point(layer, self.H, fresh)


def init_autoep_inference(model: torch.nn.Module, config=None) -> torch.nn.Module:
    """Serve an AutoEP-converted model (a DeepSpeed engine from `deepspeed.initialize`, or its module) with the
    `easybalance` block of `config`; returns the module in eval mode, with `module.serving` and, with an enabled block,
    `module.easybalance` (the Balancer). Every EP rank must call forward together (AutoEP's all-to-all): the module's
    `generate` passes HF's `synced_gpus=True` unless told otherwise, so a rank whose sequences end first keeps joining
    the forwards of the others (without it, ranks that generate different numbers of tokens wait for each other
    forever). The engine must not train afterwards: its expert parameters are views of the serving store."""
    eb_config = EasyBalanceConfig.from_ds_config(config)
    module = getattr(model, "module", model)
    if not dist_ready():
        raise RuntimeError("init_inference: AutoEP models are converted inside deepspeed.initialize, which starts "
                           "the process group; call it first")
    placer = next((vars(m)["eb_placement"] for _, m in find_autoep_layers(module) if "eb_placement" in vars(m)), None)
    if placer is not None and placer.R:
        raise ValueError(f"init_inference: this engine trains with easybalance.train_placement.replica_slots "
                         f"({placer.R}): its layers put training routes on replica slots, which serving would route a "
                         "second time. Serve an engine that loads its checkpoint (save_checkpoint writes AutoEP's own "
                         "layout), or train without replica slots. Nothing was changed")
    if placer is not None:           # a permutation: the experts home (every rank together), served as AutoEP's
        placer.move_or_raise(placer.home, "home to serve (nothing was done)")
    module.eval()
    engine = model if hasattr(model, "save_checkpoint") and hasattr(model, "load_checkpoint") else None
    ServingEngine(AutoEPStore(module, engine=engine), eb_config if eb_config.enabled else None).attach(module, module)
    if hasattr(module, "generate") and dist.get_world_size() > 1:
        generate = module.generate

        @functools.wraps(generate)
        def synced_generate(*args, **kwargs):
            kwargs.setdefault("synced_gpus", True)
            return generate(*args, **kwargs)
        module.generate = synced_generate
    return module
