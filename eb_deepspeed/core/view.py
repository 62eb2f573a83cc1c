"""The cross-layer load view: one [layers x devices] pressure matrix and one [layers x experts]
heat matrix, EMA-smoothed, identical on every rank (the EasyBalance article, §2.1 and §3.2).

Shape legend: L MoE layers, E logical experts per layer, G EP ranks (devices), B sequences.

`LoadView.update(tally)` folds one step's reduced `Tally` (see `tally.py`) into the view. Everything
here is pure tensor code on CPU float64, so every rank computes the same view from the same
reduced tallies. A layer is left untouched by a step when it saw no tokens (empty batch) or any
non-finite logits on any rank: its EMA keeps the previous value instead of decaying or learning
garbage.
"""
from __future__ import annotations

import torch

from . import metrics as M
from .tally import Tally, TallyLayout, tensor_problem

__all__ = ["LoadView", "sequence_length_weights"]


def sequence_length_weights(lengths_B: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Per-token load weights from per-sequence lengths (the EasyBalance article, last section).

    A token of a long sequence costs more than one of a short sequence on the same expert, so
    the view counts it by its sequence's length relative to the batch mean.
    lengths_B: [B] real length of each sequence (<= seq_len); returns [B * seq_len] weights,
    token t of sequence b weighing lengths_B[b] / mean(lengths_B).
    """
    lengths_B = torch.as_tensor(lengths_B, dtype=torch.float64).reshape(-1)
    if lengths_B.numel() == 0:
        return lengths_B.new_zeros(0)
    if not bool(torch.isfinite(lengths_B).all()) or bool((lengths_B < 0).any()) or bool((lengths_B > seq_len).any()):
        raise ValueError(f"sequence lengths must be in [0, {seq_len}], got min {float(lengths_B.min())} "
                         f"max {float(lengths_B.max())}")
    mean = float(lengths_B.mean())
    w_B = lengths_B / mean if mean > 0 else torch.ones_like(lengths_B)
    return w_B.repeat_interleave(seq_len)


class LoadView:
    """EMA-smoothed device pressure [L, G] and expert heat [L, E], plus the last step's tally.

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
        self.last = Tally.zeros(self.L, self.E)
        self.last_load_LG = torch.zeros(self.L, self.G, dtype=torch.float64)

    # ------------------------------------------------------------------ update
    def device_load(self, per_expert_LE: torch.Tensor) -> torch.Tensor:
        """Sum per-expert load onto the devices holding the experts. [L, E] -> [L, G]"""
        out_LG = per_expert_LE.new_zeros(per_expert_LE.shape[0], self.G)
        return out_LG.index_add_(1, self.expert_to_device_E, per_expert_LE)

    def update(self, tally: Tally, *, device_load_LG: torch.Tensor | None = None) -> torch.Tensor:
        """Fold one step's reduced tally into the view. Returns valid_L [L] bool: the layers that were
        updated (saw tokens, no non-finite logits).

        device_load_LG: [L, G] the step's load per device when experts are not where
        `expert_to_device_E` says (replicated placements); None takes the tally's own `device_LG`
        when it has one, else sums `tally.load_LE` onto the devices.
        The first valid update of a layer sets its EMA directly (no pull towards the zero start).
        """
        if tally.routed_LE.shape != (self.L, self.E):
            raise ValueError(f"tally is for (layers, experts) = {tuple(tally.routed_LE.shape)}, "
                             f"the view has {(self.L, self.E)}")
        packed_LW = tally.pack().detach().to("cpu", torch.float64)           # a private copy
        tally = Tally.unpack(packed_LW, self.E, 0 if tally.device_LG is None else self.G)
        if device_load_LG is None:
            device_load_LG = tally.device_LG
        load_LG = self.device_load(tally.load_LE) if device_load_LG is None else \
            torch.as_tensor(device_load_LG, dtype=torch.float64).detach().cpu().clone()
        if load_LG.shape != (self.L, self.G):
            raise ValueError(f"device_load_LG must be [{self.L}, {self.G}], got {tuple(load_LG.shape)}")
        for part in (packed_LW, load_LG):
            if not bool(torch.isfinite(part).all()) or bool((part < 0).any()):
                raise ValueError("tallies must be finite and non-negative; a gate recorded a corrupt count")
        valid_L = tally.valid_L()
        a = self.ema_alpha
        first_L1 = (self.updates_L == 0).unsqueeze(1)
        valid_L1 = valid_L.unsqueeze(1)
        heat_new = torch.where(first_L1, tally.routed_LE, a * tally.routed_LE + (1 - a) * self.heat_LE)
        pressure_new = torch.where(first_L1, load_LG, a * load_LG + (1 - a) * self.pressure_LG)
        self.heat_LE = torch.where(valid_L1, heat_new, self.heat_LE)
        self.pressure_LG = torch.where(valid_L1, pressure_new, self.pressure_LG)
        self.updates_L += valid_L.long()
        self.steps += 1
        self.last, self.last_load_LG = tally, load_LG
        return valid_L

    # ------------------------------------------------------------------ reads
    @property
    def ready(self) -> bool:
        """True once every layer has had `warmup_batches` valid updates (the EasyBalance article, §4.3)."""
        return bool((self.updates_L >= self.warmup_batches).all())

    def cross_layer_pressure(self, window: int | None = None) -> torch.Tensor:
        """Pressure of each device summed over layers l-w .. l+w (clipped at the ends). [L, G]"""
        w = self.window if window is None else int(window)
        csum_LG = torch.cat([self.pressure_LG.new_zeros(1, self.G), self.pressure_LG.cumsum(0)])
        idx_L = torch.arange(self.L)
        lo_L, hi_L = (idx_L - w).clamp(min=0), (idx_L + w + 1).clamp(max=self.L)
        return csum_LG[hi_L] - csum_LG[lo_L]

    def metrics(self) -> dict[str, object]:
        """Metrics of the last step and of the EMA view, as Python numbers.

        Device metrics are of the step's device load as the view took it (kept routes, weighted by
        sequence length when that is on, or the device load given to `update`); expert metrics of
        the routed demand. A layer with non-finite router logits this step routed garbage: its
        per-layer numbers are None (JSON null) and the aggregates leave it out
        (`nonfinite_layer_ids` lists them).
        """
        last = self.last
        bad_L = last.nonfinite_L > 0
        good_L = ~bad_L
        if bool(good_L.any()):
            out = M.summarize(self.last_load_LG[good_L], last.routed_LE[good_L])
        else:                                   # nothing this step to aggregate
            out = {key: [] for key in ("device_max_over_mean", "expert_max_over_mean", "max_vio", "device_cv")}
            out.update(dict.fromkeys(("device_balancedness", "expert_balancedness", "device_util_std",
                                      "device_max_over_mean_p90"), None))
        routed_L = last.routed_LE.sum(1)
        dropped_L = last.dropped_L()
        out["token_drop_rate"] = (M.token_drop_rate(dropped_L[good_L], routed_L[good_L], k=1)   # routed = tokens * k
                                  if bool(good_L.any()) else None)
        out["layer_token_drop_rate"] = torch.where(routed_L > 0, dropped_L / routed_L.clamp_min(1), 0.0)[good_L].tolist()
        out["aux_loss"] = last.mean_aux_L()[good_L].tolist()
        bad = bad_L.nonzero().flatten().tolist()
        if bad:                                 # per-layer lists get None where a layer was left out
            for key in ("device_max_over_mean", "expert_max_over_mean", "max_vio", "device_cv",
                        "layer_token_drop_rate", "aux_loss"):
                values = iter(out[key])
                out[key] = [None if bad_L[i] else next(values) for i in range(self.L)]
        out["ema_device_max_over_mean"] = M.max_over_mean(self.pressure_LG).tolist()
        out["ema_device_util_std"] = M.device_util_std(self.pressure_LG)
        out["tokens"] = float(last.tokens_L.max())
        out["nonfinite_tokens"] = float(last.nonfinite_L.sum())
        out["nonfinite_layer_ids"] = bad
        out["skipped_layers"] = int(self.L - int(last.valid_L().sum()))
        out["ready"] = self.ready
        out["steps"] = self.steps
        return out

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, object]:
        return {"shape": (self.L, self.E, self.G), "heat_LE": self.heat_LE.clone(),
                "pressure_LG": self.pressure_LG.clone(), "updates_L": self.updates_L.clone(),
                "steps": self.steps, "expert_to_device_E": self.expert_to_device_E.clone(),
                "last_tally": self.last.pack(), "last_devices": 0 if self.last.device_LG is None else self.G,
                "last_load_LG": self.last_load_LG.clone()}

    def state_problem(self, state: object) -> str | None:
        """Why `state` cannot be this view's (None: it can). Checks everything `load_state_dict` reads."""
        if not isinstance(state, dict) or "shape" not in state:
            return "the load view state is not a dict with a shape"
        try:
            shape = tuple(int(x) for x in state["shape"])
        except (TypeError, ValueError):
            return f"the load view's shape {state['shape']!r} is not (layers, experts, devices)"
        if shape != (self.L, self.E, self.G):
            return (f"the checkpointed load view is (layers, experts, devices) = {shape}, this model has "
                    f"{(self.L, self.E, self.G)}")
        devices = state.get("last_devices")
        if devices not in (0, self.G):
            return f"the load view's last_devices is {devices!r}, expected 0 or {self.G}"
        if not isinstance(state.get("steps"), int) or state["steps"] < 0:
            return f"the load view's steps is {state.get('steps')!r}, expected an integer >= 0"
        width = TallyLayout(self.E, devices).width
        return tensor_problem(state, "load view", {
            "heat_LE": (self.L, self.E), "pressure_LG": (self.L, self.G), "updates_L": (self.L, ),
            "expert_to_device_E": (self.E, ), "last_tally": (self.L, width), "last_load_LG": (self.L, self.G)})

    def load_state_dict(self, state: dict[str, object]) -> None:
        problem = self.state_problem(state)
        if problem is not None:
            raise ValueError(problem)
        self.heat_LE = state["heat_LE"].to(torch.float64).clone()
        self.pressure_LG = state["pressure_LG"].to(torch.float64).clone()
        self.updates_L = state["updates_L"].to(torch.long).clone()
        self.steps = int(state["steps"])
        self.expert_to_device_E = state["expert_to_device_E"].to(torch.long).clone()
        self.last = Tally.unpack(state["last_tally"].to(torch.float64).clone(), self.E, int(state["last_devices"]))
        self.last_load_LG = state["last_load_LG"].to(torch.float64).clone()
