"""Checkpointed state that may be damaged: why a saved state's tensors do not fit this model.

    problem = why_tensors_unfit(state, "load view", {"heat_LE": (L, E)}, {"heat_LE": (0, 1e12)})   # str or None"""
from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = []


def why_tensors_unfit(state: dict, what: str, shapes: dict[str, tuple[int, ...]],
                   ranges: Optional[dict[str, tuple[float, float]]] = None) -> str | None:
    """Why the tensors of a checkpointed `state` do not fit `shapes` (missing, wrong shape, non-finite), or lie
    outside their plausible `ranges` ({key: (lo, hi)}, both included): a finite but impossible value (a
    negative count, a bias that puts every token on one expert) is refused as a damaged state, naming it."""
    for key, shape in shapes.items():
        t = state.get(key)
        if not isinstance(t, torch.Tensor) or t.is_complex():
            return f"the {what} state's {key} is not a real tensor"
        if tuple(t.shape) != shape:
            return f"the checkpointed {what} {key} has shape {tuple(t.shape)}, this model {shape}"
        if not bool(torch.isfinite(t).all()):
            return f"the checkpointed {what} {key} holds NaN or inf"
        lo, hi = (ranges or {}).get(key, (-math.inf, math.inf))
        if t.numel() and (float(t.min()) < lo or float(t.max()) > hi):
            return (f"the checkpointed {what} {key} holds values in [{float(t.min()):.4g}, {float(t.max()):.4g}], "
                    f"outside the plausible [{lo:g}, {hi:g}]")
    return None
