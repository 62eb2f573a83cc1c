"""Observation: balance records to a JSONL log and W&B, `eb report` PNGs, the expert-load traces `eb plan` reads."""
from .monitor import JsonlLogger
from .report import read_log, render_report
from .traces import load_trace

__all__ = ["JsonlLogger", "read_log", "render_report", "load_trace"]
