"""The balance record: what the loop reports every `log.interval` steps, its keys in one place, and
the one-method door it is reported through.

Shape legend: L layers, G EP ranks, E experts.

A record is a flat dict of Python numbers, per-layer lists and two matrices. Every writer (JSONL,
W&B) and reader (`eb report`, the trace importer, benchmarks) takes its key names from the tables
below; `BalanceLog.record` is the one producer and a test checks it against them.

    logger.log(record, step)     # BalanceLogger; NullLogger is the no-op twin
    balancer.log                 # BalanceLog: when records are written, the loop's notes, an adapter's extras"""
from __future__ import annotations

import math
import numbers
import warnings
from typing import Any, Callable, Optional

__all__ = ["BalanceLogger", "NullLogger", "BalanceLog"]

# Identification of a record. `run_start` is on a run's first record only: the step the run started
# from (0, or the step of the checkpoint it resumed); readers drop older records past it (superseded).
# `nonfinite_layer_ids`: layers whose router logits were non-finite this step; their per-layer
# numbers are null, the aggregates leave them out, and the record holds no expert counts.
# `phase`: "train" (a record per optimizer step) or "serve" (per view update, every inference.view_interval
# batches; no aux controls), so a reader draws each against its own axis.
META = ("step", "samples", "mode", "policy", "phase", "run_start", "nonfinite_layer_ids")

PER_LAYER: dict[str, str] = {      # key -> plot title (a PNG each in `eb report`, a W&B key per layer)
    "device_max_over_mean": "device max/mean per layer (1 = balanced)",
    "expert_max_over_mean": "expert max/mean per layer",
    "max_vio": "MaxVio per layer (expert granularity)",
    "device_cv": "device load CV per layer",
    "layer_token_drop_rate": "token drop rate per layer",
    "device_loss_weight": "device-level balance loss weight per layer",
    "aux_loss": "aux loss per layer (unweighted l_aux)",
    "bias_spread": "selection bias per layer (max - min over experts)",
    "ema_device_max_over_mean": "device max/mean per layer (EMA view)",
    "heat_drift": "expert mix moved from the EMA heat per layer (total variation: 0 same, 1 disjoint)",
}

SCALARS: dict[str, str] = {        # scalars: key -> plot title
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
    "replans": "placements applied (serving; training placement)",
    "weight_moves": "experts moved by re-plans (serving; training placement)",
    "moved_bytes": "bytes of expert state moved so far (training placement: weights, fp32 masters, moments)",
    "lm_loss": "LM loss (the training loop's, `Balancer.note`)",
}
NOTES = ("lm_loss", )       # scalars the training loop hands over with `Balancer.note(...)`

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


class BalanceLog:
    """When a balancer's records are written, and what goes into them besides its metrics.

    Every `interval` view steps, and once more at the end of a run (`close`: the last step is never lost);
    `note` adds the training loop's scalars, `extra` an adapter's own numbers (serving: re-plans, weight moves).
    With a `NullLogger` (ranks other than 0) nothing is built."""

    def __init__(self, logger: Optional[BalanceLogger] = None, interval: int = 10):
        self.logger: BalanceLogger = logger or NullLogger()
        self.interval = int(interval)
        self.extra: Optional[Callable[[], dict]] = None
        self._notes: dict[str, Optional[float]] = {}
        self._nonfinite_notes: set[str] = set()      # keys already warned about
        self._logged_step = 0
        self._run_start: Optional[int] = 0    # put on the next record: where this run's log starts

    @property
    def on(self) -> bool:
        return not isinstance(self.logger, NullLogger)

    def after_step(self, balancer) -> None:
        if balancer.view.steps % self.interval == 0:
            self.write(balancer)

    def write(self, balancer) -> None:
        """Log the balancer's current record unless this step's is logged already."""
        steps = balancer.view.steps
        if self.on and steps and steps != self._logged_step:
            self._logged_step = steps
            record = self.record(balancer)
            if self._run_start is not None:
                record["run_start"], self._run_start = self._run_start, None
            self.logger.log(record, balancer.samples or steps)

    def close(self, balancer) -> None:
        """The last step's record (if not written yet), then the logger closes."""
        if self.on:
            self.write(balancer)
            self.logger.close()
            self.logger = NullLogger()

    def resumed(self, step: int) -> None:
        """The balancer restored a checkpoint of `step`: the next record marks where this run starts."""
        self._run_start = self._logged_step = step

    def note(self, step: int, **scalars: float) -> None:
        """Scalars of the training loop for the next records (JSONL, W&B, `eb report`'s summary) until noted again.
        Keys must be in `NOTES`; values must be real numbers. A NaN or infinite value (a diverging step on one rank)
        is recorded as null with one warning per key, never raised: the loop goes on, as for non-finite logits."""
        for key, value in scalars.items():
            if key not in NOTES:
                raise ValueError(f"note({key}=...): the balance record takes {', '.join(NOTES)}")
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"note({key}={value!r}): a finite number is needed")
            finite = math.isfinite(float(value))
            if not finite and key not in self._nonfinite_notes:
                self._nonfinite_notes.add(key)
                warnings.warn(f"easybalance: note({key}={float(value)}) at step {step}: recorded as null "
                              "(warned once per key)")
            self._notes[key] = float(value) if finite else None

    def record(self, balancer) -> dict[str, object]:
        """One balance record of `balancer` (keys: the tables above)."""
        view = balancer.view
        out = {"step": view.steps, "samples": balancer.samples, "mode": balancer.config.mode,
               "policy": balancer.config.aux.policy, "phase": "train" if balancer.train else "serve",
               **balancer.metrics()}
        if self.extra is not None:
            out.update(self.extra())
        out.update(self._notes)
        out[PRESSURE] = [[round(x, 3) for x in row] for row in view.pressure_LG.tolist()]
        if not out["nonfinite_layer_ids"]:      # a trace replays real demand, never NaN-routed counts
            counts_LE = view.last.routed_LE.round().long().tolist()
            out[EXPERT_COUNTS] = [row[:e] for row, e in zip(counts_LE, balancer.experts_L)]   # each its own experts
        return out
