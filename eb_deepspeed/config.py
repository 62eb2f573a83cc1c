"""The `"easybalance"` block of a DeepSpeed config: typed, strict, never mutates the user's dict.

    cfg = EasyBalanceConfig.from_ds_config("ds_config.json")      # or a dict
    cfg.enabled, cfg.mode, cfg.weights.cross, cfg.window_for(num_layers)

Defaults come from the tuning table of the EasyBalance article (seed 000, §5.1):
EMA alpha 0.3, cross-layer window 5-8 layers, cost weights intra 0.3 / cross 0.5 / comm 0.2,
decision batch 8, warm-up 3-5 batches. Topology presets set the cost weights the way the
article says (§3.3): NVLink all-to-all machines lower comm to ~0.1 and raise cross to ~0.6;
across nodes comm must be >= 0.4. Explicit `weights` override the preset key by key.

Every mistake raises `ConfigError` naming the JSON path, e.g.
    easybalance.ema_alpha (1.5) must be in (0, 1]
    easybalance.weight: unknown key; valid keys: cross, comm, intra
"""
from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping

__all__ = ["ConfigError", "CostWeights", "LogConfig", "AuxConfig", "EasyBalanceConfig", "TOPOLOGY_PRESETS", "MODES",
           "AUX_POLICIES"]

MODES = ("observe", "balance")
AUX_POLICIES = ("fixed", "cross_layer", "bias")

# (intra, cross, comm) — seed 000 §3.3 and §5.1.
TOPOLOGY_PRESETS: dict[str, tuple[float, float, float]] = {
    "pcie": (0.3, 0.5, 0.2),        # the article's "usual starting point"
    "nvlink": (0.3, 0.6, 0.1),      # all-to-all NVLink: comm ~0.1, cross ~0.6
    "multi_node": (0.2, 0.4, 0.4),  # across a network: comm >= 0.4
}


class ConfigError(ValueError):
    """A user mistake in the `easybalance` block; the message names the JSON path."""


@dataclass(frozen=True)
class CostWeights:
    """Weights of the three cost terms of seed 000 §2.2 (intra-layer heat, cross-layer pressure, comm)."""
    intra: float
    cross: float
    comm: float


@dataclass(frozen=True)
class LogConfig:
    """Where and how often balance curves are written."""
    interval: int = 10              # boundaries between two log records
    dir: str = "easybalance_log"    # JSONL log (rank 0); `eb report DIR` renders it
    wandb: bool = True              # also send to W&B when DeepSpeed's own `wandb` block is enabled


@dataclass(frozen=True)
class AuxConfig:
    """Training control (`easybalance.aux`): per-layer aux-loss weights or a selection bias."""
    policy: str = "cross_layer"
    weight_range: tuple[float, float] = (0.5, 2.0)   # cross_layer: clip of w_l (mean 1 kept)
    smoothing: float = 0.3                           # cross_layer: fraction of the way to the target per step
    bias_rate: float = 1e-3                          # bias: sign-update rate u
    device_weight: float = 0.5                       # bias: weight of the device (window pressure) term
    aux_scale: float = 1.0                           # bias: weight of every layer's l_aux
    explicit: frozenset = field(default=frozenset(), compare=False, repr=False)

    def ignored_options(self) -> list[str]:
        used = {"fixed": set(), "cross_layer": {"weight_range", "smoothing"},
                "bias": {"bias_rate", "device_weight", "aux_scale"}}[self.policy]
        return sorted(self.explicit - used - {"policy"})


