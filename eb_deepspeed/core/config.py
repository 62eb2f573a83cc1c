"""The `"easybalance"` block of a DeepSpeed config: one table of keys, typed, strict, never mutates the user's dict.

    cfg = EasyBalanceConfig.from_ds_config("ds_config.json")      # or a dict
    cfg.enabled, cfg.mode, cfg.aux.policy, cfg.inference.split, cfg.window_for(num_layers)
    cfg.ignored_options("train")    # JSON paths set by the user that have no effect here
    KEYS                            # the table: each key's path, default, valid values and where it acts

The table is the fields of the config dataclasses: each leaf (`key`) declares its default (what an empty block
gives), its valid values (`Valid`: the reader and the text docs/config.md shows) and where it acts (`ACTS`). The
reader, the "no effect here" warnings, README's block of defaults and docs/config.md's table come from it or are
tested against it (tests/test_config.py). Defaults come from the tuning table of the EasyBalance article (§5.1): EMA
alpha 0.3, cross-layer window 5-8 layers, warm-up 3-5 batches; docs/config.md gives each key's reason.

Every mistake raises `ConfigError` naming the JSON path, e.g.
    easybalance.ema_alpha (1.5) must be in (0, 1]
    easybalance.inference.weight: unknown key; valid keys: ..."""
from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping, Optional

from .files import MAX_JSON_DEPTH, clip, json_too_deep, load_json
from .policies import POLICIES
from .topology import TOPOLOGIES

__all__ = ["ConfigError", "LogConfig", "AuxConfig", "InferenceConfig", "TrainPlacementConfig",
           "EasyBalanceConfig", "KEYS"]

CONTEXTS = ("train", "serve")   # eb_deepspeed.initialize / eb_deepspeed.init_inference (as a record's "phase")
# Where a key acts, by what reads it: "both" wherever the block is on (the view, its records, checkpoints);
# "training" eb_deepspeed.initialize in mode "balance" (the control law); "serving" eb_deepspeed.init_inference in
# mode "balance" (replicas, re-plans); "placement" eb_deepspeed.initialize with train_placement on, in either mode.
ACTS = ("both", "training", "serving", "placement")
INT_MAX = 2 ** 31 - 1     # the largest integer any option takes (counts, intervals, windows)
# replica slots a rank: a layer's G * (E / G + R) slots must fit the planner's 65536 (planning.placement.MAX_SLOTS),
# so R < 65536 for any G >= 1 (serving and training check the product for their model)
MAX_REPLICA_SLOTS = 2 ** 16 - 1


class ConfigError(ValueError):
    """A user mistake in the `easybalance` block; the message names the JSON path."""


# ---------------------------------------------------------------------- valid values: read, check, describe
@dataclass(frozen=True)
class Valid:
    """A key's valid values: `text`, what docs/config.md's table shows; `read(value, path)`, the value read, or a
    ConfigError naming `path`."""
    text: str
    read: Callable[[Any, str], Any]


def _fail(path: str, value: Any, rule: str):
    raise ConfigError(f"{path} ({clip(repr(value))}) {rule}")


def boolean() -> Valid:
    return Valid("bool", lambda v, p: v if isinstance(v, bool) else _fail(p, v, "must be true or false"))


def nonempty() -> Valid:
    return Valid("non-empty string", lambda v, p: v if isinstance(v, str) and v and "\x00" not in v else
                 _fail(p, v, "must be a non-empty string"))


def choice(options: tuple) -> Valid:
    return Valid(", ".join(f"`{o}`" for o in options), lambda v, p: v if isinstance(v, str) and v in options else
                 _fail(p, v, f"must be one of: {', '.join(options)}"))


def integer(least: int, most: int = INT_MAX, nullable: bool = False) -> Valid:
    """An integer in [least, most] (and null, None, when `nullable`)."""
    hint = " or null" if nullable else ""

    def read(v, p):
        if nullable and v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            _fail(p, v, f"must be an integer >= {least}{hint}")
        return _fail(p, v, f"must be >= {least}{hint}") if v < least else _fail(p, v, f"must be <= {most}") \
            if v > most else v
    span = f"int ≥ {least}" if most == INT_MAX else f"int in [{least}, {most}]"
    return Valid(span + (", `null`" if nullable else ""), read)


