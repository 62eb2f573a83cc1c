"""The cross-layer load view: one [layers x devices] pressure matrix and one [layers x experts]
heat matrix, EMA-smoothed, identical on every rank (seed 000 §2.1 and §3.2).

Shape legend: L MoE layers, E logical experts per layer, G EP ranks (devices), W tally width (3E + 6).

Each gate adds its routes to a per-layer *tally* during forward (see `tally_width`); at each
gradient-accumulation boundary the adapter stacks the tallies into one `[L, W]` tensor, does
one all-reduce, and calls `LoadView.update` with the sum. Everything here is pure tensor code
on CPU float64, so every rank computes the same view from the same reduced tallies.

Tally layout per layer, W = 3E + 6:
    [0, E)          routed     route requests per expert before the capacity limit (demand)
    E               scratch    routes that were not kept land here; ignored
    [E+1, 2E+1)     kept       routes kept per expert (processed)
    2E + 1          scratch
    [2E+2, 3E+2)    load       kept routes weighted by sequence length (= kept when weighting is off)
    3E + 2          tokens     tokens seen
    3E + 3          nonfinite  tokens whose router logits held NaN/Inf
    3E + 4          aux        sum of the layer's unweighted l_aux over forwards (and ranks)
    3E + 5          forwards   forward calls that recorded (so aux / forwards is the mean l_aux)

(A scratch slot sits just before `kept` and `load` so that the gate's index_adds of
`expert id + offset` need no mask: routes that were not kept carry id -1. Dropped routes are
routed - kept.)

A layer is left untouched by a step when it saw no tokens (empty batch) or any non-finite
logits on any rank: its EMA keeps the previous value instead of decaying or learning garbage.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import metrics as M

__all__ = ["LoadView", "tally_width", "split_tally", "TallySplit", "sequence_length_weights"]


def tally_width(num_experts: int) -> int:
    return 3 * num_experts + 6


@dataclass
class TallySplit:
    routed_LE: torch.Tensor
    kept_LE: torch.Tensor
    load_LE: torch.Tensor
    tokens_L: torch.Tensor
    nonfinite_L: torch.Tensor
    aux_L: torch.Tensor
    forwards_L: torch.Tensor


def split_tally(tally_LW: torch.Tensor, num_experts: int) -> TallySplit:
    """Split a stacked tally [L, 3E + 6] into its named parts (views, no copies)."""
    E = num_experts
    if tally_LW.dim() != 2 or tally_LW.shape[1] != tally_width(E):
        raise ValueError(f"tally must be [layers, {tally_width(E)}] for {E} experts, got {tuple(tally_LW.shape)}")
    return TallySplit(tally_LW[:, :E], tally_LW[:, E + 1:2 * E + 1], tally_LW[:, 2 * E + 2:3 * E + 2],
                      tally_LW[:, 3 * E + 2], tally_LW[:, 3 * E + 3], tally_LW[:, 3 * E + 4], tally_LW[:, 3 * E + 5])


def sequence_length_weights(lengths_B: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Per-token load weights from per-sequence lengths (seed 000, last section).

    A token of a long sequence costs more than one of a short sequence on the same expert, so
    the view counts it by its sequence's length relative to the batch mean.
    lengths_B: [B] real length of each sequence (<= seq_len); returns [B * seq_len] weights,
    token t of sequence b weighing lengths_B[b] / mean(lengths_B).
    """
    lengths_B = torch.as_tensor(lengths_B, dtype=torch.float64).reshape(-1)
    if lengths_B.numel() == 0:
        return lengths_B.new_zeros(0)
    if bool((lengths_B < 0).any()) or bool((lengths_B > seq_len).any()):
        raise ValueError(f"sequence lengths must be in [0, {seq_len}], got min {float(lengths_B.min())} "
                         f"max {float(lengths_B.max())}")
    mean = float(lengths_B.mean())
    w_B = lengths_B / mean if mean > 0 else torch.ones_like(lengths_B)
    return w_B.repeat_interleave(seq_len)


