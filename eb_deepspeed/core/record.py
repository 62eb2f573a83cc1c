"""The balance record: what the loop reports every `log.interval` steps, its keys in one place, and
the one-method door it is reported through.

Shape legend: L layers, G EP ranks, E experts.

A record is a flat dict of Python numbers, per-layer lists and two matrices. Every writer (JSONL,
W&B) and reader (`eb report`, the trace importer, benchmarks) takes its key names from the tables
below; `Balancer.record()` is the one producer and a test checks it against them.

    logger.log(record, step)     # BalanceLogger; NullLogger is the no-op twin
"""
from __future__ import annotations

from typing import Any

__all__ = ["PER_LAYER", "SCALARS", "NOTES", "PRESSURE", "EXPERT_COUNTS", "BalanceLogger", "NullLogger"]

# Identification of a record. `run_start` is on a run's first record only: the step the run started
# from (0, or the step of the checkpoint it resumed); readers drop older records past it (superseded).
# `nonfinite_layer_ids`: layers whose router logits were non-finite this step; their per-layer
# numbers are null, the aggregates leave them out, and the record holds no expert counts.
# `phase`: "train" (a record per optimizer step) or "serve" (per view update, every inference.view_interval
# batches; no aux controls), so a reader draws each against its own axis.
META = ("step", "samples", "mode", "policy", "phase", "run_start", "nonfinite_layer_ids")

# Per-layer curves: key -> plot title (one PNG each in `eb report`, one W&B key per layer).
PER_LAYER: dict[str, str] = {
    "device_max_over_mean": "device max/mean per layer (1 = balanced)",
    "expert_max_over_mean": "expert max/mean per layer",
    "max_vio": "MaxVio per layer (expert granularity)",
    "device_cv": "device load CV per layer",
    "layer_token_drop_rate": "token drop rate per layer",
    "aux_weight": "aux-loss weight per layer",
    "device_loss_weight": "device-level balance loss weight per layer",
    "aux_loss": "aux loss per layer (unweighted l_aux)",
    "bias_spread": "selection bias per layer (max - min over experts)",
    "ema_device_max_over_mean": "device max/mean per layer (EMA view)",
}

# Scalars: key -> plot title.
SCALARS: dict[str, str] = {
    "device_util_std": "device utilisation std (mean over layers)",
    "ema_device_util_std": "device utilisation std (EMA view)",
    "token_drop_rate": "token drop rate (all layers)",
    "device_balancedness": "device balancedness (sum mean / sum max)",
    "expert_balancedness": "expert balancedness (sum mean / sum max)",
    "device_max_over_mean_p90": "p90 over layers of device max/mean",
    "tokens": "tokens per step (most of any layer)",
    "nonfinite_tokens": "tokens with non-finite router logits",
    "skipped_layers": "layers left out of the view this step",
    "ready": "view warmed up",
    "steps": "view updates",
    "replans": "placements applied (serving)",
    "weight_moves": "expert weights moved by re-plans (serving)",
    "lm_loss": "LM loss (the training loop's, `Balancer.note`)",
}
# Scalars the training loop hands over with `Balancer.note(...)`.
NOTES = ("lm_loss", )

PRESSURE = "pressure_LG"        # [L, G] EMA device pressure: the heatmap
EXPERT_COUNTS = "expert_counts_LE"   # [L, E] the step's routed counts: a trace `eb plan` and the simulator read
MATRICES = (PRESSURE, EXPERT_COUNTS)


class BalanceLogger:
    """Where records go. `log` is the whole interface; `close` flushes."""

    def log(self, record: dict[str, Any], step: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class NullLogger(BalanceLogger):
    """The no-op twin: ranks other than 0, or nothing configured."""

    def log(self, record: dict[str, Any], step: int) -> None:
        pass
