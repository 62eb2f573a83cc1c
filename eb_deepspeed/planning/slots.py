"""Physical-slot helpers shared by the planner's steps.

Shape legend: N rows (layers, or candidate placements), P physical slots (G * S; slot p lives on
device p // S), G devices, S slots per device, E logical experts.
"""
from __future__ import annotations

import numpy as np

__all__ = ["holds_mask"]


def holds_mask(phy_NP: np.ndarray, S: int, E: int) -> np.ndarray:
    """holds_NGE [N, G, E] bool from phy_NP [N, P] (-1 = empty): device g holds a replica of expert e."""
    N, P = phy_NP.shape
    h = np.zeros((N, P // S, E + 1), dtype=bool)
    h[np.arange(N)[:, None], np.arange(P)[None, :] // S, phy_NP + 1] = True
    return h[:, :, 1:]
