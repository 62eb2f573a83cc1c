"""`eb report RUN_DIR`: balance curves and the layers x devices heatmap as PNGs, from the JSONL log.

    eb report easybalance_log            # writes easybalance_log/plots/*.png

No W&B needed: the JSONL log is always written (rank 0) by the step hook.
Shape legend: L layers, G EP ranks.
"""
from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["read_log", "render_report", "heatmap_figure", "curve_figure", "CURVES"]

# (record key, plot title, file name): one PNG per per-layer curve.
CURVES = (
    ("device_max_over_mean", "device max/mean per layer (1 = balanced)", "device_max_over_mean.png"),
    ("expert_max_over_mean", "expert max/mean per layer", "expert_max_over_mean.png"),
    ("max_vio", "MaxVio per layer (expert granularity)", "max_vio.png"),
    ("layer_token_drop_rate", "token drop rate per layer", "token_drop_rate.png"),
    ("aux_weight", "aux-loss weight per layer", "aux_weight.png"),
    ("aux_loss", "aux loss per layer (unweighted l_aux)", "aux_loss.png"),
)
SCALARS = (("device_util_std", "device utilisation std (mean over layers)"),
           ("token_drop_rate", "token drop rate (all layers)"),
           ("device_max_over_mean_p90", "p90 over layers of device max/mean"))


def read_log(run_dir: str) -> list[dict[str, Any]]:
    """Records of `run_dir/balance.jsonl` (or of a .jsonl path), in order. Bad lines raise ValueError."""
    path = run_dir if run_dir.endswith(".jsonl") else os.path.join(run_dir, "balance.jsonl")
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

    for key, title, fname in CURVES:
        fig = curve_figure(records, key, title)
        if fig is None:
            continue
        written.append(os.path.join(out_dir, fname))
        fig.savefig(written[-1], dpi=90)
        plt.close(fig)

    fig, axes = plt.subplots(1, len(SCALARS), figsize=(4 * len(SCALARS), 3.5))
    for ax, (key, title) in zip(axes, SCALARS):
        ax.plot(steps, [r.get(key, float("nan")) for r in records])
        ax.set_title(title, fontsize="medium")
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    written.append(os.path.join(out_dir, "summary.png"))
    fig.savefig(written[-1], dpi=90)
    plt.close(fig)

    last = records[-1]
    if last.get("pressure_LG"):
        fig = heatmap_figure(last["pressure_LG"], title=f"device pressure (EMA) at step {last['step']}")
        written.append(os.path.join(out_dir, "pressure_heatmap.png"))
        fig.savefig(written[-1], dpi=90)
        plt.close(fig)
    return written
