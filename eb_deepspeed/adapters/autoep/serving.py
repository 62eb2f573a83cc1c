"""Serving Hugging Face MoE models converted by DeepSpeed's AutoEP with replicas and per-batch steering.

Shape legend: L MoE layers, E logical experts, K top-k, T tokens, N routes (T x K), G EP ranks, S slots per rank,
P physical slots (G * S; slot p lives on EP rank p // S), R replicas of one expert, H home experts per rank (E / G).

    engine, _, _, _ = deepspeed.initialize(model=hf_model, config=ds_config)   # AutoEP converts the model
    model = eb_deepspeed.init_inference(engine, config=ds_config)             # the same call as DeepSpeed-MoE's
    logits = model(input_ids=ids).logits          # or model.generate(...): every EP rank together, as AutoEP needs
    model.serving.placement, model.serving.replans, model.easybalance.metrics()

AutoEP's layer is dropless: the all-to-all sends exactly the routes each rank owes each other rank, and the
grouped GEMMs run over exactly the routes a rank received, so a layer takes as long as its busiest rank. A
served layer is AutoEP's own `AutoEPMoELayer`, with two changes:

  * its grouped experts (`GroupedExperts`: w1, w2, w3 [S, ...]) hold S_max = H + R slots per rank, the home
    experts in the first H (as AutoEP placed them) and replicas after them; the parameters are views of the
    first S rows of a [S_max, ...] store, S = H (AutoEP's own layout) or S_max (replicas);
  * a forward hook on its router (`AutoEPRoutes`) keeps the router's logical top-k and gate values and puts
    each route on a physical slot: an expert's routes on this rank split over its replicas by the plan's
    table (`split="view"`, no collective) or by steering this batch's counts of every rank (`split="exact"`,
    one all-gather of [E] counts per layer). The layer's `num_local_experts` is S, so its all-to-all splits
    (`counts.view(ep_size, num_local_experts)`), grouped GEMMs and combine run over the P slots unchanged.

Every route meets its expert's weights with its own gate value, so the outputs are those of plain AutoEP up to
the rounding of GEMMs over differently grouped rows. The tally is of logical experts, with the EP rank each
route went to as the device columns. Re-planning, the two-phase weight moves and the layout trial are
`adapters.deepspeed.serving.Serving`'s; this subclass supplies the layer's storage and tables and the
planner's dropless model (`expected_device_load`: the busiest rank's routes).
"""
from __future__ import annotations

import os
import warnings
from typing import Optional

import torch

from ...core.config import EasyBalanceConfig
from ...core.tally import TallyRecorder, logit_sums
from ...planning.placement import Placement, expected_device_load, plan_placement, with_prefix
from ..common import dist_ready
from ..deepspeed.replicas import SlotTable, _split_by_fraction, steered_split
from ..deepspeed.serving import Serving
from .engine import find_autoep_layers

__all__ = ["AutoEPRoutes", "AutoEPServing", "init_autoep_inference", "has_autoep_layers"]


def has_autoep_layers(model: torch.nn.Module) -> bool:
    """The model (or a DeepSpeed engine's module) holds layers AutoEP converted."""
    try:
        return bool(find_autoep_layers(getattr(model, "module", model)))
    except ImportError:          # a DeepSpeed without AutoEP
        return False