class LoadView:
    """EMA-smoothed device pressure [L, G] and expert heat [L, E], plus the last step's raw tallies.

    expert_to_device_E: [E] EP rank holding each expert; default is DeepSpeed's contiguous layout
    (expert e on rank e // (E / G)).
    """

    def __init__(self, num_layers: int, num_experts: int, num_devices: int, *, ema_alpha: float = 0.3,
                 window: int = 5, warmup_batches: int = 4, expert_to_device_E: torch.Tensor | None = None):
        if num_layers < 1 or num_experts < 1 or num_devices < 1:
            raise ValueError(f"num_layers ({num_layers}), num_experts ({num_experts}) and num_devices "
                             f"({num_devices}) must be >= 1")
        if expert_to_device_E is None:
            if num_experts % num_devices:
                raise ValueError(f"num_experts ({num_experts}) must be divisible by num_devices ({num_devices})")
            expert_to_device_E = torch.arange(num_experts) // (num_experts // num_devices)
        expert_to_device_E = torch.as_tensor(expert_to_device_E, dtype=torch.long)
        if expert_to_device_E.shape != (num_experts,) or int(expert_to_device_E.min()) < 0 \
                or int(expert_to_device_E.max()) >= num_devices:
            raise ValueError(f"expert_to_device_E must be [{num_experts}] with values in [0, {num_devices})")
        self.L, self.E, self.G = num_layers, num_experts, num_devices
        self.ema_alpha, self.window, self.warmup_batches = float(ema_alpha), int(window), int(warmup_batches)
        self.expert_to_device_E = expert_to_device_E
        self.heat_LE = torch.zeros(self.L, self.E, dtype=torch.float64)
        self.pressure_LG = torch.zeros(self.L, self.G, dtype=torch.float64)
        self.updates_L = torch.zeros(self.L, dtype=torch.long)
        self.steps = 0
        self._last_tally_LW = torch.zeros(self.L, tally_width(self.E), dtype=torch.float64)
        self.last = split_tally(self._last_tally_LW, self.E)

    # ------------------------------------------------------------------ update
    def device_load(self, per_expert_LE: torch.Tensor) -> torch.Tensor:
        """Sum per-expert load onto the devices holding the experts. [L, E] -> [L, G]"""
        out_LG = per_expert_LE.new_zeros(per_expert_LE.shape[0], self.G)
        return out_LG.index_add_(1, self.expert_to_device_E, per_expert_LE)

    def update(self, tally_LW: torch.Tensor) -> torch.Tensor:
        """Fold one step's reduced tallies [L, 3E + 6] into the view. Returns valid_L [L] bool:
        the layers that were updated (saw tokens, no non-finite logits).

        The first valid update of a layer sets its EMA directly (no pull towards the zero start).
        """
        tally_LW = torch.as_tensor(tally_LW).detach().to("cpu", torch.float64).clone()
        part = split_tally(tally_LW, self.E)
        tally_LW[:, [self.E, 2 * self.E + 1]] = 0.0  # the scratch slots
        if not bool(torch.isfinite(tally_LW).all()) or bool((tally_LW < 0).any()):
            raise ValueError("tallies must be finite and non-negative; a gate recorded a corrupt count")
        valid_L = (part.tokens_L > 0) & (part.nonfinite_L == 0)
        a = self.ema_alpha
        first_L1 = (self.updates_L == 0).unsqueeze(1)
        valid_L1 = valid_L.unsqueeze(1)

        heat_new = torch.where(first_L1, part.routed_LE, a * part.routed_LE + (1 - a) * self.heat_LE)
        load_LG = self.device_load(part.load_LE)
        pressure_new = torch.where(first_L1, load_LG, a * load_LG + (1 - a) * self.pressure_LG)
        self.heat_LE = torch.where(valid_L1, heat_new, self.heat_LE)
        self.pressure_LG = torch.where(valid_L1, pressure_new, self.pressure_LG)
        self.updates_L += valid_L.long()
        self.steps += 1
        self._last_tally_LW, self.last = tally_LW, part
        return valid_L

    # ------------------------------------------------------------------ reads
    @property
    def ready(self) -> bool:
        """True once every layer has had `warmup_batches` valid updates (seed 000 §4.3)."""
        return bool((self.updates_L >= self.warmup_batches).all())

    def cross_layer_pressure(self, window: int | None = None) -> torch.Tensor:
        """Pressure of each device summed over layers l-w .. l+w (clipped at the ends). [L, G]"""
        w = self.window if window is None else int(window)
        csum_LG = torch.cat([self.pressure_LG.new_zeros(1, self.G), self.pressure_LG.cumsum(0)])
        idx_L = torch.arange(self.L)
        lo_L, hi_L = (idx_L - w).clamp(min=0), (idx_L + w + 1).clamp(max=self.L)
        return csum_LG[hi_L] - csum_LG[lo_L]

    def metrics(self) -> dict[str, object]:
        """Metrics of the last step (raw tallies) and of the EMA view, as Python numbers."""
        last = self.last
        out = M.summarize(self.device_load(last.kept_LE), last.routed_LE)
        routed_L = last.routed_LE.sum(1)
        dropped_L = (routed_L - last.kept_LE.sum(1)).clamp_min(0)
        out["token_drop_rate"] = M.token_drop_rate(dropped_L, routed_L, k=1)  # routed = tokens * k already
        out["layer_token_drop_rate"] = torch.where(routed_L > 0, dropped_L / routed_L.clamp_min(1), 0.0).tolist()
        out["ema_device_max_over_mean"] = M.max_over_mean(self.pressure_LG).tolist()
        out["ema_device_util_std"] = M.device_util_std(self.pressure_LG)
        out["aux_loss"] = torch.where(last.forwards_L > 0, last.aux_L / last.forwards_L.clamp_min(1), 0.0).tolist()
        out["tokens"] = float(last.tokens_L.max())
        out["nonfinite_tokens"] = float(last.nonfinite_L.sum())
        out["skipped_layers"] = int(self.L - int(((last.tokens_L > 0) & (last.nonfinite_L == 0)).sum()))
        out["ready"] = self.ready
        out["steps"] = self.steps
        return out

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, object]:
        return {"shape": (self.L, self.E, self.G), "heat_LE": self.heat_LE.clone(),
                "pressure_LG": self.pressure_LG.clone(), "updates_L": self.updates_L.clone(),
                "steps": self.steps, "expert_to_device_E": self.expert_to_device_E.clone(),
                "last_tally_LW": self._last_tally_LW.clone()}

    def load_state_dict(self, state: dict[str, object]) -> None:
        shape = tuple(state["shape"])
        if shape != (self.L, self.E, self.G):
            raise ValueError(f"checkpointed load view is (layers, experts, devices) = {shape}, "
                             f"this model has {(self.L, self.E, self.G)}")
        self.heat_LE = state["heat_LE"].to(torch.float64).clone()
        self.pressure_LG = state["pressure_LG"].to(torch.float64).clone()
        self.updates_L = state["updates_L"].to(torch.long).clone()
        self.steps = int(state["steps"])
        self.expert_to_device_E = state["expert_to_device_E"].to(torch.long).clone()
        self._last_tally_LW = state["last_tally_LW"].to(torch.float64).clone()
        self.last = split_tally(self._last_tally_LW, self.E)
