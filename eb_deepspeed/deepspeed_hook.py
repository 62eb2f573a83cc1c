"""The DeepSpeed adapter: gate swap, expert-parallel group hook, step hook, checkpoint state.

Shape legend: L MoE layers, E experts per layer, G EP ranks, W tally width (3E + 2).

    engine, optimizer, _, _ = eb_deepspeed.initialize(model=model, model_parameters=params,
                                                      config="ds_config.json")
    engine.easybalance.view          # the LoadView (identical on every rank)
    engine.easybalance.metrics()     # per-layer and aggregate balance metrics

Everything distributed lives here; `load_view`, `metrics` and `config` are pure. The hook does
exactly one collective per optimizer step (an all-reduce of the stacked [L, W] tallies over the
data-parallel group, which spans every expert-parallel x data-parallel rank) and one
all-gather at start-up (to check that every rank agrees on the model and config, and to learn
the rank -> node map). With world size 1 there is no communication at all.
"""
from __future__ import annotations

import copy
import inspect
import socket
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist

from .aux_control import AuxController
from .config import EasyBalanceConfig, strip_block
from .gate import CrossLayerGate
from .load_view import LoadView, sequence_length_weights
from .monitor import BalanceLogger, DeepSpeedMonitorLogger, JsonlLogger, MultiLogger, NullLogger

__all__ = ["initialize", "EasyBalance", "swap_gates", "find_moe_layers", "STATE_KEY"]

STATE_KEY = "easybalance"  # key of the balancer state in DeepSpeed's checkpoint client_state


def find_moe_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Every `deepspeed.moe.layer.MoE` in `model`, in module order (the order of layers)."""
    from deepspeed.moe.layer import MoE
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def swap_gates(model: torch.nn.Module) -> list[CrossLayerGate]:
    """Replace each MoE layer's TopKGate by a CrossLayerGate sharing its `wg` parameter.

    Call before `deepspeed.initialize` (DeepSpeed then hands the gates their EP group).
    Parameter names, values and objects are unchanged, so optimizers and checkpoints see the
    same model. Already-swapped gates are kept.
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


