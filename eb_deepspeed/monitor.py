"""Balance logging behind one tiny interface: `logger.log(record, step)`.

Shape legend: L layers, G EP ranks.

A record is a dict of Python numbers and per-layer lists (see `EasyBalance.log_record`).
  * `JsonlLogger` appends it to `DIR/balance.jsonl` — always on, rank 0 only; `eb report DIR`
    renders it to PNGs (see `report.py`), so nothing needs a W&B account.
  * `DeepSpeedMonitorLogger` sends it through DeepSpeed's own monitor (`engine.monitor`), so
    it lands in W&B (and TensorBoard/CSV) whenever the user's ds_config enables them, keys
    namespaced `easybalance/layer_03/device_max_over_mean`; the layers x devices pressure
    heatmap goes to W&B as an image.
  * `NullLogger` is the no-op twin, so the step hook never asks "is logging on?".
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterable

__all__ = ["BalanceLogger", "NullLogger", "JsonlLogger", "DeepSpeedMonitorLogger", "MultiLogger",
           "flatten_record", "PER_LAYER_KEYS", "JSONL_NAME"]

JSONL_NAME = "balance.jsonl"
PER_LAYER_KEYS = ("device_max_over_mean", "expert_max_over_mean", "max_vio", "device_cv",
                  "layer_token_drop_rate", "aux_weight", "aux_loss", "ema_device_max_over_mean")
SCALAR_KEYS = ("device_util_std", "ema_device_util_std", "token_drop_rate", "device_balancedness",
               "expert_balancedness", "device_max_over_mean_p90", "nonfinite_tokens", "skipped_layers")


class BalanceLogger:
    def log(self, record: dict[str, Any], step: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class NullLogger(BalanceLogger):
    def log(self, record: dict[str, Any], step: int) -> None:
        pass


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
    """Appends one JSON object per record to DIR/balance.jsonl (append: a resumed run continues it)."""

    def __init__(self, directory: str):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, JSONL_NAME)
        self._file = open(self.path, "a", encoding="utf-8")

    def log(self, record: dict[str, Any], step: int) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def flatten_record(record: dict[str, Any], prefix: str = "easybalance") -> dict[str, float]:
    """Namespaced scalar keys: `easybalance/device_util_std`, `easybalance/layer_03/max_vio`."""
    out: dict[str, float] = {}
    for key in SCALAR_KEYS:
        if key in record:
            out[f"{prefix}/{key}"] = float(record[key])
    for key in PER_LAYER_KEYS:
        for layer, value in enumerate(record.get(key, ()) or ()):
            out[f"{prefix}/layer_{layer:02d}/{key}"] = float(value)
    return out


class DeepSpeedMonitorLogger(BalanceLogger):
    """Through `engine.monitor.write_events` (DeepSpeed logs on global rank 0 only)."""

    def __init__(self, monitor, heatmap: bool = True):
        self.monitor = monitor
        self.heatmap = heatmap and getattr(monitor, "wandb_monitor", None) is not None

    def log(self, record: dict[str, Any], step: int) -> None:
        events = [(k, v, step) for k, v in flatten_record(record).items()]
        self.monitor.write_events(events)
        if self.heatmap and "pressure_LG" in record:
            self._log_heatmap(record, step)

    def _log_heatmap(self, record: dict[str, Any], step: int) -> None:
        import wandb  # lazy: only when DeepSpeed's wandb monitor is on
        if wandb.run is None:
            return
        from .report import heatmap_figure
        import matplotlib.pyplot as plt
        fig = heatmap_figure(record["pressure_LG"], title=f"device pressure (EMA), step {record['step']}")
        wandb.log({"easybalance/pressure_heatmap": wandb.Image(fig)}, step=step)
        plt.close(fig)
