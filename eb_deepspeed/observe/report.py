"""`eb report RUN_DIR`: balance curves and the layers x devices heatmap as PNGs, from the JSONL log.

    eb report easybalance_log            # writes easybalance_log/plots/*.png
    eb report --compare RUN_A RUN_B ...  # one PNG overlaying the runs' summary curves (after a sweep)

Shape legend: L layers, G EP ranks."""
from __future__ import annotations

import itertools
import json
import math
import os
import warnings
from collections import deque
from typing import Any, Callable, Iterator, Optional, Sequence

from ..core import record as R
from ..core.files import clip, open_regular

__all__ = ["read_log", "render_report", "render_compare"]

JSONL_NAME = "balance.jsonl"     # the log file in a run's balance directory (written by monitor.JsonlLogger)

# Per-layer curves drawn, one PNG each, named by FILE_NAMES or the key (max_vio, expert_max_over_mean - 1, is not).
CURVES = ("device_max_over_mean", "expert_max_over_mean", "layer_token_drop_rate",
          "device_loss_weight", "bias_spread", "aux_loss")
SMOOTH = 5          # records in the trailing mean drawn over the faint logged values
_FAINT_SOLID = f"faint = logged values, solid = trailing mean of {SMOOTH} records"
ZERO_MEANS_OFF = ("bias_spread", "device_loss_weight")   # all zero: the policy has no such control, so no PNG
FILE_NAMES = {"layer_token_drop_rate": "token_drop_rate.png"}
MAX_POINTS = 2000   # records drawn per curve: a longer log is thinned evenly while it is read
MAX_DRAWN = 1e300   # larger magnitudes are gaps: an axis spanning 1.7e308 overflows inside matplotlib
# The longest line read as one record: the largest real one (expert_counts_LE of 61 layers x 256 experts,
# pressure_LG of 61 x 64) is about 200 KiB; 16 MiB is 80 times that. A longer line is refused, not read.
MAX_RECORD_BYTES = 16 * 2 ** 20
SUMMARY = ("device_util_std", "token_drop_rate", "device_max_over_mean_p90")    # scalars of the summary figure
# A serving run (records with phase "serve"): no training controls, its own summary, another x axis.
TRAINING_ONLY = ("device_loss_weight", "bias_spread", "aux_loss")
SERVE_SUMMARY = ("device_max_over_mean_p90", "device_util_std", "token_drop_rate", "replans")
COMPARE_LAYERS = 8      # `--compare`: per-layer panels drawn at most (evenly spaced over the layers)
COMPARE_ROWS = (("expert_max_over_mean", "expert max/mean"), ("device_max_over_mean", "busiest rank's load / mean"))


def summary_panels(records: list[dict]) -> tuple[str, ...]:
    """The scalars of summary.png: serving's, or training's with the LM loss and, under training placement, its
    re-plans beside the balance curves."""
    if _serving(records):
        return SERVE_SUMMARY
    return SUMMARY + tuple(k for k in R.NOTES + ("replans", ) if any(k in r for r in records))


def log_path(run_dir: str) -> str:
    """The balance log of a run directory (or the .jsonl path itself)."""
    return run_dir if run_dir.endswith(".jsonl") else os.path.join(run_dir, JSONL_NAME)


def _records_of(path: str) -> Iterator[dict[str, Any]]:
    with open_regular(path) as f:
        for lineno in itertools.count(1):
            raw = f.readline(MAX_RECORD_BYTES + 1)
            if len(raw) > MAX_RECORD_BYTES:
                raise ValueError(f"{path}:{lineno}: a record longer than {MAX_RECORD_BYTES // 2 ** 20} MiB, the most "
                                 "a balance record may take (a real one is well under 1 MiB)")
            if not raw:
                return
            if not raw.strip():
                continue
            try:
                record, out_of_range = _parse(raw)
            except (json.JSONDecodeError, RecursionError) as e:
                if not raw.endswith(b"\n"):     # readline stops short of a newline only at the end of the file
                    warnings.warn(f"{path}:{lineno}: skipped a partial last record (a killed or running writer)")
                    return
                raise ValueError(f"{path}:{lineno}: not a JSON record "
                                 f"({getattr(e, 'msg', 'nested too deeply')})") from None
            _check_record(record, out_of_range, f"{path}:{lineno}")
            yield record


