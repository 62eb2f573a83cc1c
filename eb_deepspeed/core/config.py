"""The `"easybalance"` block of a DeepSpeed config: typed, strict, never mutates the user's dict.

    cfg = EasyBalanceConfig.from_ds_config("ds_config.json")      # or a dict
    cfg.enabled, cfg.mode, cfg.aux.policy, cfg.inference.split, cfg.window_for(num_layers)
    cfg.ignored_options("train")    # JSON paths set by the user that have no effect here

Defaults come from the tuning table of the EasyBalance article (§5.1): EMA alpha 0.3, cross-layer window 5-8
layers, warm-up 3-5 batches. The options that only steer serving live under `easybalance.inference`; the topology
presets come from `topology.TOPOLOGIES`, the aux policies and their options from `policies.POLICIES`.
docs/config.md gives each key's reason (a measured win, or the anchor users come from).

Every mistake raises `ConfigError` naming the JSON path, e.g.
    easybalance.ema_alpha (1.5) must be in (0, 1]
    easybalance.inference.weight: unknown key; valid keys: ...
"""
from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from .files import MAX_JSON_DEPTH, json_too_deep, load_json
from .policies import POLICIES
from .topology import TOPOLOGIES

__all__ = ["ConfigError", "LogConfig", "AuxConfig", "InferenceConfig", "TrainPlacementConfig",
           "EasyBalanceConfig"]

MODES = ("observe", "balance")
SPLITS = ("view", "exact")          # how serving splits an expert's routes over its replicas
CONTEXTS = ("train", "serve")   # eb_deepspeed.initialize / eb_deepspeed.init_inference (as a record's "phase")
CHECKPOINT_MODES = ("strict", "ignore_mismatch")   # easybalance.checkpoint: a saved state that does not fit


class ConfigError(ValueError):
    """A user mistake in the `easybalance` block; the message names the JSON path."""


@dataclass(frozen=True)
class LogConfig:
    """Where and how often balance curves are written."""
    interval: int = 10              # boundaries between two log records
    dir: str = "easybalance_log"    # JSONL log (rank 0); `eb report DIR` renders it
    wandb: bool = True              # also send to W&B when DeepSpeed's own `wandb` block is enabled


@dataclass(frozen=True)
class AuxConfig:
    """Training control (`easybalance.aux`): per-layer aux-loss weights or a selection bias."""
    policy: str = "bias_cross_layer"                 # the sweep's best (docs/benchmarks.md)
    weight_range: tuple[float, float] = (0.25, 4.0)  # cross_layer: clip of the per-layer device-loss weights
    gain: float = 0.02                               # cross_layer: integral gain on the log-weights (measured)
    bias_rate: float = 0.03                          # bias: sign-update rate u (logits; measured, docs/training.md)
    loss_coeff: float = 0.01                         # AutoEP: coefficient of the balance loss easybalance attaches
    explicit: frozenset = field(default=frozenset(), compare=False, repr=False)


@dataclass(frozen=True)
class InferenceConfig:
    """Serving (`easybalance.inference`): replicas, steering and re-planning."""
    replica_slots: int = 1          # extra physical expert slots per EP rank (0 = no replicas)
    split: str = "exact"            # "exact": split each batch (AutoEP; DeepSpeed-MoE's padded layer serves "view");
                                    # "view": even over the copies
    topology: str = "pcie"          # the links a weight copy crosses (its price)
    replan_threshold: float = 1.5   # consider a re-plan when a layer's expected slot max/mean passes this
    replan_interval: int = 24       # batches between two re-plans, at least (measured: docs/benchmarks.md, replay)
    view_interval: int = 4          # batches between two view updates (one all-reduce each)
    explicit: frozenset = field(default=frozenset(), compare=False, repr=False)


@dataclass(frozen=True)
class TrainPlacementConfig:
    """Training-time expert placement (`easybalance.train_placement`, AutoEP): experts re-placed over the EP ranks
    from the view, weights and optimizer state moved, routing untouched (`adapters.autoep.placement`). Off without
    the sub-block; on when it is there, as the block itself is."""
    enabled: bool = False
    interval: int = 50              # optimizer steps between two re-plans (each only when it pays for its move)
    replica_slots: int = 0          # extra expert slots per EP rank for replicas of hot experts (0: a permutation)


