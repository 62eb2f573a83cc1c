"""Imbalance metrics with pinned definitions (docs/design.md, "Metric definitions").

Shape legend: L layers, X any load axis (G devices or E experts), G EP ranks, E experts.

All functions are pure and take a load matrix `load_LX` (tokens per layer and device/expert).
A layer with no load at all counts as perfectly balanced (max/mean = 1, balancedness = 1,
max_vio = cv = util std = 0), so an empty batch never turns a curve into NaN.

    >>> import torch
    >>> max_over_mean(torch.tensor([[3., 1.]]))   # max 3, mean 2
    tensor([1.5000], dtype=torch.float64)"""
from __future__ import annotations

import torch

__all__ = ["max_over_mean", "balancedness", "aggregate_balancedness", "max_vio", "cv", "device_util_std", "token_drop_rate"]


def _as_LX(load: torch.Tensor) -> torch.Tensor:
    load = torch.as_tensor(load, dtype=torch.float64)
    if load.dim() == 1:
        load = load.unsqueeze(0)
    if load.dim() != 2:
        raise ValueError(f"load must be [layers, devices_or_experts], got shape {tuple(load.shape)}")
    return load


def max_over_mean(load_LX: torch.Tensor) -> torch.Tensor:
    """max / mean per layer (1 is perfect). [L, X] -> [L]"""
    load = _as_LX(load_LX)
    mean_L, max_L = load.mean(1), load.amax(1)
    return torch.where(mean_L > 0, max_L / mean_L.clamp_min(1e-300), torch.ones_like(mean_L))


def balancedness(load_LX: torch.Tensor) -> torch.Tensor:
    """mean / max per layer (1 is perfect). [L, X] -> [L]"""
    load = _as_LX(load_LX)
    mean_L, max_L = load.mean(1), load.amax(1)
    return torch.where(max_L > 0, mean_L / max_L.clamp_min(1e-300), torch.ones_like(mean_L))


def aggregate_balancedness(load_LX: torch.Tensor) -> float:
    """sum over layers of mean / sum over layers of max (vLLM's definition). [L, X] -> scalar"""
    load = _as_LX(load_LX)
    total_max = float(load.amax(1).sum())
    return float(load.mean(1).sum()) / total_max if total_max > 0 else 1.0


def max_vio(counts_LE: torch.Tensor) -> torch.Tensor:
    """(max - mean) / mean per layer at expert granularity (Wang et al. 2024). [L, E] -> [L]"""
    return max_over_mean(counts_LE) - 1.0


def cv(load_LX: torch.Tensor) -> torch.Tensor:
    """Coefficient of variation: population std / mean per layer. [L, X] -> [L]"""
    load = _as_LX(load_LX)
    mean_L = load.mean(1)
    return torch.where(mean_L > 0, load.std(1, unbiased=False) / mean_L.clamp_min(1e-300), torch.zeros_like(mean_L))


def device_util_std(load_LG: torch.Tensor) -> float:
    """Population std over devices of L / max(L), averaged over layers (the EasyBalance article's
    设备利用率标准差, device-utilisation std). [L, G] -> scalar"""
    load = _as_LX(load_LG)
    max_L = load.amax(1, keepdim=True)
    util_LG = torch.where(max_L > 0, load / max_L.clamp_min(1e-300), torch.ones_like(load))
    return float(util_LG.std(1, unbiased=False).mean())


def token_drop_rate(dropped_routes: float | torch.Tensor, tokens: float | torch.Tensor, k: int) -> float:
    """dropped routes / (tokens * k); 0 when there were no tokens."""
    dropped, tokens = float(torch.as_tensor(dropped_routes).sum()), float(torch.as_tensor(tokens).sum())
    if k < 1:
        raise ValueError(f"k ({k}) must be >= 1")
    return dropped / (tokens * k) if tokens > 0 else 0.0


def per_width(fn, load_LX: torch.Tensor, widths_L: torch.Tensor | None) -> torch.Tensor:
    """A per-layer metric `fn` ([L, X] -> [L]) of each layer's first widths_L[l] columns only: layers of
    different widths (expert counts) padded into one matrix. widths_L None: every column counts."""
    load = _as_LX(load_LX)
    if widths_L is None or bool((torch.as_tensor(widths_L) == load.shape[1]).all()):
        return fn(load)
    widths_L = torch.as_tensor(widths_L)
    out_L = torch.empty(load.shape[0], dtype=torch.float64)
    for width in widths_L.unique().tolist():
        rows_L = widths_L == width
        out_L[rows_L] = fn(load[rows_L, :width]).to(torch.float64)
    return out_L


# The keys `summarize` returns (the record's tables in core/record.py say which are per-layer curves).
SUMMARY_KEYS = ("device_max_over_mean", "expert_max_over_mean", "max_vio", "device_cv", "device_balancedness",
                "expert_balancedness", "device_util_std", "device_max_over_mean_p90")


def summarize(device_LG: torch.Tensor, expert_LE: torch.Tensor, experts_L: torch.Tensor | None = None) -> dict[str, object]:
    """Per-layer and aggregate metrics of one load snapshot, as plain Python numbers.

    device_LG: [L, G] tokens per layer and EP rank; expert_LE: [L, E] routes per layer and expert;
    experts_L: [L] experts of each layer when layers differ (PR-MoE): layer l's experts are its first
    experts_L[l] columns, the rest padding that no expert metric counts (None: every column)."""
    dev_mom_L = max_over_mean(device_LG)
    exp_mom_L = per_width(max_over_mean, expert_LE, experts_L)
    exp_mean_L = per_width(lambda x: x.mean(1), expert_LE, experts_L)
    exp_max_L = per_width(lambda x: x.amax(1), expert_LE, experts_L)
    exp_max_total = float(exp_max_L.sum())
    return {
        "device_max_over_mean": dev_mom_L.tolist(),
        "expert_max_over_mean": exp_mom_L.tolist(),
        "max_vio": (exp_mom_L - 1.0).tolist(),
        "device_cv": cv(device_LG).tolist(),
        "device_balancedness": aggregate_balancedness(device_LG),
        "expert_balancedness": float(exp_mean_L.sum()) / exp_max_total if exp_max_total > 0 else 1.0,
        "device_util_std": device_util_std(device_LG),
        "device_max_over_mean_p90": float(torch.quantile(dev_mom_L, 0.9)) if dev_mom_L.numel() else 1.0,
    }