class EasyBalance:
    """The balancer attached to one engine: owns the view, the step hook and the checkpoint state."""

    def __init__(self, config: EasyBalanceConfig, gates: list[CrossLayerGate], num_devices: int, *,
                 reduce_group=None, ep_group=None, logger: Optional[BalanceLogger] = None):
        if not gates:
            raise ValueError("easybalance is enabled but the model has no deepspeed.moe.layer.MoE layers")
        experts = sorted({g.num_experts for g in gates})
        if len(experts) != 1:
            raise ValueError(f"every MoE layer must have the same num_experts for the cross-layer view, got "
                             f"{[g.num_experts for g in gates]}")
        self.config = config
        self.gates = gates
        self.num_layers, self.num_experts, self.num_devices = len(gates), experts[0], num_devices
        self.view = LoadView(self.num_layers, self.num_experts, num_devices, ema_alpha=config.ema_alpha,
                             window=config.window_for(len(gates)), warmup_batches=config.warmup_batches)
        self.controller = AuxController(self.num_layers, self.num_experts, config.aux)
        self._apply_controls()
        self.reduce_group = reduce_group
        self.ep_group = ep_group
        self.world_size = dist.get_world_size(reduce_group) if _dist_ready() else 1
        self.rank = dist.get_rank() if _dist_ready() else 0
        self.rank_to_node: list[int] = [0]
        self.ep_group_ranks: list[int] = [self.rank]
        self.logger: BalanceLogger = logger or NullLogger()
        self.global_samples = 0
        self._tally_device = torch.device("cpu")
        self._warned_nonfinite = False

    # ------------------------------------------------------------------ set-up
    def agree_across_ranks(self) -> None:
        """One all-gather at start-up: every rank must hold the same layers, experts and config.

        A rank that disagrees would make the per-step all-reduce mismatch (or hang); instead every
        rank raises the same ValueError here. Also learns the rank -> node map.
        """
        mine = {"layers": self.num_layers, "experts": self.num_experts, "devices": self.num_devices,
                "top_k": [g.k for g in self.gates], "config": self.config.to_dict()}
        host = socket.gethostname()
        if self.world_size > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (mine, host))
        else:
            gathered = [(mine, host)]
        for rank, (theirs, _) in enumerate(gathered):
            if theirs != mine:
                diff = {k: (mine[k], theirs[k]) for k in mine if mine[k] != theirs.get(k)}
                raise ValueError(f"rank {rank} disagrees with rank {self.rank} on the MoE model or easybalance "
                                 f"config (mine, theirs): {diff}")
        nodes: dict[str, int] = {}
        self.rank_to_node = [nodes.setdefault(h, len(nodes)) for _, h in gathered]
        if self.ep_group is not None and _dist_ready():
            self.ep_group_ranks = dist.get_process_group_ranks(self.ep_group)
        if len(nodes) > 1 and self.config.topology != "multi_node" and "topology" not in self.config.explicit:
            warnings.warn(f"easybalance: ranks span {len(nodes)} nodes; consider easybalance.topology = "
                          f"\"multi_node\" (comm weight >= 0.4, seed 000 §3.3)")

    @property
    def num_nodes(self) -> int:
        return max(self.rank_to_node) + 1

    def attach(self, engine) -> None:
        """Hook the engine: view update after each optimizer step, balancer state in checkpoints."""
        from deepspeed.accelerator import get_accelerator
        self._tally_device = torch.device(get_accelerator().current_device_name())
        engine.easybalance = self
        original_step = engine.step

        def step(*args, **kwargs):
            boundary = engine.is_gradient_accumulation_boundary()
            out = original_step(*args, **kwargs)
            if boundary:
                self.global_samples = int(getattr(engine, "global_samples", 0))
                self.on_boundary()
            return out

        engine.step = step
        _wrap_checkpointing(engine, self)

    # ------------------------------------------------------------------ per step
    def set_sequence_lengths(self, lengths_B: torch.Tensor, seq_len: int) -> None:
        """Real lengths of the sequences in the next micro-batch ([B]); weights the view by length.

        Only used with `easybalance.seq_len_weighting: true`; call before each forward.
        """
        if not self.config.seq_len_weighting:
            raise ValueError("set_sequence_lengths() needs easybalance.seq_len_weighting = true")
        w_T = sequence_length_weights(lengths_B, seq_len)
        for gate in self.gates:
            gate.token_weights_T = w_T

    def on_boundary(self) -> torch.Tensor:
        """Drain every gate's tally, all-reduce them in one collective, update the view; returns valid_L."""
        tally_LW = torch.stack([g.take_tally(self._tally_device) for g in self.gates])
        if self.world_size > 1:
            dist.all_reduce(tally_LW, group=self.reduce_group)
        valid_L = self.view.update(tally_LW)
        if self.config.mode == "balance" and self.controller.update(self.view):
            self._apply_controls()
        if not bool(valid_L.all()) and float(self.view.last.nonfinite_L.sum()) > 0 and not self._warned_nonfinite:
            self._warned_nonfinite = True
            bad = [i for i, n in enumerate(self.view.last.nonfinite_L.tolist()) if n > 0]
            warnings.warn(f"easybalance: non-finite router logits in MoE layers {bad} at step {self.view.steps}; "
                          "those layers were left out of the load view for that step")
        if self.view.steps % self.config.log.interval == 0:
            self.logger.log(self.log_record(), self.global_samples or self.view.steps)
        return valid_L

    def _apply_controls(self) -> None:
        """Hand the controller's weights (and bias) to the gates; observe mode leaves DeepSpeed's routing."""
        if self.config.mode != "balance":
            return
        for layer, gate in enumerate(self.gates):
            gate.aux_weight = float(self.controller.weight_L[layer])
            if self.controller.uses_bias:
                gate.selection_bias_E = self.controller.bias_LE[layer].to(gate.wg.weight.device, torch.float32)

    # ------------------------------------------------------------------ reads
    def aux_weights(self) -> list[float]:
        return [float(g.aux_weight) for g in self.gates]

    def metrics(self) -> dict[str, object]:
        """The view's metrics plus the per-layer aux weights (see `LoadView.metrics`)."""
        out = self.view.metrics()
        out["aux_weight"] = self.aux_weights()
        return out

    def log_record(self) -> dict[str, object]:
        record = {"step": self.view.steps, "samples": self.global_samples, "mode": self.config.mode}
        record.update(self.metrics())
        record["pressure_LG"] = [[round(x, 3) for x in row] for row in self.view.pressure_LG.tolist()]
        # the step's routed counts per layer and expert: a trace `eb simulate --workload trace` replays
        record["expert_counts_LE"] = self.view.last.routed_LE.round().long().tolist()
        return record

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, object]:
        return {"version": 1, "view": self.view.state_dict(), "aux": self.controller.state_dict(),
                "config": self.config.to_dict()}

    def load_state_dict(self, state: dict[str, object]) -> None:
        if int(state.get("version", 0)) != 1:
            raise ValueError(f"unknown easybalance checkpoint version {state.get('version')!r}")
        self.view.load_state_dict(state["view"])
        self.controller.load_state_dict(state["aux"])
        self._apply_controls()