def number(text: str) -> Valid:
    """A finite number in `text`: an interval "(0, 1]" / "[0, 1e6]" or a bound "≥ 1"."""
    def read(v, p):
        n = _finite(v, p)
        if text.startswith("≥"):
            return n if n >= float(text[1:]) else _fail(p, n, f"must be >= {text[1:].strip()}")
        lo, hi = (float(x) for x in text[1:-1].split(","))
        return n if (lo < n if text[0] == "(" else lo <= n) and n <= hi else _fail(p, n, f"must be in {text}")
    return Valid(text, read)


def weight_range() -> Valid:
    def read(v, p):
        if not isinstance(v, (list, tuple)) or len(v) != 2:
            _fail(p, v, "must be [min, max] with min <= 1 <= max")
        lo, hi = (_finite(x, f"{p}[{i}]") for i, x in enumerate(v))
        return (lo, hi) if 0.0 < lo <= 1.0 <= hi <= 1e6 else _fail(
            p, [lo, hi], "must be [min, max] with 0 < min <= 1 <= max <= 1e6 (weights start at 1)")
    return Valid("0 < min ≤ 1 ≤ max ≤ 1e6", read)


def _finite(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(path, value, "must be a finite number")
    try:
        number = float(value)
    except OverflowError:          # an integer of hundreds of digits
        number = math.inf
    return number if math.isfinite(number) else _fail(path, value, "must be a finite number")


def key(default: Any, valid: Valid, acts: str, *, reads: str = "", absent: Any = ...):
    """A leaf of the block: its `default` (JSON: what an empty block gives), its `valid` values and where it `acts` (names
    of ACTS joined by "+"). reads: "option" (an `aux` option, read only by the policies that list it in
    `POLICIES`) or "view" (read in training only by a policy that acts on the view). absent: the value without the
    (sub-)block, where it differs from `default` (`enabled`: off without the block, on with it)."""
    assert set(acts.split("+")) <= set(ACTS)
    return field(default=valid.read(default, "") if absent is ... else absent,
                 metadata={"default": default, "valid": valid, "acts": tuple(acts.split("+")), "reads": reads})


def section(cls):
    return field(default_factory=cls, metadata={"section": cls})


# ---------------------------------------------------------------------- the table
@dataclass(frozen=True)
class LogConfig:
    """Where and how often balance curves are written."""
    interval: int = key(10, integer(1), "both")             # boundaries between two log records
    dir: str = key("easybalance_log", nonempty(), "both")   # JSONL log (rank 0); `eb report DIR` renders it
    wandb: bool = key(True, boolean(), "both")             # also send to W&B when DeepSpeed's `wandb` block is on


@dataclass(frozen=True)
class AuxConfig:
    """Training control (`easybalance.aux`): per-layer aux-loss weights or a selection bias."""
    policy: str = key("bias_cross_layer", choice(tuple(POLICIES)), "training")     # the sweep's best
    weight_range: tuple = key([0.25, 4.0], weight_range(), "training", reads="option")   # per-layer weights' clip
    gain: float = key(0.02, number("(0, 10]"), "training", reads="option")            # integral gain (measured)
    bias_rate: float = key(0.03, number("(0, 1]"), "training", reads="option")        # bias's sign-update step
    loss_coeff: float = key(0.01, number("[0, 1e6]"), "training")    # AutoEP: the balance loss easybalance attaches


@dataclass(frozen=True)
class InferenceConfig:
    """Serving (`easybalance.inference`): replicas, the split and re-planning; `topology` prices weight copies for
    serving and training placement alike."""
    replica_slots: int = key(1, integer(0, MAX_REPLICA_SLOTS), "serving")   # extra expert slots per EP rank
    split: str = key("exact", choice(("view", "exact")), "serving")     # the runtime's split over the copies
    topology: str = key("pcie", choice(tuple(TOPOLOGIES)), "serving+placement")   # the links a copy crosses
    replan_threshold: float = key(1.5, number("≥ 1"), "serving")    # a layer's expected max/mean that asks to re-plan
    replan_interval: int = key(24, integer(1), "serving")             # batches between two re-plans, at least
    view_interval: int = key(4, integer(1), "serving")                # batches between two view updates


@dataclass(frozen=True)
class TrainPlacementConfig:
    """Training-time expert placement (`easybalance.train_placement`, AutoEP): experts re-placed over the EP ranks
    from the view, weights and optimizer state moved, routing untouched. Off without the sub-block; on when it is
    there, as the block itself is."""
    enabled: bool = key(True, boolean(), "placement", absent=False)
    interval: int = key(50, integer(1), "placement")            # optimizer steps between two re-plans
    replica_slots: int = key(0, integer(0, MAX_REPLICA_SLOTS), "placement")   # extra slots a rank for replicas


@dataclass(frozen=True)
class EasyBalanceConfig:
    enabled: bool = key(True, boolean(), "both", absent=False)
    mode: str = key("balance", choice(("observe", "balance")), "both")
    ema_alpha: float = key(0.3, number("(0, 1]"), "both")
    window: Optional[int] = key(None, integer(0, nullable=True), "training", reads="view")   # null: by depth
    warmup_batches: int = key(4, integer(0), "training+serving+placement", reads="view")
    checkpoint: str = key("strict", choice(("strict", "ignore_mismatch")), "both")
    log: LogConfig = section(LogConfig)
    aux: AuxConfig = section(AuxConfig)
    inference: InferenceConfig = section(InferenceConfig)
    train_placement: TrainPlacementConfig = section(TrainPlacementConfig)
    explicit: frozenset = field(default=frozenset(), compare=False, repr=False)   # the paths the user set

    @classmethod
    def from_ds_config(cls, ds_config: Mapping[str, Any] | str | os.PathLike | None) -> "EasyBalanceConfig":
        """Read the `"easybalance"` block of a DeepSpeed config (dict or JSON path); no block, or None: disabled."""
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
        explicit: set[str] = set()
        values = _read(cls, copy.deepcopy(_mapping(block, path)), path, "", explicit)
        return cls(**values, explicit=frozenset(explicit))

    @property
    def balance(self) -> bool:
        """The controls act (mode "balance"); "observe" changes nothing."""
        return self.mode == "balance"

    def window_for(self, num_layers: int) -> int:
        """Half-width of the cross-layer window: pressure around layer l sums layers l-w .. l+w.

        null (None) follows the EasyBalance article, §5.1: 5 layers, widened for deep models (61 layers -> 8)."""
        return self.window if self.window is not None else int(min(8, max(5, math.ceil(num_layers / 8))))

    def changed(self) -> set[str]:
        """The paths the user set to other than their defaults (the README's block of defaults changes nothing; a
        sub-block that is there switches on what it configures)."""
        return {p for p in self.explicit if _get(self, p) != _get(EasyBalanceConfig(), p)}

    def ignored_options(self, context: str) -> list[str]:
        """JSON paths the user set, to other than their defaults, that have no effect in this mode and context
        (one warning each), by where each key acts (`KEYS`).

        context: "train" (`eb_deepspeed.initialize`) or "serve" (`eb_deepspeed.init_inference`)."""
        if context not in CONTEXTS:
            raise ValueError(f"context ({context!r}) must be one of: {', '.join(CONTEXTS)}")
        on = {"both"}
        if context == "train":
            on |= {"training"} if self.balance else set()
            on |= {"placement"} if self.train_placement.enabled else set()
        elif self.balance:
            on.add("serving")
        policy = POLICIES[self.aux.policy]

        def acts(row: "Key") -> bool:
            read = {"option": row.name in policy.options, "view": policy.uses_view}.get(row.reads, True)
            return any(a in on and (a != "training" or read) for a in row.acts)
        return [f"easybalance.{p}" for p in sorted(self.changed()) if not acts(KEYS[p])]

    def to_dict(self) -> dict[str, Any]:
        """The block as JSON (every key, defaults filled in): what `from_block` reads."""
        return _as_json(self)


@dataclass(frozen=True)
class Key:
    """One row of the table: a leaf's JSON path below `easybalance`, default, valid values, where it acts."""
    path: str
    default: Any
    valid: Valid
    acts: tuple
    reads: str

    @property
    def name(self) -> str:
        return self.path.rsplit(".", 1)[-1]


def _rows(cls, prefix: str = "") -> dict[str, Key]:
    out = {}
    for f in fields(cls):
        if "section" in f.metadata:
            out |= _rows(f.metadata["section"], f"{prefix}{f.name}.")
        elif "valid" in f.metadata:
            m = f.metadata
            out[prefix + f.name] = Key(prefix + f.name, m["default"], m["valid"], m["acts"], m["reads"])
    return out


KEYS: dict[str, Key] = _rows(EasyBalanceConfig)


def _read(cls, block: dict, path: str, prefix: str, explicit: set) -> dict[str, Any]:
    """The fields of `cls` from `block` (its JSON path `path`): each leaf by its `Valid`, a section recursively (a
    missing section: its dataclass defaults)."""
    _reject_unknown(block, path, [f.name for f in fields(cls) if "section" in f.metadata or "valid" in f.metadata])
    explicit |= {prefix + k for k in block if prefix + k in KEYS}
    out = {}
    for f in fields(cls):
        if "section" in f.metadata:
            sub = block.get(f.name)
            out[f.name] = f.metadata["section"]() if sub is None else f.metadata["section"](
                **_read(f.metadata["section"], dict(_mapping(sub, f"{path}.{f.name}")), f"{path}.{f.name}",
                        f"{prefix}{f.name}.", explicit))
        elif "valid" in f.metadata:
            out[f.name] = f.metadata["valid"].read(block.get(f.name, f.metadata["default"]), f"{path}.{f.name}")
    if "enabled" in out:       # a (sub-)block that is there switches on what it configures, unless it says not
        explicit.add(prefix + "enabled")
    return out


def _get(cfg, path: str) -> Any:
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _as_json(obj) -> dict[str, Any]:
    """A config dataclass's fields as JSON values (sections as objects, tuples as lists), without `explicit`."""
    out = {}
    for f in [f for f in fields(obj) if f.name != "explicit"]:
        value = getattr(obj, f.name)
        out[f.name] = _as_json(value) if "section" in f.metadata else list(value) if isinstance(value, tuple) else value
    return out


def strip_block(ds_config: Mapping[str, Any] | str | os.PathLike | None) -> dict[str, Any] | None:
    """A copy of the DeepSpeed config without the `easybalance` block (the user's dict is untouched)."""
    if ds_config is None:
        return None
    out = copy.deepcopy(dict(read_json(ds_config)))
    out.pop("easybalance", None)
    return out


def read_json(ds_config):
    """A dict as it is, once checked to nest at most MAX_JSON_DEPTH deep; a path read as JSON (`load_json`: a
    regular file of at most MAX_JSON_BYTES), with a ConfigError naming the file when that fails."""
    if not isinstance(ds_config, (str, os.PathLike)):
        if too_deep := json_too_deep(ds_config):
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


def _mapping(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path} must be a JSON object, got {type(value).__name__} ({clip(repr(value))})")
    return dict(value)


def _reject_unknown(block: Mapping[str, Any], path: str, valid: list[str]) -> None:
    if odd := [k for k in block if not isinstance(k, str)]:
        raise ConfigError(f"{path}: keys must be strings, got {odd!r}; valid keys: {', '.join(sorted(valid))}")
    if unknown := sorted(set(block) - set(valid)):
        where = ", ".join(f"{path}.{k}" for k in unknown)
        raise ConfigError(f"{where}: unknown key; valid keys: {', '.join(sorted(valid))}")
