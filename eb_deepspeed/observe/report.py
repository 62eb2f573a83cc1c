"""`eb report RUN_DIR`: balance curves and the layers x devices heatmap as PNGs, from the JSONL log.

    eb report easybalance_log            # writes easybalance_log/plots/*.png

No W&B needed: the JSONL log is always written (rank 0) by the step hook.
Shape legend: L layers, G EP ranks.
"""
from __future__ import annotations

import json
import os
from typing import Any

from ..core import record as R

__all__ = ["read_log", "render_report", "heatmap_figure", "curve_figure", "CURVES", "SUMMARY", "JSONL_NAME"]

JSONL_NAME = "balance.jsonl"     # the log file in a run's balance directory (written by monitor.JsonlLogger)

# Per-layer curves drawn, one PNG each (file name: the key, but `layer_token_drop_rate` -> token_drop_rate.png).
CURVES = ("device_max_over_mean", "expert_max_over_mean", "max_vio", "layer_token_drop_rate", "aux_weight", "aux_loss")
FILE_NAMES = {"layer_token_drop_rate": "token_drop_rate.png"}
# Scalars of the summary figure.
SUMMARY = ("device_util_std", "token_drop_rate", "device_max_over_mean_p90")


def read_log(run_dir: str) -> list[dict[str, Any]]:
    """Records of `run_dir/balance.jsonl` (or of a .jsonl path), in order. Bad lines raise ValueError."""
    path = run_dir if run_dir.endswith(".jsonl") else os.path.join(run_dir, JSONL_NAME)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no balance log at {path}; is easybalance.log.dir pointing here?")
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not a JSON record ({e.msg})") from None
    if not records:
        raise ValueError(f"{path} holds no records yet")
    return records


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def heatmap_figure(pressure_LG, title: str = "device pressure"):
    plt = _plt()
    L = len(pressure_LG)
    G = len(pressure_LG[0]) if L else 0
    fig, ax = plt.subplots(figsize=(max(4, 1 + 0.6 * G), max(3, 1 + 0.35 * L)))
    im = ax.imshow(pressure_LG, aspect="auto", cmap="magma", interpolation="nearest")
    ax.set_xlabel("EP rank (device)")
    ax.set_ylabel("MoE layer")
    ax.set_xticks(range(G))
    ax.set_yticks(range(L))
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="tokens / step (EMA)")
    fig.tight_layout()
    return fig


def curve_figure(records: list[dict[str, Any]], key: str, title: str):
    """One line per layer of the per-layer list `key` against the optimizer step; None if never logged."""
    rows = [r.get(key) for r in records]
    if not any(rows):
        return None
    plt = _plt()
    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4))
    num_layers = max(len(r) for r in rows if r)
    for layer in range(num_layers):
        pts = [(s, r[layer]) for s, r in zip(steps, rows) if r and layer < len(r)]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"layer {layer}")
    ax.set_xlabel("optimizer step")
    ax.set_title(title)
    ax.legend(fontsize="small", ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def render_report(run_dir: str, out_dir: str | None = None) -> list[str]:
    """Write the PNGs; returns their paths."""
    records = read_log(run_dir)
    base = os.path.dirname(run_dir) if run_dir.endswith(".jsonl") else run_dir
    out_dir = out_dir or os.path.join(base, "plots")
    os.makedirs(out_dir, exist_ok=True)
    plt = _plt()
    steps = [r["step"] for r in records]
    written = []

    for key in CURVES:
        fig = curve_figure(records, key, R.PER_LAYER[key])
        if fig is None:
            continue
        written.append(os.path.join(out_dir, FILE_NAMES.get(key, f"{key}.png")))
        fig.savefig(written[-1], dpi=90)
        plt.close(fig)

    fig, axes = plt.subplots(1, len(SUMMARY), figsize=(4 * len(SUMMARY), 3.5))
    for ax, key in zip(axes, SUMMARY):
        ax.plot(steps, [r.get(key, float("nan")) for r in records])
        ax.set_title(R.SCALARS[key], fontsize="medium")
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    written.append(os.path.join(out_dir, "summary.png"))
    fig.savefig(written[-1], dpi=90)
    plt.close(fig)

    last = records[-1]
    if last.get(R.PRESSURE):
        fig = heatmap_figure(last[R.PRESSURE], title=f"device pressure (EMA) at step {last['step']}")
        written.append(os.path.join(out_dir, "pressure_heatmap.png"))
        fig.savefig(written[-1], dpi=90)
        plt.close(fig)
    return written