@dataclass(frozen=True)
class EasyBalanceConfig:
    enabled: bool = False           # False when the block is absent; True by default when present
    mode: str = "balance"
    topology: str = "pcie"
    weights: CostWeights = field(default_factory=lambda: CostWeights(*TOPOLOGY_PRESETS["pcie"]))
    ema_alpha: float = 0.3
    window: int | None = None       # None = "auto": 5 layers, growing to 8 for deep models
    decision_batch: int = 8
    warmup_batches: int = 4
    seq_len_weighting: bool = False
    log: LogConfig = field(default_factory=LogConfig)
    aux: AuxConfig = field(default_factory=AuxConfig)
    explicit: frozenset = field(default=frozenset(), compare=False, repr=False)  # keys the user set

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_ds_config(cls, ds_config: Mapping[str, Any] | str | os.PathLike | None) -> "EasyBalanceConfig":
        """Read the `"easybalance"` block of a DeepSpeed config (dict, or path to its JSON file).

        No block, or `None`, gives a disabled config: plain DeepSpeed behaviour.
        """
        if ds_config is None:
            return cls()
        if isinstance(ds_config, (str, os.PathLike)):
            with open(ds_config, encoding="utf-8") as f:
                ds_config = json.load(f)
        if not isinstance(ds_config, Mapping):
            raise ConfigError(f"ds_config must be a dict or a path to a JSON file, got {type(ds_config).__name__}")
        block = ds_config.get("easybalance")
        if block is None:
            return cls()
        return cls.from_block(block)

    @classmethod
    def from_block(cls, block: Mapping[str, Any], path: str = "easybalance") -> "EasyBalanceConfig":
        block = copy.deepcopy(dict(_mapping(block, path)))
        explicit = frozenset(block)
        _reject_unknown(block, path, ["enabled", "mode", "topology", "weights", "ema_alpha", "window",
                                      "decision_batch", "warmup_batches", "seq_len_weighting", "log", "aux"])
        enabled = _bool(block.pop("enabled", True), f"{path}.enabled")
        mode = _choice(block.pop("mode", "balance"), f"{path}.mode", MODES)
        topology = _choice(block.pop("topology", "pcie"), f"{path}.topology", tuple(TOPOLOGY_PRESETS))
        weights = _weights(block.pop("weights", {}), f"{path}.weights", TOPOLOGY_PRESETS[topology])
        ema_alpha = _number(block.pop("ema_alpha", 0.3), f"{path}.ema_alpha")
        if not 0.0 < ema_alpha <= 1.0:
            raise ConfigError(f"{path}.ema_alpha ({ema_alpha}) must be in (0, 1]")
        window = block.pop("window", "auto")
        if window == "auto":
            window = None
        else:
            window = _int(window, f"{path}.window", minimum=0, hint=' or "auto"')
        cfg = cls(
            enabled=enabled,
            mode=mode,
            topology=topology,
            weights=weights,
            ema_alpha=ema_alpha,
            window=window,
            decision_batch=_int(block.pop("decision_batch", 8), f"{path}.decision_batch", minimum=1),
            warmup_batches=_int(block.pop("warmup_batches", 4), f"{path}.warmup_batches", minimum=0),
            seq_len_weighting=_bool(block.pop("seq_len_weighting", False), f"{path}.seq_len_weighting"),
            log=_log(block.pop("log", {}), f"{path}.log"),
            aux=_aux(block.pop("aux", {}), f"{path}.aux"),
            explicit=explicit,
        )
        assert not block, f"unparsed keys left: {sorted(block)}"
        return cfg

    # ------------------------------------------------------------------ derived values
    def window_for(self, num_layers: int) -> int:
        """Half-width of the cross-layer window: pressure around layer l sums layers l-w .. l+w.

        "auto" follows seed 000 §5.1: 5 layers, widened for deep models (61 layers -> 8).
        """
        if self.window is not None:
            return self.window
        return int(min(8, max(5, math.ceil(num_layers / 8))))

    def ignored_options(self) -> list[str]:
        """Options the user set that this mode does not use (each gets one warning).

        `observe` changes nothing, so the options that only steer decisions are ignored there;
        in `balance`, the `aux` options that the chosen policy does not use.
        """
        if self.mode == "observe":
            return sorted(self.explicit & {"topology", "weights", "decision_batch", "warmup_batches", "aux"})
        return [f"aux.{name}" for name in self.aux.ignored_options()]

    def to_dict(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled, "mode": self.mode, "topology": self.topology,
            "weights": {"intra": self.weights.intra, "cross": self.weights.cross, "comm": self.weights.comm},
            "ema_alpha": self.ema_alpha, "window": "auto" if self.window is None else self.window,
            "decision_batch": self.decision_batch, "warmup_batches": self.warmup_batches,
            "seq_len_weighting": self.seq_len_weighting,
            "log": {"interval": self.log.interval, "dir": self.log.dir, "wandb": self.log.wandb},
            "aux": {"policy": self.aux.policy, "weight_range": list(self.aux.weight_range),
                    "smoothing": self.aux.smoothing, "bias_rate": self.aux.bias_rate,
                    "device_weight": self.aux.device_weight, "aux_scale": self.aux.aux_scale},
        }


def strip_block(ds_config: Mapping[str, Any] | str | os.PathLike | None) -> dict[str, Any] | None:
    """A copy of the DeepSpeed config without the `easybalance` block (the user's dict is untouched)."""
    if ds_config is None:
        return None
    if isinstance(ds_config, (str, os.PathLike)):
        with open(ds_config, encoding="utf-8") as f:
            ds_config = json.load(f)
    out = copy.deepcopy(dict(ds_config))
    out.pop("easybalance", None)
    return out


