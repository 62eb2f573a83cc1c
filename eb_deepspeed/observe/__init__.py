"""Observation: balance records to a JSONL log (always, rank 0) and W&B (through DeepSpeed's own
monitor), `eb report` PNGs from the log, and the expert-load traces `eb plan` reads (`traces.py`). Record keys
live in `core/record.py`."""
from .monitor import JsonlLogger
from .report import read_log, render_report
from .traces import load_trace

__all__ = ["JsonlLogger", "read_log", "render_report", "load_trace"]
