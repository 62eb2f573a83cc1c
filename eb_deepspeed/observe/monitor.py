"""Balance logging behind one tiny interface: `logger.log(record, step)`.

Shape legend: L layers, G EP ranks.

A record is a dict of Python numbers and per-layer lists (`BalanceLog.record`; keys in `core/record.py`).
  * `JsonlLogger` appends it to `DIR/balance.jsonl` — always on, rank 0 only; `eb report DIR` renders it to PNGs
    (see `report.py`), so nothing needs a W&B account.
  * `DeepSpeedMonitorLogger` sends it through DeepSpeed's own monitor (`engine.monitor`), so it lands in W&B (and
    TensorBoard/CSV) whenever the user's ds_config enables them, keys as `flatten_record` names them, with the
    layers x devices pressure heatmap as a W&B image; `WandbRunLogger` into an open `wandb.run`.
  * `NullLogger` (`core/record.py`) is the no-op twin, so the step hook never asks "is logging on?"."""
from __future__ import annotations

import json
import os
import stat
import sys
import warnings
from typing import Any, Iterable

from ..core import record as R
from ..core.record import BalanceLogger, NullLogger
from .report import JSONL_NAME, heatmap_figure

__all__ = ["JsonlLogger"]


class MultiLogger(BalanceLogger):
    def __init__(self, loggers: Iterable[BalanceLogger]):
        self.loggers = list(loggers)

    def log(self, record: dict[str, Any], step: int) -> None:
        for logger in self.loggers:
            logger.log(record, step)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


class JsonlLogger(BalanceLogger):
    """Appends one JSON object per record to DIR/balance.jsonl (append: a resumed run continues it).

    Bounded: past `max_mb` MiB (256) the file rotates to balance.jsonl.1 (replacing an older one), so the log
    holds at most about 2 x max_mb on disk and readers see the newest records. A partial last line
    left by a killed run is cut off (with a warning) before anything is appended."""

    def __init__(self, directory: str, max_mb: float = 256.0):
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise ValueError(f"easybalance.log.dir ({directory!r}) names a file, not a directory")
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, JSONL_NAME)
        if not os.path.isabs(directory):    # said once where a relative log.dir lands (the working directory)
            print(f"easybalance: balance records go to {os.path.abspath(self.path)} (easybalance.log.dir "
                  f"{directory!r}, relative to the working directory)", file=sys.stderr, flush=True)
        self.max_bytes = int(max_mb * 2 ** 20)
        self._file = _open_append(self.path)
        _cut_partial_line(self._file)
        self._size = self._file.seek(0, os.SEEK_END)
        if self._size:
            warnings.warn(f"easybalance: {self.path} already holds another run's records; this run's follow them, "
                          "its first marked run_start (a resumed run continuing its log: as intended). `eb report` "
                          "plots the last run of a file: give each new run its own easybalance.log.dir to keep both")

    def log(self, record: dict[str, Any], step: int) -> None:
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode("utf-8")
        if self._size and self._size + len(line) > self.max_bytes:
            self._file.close()
            os.replace(self.path, self.path + ".1")
            self._file = _open_append(self.path)
            self._size = 0
        self._file.write(line)
        self._size += len(line)

    def close(self) -> None:
        self._file.close()


def _open_append(path: str):
    """`path` opened to append bytes (created if absent), never through a link and only as a regular file: a
    log is written where it is named, never over a link's target or into a device or FIFO."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if os.path.islink(path):
            raise ValueError(f"{path} is a symbolic link: easybalance writes its log only to a regular file") from None
        raise ValueError(f"{path}: cannot open the balance log ({e.strerror or e})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{path} is not a regular file: easybalance writes its log only to a regular file")
    return os.fdopen(fd, "rb+", buffering=0)


def _cut_partial_line(f) -> None:
    """Truncate the open log `f` after its last newline (a record cut short by a killed writer)."""
    size = end = f.seek(0, os.SEEK_END)
    while end > 0:                       # back to the last newline, a block at a time
        start = max(0, end - 65536)
        f.seek(start)
        cut = f.read(end - start).rfind(b"\n")
        end = start + cut + 1 if cut >= 0 else start
        if cut >= 0:
            break
    if end < size:
        f.truncate(end)
        f.seek(end)
        warnings.warn(f"easybalance: {f.name} ended in a partial record (a killed run); cut it off "
                      f"({size - end} bytes)")


def flatten_record(record: dict[str, Any]) -> dict[str, float]:
    """Namespaced scalar keys: `easybalance/device_util_std`, and per layer `easybalance_layer_03/max_vio`
    (W&B sections panels by the part before the first "/": one section per layer)."""
    out: dict[str, float] = {}
    for key in R.SCALARS:
        if record.get(key) is not None:        # None: left out this step (non-finite router logits)
            out[f"easybalance/{key}"] = float(record[key])
    for key in R.PER_LAYER:
        for layer, value in enumerate(record.get(key, ()) or ()):
            if value is not None:
                out[f"easybalance_layer_{layer:02d}/{key}"] = float(value)
    return out


class DeepSpeedMonitorLogger(BalanceLogger):
    """Through `engine.monitor.write_events` (DeepSpeed logs on global rank 0 only); with DeepSpeed's W&B
    monitor on, the pressure heatmap goes to W&B as an image too."""

    def __init__(self, monitor):
        self.monitor = monitor
        self.heatmap = getattr(monitor, "wandb_monitor", None) is not None

    def log(self, record: dict[str, Any], step: int) -> None:
        self.monitor.write_events([(k, v, step) for k, v in flatten_record(record).items()])
        if self.heatmap and R.PRESSURE in record:
            import wandb  # lazy: only when DeepSpeed's wandb monitor is on
            if wandb.run is not None:
                _log_heatmap(wandb, record, step)


class WandbRunLogger(BalanceLogger):
    """Into the current `wandb.run` (frameworks without DeepSpeed's monitor: Megatron-Core), with the
    same keys as `DeepSpeedMonitorLogger` and the heatmap as an image."""

    def log(self, record: dict[str, Any], step: int) -> None:
        import wandb
        if wandb.run is None:
            return
        wandb.log(flatten_record(record), step=step)
        if R.PRESSURE in record:
            _log_heatmap(wandb, record, step)


def _log_heatmap(wandb, record: dict[str, Any], step: int) -> None:
    import matplotlib.pyplot as plt
    fig = heatmap_figure(record[R.PRESSURE], title=f"device pressure (EMA), step {record['step']}")
    wandb.log({"easybalance/pressure_heatmap": wandb.Image(fig)}, step=step)
    plt.close(fig)