def _wrap_checkpointing(engine, balancer: EasyBalance) -> None:
    """Save the balancer state in DeepSpeed's client_state; restore it on load.

    Stored in client_state rather than in module buffers so that model state dicts stay exactly
    DeepSpeed's (checkpoints load both ways between plain DeepSpeed and eb_deepspeed).
    """
    original_save, original_load = engine.save_checkpoint, engine.load_checkpoint
    save_sig = inspect.signature(original_save)

    def save_checkpoint(*args, **kwargs):
        bound = save_sig.bind(*args, **kwargs)
        client_state = dict(bound.arguments.get("client_state") or {})
        client_state[STATE_KEY] = balancer.state_dict()
        bound.arguments["client_state"] = client_state
        return original_save(*bound.args, **bound.kwargs)

    def load_checkpoint(*args, **kwargs):
        load_path, client_state = original_load(*args, **kwargs)
        if load_path is not None and client_state is not None:
            state = client_state.pop(STATE_KEY, None)
            if state is None:
                warnings.warn(f"easybalance: checkpoint {load_path} holds no balancer state; "
                              "the load view starts cold")
            else:
                balancer.load_state_dict(state)
        return load_path, client_state

    engine.save_checkpoint = save_checkpoint
    engine.load_checkpoint = load_checkpoint


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def initialize(args=None, model: Optional[torch.nn.Module] = None, *, config=None, config_params=None,
               **kwargs):
    """`deepspeed.initialize`, plus the `easybalance` block of the same config.

    Takes every argument `deepspeed.initialize` takes and returns the same 4-tuple
    `(engine, optimizer, dataloader, lr_scheduler)`. With no block, or `"enabled": false`, this
    is plain `deepspeed.initialize` (the block is only removed from a copy of the config).
    Otherwise each `MoE` layer's gate becomes a `CrossLayerGate`, and `engine.easybalance`
    holds the balancer (view, metrics, step hook, checkpoint state).
    """
    import deepspeed
    from deepspeed.utils import groups

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
    for option in eb_config.ignored_options():
        warnings.warn(f"easybalance.{option} is ignored in mode \"{eb_config.mode}\"")

    gates = swap_gates(model)
    if not gates:
        raise ValueError("easybalance is enabled but the model has no deepspeed.moe.layer.MoE layers")
    out = deepspeed.initialize(args=args, model=model, config=ds_config, **kwargs)
    engine = out[0]

    moes = find_moe_layers(engine.module)
    ep_sizes = sorted({m.ep_size for _, m in moes})
    if len(ep_sizes) != 1:
        raise ValueError(f"every MoE layer must have the same ep_size for the cross-layer view, got "
                         f"{[m.ep_size for _, m in moes]}")
    ep_group = groups._get_expert_parallel_group(moes[0][1].expert_group_name) if _dist_ready() else None
    reduce_group = groups._get_data_parallel_group() if _dist_ready() else None

    balancer = EasyBalance(eb_config, gates, ep_sizes[0], reduce_group=reduce_group, ep_group=ep_group)
    balancer.agree_across_ranks()
    balancer.logger = _make_logger(eb_config, engine, balancer.rank)
    balancer.attach(engine)
    return out


def _make_logger(cfg: EasyBalanceConfig, engine, rank: int) -> BalanceLogger:
    if rank != 0:
        return NullLogger()
    loggers: list[BalanceLogger] = [JsonlLogger(cfg.log.dir)]
    monitor = getattr(engine, "monitor", None)
    if cfg.log.wandb and monitor is not None and getattr(monitor, "enabled", False):
        loggers.append(DeepSpeedMonitorLogger(monitor))
    return MultiLogger(loggers)