# ---------------------------------------------------------------------- typed readers
def _mapping(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path} must be a JSON object, got {type(value).__name__} ({value!r})")
    return value


def _reject_unknown(block: Mapping[str, Any], path: str, valid: list[str]) -> None:
    unknown = sorted(set(block) - set(valid))
    if unknown:
        where = ", ".join(f"{path}.{k}" for k in unknown)
        raise ConfigError(f"{where}: unknown key; valid keys: {', '.join(sorted(valid))}")


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{path} ({value!r}) must be true or false")
    return value


def _number(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{path} ({value!r}) must be a finite number")
    return float(value)


def _int(value: Any, path: str, minimum: int, hint: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{path} ({value!r}) must be an integer >= {minimum}{hint}")
    if value < minimum:
        raise ConfigError(f"{path} ({value}) must be >= {minimum}{hint}")
    return value


def _choice(value: Any, path: str, valid: tuple[str, ...]) -> str:
    if value not in valid:
        raise ConfigError(f"{path} ({value!r}) must be one of: {', '.join(valid)}")
    return value


def _weights(block: Any, path: str, preset: tuple[float, float, float]) -> CostWeights:
    block = dict(_mapping(block, path))
    _reject_unknown(block, path, ["intra", "cross", "comm"])
    base = CostWeights(*preset)
    values = {}
    for f in fields(CostWeights):
        if f.name in block:
            v = _number(block[f.name], f"{path}.{f.name}")
            if not 0.0 <= v <= 1.0:
                raise ConfigError(f"{path}.{f.name} ({v}) must be in [0, 1]")
            values[f.name] = v
    out = replace(base, **values)
    if out.intra + out.cross + out.comm <= 0.0:
        raise ConfigError(f"{path}: intra, cross and comm ({out.intra}, {out.cross}, {out.comm}) "
                          "must not all be 0")
    return out


def _log(block: Any, path: str) -> LogConfig:
    block = dict(_mapping(block, path))
    _reject_unknown(block, path, ["interval", "dir", "wandb"])
    d = block.get("dir", LogConfig.dir)
    if not isinstance(d, str) or not d:
        raise ConfigError(f"{path}.dir ({d!r}) must be a non-empty string")
    return LogConfig(interval=_int(block.get("interval", LogConfig.interval), f"{path}.interval", minimum=1),
                     dir=d, wandb=_bool(block.get("wandb", True), f"{path}.wandb"))


def _aux(block: Any, path: str) -> AuxConfig:
    block = dict(_mapping(block, path))
    _reject_unknown(block, path, ["policy", "weight_range", "smoothing", "bias_rate", "device_weight", "aux_scale"])
    d = AuxConfig()
    policy = _choice(block.get("policy", d.policy), f"{path}.policy", AUX_POLICIES)
    rng = block.get("weight_range", list(d.weight_range))
    if not isinstance(rng, (list, tuple)) or len(rng) != 2:
        raise ConfigError(f"{path}.weight_range ({rng!r}) must be [min, max] with min <= 1 <= max")
    lo, hi = _number(rng[0], f"{path}.weight_range[0]"), _number(rng[1], f"{path}.weight_range[1]")
    if not 0.0 <= lo <= 1.0 <= hi:
        raise ConfigError(f"{path}.weight_range ([{lo}, {hi}]) must be [min, max] with 0 <= min <= 1 <= max "
                          "(the weights keep mean 1)")
    smoothing = _number(block.get("smoothing", d.smoothing), f"{path}.smoothing")
    if not 0.0 < smoothing <= 1.0:
        raise ConfigError(f"{path}.smoothing ({smoothing}) must be in (0, 1]")
    rate = _number(block.get("bias_rate", d.bias_rate), f"{path}.bias_rate")
    if not 0.0 < rate <= 1.0:
        raise ConfigError(f"{path}.bias_rate ({rate}) must be in (0, 1]")
    device_weight = _number(block.get("device_weight", d.device_weight), f"{path}.device_weight")
    if device_weight < 0:
        raise ConfigError(f"{path}.device_weight ({device_weight}) must be >= 0")
    aux_scale = _number(block.get("aux_scale", d.aux_scale), f"{path}.aux_scale")
    if aux_scale < 0:
        raise ConfigError(f"{path}.aux_scale ({aux_scale}) must be >= 0")
    return AuxConfig(policy=policy, weight_range=(lo, hi), smoothing=smoothing, bias_rate=rate,
                     device_weight=device_weight, aux_scale=aux_scale, explicit=frozenset(block))