@dataclass(frozen=True)
class EasyBalanceConfig:
    enabled: bool = False           # False when the block is absent; True by default when present
    mode: str = "balance"
    ema_alpha: float = 0.3
    window: int | None = None       # None = "auto": 5 layers, growing to 8 for deep models
    warmup_batches: int = 4
    checkpoint: str = "strict"      # a saved balancer state that does not fit: "strict" error, or "ignore_mismatch"
    log: LogConfig = field(default_factory=LogConfig)
    aux: AuxConfig = field(default_factory=AuxConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    train_placement: TrainPlacementConfig = field(default_factory=TrainPlacementConfig)
    explicit: frozenset = field(default=frozenset(), compare=False, repr=False)  # keys the user set

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_ds_config(cls, ds_config: Mapping[str, Any] | str | os.PathLike | None) -> "EasyBalanceConfig":
        """Read the `"easybalance"` block of a DeepSpeed config (dict, or path to its JSON file).

        No block, or `None`, gives a disabled config: plain DeepSpeed behaviour.
        """
        if ds_config is None:
            return cls()
        ds_config = read_json(ds_config)
        if not isinstance(ds_config, Mapping):
            raise ConfigError(f"ds_config must be a dict or a path to a JSON file, got {type(ds_config).__name__}")
        if "easybalance" not in ds_config:
            return cls()
        block = ds_config["easybalance"]
        if block is None:   # a template that left the block empty, not a way to switch it off
            raise ConfigError('easybalance (null) must be a JSON object; use {"enabled": false} to switch it off')
        return cls.from_block(block)

    @classmethod
    def from_block(cls, block: Mapping[str, Any], path: str = "easybalance") -> "EasyBalanceConfig":
        block = copy.deepcopy(dict(_mapping(block, path)))
        explicit = frozenset(block)
        _reject_unknown(block, path, [f.name for f in fields(cls) if f.name != "explicit"])
        d = cls()
        ema_alpha = _number(block.pop("ema_alpha", d.ema_alpha), f"{path}.ema_alpha")
        if not 0.0 < ema_alpha <= 1.0:
            raise ConfigError(f"{path}.ema_alpha ({ema_alpha}) must be in (0, 1]")
        window = block.pop("window", "auto")
        window = None if window == "auto" else _int(window, f"{path}.window", minimum=0, hint=' or "auto"')
        cfg = cls(
            enabled=_bool(block.pop("enabled", True), f"{path}.enabled"),   # a block present means on
            mode=_choice(block.pop("mode", d.mode), f"{path}.mode", MODES),
            ema_alpha=ema_alpha,
            window=window,
            warmup_batches=_int(block.pop("warmup_batches", d.warmup_batches), f"{path}.warmup_batches", minimum=0),
            checkpoint=_choice(block.pop("checkpoint", d.checkpoint), f"{path}.checkpoint", CHECKPOINT_MODES),
            log=_log(block.pop("log", {}), f"{path}.log"),
            aux=_aux(block.pop("aux", {}), f"{path}.aux"),
            inference=_inference(block.pop("inference", {}), f"{path}.inference"),
            train_placement=_train_placement(block.pop("train_placement", None), f"{path}.train_placement"),
            explicit=explicit,
        )
        assert not block, f"unparsed keys left: {sorted(block)}"
        return cfg

    # ------------------------------------------------------------------ derived values
    def window_for(self, num_layers: int) -> int:
        """Half-width of the cross-layer window: pressure around layer l sums layers l-w .. l+w.

        "auto" follows the EasyBalance article, §5.1: 5 layers, widened for deep models (61 layers -> 8).
        """
        if self.window is not None:
            return self.window
        return int(min(8, max(5, math.ceil(num_layers / 8))))

    def ignored_options(self, context: str) -> list[str]:
        """JSON paths the user set, to other than their defaults, that have no effect in this mode and context
        (one warning each).

        context: "train" (`eb_deepspeed.initialize`) or "serve" (`eb_deepspeed.init_inference`).
        `observe` changes nothing, so every option that only steers decisions is ignored there.
        """
        if context not in CONTEXTS:
            raise ValueError(f"context ({context!r}) must be one of: {', '.join(CONTEXTS)}")
        top = {"aux", "inference"} | ({"train_placement"} if context == "serve" else set())
        if self.mode == "observe":
            top |= {"window", "warmup_batches"} - ({"warmup_batches"} if self.train_placement.enabled else set())
        elif context == "train":
            if not POLICIES[self.aux.policy].uses_view:
                top |= {"window", "warmup_batches"}
            top.discard("aux")
        else:
            top.discard("inference")
        # A key set to its default changes nothing either way (the README's block of defaults, copied): no warning.
        default = EasyBalanceConfig()
        changed = {k for k in self.explicit if getattr(self, k) != getattr(default, k)}
        changed_in = {"aux": {k for k in self.aux.explicit if getattr(self.aux, k) != getattr(default.aux, k)},
                      "inference": {k for k in self.inference.explicit
                                    if getattr(self.inference, k) != getattr(default.inference, k)}}
        out = []
        for key in sorted(self.explicit & top):
            sub = changed_in.get(key)
            if sub is None:
                out += [f"easybalance.{key}"] if key in changed else []
            else:
                out += [f"easybalance.{key}.{k}" for k in sorted(sub)]
        if self.mode == "balance" and context == "train":
            used = set(POLICIES[self.aux.policy].options) | {"policy", "loss_coeff"}
            out += [f"easybalance.aux.{k}" for k in sorted(changed_in["aux"] - used)]
        return out

    def to_dict(self) -> dict[str, Any]:
        """The block as JSON (every key, defaults filled in; `window` None is "auto"): what `from_block` reads."""
        out = _fields_dict(self)
        out["window"] = "auto" if self.window is None else self.window
        return out


def _fields_dict(obj) -> dict[str, Any]:
    """A config dataclass's fields as JSON values (nested dataclasses as objects, tuples as lists), without the
    `explicit` bookkeeping."""
    out = {}
    for f in fields(obj):
        if f.name == "explicit":
            continue
        value = getattr(obj, f.name)
        out[f.name] = _fields_dict(value) if hasattr(value, "__dataclass_fields__") else \
            list(value) if isinstance(value, tuple) else value
    return out


def strip_block(ds_config: Mapping[str, Any] | str | os.PathLike | None) -> dict[str, Any] | None:
    """A copy of the DeepSpeed config without the `easybalance` block (the user's dict is untouched)."""
    if ds_config is None:
        return None
    out = copy.deepcopy(dict(read_json(ds_config)))
    out.pop("easybalance", None)
    return out


# ---------------------------------------------------------------------- typed readers
INT_MAX = 2 ** 31 - 1     # the largest integer any option takes (counts, intervals, windows)
# inference.replica_slots: extra slots per rank; a layer's G * (E / G + R) slots must fit the planner's
# 65536 slots a layer (planning.placement.MAX_SLOTS), so R < 65536 for any G >= 1 (serving checks the product)
MAX_REPLICA_SLOTS = 2 ** 16 - 1


def read_json(ds_config):
    """A dict as it is, once checked to nest at most MAX_JSON_DEPTH deep; a path read as JSON (`load_json`: a
    regular file of at most MAX_JSON_BYTES), with a ConfigError naming the file when that fails."""
    if not isinstance(ds_config, (str, os.PathLike)):
        too_deep = json_too_deep(ds_config)
        if too_deep:
            raise ConfigError(f"ds_config: nested deeper than {MAX_JSON_DEPTH} levels (at {too_deep}; a DeepSpeed "
                              "config nests a few)")
        return ds_config
    try:
        return load_json(ds_config, "a JSON DeepSpeed config",
                         object_pairs_hook=lambda pairs: _unique_keys(pairs, ds_config))
    except OSError as e:
        raise ConfigError(f"{ds_config}: cannot read the DeepSpeed config ({e.strerror or e})") from None
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _unique_keys(pairs: list[tuple[str, Any]], source) -> dict[str, Any]:
    """One JSON object; a key given twice is refused, as DeepSpeed refuses it (otherwise the last would win)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        twice = sorted({k for k, _ in pairs if k in seen or seen.add(k)})
        raise ConfigError(f"{source}: duplicate keys in the DeepSpeed config: {twice} (DeepSpeed refuses them too; "
                          "keep one of each)")
    return out


def _mapping(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path} must be a JSON object, got {type(value).__name__} ({_short(value)})")
    return value


def _reject_unknown(block: Mapping[str, Any], path: str, valid: list[str]) -> None:
    odd = [k for k in block if not isinstance(k, str)]
    if odd:
        raise ConfigError(f"{path}: keys must be strings, got {odd!r}; valid keys: {', '.join(sorted(valid))}")
    unknown = sorted(set(block) - set(valid))
    if unknown:
        where = ", ".join(f"{path}.{k}" for k in unknown)
        raise ConfigError(f"{where}: unknown key; valid keys: {', '.join(sorted(valid))}")


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{path} ({_short(value)}) must be true or false")
    return value


def _number(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{path} ({_short(value)}) must be a finite number")
    try:
        number = float(value)
    except OverflowError:          # an integer of hundreds of digits
        number = math.inf
    if not math.isfinite(number):
        raise ConfigError(f"{path} ({_short(value)}) must be a finite number")
    return number


def _int(value: Any, path: str, minimum: int, hint: str = "", maximum: int = INT_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{path} ({_short(value)}) must be an integer >= {minimum}{hint}")
    if value < minimum:
        raise ConfigError(f"{path} ({_short(value)}) must be >= {minimum}{hint}")
    if value > maximum:
        raise ConfigError(f"{path} ({_short(value)}) must be <= {maximum}")
    return value


def _short(value: Any) -> str:
    """repr of a value for a message, cut to 60 characters (a hostile value can be huge)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _choice(value: Any, path: str, valid) -> str:
    if not isinstance(value, str) or value not in valid:
        raise ConfigError(f"{path} ({_short(value)}) must be one of: {', '.join(valid)}")
    return value


def _log(block: Any, path: str) -> LogConfig:
    block = dict(_mapping(block, path))
    _reject_unknown(block, path, ["interval", "dir", "wandb"])
    d = block.get("dir", LogConfig.dir)
    if not isinstance(d, str) or not d or "\x00" in d:
        raise ConfigError(f"{path}.dir ({_short(d)}) must be a non-empty string")
    return LogConfig(interval=_int(block.get("interval", LogConfig.interval), f"{path}.interval", minimum=1),
                     dir=d, wandb=_bool(block.get("wandb", LogConfig.wandb), f"{path}.wandb"))


def _aux(block: Any, path: str) -> AuxConfig:
    block = dict(_mapping(block, path))
    _reject_unknown(block, path, ["policy", "loss_coeff",
                                  *{o for p in POLICIES.values() for o in p.options}])
    d = AuxConfig()
    policy = _choice(block.get("policy", d.policy), f"{path}.policy", tuple(POLICIES))
    rng = block.get("weight_range", list(d.weight_range))
    if not isinstance(rng, (list, tuple)) or len(rng) != 2:
        raise ConfigError(f"{path}.weight_range ({_short(rng)}) must be [min, max] with min <= 1 <= max")
    lo, hi = _number(rng[0], f"{path}.weight_range[0]"), _number(rng[1], f"{path}.weight_range[1]")
    if not 0.0 < lo <= 1.0 <= hi <= 1e6:
        raise ConfigError(f"{path}.weight_range ([{lo}, {hi}]) must be [min, max] with 0 < min <= 1 <= max <= 1e6 "
                          "(weights start at 1)")
    gain = _number(block.get("gain", d.gain), f"{path}.gain")
    if not 0.0 < gain <= 10.0:
        raise ConfigError(f"{path}.gain ({gain}) must be in (0, 10]")
    rate = _number(block.get("bias_rate", d.bias_rate), f"{path}.bias_rate")
    if not 0.0 < rate <= 1.0:
        raise ConfigError(f"{path}.bias_rate ({rate}) must be in (0, 1]")
    loss_coeff = _number(block.get("loss_coeff", d.loss_coeff), f"{path}.loss_coeff")
    if not 0.0 <= loss_coeff <= 1e6:
        raise ConfigError(f"{path}.loss_coeff ({loss_coeff}) must be in [0, 1e6]")
    return AuxConfig(policy=policy, weight_range=(lo, hi), gain=gain, bias_rate=rate,
                     loss_coeff=loss_coeff, explicit=frozenset(block))


def _inference(block: Any, path: str) -> InferenceConfig:
    block = dict(_mapping(block, path))
    _reject_unknown(block, path, [f.name for f in fields(InferenceConfig) if f.name != "explicit"])
    d = InferenceConfig()
    topology = _choice(block.get("topology", d.topology), f"{path}.topology", tuple(TOPOLOGIES))
    threshold = _number(block.get("replan_threshold", d.replan_threshold), f"{path}.replan_threshold")
    if threshold < 1.0:
        raise ConfigError(f"{path}.replan_threshold ({threshold}) must be >= 1 (a device max/mean)")
    return InferenceConfig(
        replica_slots=_int(block.get("replica_slots", d.replica_slots), f"{path}.replica_slots", minimum=0,
                           maximum=MAX_REPLICA_SLOTS),
        split=_choice(block.get("split", d.split), f"{path}.split", SPLITS),
        topology=topology,
        replan_threshold=threshold,
        replan_interval=_int(block.get("replan_interval", d.replan_interval), f"{path}.replan_interval", minimum=1),
        view_interval=_int(block.get("view_interval", d.view_interval), f"{path}.view_interval", minimum=1),
        explicit=frozenset(block))


def _train_placement(block: Any, path: str) -> TrainPlacementConfig:
    if block is None:
        return TrainPlacementConfig()
    block = dict(_mapping(block, path))
    _reject_unknown(block, path, ["enabled", "interval", "replica_slots"])
    d = TrainPlacementConfig()
    return TrainPlacementConfig(enabled=_bool(block.get("enabled", True), f"{path}.enabled"),
                                interval=_int(block.get("interval", d.interval), f"{path}.interval", minimum=1),
                                replica_slots=_int(block.get("replica_slots", d.replica_slots),
                                                   f"{path}.replica_slots", minimum=0))