# Numbers no writer logs: an integer of more than 20 digits (2^63 has 19), a literal that overflows a float64
# (1e999; the writer logs non-finite values as NaN and Infinity). Every float is checked as it is parsed;
# integers one by one only on a line holding a run of 21 digits (which no float's repr has), found by a byte
# map and a search: a Python call per integer would dominate the parse of a record of expert counts.
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
_OUT_OF_RANGE = object()    # what _parse puts in place of such a number
_INT64 = range(-2 ** 63, 2 ** 63)


def _parse(raw: bytes) -> tuple[Any, str]:
    """(the JSON value of a log line, the text of its first number no writer logs, or ""), each such number
    replaced by _OUT_OF_RANGE; integers are checked only when the line holds a run of 21 digits."""
    first: list[str] = []

    def mark(text: str):
        first.append(text)
        return _OUT_OF_RANGE

    def whole(text: str):
        return int(text) if len(text.lstrip("-")) <= 20 else mark(text)

    def real(text: str):
        value = float(text)
        return value if math.isfinite(value) else mark(text)

    long_digits = b"0" * 21 in raw.translate(_DIGITS_AS_ZERO)
    record = json.loads(raw.decode("utf-8", errors="replace"), parse_float=real,
                        parse_int=whole if long_digits else int)
    return record, (first[0] if first else "")


def _check_record(record: Any, out_of_range: str, where: str) -> None:
    """A balance record is a JSON object with an integer `step` (in int64) and no number out of range."""
    if out_of_range and isinstance(record, dict):
        text = clip(out_of_range, 40)
        raise ValueError(f"{where}: {_where(record, _OUT_OF_RANGE)} is {text}: out of range (a logged integer has "
                         "at most 20 digits, a number fits a float64; the writer logs NaN and Infinity by name)")
    step = record.get("step") if isinstance(record, dict) else None
    if type(step) is not int:       # not isinstance: true is an int
        raise ValueError(f"{where}: a balance record is a JSON object with an integer 'step', "
                         f"got {type(record).__name__}")
    if step not in _INT64:
        raise ValueError(f"{where}: step is {step}: out of range (a step fits in 64 bits)")


def _where(record: dict, target) -> str:
    """The JSON path (`key[2][0]`) of `target` in the record (found iteratively, first key first)."""
    stack = [(v, k) for k, v in reversed(record.items())]
    while stack:
        value, where = stack.pop()
        if value is target:
            return where
        if isinstance(value, (list, dict)):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            stack += reversed([(v, f"{where}[{k!r}]" if isinstance(value, dict) else f"{where}[{k}]")
                               for k, v in items])
    return "a value"


def read_log(run_dir: str, keys: Optional[Sequence[str]] = None, max_records: Optional[int] = None,
             last: Optional[int] = None, convert: Optional[Callable[[dict], dict]] = None) -> list[dict[str, Any]]:
    """Records of `run_dir/balance.jsonl` (or of a .jsonl path), in step order, streamed (the rotated balance.jsonl.1
    first) one line at a time.

    A malformed line raises ValueError naming the file and line, and so do a line longer than MAX_RECORD_BYTES and a
    number no writer logs (an integer of 21 digits or more, 1e999), naming its key; a last line cut short (a killed or
    still-running writer) is skipped with a warning. Only regular files are read (a link to a device or FIFO is a
    ValueError, never a hang). A resumed run's first record carries `run_start`: older records past that step were
    superseded by the resumed run and are dropped, so no step repeats. keys: keep only these keys (and `step`) of
    every record but the last, which is kept whole. max_records: keep about that many, evenly spaced (and always the
    last); last: keep only the last that many. Either way memory stays bounded however long the log. convert: applied
    to every record as it is kept (keys taken first; it keeps "step"), e.g. lists to tensors: a kept record costs
    what it converts to, not its JSON's Python objects."""
    kept: list[dict[str, Any]] | deque = [] if last is None else deque(maxlen=max(int(last), 1))
    stride, seen, newest, runs, path = 1, 0, None, 0, log_path(run_dir)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no balance log at {path}; is easybalance.log.dir pointing here?")
    for record in itertools.chain.from_iterable(_records_of(p) for p in (path + ".1", path) if os.path.exists(p)):
        start = record.get("run_start")
        if isinstance(start, int) and not isinstance(start, bool):
            runs += newest is not None and (newest["step"] > start or start == 0)   # a run that replaces what it follows
            while kept and kept[-1]["step"] > start:
                kept.pop()
            if not kept:            # a run that replaces the whole log: thinned from its own first record
                stride, seen = 1, 0
            if newest is not None and newest["step"] > start:
                newest = None
        if newest is not None and (seen - 1) % stride == 0:
            taken = newest if keys is None else {k: newest[k] for k in ("step", *keys) if k in newest}
            kept.append(taken if convert is None else convert(taken))
        newest, seen = record, seen + 1
        if max_records is not None and len(kept) > max_records:
            stride *= 2
            kept = kept[::2]
    if newest is None:
        raise ValueError(f"{path} holds no records yet")
    if runs:
        warnings.warn(f"{path} holds {runs + 1} runs (a new run or a resume appended to the log): "
                      "shown is the last, with the steps of earlier runs it did not replace")
    if kept and kept[-1]["step"] >= newest["step"]:
        kept.pop()
    out = list(kept) + [newest if convert is None else convert(newest)]
    return out if last is None else out[-int(last):]


