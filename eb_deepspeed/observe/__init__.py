"""Observation: balance records to a JSONL log (always, rank 0) and W&B (through DeepSpeed's own
monitor), and `eb report` PNGs from the log. Record keys live in `core/record.py`."""
from .monitor import DeepSpeedMonitorLogger, JsonlLogger, MultiLogger, flatten_record
from .report import read_log, render_report

__all__ = ["JsonlLogger", "DeepSpeedMonitorLogger", "MultiLogger", "flatten_record", "read_log", "render_report"]