class AutoEPRoutes:
    """One served AutoEP layer's route -> slot map and tally (the `core.balancer.BalancedGate` protocol).

    layer: the `AutoEPMoELayer`; G EP ranks; table/S: the placement serving now (`set_table`); rank: this
    rank's place in the EP group; split: "view" or "exact"; node_G: [G] node of each EP rank; steer_options:
    `planning.steer`'s cost weights, topology and decision batch.
    """

    recording = True      # serving tallies every forward; set False to serve without the view

    def __init__(self, layer: torch.nn.Module, layer_index: int, G: int, S: int, *, rank: int, table: SlotTable,
                 split: str, node_G: torch.Tensor, steer_options: dict):
        self.layer, self.layer_index = layer, layer_index
        self.num_experts, self.k = int(layer.num_experts), int(layer.top_k)
        self.G, self.rank, self.split = int(G), int(rank), split
        self.node_G, self.steer_options = node_G, dict(steer_options)
        self.pressure_G: Optional[torch.Tensor] = None     # the view's cross-layer pressure of this layer
        self.tally = TallyRecorder(self.num_experts, self.G)
        self.token_weights_T: Optional[torch.Tensor] = None
        self._logit_sums_T: Optional[torch.Tensor] = None
        self.set_table(table, S)
        layer.router.gate.register_forward_hook(self._keep_logits)
        layer.router.register_forward_hook(self._route)

    def set_pressure(self, pressure_G: Optional[torch.Tensor]) -> None:
        """The view's cross-layer pressure of this layer [G] for exact steering (None: none yet)."""
        self.pressure_G = pressure_G

    def set_table(self, table: SlotTable, slots_per_device: int) -> None:
        """Serve a placement from the next forward on (slots per rank may change with it)."""
        self.table, self.S = table, int(slots_per_device)
        self.P = self.G * self.S
        E, R = table.log2phy_ER.shape
        self.one_each = self.P == E and R == 1          # one slot per expert: AutoEP's layout or a permutation
        self.home_layout = self.one_each and bool((table.log2phy_ER[:, 0] == torch.arange(E)).all())
        self._on_device = None

    # ------------------------------------------------------------------ BalancedGate (serving: no controls)
    def take_tally(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return self.tally.take(device)

    def discard_tally(self, last_forward_only: bool = False) -> None:
        self.tally.discard(last_forward_only)

    def set_aux_weight(self, weight: float) -> None:
        pass                # serving has no loss

    def set_selection_bias(self, bias_E: Optional[torch.Tensor]) -> None:
        pass                # serving routes as the model was trained to

    def set_device_loss(self, weight: float, expert_to_device_E: torch.Tensor) -> None:
        pass

    def set_token_weights(self, weights_T: Optional[torch.Tensor]) -> None:
        self.token_weights_T = weights_T

    # ------------------------------------------------------------------ hooks
    def _keep_logits(self, gate, args, logits_TE) -> None:
        if self.recording and logits_TE.shape[0] > 0:
            self._logit_sums_T = logit_sums(logits_TE)

    def _route(self, router, args, output):
        """The router's (top_scores_TK, selected_TK, counts_E) -> (top_scores_TK, slot_TK, counts_P)."""
        top_scores_TK, selected_TK, counts_E = output
        logit_sums_T, self._logit_sums_T = self._logit_sums_T, None
        T = selected_TK.shape[0]
        if self.home_layout:
            if self.recording and T > 0:
                self.tally.record_routes(selected_TK, routed_E=counts_E, kept_E=counts_E, device_E=self._maps(
                    counts_E.device)[1], logit_sums_T=logit_sums_T, tokens=T,
                    token_weights_T=self.token_weights_T, layer=self.layer_index)
            return None                                  # AutoEP's own layout: its routes as they are
        slot_TK, counts_P = self.slots(selected_TK, counts_E)
        if self.recording and T > 0:
            self.tally.record_routes(selected_TK, routed_E=counts_E, kept_E=counts_E, device_TK=slot_TK // self.S,
                                     logit_sums_T=logit_sums_T, tokens=T, token_weights_T=self.token_weights_T,
                                     layer=self.layer_index)
        return top_scores_TK, slot_TK.to(selected_TK.dtype), counts_P.to(counts_E.dtype)

    def slots(self, selected_TK: torch.Tensor, counts_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each route's physical slot [T, K] and the routes per slot [P]: an expert's routes on this rank,
        in token order, fill its replicas one after another in the split's numbers."""
        log2phy_ER, _ = self._maps(selected_TK.device)
        expert_N = selected_TK.reshape(-1).long()
        counts_E = counts_E.long()
        if self.one_each:
            slot_N = log2phy_ER[:, 0][expert_N]
            counts_P = torch.zeros(self.P, dtype=torch.long, device=counts_E.device)
            counts_P[log2phy_ER[:, 0]] = counts_E
            return slot_N.view_as(selected_TK), counts_P
        n_ER = self._split(counts_E)
        N = expert_N.numel()
        order_N = torch.argsort(expert_N, stable=True)
        start_E = counts_E.cumsum(0) - counts_E
        position_N = torch.empty_like(expert_N)
        position_N[order_N] = torch.arange(N, device=expert_N.device) - start_E[expert_N[order_N]]
        ends_ER = n_ER.cumsum(1)
        replica_N = (position_N[:, None] >= ends_ER[expert_N]).sum(1).clamp_max(ends_ER.shape[1] - 1)
        slot_N = log2phy_ER[expert_N, replica_N]
        counts_P = torch.bincount(slot_N, minlength=self.P)
        return slot_N.view_as(selected_TK), counts_P

    def _split(self, counts_E: torch.Tensor) -> torch.Tensor:
        """This rank's routes per replica [E, R]."""
        if self.split == "view":
            return _split_by_fraction(counts_E, self.table.fraction_ER.to(counts_E.device))
        n_ER, _ = steered_split(counts_E, self.table, self.S, self.G, self.rank, self.layer.ep_group, self.node_G,
                                self.pressure_G, self.steer_options)
        return n_ER

    def _maps(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(log2phy_ER, [E] EP rank of each expert's first slot) on `device`, copied once per table."""
        if self._on_device is None or self._on_device[0] != device:
            log2phy_ER = self.table.log2phy_ER.to(device)
            self._on_device = (device, log2phy_ER, log2phy_ER[:, 0] // self.S)
        return self._on_device[1], self._on_device[2]


class AutoEPServing(Serving):
    """`Serving` for AutoEP layers: the layer's storage and tables, and the planner's dropless model."""

    def __init__(self, module: torch.nn.Module, config: Optional[EasyBalanceConfig], engine=None):
        self._stores: list[dict[str, torch.Tensor]] = []     # per layer, the [S_max, ...] rows of each weight
        self.engine = engine        # the DeepSpeed engine whose checkpoint code reads and writes AutoEP's files
        super().__init__(module, config)

    @property
    def dispatch(self) -> str:        # type: ignore[override]
        """Dropless: `exact` steers each batch (the planner's "steered"); `view` splits evenly ("uniform")."""
        return "steered" if self.config is not None and self.config.inference.split == "exact" else "uniform"

    @staticmethod
    def _find_layers(module: torch.nn.Module) -> list:
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
        return layers

    @staticmethod
    def _layer_shape(layer) -> tuple[int, int]:
        return int(layer.num_experts), int(layer.ep_size)

    @staticmethod
    def _layer_ep_group(layer):
        return layer.ep_group

    @staticmethod
    def _layer_top_k(layer) -> int:
        return int(layer.top_k)

    # ------------------------------------------------------------------ storage
    def _replicate(self, layer: int, moe, record: bool) -> None:
        """S_max slots per rank: a [S_max, ...] store behind each grouped weight (the home experts in the first
        H rows, zeros after them), the parameters views of its first S rows; and the route map."""
        store = {}
        for name, param in moe.experts.named_parameters(recurse=False):
            if param.shape[0] != self.H:
                raise ValueError(f"AutoEP layer {layer}: expert weight {name} {tuple(param.shape)} has no leading "
                                 f"dimension of its {self.H} local experts")
            full = torch.zeros((self.S_max, ) + tuple(param.shape[1:]), dtype=param.dtype, device=param.device)
            full[:self.H].copy_(param.detach())
            param.requires_grad_(False)
            store[name] = full
        self._stores.append(store)
        inf = self.config.inference if self.config is not None else None
        steer_options = {} if inf is None else {"weights": inf.weights.as_tuple(), "topology": self.topology,
                                                "decision_batch": inf.decision_batch}
        gate = AutoEPRoutes(moe, layer, self.G, self.S, rank=self.rank, table=SlotTable.even(self.placement.log2phy[layer]),
                            split="view" if inf is None else inf.split, node_G=self.node_G, steer_options=steer_options)
        gate.recording = record
        self.gates.append(gate)
        self._point(layer, self.S)

    def _point(self, layer: int, S: int) -> None:
        """The layer's expert parameters: the first S rows of its store."""
        moe = self.moes[layer]
        for name, param in moe.experts.named_parameters(recurse=False):
            param.data = self._stores[layer][name][:S]
        moe.num_local_experts = S
        moe.experts.num_experts = S
        # AutoEP adds every forward's routes per slot to this buffer (never reset, never saved): its shape follows
        moe.tokens_per_expert = torch.zeros(self.G * S, dtype=torch.float32, device=moe.tokens_per_expert.device)

    def _slot_state(self, layer: int, j: int) -> torch.Tensor:
        return torch.cat([w[j].reshape(-1) for w in self._stores[layer].values()])

    def _load_slot(self, layer: int, j: int, flat: torch.Tensor) -> None:
        _unflatten_row(list(self._stores[layer].values()), j, flat)

    def _set_tables(self, layer: int, placement: Placement) -> None:
        self._point(layer, placement.slots_per_device)
        self.gates[layer].set_table(SlotTable.even(placement.log2phy[layer]), placement.slots_per_device)

    def expert_module(self, layer: int, j: int):
        raise NotImplementedError("AutoEP's grouped experts have no module per expert: use _slot_state")

    # ------------------------------------------------------------------ the dropless model
    def _plan(self, heat_LE: torch.Tensor) -> Placement:
        """Replicas for every slot in the dispatch of the split; its counts over a one-slot-per-expert prefix
        (the layout trial's other layout) when that is expected to cost no more."""
        num_nodes = int(self.node_G.max()) + 1
        planned = plan_placement(heat_LE, self.G, self.S_max, num_nodes=num_nodes, previous=self.resident,
                                 dispatch=self.dispatch)
        prefixed = with_prefix(planned, previous=self.resident, node_G=self.node_G.numpy())
        if prefixed is not None and float(self._cost(heat_LE, prefixed).sum()) <= float(self._cost(heat_LE, planned).sum()):
            return prefixed
        return planned

    @staticmethod
    def _cost(heat_LE: torch.Tensor, plan: Placement) -> torch.Tensor:
        """[L] the expected routes of each layer's busiest rank (dropless: its time), each expert's routes
        split evenly over its replicas (steering does at least as well)."""
        return expected_device_load(heat_LE, plan).amax(1)

    @staticmethod
    def _ratio(heat_LE: torch.Tensor, plan: Placement) -> torch.Tensor:
        """[L] the expected busiest rank's routes over the mean."""
        load_LG = expected_device_load(heat_LE, plan)
        mean_L = load_LG.mean(1)
        return torch.where(mean_L > 0, load_LG.amax(1) / mean_L.clamp_min(1e-300), torch.ones_like(mean_L))

    # ------------------------------------------------------------------ checkpoints (the engine's own files)
    def save_checkpoint(self, ckpt_dir: str, tag: str = "served") -> str:
        """Write the DeepSpeed engine's checkpoint (AutoEP's layout: rank g's home experts g*H .. g*H+H-1)
        with the logical experts: each layer's parameters point at its home experts (`home_states`, fetched
        from wherever they serve) while the engine saves, then at the serving slots again. Collective."""
        engine = self._engine("save_checkpoint")
        homes = self.home_states()
        self._point_home(homes)
        try:
            engine.save_checkpoint(ckpt_dir, tag=tag)
        finally:
            self._serve(self.placement)
        return os.path.join(ckpt_dir, str(tag))

    def load_checkpoint(self, ckpt_dir: str, tag: Optional[str] = None) -> str:
        """Load a DeepSpeed checkpoint of the same model (a training engine's, or `save_checkpoint`'s) with
        the engine (`load_module_only`): the home experts go into AutoEP's layout, then the replicas and
        moved experts of the placement serving before are fetched from them (a weight move, every rank
        together). Returns the checkpoint's path. Collective."""
        engine = self._engine("load_checkpoint")
        serving, resident = self.placement, self.resident
        self._point_home(None)
        try:
            path, _ = engine.load_checkpoint(ckpt_dir, tag=tag, load_module_only=True)
            if path is None:
                raise FileNotFoundError(f"{ckpt_dir}: DeepSpeed found no checkpoint to load (tag {tag!r})")
        except BaseException:
            self._serve(serving)               # the weights as they were
            raise
        with torch.no_grad():
            for layer, moe in enumerate(self.moes):
                for name, param in moe.experts.named_parameters(recurse=False):
                    self._stores[layer][name][:self.H].copy_(param.detach())
        self.resident = self.home
        self._serve(self.home)
        if resident is not self.home and self.apply(resident) and serving is not resident:
            self._serve(serving)                   # the prefix that served, resident again
        return path

    def _engine(self, what: str):
        if self.engine is None:
            raise ValueError(f"serving.{what}: pass init_inference the DeepSpeed engine (deepspeed.initialize's), "
                             "not its module: its checkpoint code reads and writes AutoEP's files")
        return self.engine

    def _point_home(self, homes: Optional[dict]) -> None:
        """Every layer's expert parameters: fresh [H, ...] tensors in AutoEP's own layout, filled with this
        rank's home experts (`home_states`) or left for a load to fill (None)."""
        for layer, moe in enumerate(self.moes):
            store = self._stores[layer]
            fresh = {name: torch.empty((self.H, ) + tuple(w.shape[1:]), dtype=w.dtype, device=w.device)
                     for name, w in store.items()}
            if homes is not None:
                for j in range(self.H):
                    _unflatten_row(list(fresh.values()), j, homes[(layer, self.rank * self.H + j)])
            for name, param in moe.experts.named_parameters(recurse=False):
                param.data = fresh[name]
            moe.num_local_experts = moe.experts.num_experts = self.H


def _unflatten_row(weights: list, j: int, flat: torch.Tensor) -> None:
    """Row j of each grouped weight [S, ...] from one vector (`_slot_state`'s order)."""
    at = 0
    with torch.no_grad():
        for w in weights:
            n = w[j].numel()
            w[j].copy_(flat[at:at + n].view_as(w[j]))
            at += n


def init_autoep_inference(model: torch.nn.Module, config=None) -> torch.nn.Module:
    """Serve an AutoEP-converted model (a DeepSpeed engine from `deepspeed.initialize`, or its module) with the
    `easybalance` block of `config`; returns the module in eval mode, with `module.serving` and, with an
    enabled block, `module.easybalance` (the Balancer). Every EP rank must call forward together (AutoEP's
    all-to-all). The engine must not train afterwards: its expert parameters are views of the serving store."""
    eb_config = EasyBalanceConfig.from_ds_config(config)
    if eb_config.enabled:
        for path in eb_config.ignored_options("inference"):
            warnings.warn(f'{path} has no effect in serving (mode "{eb_config.mode}")')
    module = getattr(model, "module", model)
    if not dist_ready():
        raise RuntimeError("init_inference: AutoEP models are converted inside deepspeed.initialize, which starts "
                           "the process group; call it first")
    module.eval()
    engine = model if hasattr(model, "save_checkpoint") and hasattr(model, "load_checkpoint") else None
    serving = AutoEPServing(module, eb_config if eb_config.enabled else None, engine=engine)
    module.serving = serving
    if serving.balancer is not None:
        module.easybalance = serving.balancer
        module.register_forward_pre_hook(
            lambda mod, args, kwargs: serving.before_batch(tuple(args) + tuple(kwargs.values())), with_kwargs=True)
        module.register_forward_hook(lambda mod, args, output: serving.after_batch())
    return module