def _number(value) -> float:
    """A logged value as a float; null (a layer left out that step), NaN, Infinity and anything else odd
    -> a gap; beyond +-MAX_DRAWN a gap with a warning."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return float("nan")
    if -MAX_DRAWN <= value <= MAX_DRAWN:
        return float(value)
    if value == value and abs(value) != math.inf:
        warnings.warn(f"eb report: a logged value beyond +-{MAX_DRAWN:g} is drawn as a gap (no plot axis spans it)")
    return float("nan")


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: str, dpi: int = 90) -> str:
    """Write `fig` to `path` (".png" added when it has no extension, as matplotlib does) and close it; returns the
    path written."""
    path = path if os.path.splitext(path)[1] else path + ".png"
    fig.savefig(path, dpi=dpi)
    _plt().close(fig)
    return path


def heatmap_figure(pressure_LG, title: str = "device pressure", ax=None, spread: Optional[float] = None):
    """Layers x devices: each device's load over its layer's mean, on a scale centred at 1 (balanced) and
    symmetric around it, so a 15 % spread looks like 15 %; `spread`: the scale's half-width (several maps drawn on
    one scale), by default this map's own. Drawn into `ax`, or into a new figure, returned."""
    L, G = len(pressure_LG), len(pressure_LG[0]) if len(pressure_LG) else 0
    fig = None
    if ax is None:      # bounded size (a 64-rank, 61-layer view would otherwise draw a 40-inch figure): 16 x 12 in
        fig, ax = _plt().subplots(figsize=(min(16, max(6, 1 + 0.6 * G)), min(12, max(3.5, 1 + 0.35 * L))))
    values = _over_layer_mean(pressure_LG)
    spread = _spread([values]) if spread is None else spread
    im = ax.imshow(values, aspect="auto", cmap="RdBu_r", vmin=1 - spread, vmax=1 + spread, interpolation="nearest")
    ax.set(xlabel="EP rank (device)", ylabel="MoE layer", xticks=range(0, G, max(1, G // 16)),
           yticks=range(0, L, max(1, L // 24)))
    ax.set_title(title, fontsize="medium")
    ax.figure.colorbar(im, ax=ax, label="load / layer mean (1 = balanced)")
    if fig is not None:
        fig.tight_layout()
    return fig


def _over_layer_mean(pressure_LG) -> list[list[float]]:
    values = [[_number(v) for v in row] for row in pressure_LG]
    means = [sum(v for v in row if v == v) / max(1, sum(v == v for v in row)) for row in values]
    return [[v / m if m > 0 else float("nan") for v in row] for row, m in zip(values, means)]


def _spread(maps: list[list[list[float]]]) -> float:
    """The colour scale's half-width around 1 that holds every value of the maps (`_over_layer_mean`'s), >= 0.05."""
    return max([abs(v - 1.0) for values in maps for row in values for v in row if v == v] + [0.05])


def _serving(records: list[dict[str, Any]]) -> bool:
    return records[-1].get("phase") == "serve"


def _x_label(records: list[dict[str, Any]]) -> str:
    return "view update (every inference.view_interval batches)" if _serving(records) else "optimizer step"


def _run_label(records: list[dict[str, Any]]) -> str:
    last = records[-1]
    mode = last.get("mode", "?")
    if _serving(records):
        return f"serving, mode {mode}"
    return f"mode {mode}" + (f", policy {last['policy']}" if mode == "balance" and last.get("policy") else "")


def _panel(ax, series: list[tuple[list, Optional[str]]], key: str, title: str, xlabel: Optional[str] = None,
           ylabel: Optional[str] = None) -> None:
    """Each (points, label) of `series` in a colour of its own, the logged values faint, a trailing mean of SMOOTH
    records solid; the title, labels and grid, and a dashed line at 1 under a ratio (balanced) or the loss weight."""
    for index, (points, label) in enumerate(series):
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        ax.plot(xs, ys, color=f"C{index % 10}", alpha=0.25, linewidth=0.8)
        ax.plot(xs, _smoothed(ys, SMOOTH), color=f"C{index % 10}", label=label,
                marker="o" if len(xs) == 1 else None)            # one record: a point, not an invisible line
    if "max_over_mean" in key or key == "device_loss_weight":
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
    ax.set_title(title, fontsize="medium")
    ax.set(xlabel=xlabel or "", ylabel=ylabel or "")       # an axis's labels are "" until set
    ax.grid(alpha=0.3)


def _points(records: list[dict[str, Any]], key: str, layer: Optional[int] = None) -> list[tuple[float, float]]:
    """(step, value) of the scalar `key` in every record, or of its `layer` in the records whose list has one."""
    if layer is None:
        return [(r["step"], _number(r.get(key))) for r in records]
    return [(r["step"], _number(r[key][layer])) for r in records if r.get(key) and layer < len(r[key])]


def _smoothed(values: list[float], span: int) -> list[float]:
    """Trailing mean over `span` points, skipping gaps (NaN)."""
    windows = ([v for v in values[max(0, i - span + 1):i + 1] if v == v] for i in range(len(values)))
    return [sum(window) / len(window) if window else float("nan") for window in windows]


def curve_figure(records: list[dict[str, Any]], key: str, title: str):
    """One line per layer of the per-layer list `key` against the optimizer step (a serving run: the view
    update), the logged values faint, a trailing mean of SMOOTH records solid, labelled with the run's mode
    and policy; None if never logged, all zero where zero means off, or a training control of a serving run."""
    rows = [r.get(key) for r in records]
    if not any(rows) or (key in ZERO_MEANS_OFF and not any(_number(v) for r in rows if r for v in r)) \
            or (key in TRAINING_ONLY and _serving(records)):
        return None
    fig, ax = _plt().subplots(figsize=(7, 4))
    values = {x for r in rows if r for x in map(_number, r) if x == x}     # gaps (NaN) left out
    why = f"\nflat: {_run_label(records)} keeps it at {next(iter(values)):g} every step" if len(values) == 1 else ""
    _panel(ax, [(_points(records, key, layer), f"layer {layer}") for layer in range(max(len(r) for r in rows if r))],
           key, f"{title} ({_run_label(records)}){why}", _x_label(records), title)
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    return fig


def render_report(run_dir: str, out_dir: str | None = None) -> list[str]:
    """Write the PNGs; returns their paths. run_dir: a balance log's directory, the .jsonl itself, or an example
    run directory holding balance/ (as `render_compare` takes); the PNGs go to run_dir/plots by default."""
    records = read_log(_balance_dir(run_dir), keys=(*CURVES, *SUMMARY, *SERVE_SUMMARY, *R.NOTES, "phase"),
                       max_records=MAX_POINTS)
    out_dir = out_dir or os.path.join(os.path.dirname(run_dir) if run_dir.endswith(".jsonl") else run_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    written = [_save(fig, os.path.join(out_dir, FILE_NAMES.get(key, f"{key}.png"))) for key in CURVES
               if (fig := curve_figure(records, key, R.PER_LAYER[key])) is not None]
    panels = summary_panels(records)
    fig, axes = _plt().subplots(1, len(panels), figsize=(4 * len(panels), 3.5))
    for ax, key in zip(axes, panels):
        _panel(ax, [(_points(records, key), None)], key, R.SCALARS[key], _x_label(records), key)
    fig.suptitle(f"{_run_label(records)}: {_FAINT_SOLID}", fontsize="medium")
    fig.tight_layout()
    written.append(_save(fig, os.path.join(out_dir, "summary.png")))
    last = records[-1]
    if last.get(R.PRESSURE):
        at = "view update" if _serving(records) else "step"
        fig = heatmap_figure(last[R.PRESSURE], title=f"device pressure (EMA) at {at} {last['step']}\n"
                                                     f"{_run_label(records)}")
        written.append(_save(fig, os.path.join(out_dir, "pressure_heatmap.png")))
    return written


def _balance_dir(run_dir: str) -> str:
    """A run directory of the example (holding balance/) or the balance directory itself."""
    nested = os.path.join(run_dir, "balance")
    return nested if not run_dir.endswith(".jsonl") and os.path.exists(log_path(nested)) else run_dir


def _second_half_loads(records: list[dict[str, Any]]) -> Optional[list[list[float]]]:
    """Each layer's device pressure (EMA of routed tokens per device) summed over the second half of the
    records, [L, G]: where the load sat once the routers had settled."""
    rows = [r.get(R.PRESSURE) for r in records[len(records) // 2:] if r.get(R.PRESSURE)]
    if not rows:
        return None
    L, G = len(rows[-1]), len(rows[-1][0])          # the last run's shape (a resume may change the EP ranks)
    rows = [r for r in rows if len(r) == L and all(len(x) == G for x in r)]
    return [[sum(_number(r[layer][g]) for r in rows) for g in range(G)] for layer in range(L)]


def render_compare(run_dirs: Sequence[str], out_path: str) -> str:
    """One PNG, one colour per run (raw faint, a trailing mean of SMOOTH records solid), labelled with the run's
    directory name and mode: per layer (at most COMPARE_LAYERS, evenly spaced) the expert max/mean and the busiest
    device's load over the mean; the summary curves and the noted LM loss; and per run a layers x devices map of each
    device's load over its layer's mean (EMA pressure, second half of the run), all on one scale. Returns the path."""
    if len(run_dirs) < 2:
        raise ValueError("eb report --compare needs at least two runs")
    keys = (*SUMMARY, *R.NOTES, "expert_max_over_mean", "device_max_over_mean", R.PRESSURE, "phase", "mode", "policy")
    runs = [read_log(_balance_dir(d), keys=keys, max_records=MAX_POINTS) for d in run_dirs]
    num_layers = max(len(r.get("device_max_over_mean") or ()) for records in runs for r in records)
    layers = sorted({round(i * (num_layers - 1) / max(1, COMPARE_LAYERS - 1)) for i in range(COMPARE_LAYERS)}) \
        if num_layers > COMPARE_LAYERS else list(range(num_layers))
    # the drop rate only where a run dropped tokens (dropless AutoEP never does); the LM loss when noted
    summary = tuple(k for k in SUMMARY if k != "token_drop_rate" or any(_number(r.get(k)) > 0 for rs in runs for r in rs))
    summary += tuple(k for k in R.NOTES if any(k in r for records in runs for r in records))
    labels = [f"{os.path.basename(os.path.normpath(d))} ({_run_label(records)})" for d, records in zip(run_dirs, runs)]
    loads = [(label, x) for label, x in zip(labels, map(_second_half_loads, runs)) if x is not None]
    cols = max(len(layers), len(summary) + len(loads), 1)
    fig, axes = _plt().subplots(3, cols, figsize=(4.2 * cols, 11), squeeze=False)
    # rows 0 and 1: per layer; row 2: the summary curves, then the maps
    panels = [(row, col, key, layer, f"layer {layer}: {what}", None) for row, (key, what) in enumerate(COMPARE_ROWS)
              for col, layer in enumerate(layers)]
    panels += [(2, col, key, None, R.SCALARS[key], "optimizer step") for col, key in enumerate(summary)]
    for row, col, key, layer, title, xlabel in panels:
        _panel(axes[row][col], [(_points(records, key, layer), label) for records, label in zip(runs, labels)], key,
               title, xlabel)
    spread = _spread([_over_layer_mean(x) for _, x in loads if x])
    for col, (label, x) in enumerate(loads, start=len(summary)):
        heatmap_figure(x, f"{label}\nload / layer mean, second half", axes[2][col], spread)
    for row, used in ((0, len(layers)), (1, len(layers)), (2, len(summary) + len(loads))):
        for col in range(used, cols):
            axes[row][col].axis("off")
    axes[0][0].legend(fontsize="small")
    fig.suptitle(f"{len(run_dirs)} runs: {_FAINT_SOLID}", fontsize="medium")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    return _save(fig, out_path, dpi=80)
