"""The cross-layer load view: one [layers x devices] pressure matrix and one [layers x experts]
heat matrix, EMA-smoothed, identical on every rank (the EasyBalance article, §2.1 and §3.2).

Shape legend: L MoE layers, E logical experts per layer (the most of any layer when layers differ),
G EP ranks (devices; the largest EP group when layers differ).

`LoadView.update(tally)` folds one step's reduced `Tally` into the view: pure CPU float64 tensor code, so every
rank computes the same view. A layer that saw no tokens or any non-finite logits on any rank is left untouched by
that step (its EMA holds instead of decaying or learning garbage)."""
from __future__ import annotations

import math

import torch

from . import metrics as M
from .record import PER_LAYER
from .tally import Tally, TallyLayout

__all__ = ["LoadView"]


def _per_layer(value, num_layers: int, name: str) -> torch.Tensor:
    """[L] long from an int (every layer) or a sequence of L ints, each >= 1."""
    out_L = torch.as_tensor(value, dtype=torch.long).reshape(-1)
    if out_L.numel() == 1:
        out_L = out_L.expand(num_layers).clone()
    if out_L.numel() != num_layers or bool((out_L < 1).any()):
        raise ValueError(f"{name} ({value}) must be >= 1, one number or one per layer ({num_layers})")
    return out_L


def _show(x_L: torch.Tensor):
    """One number when every layer has it, else the per-layer list (for messages)."""
    return int(x_L[0]) if bool((x_L == x_L[0]).all()) else x_L.tolist()


class LoadView:
    """EMA-smoothed device pressure [L, G] and expert heat [L, E], plus the last step's tally.

    Layers may differ in shape (PR-MoE: more experts in deeper layers; a smaller `ep_size` where a
    layer has fewer experts than ranks): `num_experts` and `num_devices` are then per-layer sequences
    [L] (E_l experts over an EP group of e_l ranks). The view pads experts to E = max E_l (layer l's
    experts are its first E_l columns; `mask_LE` marks them) and spans G = max e_l devices: a layer with
    a smaller group (e_l divides G) is repeated G / e_l times across the view's devices, copy c of its
    group-local rank j being view device c * e_l + j (DeepSpeed's contiguous EP groups nest so). Each
    rank's tokens reach only its own group's copy; gates that know their copy tally the exact device
    load (`Tally.device_LG`), else a copied layer's expert load is split evenly over its copies.

    expert_to_device_E: EP rank (group-local) holding each expert, [E] for every layer or [L, E];
    default DeepSpeed's contiguous layout (expert e of layer l on rank e // (E_l / e_l))."""

    def __init__(self, num_layers: int, num_experts, num_devices, *, ema_alpha: float = 0.3,
                 window: int = 5, warmup_batches: int = 4, expert_to_device_E: torch.Tensor | None = None):
        if num_layers < 1:
            raise ValueError(f"num_layers ({num_layers}) must be >= 1")
        self.experts_L = experts_L = _per_layer(num_experts, num_layers, "num_experts")
        self.devices_L = devices_L = _per_layer(num_devices, num_layers, "num_devices")
        self.L, self.E, self.G = int(num_layers), int(experts_L.max()), int(devices_L.max())
        if bool((self.G % devices_L).any()):
            raise ValueError(f"every layer's EP size must divide the largest ({self.G}), got {devices_L.tolist()}")
        self.copies_L = self.G // devices_L                         # copies of each layer's EP group in the view
        self.mask_LE = torch.arange(self.E)[None, :] < experts_L[:, None]
        self.expert_to_device_LE = self._checked_map(expert_to_device_E)
        self.ema_alpha, self.window, self.warmup_batches = float(ema_alpha), int(window), int(warmup_batches)
        self.heat_LE = torch.zeros(self.L, self.E, dtype=torch.float64)
        self.drift_L = torch.zeros(self.L, dtype=torch.float64)   # the last step's expert mix against the heat
        self.var_LE = torch.zeros(self.L, self.E, dtype=torch.float64)   # EMA of (step - heat)^2: see `swing_LE`
        self.pressure_LG = torch.zeros(self.L, self.G, dtype=torch.float64)
        self.updates_L = torch.zeros(self.L, dtype=torch.long)
        self.steps = 0
        self.last = Tally.zeros(self.L, self.E)
        self.last_load_LG = torch.zeros(self.L, self.G, dtype=torch.float64)

    def _checked_map(self, expert_to_device: torch.Tensor | None) -> torch.Tensor:
        """[L, E] group-local EP rank of each expert (padded experts 0), from [E], [L, E] or the default."""
        L, E = self.L, self.E
        if expert_to_device is None:
            if bool((self.experts_L % self.devices_L).any()):
                raise ValueError(f"num_experts ({_show(self.experts_L)}) must be divisible by num_devices "
                                 f"({_show(self.devices_L)}) in every layer")
            map_LE = torch.arange(E)[None, :] // (self.experts_L // self.devices_L)[:, None]
        else:
            map_LE = torch.as_tensor(expert_to_device, dtype=torch.long)
            if map_LE.dim() == 1:
                map_LE = map_LE.expand(L, -1)
            if map_LE.shape != (L, E):
                raise ValueError(f"expert_to_device_E must be [{E}] or [{L}, {E}], got {tuple(map_LE.shape)}")
        map_LE = torch.where(self.mask_LE, map_LE, 0)
        if bool((map_LE < 0).any()) or bool((map_LE >= self.devices_L[:, None]).any()):
            raise ValueError(f"expert_to_device_E: each layer's experts must sit on EP ranks [0, num_devices) "
                             f"({_show(self.devices_L)})")
        return map_LE.clone()

    def move_experts(self, expert_to_device_LE: torch.Tensor) -> None:
        """Experts now on other EP ranks ([E] or [L, E]): loads go onto their new ranks, the device pressure is
        rebuilt from the heat (as a checkpoint of another layout is restored)."""
        self.expert_to_device_LE = self._checked_map(expert_to_device_LE)
        self.pressure_LG = self.expert_to_device_load(self.heat_LE)

    def layer_map(self, layer: int) -> torch.Tensor:
        """[E_l] group-local EP rank of each expert of `layer` (what its gate's device loss needs)."""
        return self.expert_to_device_LE[layer, :int(self.experts_L[layer])]

    def _copies(self):
        """(has_L [L] bool, device_LE [L, E]) for each copy c of the layers' EP groups: which layers have a
        copy c, and the view device that copy gives each expert (c * e_l + its group-local rank)."""
        for copy in range(int(self.copies_L.max())):
            yield self.copies_L > copy, (copy * self.devices_L[:, None] + self.expert_to_device_LE).clamp_max(self.G - 1)

    def expert_device_mean(self, x_LG: torch.Tensor) -> torch.Tensor:
        """Per expert, the mean of `x_LG` [L, G] over the view devices holding a copy of it. -> [L, E]
        (padded experts 0). One copy per expert (uniform layers): x_LG at the expert's device."""
        x_LG = x_LG.to(torch.float64)
        out_LE = torch.zeros(self.L, self.E, dtype=torch.float64)
        for has_L, device_LE in self._copies():
            out_LE += torch.where(has_L[:, None], x_LG.gather(1, device_LE), 0.0)
        return torch.where(self.mask_LE, out_LE / self.copies_L[:, None], 0.0)

    def expert_to_device_load(self, per_expert_LE: torch.Tensor) -> torch.Tensor:
        """Sum per-expert load onto the devices holding the experts. [L, E] -> [L, G]

        A layer whose EP group is copied across the view's devices has its load split evenly over its
        copies (exact when every rank routes alike; gates that tally devices give the exact load)."""
        per_expert_LE = torch.where(self.mask_LE, per_expert_LE.to(torch.float64), 0.0)
        out_LG = per_expert_LE.new_zeros(self.L, self.G)
        row_L1 = torch.arange(self.L)[:, None] * self.G
        for has_L, device_LE in self._copies():
            share_LE = per_expert_LE if bool((self.copies_L == 1).all()) else \
                torch.where(has_L[:, None], per_expert_LE / self.copies_L[:, None], 0.0)
            out_LG.view(-1).index_add_(0, (row_L1 + device_LE).reshape(-1), share_LE.reshape(-1))
        return out_LG

    def update(self, tally: Tally) -> torch.Tensor:
        """Fold one step's reduced tally into the view (a copy of it). Returns valid_L [L] bool: the layers
        that were updated (saw tokens, no non-finite logits). The device load is the tally's `device_LG` when it
        has one (replicated placements), else its `kept_LE` summed onto the experts' devices. The first valid
        update of a layer sets its EMA directly (no pull towards the zero start)."""
        if tally.routed_LE.shape != (self.L, self.E):
            raise ValueError(f"tally is for (layers, experts) = {tuple(tally.routed_LE.shape)}, "
                             f"the view has {(self.L, self.E)}")
        return self.update_packed(tally.pack().detach().to("cpu", torch.float64),       # pack: a private copy
                                  0 if tally.device_LG is None else self.G)

    def update_packed(self, packed_LW: torch.Tensor, num_devices: int = 0) -> torch.Tensor:
        """`update` from the reduced packed tally [L, W] (CPU float64), which the view keeps as `last` (its
        fields are views into it: hand over a buffer no one else writes). num_devices: G when the tally
        holds `device_LG`, else 0."""
        tally = Tally.unpack(packed_LW, self.E, num_devices)
        padded_LE = ~self.mask_LE
        if bool(padded_LE.any()) and any(bool(t[padded_LE].ne(0).any()) for t in (tally.routed_LE, tally.kept_LE)):
            raise ValueError(f"a tally counted routes to experts a layer does not have (experts per layer "
                             f"{self.experts_L.tolist()}); a gate recorded a corrupt count")
        load_LG = self.expert_to_device_load(tally.kept_LE) if tally.device_LG is None else tally.device_LG.clone()
        for part in (packed_LW, load_LG):
            if not bool(torch.isfinite(part).all()) or bool((part < 0).any()):
                raise ValueError("tallies must be finite and non-negative; a gate recorded a corrupt count")
        valid_L = tally.valid_L()
        a = self.ema_alpha
        first_L1 = (self.updates_L == 0).unsqueeze(1)
        valid_L1 = valid_L.unsqueeze(1)
        self.drift_L = torch.where(valid_L & ~first_L1[:, 0], _mix_distance(tally.routed_LE, self.heat_LE), 0.0)
        heat_ew, var_ew = ew_step(self.heat_LE, self.var_LE, tally.routed_LE, a)
        heat_new = torch.where(first_L1, tally.routed_LE, heat_ew)
        var_new = torch.where(first_L1, 0.0, var_ew)        # no swing before a second step
        self.var_LE = torch.where(valid_L1, var_new, self.var_LE)
        pressure_new = torch.where(first_L1, load_LG, a * load_LG + (1 - a) * self.pressure_LG)
        self.heat_LE = torch.where(valid_L1, heat_new, self.heat_LE)
        self.pressure_LG = torch.where(valid_L1, pressure_new, self.pressure_LG)
        self.updates_L += valid_L.long()
        self.steps += 1
        self.last, self.last_load_LG = tally, load_LG
        return valid_L

    @property
    def swing_LE(self) -> torch.Tensor:
        """[L, E] how far each expert's routed count swings from step to step around its heat (the
        exponentially weighted standard deviation, same units): batch noise and drift alike. The planner
        gives replicas by heat + HEDGE x swing under an even split (`plan_placement`)."""
        return self.var_LE.sqrt()

    @property
    def ready(self) -> bool:
        """True once every layer has had `warmup_batches` valid updates (the EasyBalance article, §4.3)."""
        return bool((self.updates_L >= self.warmup_batches).all())

    def window_pressure(self, window: int | None = None) -> torch.Tensor:
        """Pressure of each device summed over layers l-w .. l+w (clipped at the ends). [L, G]"""
        w = self.window if window is None else int(window)
        csum_LG = torch.cat([self.pressure_LG.new_zeros(1, self.G), self.pressure_LG.cumsum(0)])
        idx_L = torch.arange(self.L)
        lo_L, hi_L = (idx_L - w).clamp(min=0), (idx_L + w + 1).clamp(max=self.L)
        return csum_LG[hi_L] - csum_LG[lo_L]

    def metrics(self) -> dict[str, object]:
        """Metrics of the last step and of the EMA view, as Python numbers.

        Device metrics are of the step's device load as the view took it (kept routes, or the tally's own
        device load); expert metrics of the routed demand. A layer with non-finite router logits this step routed
        garbage: its per-layer numbers are None (JSON null) and the aggregates leave it out (`nonfinite_layer_ids`)."""
        last = self.last
        bad_L = last.nonfinite_L > 0
        good_L = ~bad_L
        if bool(good_L.any()):
            out = M.summarize(self.last_load_LG[good_L], last.routed_LE[good_L], self.experts_L[good_L])
        else:                                   # nothing this step to aggregate: the record's keys, empty
            out = {key: [] if key in PER_LAYER else None for key in M.SUMMARY_KEYS}
        routed_L = last.routed_LE.sum(1)
        dropped_L = last.dropped_L()
        out["token_drop_rate"] = (M.token_drop_rate(dropped_L[good_L], routed_L[good_L], k=1)   # routed = tokens * k
                                  if bool(good_L.any()) else None)
        out["layer_token_drop_rate"] = torch.where(routed_L > 0, dropped_L / routed_L.clamp_min(1), 0.0)[good_L].tolist()
        out["aux_loss"] = last.mean_aux_L()[good_L].tolist()
        out["heat_drift"] = self.drift_L[good_L].tolist()
        bad = bad_L.nonzero().flatten().tolist()
        if bad:                                 # per-layer lists get None where a layer was left out
            for key in [k for k in PER_LAYER if k in out]:
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

    def state_dict(self) -> dict[str, object]:
        return {"shape": (self.L, self.E, self.G), "heat_LE": self.heat_LE.clone(),
                "pressure_LG": self.pressure_LG.clone(), "updates_L": self.updates_L.clone(),
                "steps": self.steps, "experts_L": self.experts_L.clone(), "devices_L": self.devices_L.clone(),
                "expert_to_device_LE": self.expert_to_device_LE.clone(),
                "last_tally": self.last.pack(), "last_devices": 0 if self.last.device_LG is None else self.G,
                "last_load_LG": self.last_load_LG.clone(), "drift_L": self.drift_L.clone(),
                "var_LE": self.var_LE.clone()}

    def layout_change(self, state: dict) -> str | None:
        """How the devices of a state (one `why_unfit` accepts) differ from this view's (None: they do not):
        another EP size, or experts on other EP ranks. Such a state is restored expert by expert (`load_state_dict`)."""
        devices_L = state["devices_L"].to(torch.long)
        if not torch.equal(devices_L, self.devices_L):
            return f"EP ranks per layer {_show(devices_L)} -> {_show(self.devices_L)}"
        if not torch.equal(torch.where(self.mask_LE, state["expert_to_device_LE"].long(), 0), self.expert_to_device_LE):
            return "experts on other EP ranks"
        return None

    def why_unfit(self, state: object) -> str | None:
        """Why `state` cannot be this view's (None: it can). Checks everything `load_state_dict` reads.

        Layers and experts must match; the devices may differ (`layout_change`): then only the expert-level
        fields are read."""
        if not isinstance(state, dict) or "shape" not in state:
            return "the load view state is not a dict with a shape"
        try:
            shape = tuple(int(x) for x in state["shape"])
        except (TypeError, ValueError):
            return f"the load view's shape {state['shape']!r} is not (layers, experts, devices)"
        if len(shape) != 3 or shape[:2] != (self.L, self.E) or shape[2] < 1:
            return (f"the checkpointed load view is (layers, experts, devices) = {shape}, this model has "
                    f"{(self.L, self.E, self.G)}")
        G = shape[2]
        devices = state.get("last_devices")
        if devices not in (0, G):
            return f"the load view's last_devices is {devices!r}, expected 0 or {G}"
        if not isinstance(state.get("steps"), int) or state["steps"] < 0:
            return f"the load view's steps is {state.get('steps')!r}, expected an integer >= 0"
        width = TallyLayout(self.E, devices).width
        shapes = {"heat_LE": (self.L, self.E), "pressure_LG": (self.L, G), "updates_L": (self.L, ),
                  "last_tally": (self.L, width), "last_load_LG": (self.L, G), "drift_L": (self.L, ),
                  "var_LE": (self.L, self.E), "experts_L": (self.L, ), "devices_L": (self.L, ),
                  "expert_to_device_LE": (self.L, self.E)}
        # counts and loads are never negative; every field of the last tally is a count or a non-negative loss
        ranges = {key: (0.0, math.inf) for key in ("heat_LE", "pressure_LG", "updates_L", "last_tally", "last_load_LG",
                                                   "var_LE")}
        ranges["drift_L"] = (0.0, 1.0)
        problem = why_tensors_unfit(state, "load view", shapes, ranges)
        if problem is None and not torch.equal(state["experts_L"].to(torch.long), self.experts_L):
            return (f"the checkpointed load view's experts_L per layer is {state['experts_L'].tolist()}, this model's "
                    f"{self.experts_L.tolist()}")
        return problem

    def load_state_dict(self, state: dict[str, object]) -> str | None:
        """Restore a state `why_unfit` accepts (else ValueError, nothing changed). Returns `layout_change`: with
        the same devices everything is restored; with other devices (another EP size, another expert layout)
        the expert heat, update counts and step count carry over, the device pressure is rebuilt from the heat
        for this view's layout, and the last step's tally starts empty."""
        problem = self.why_unfit(state)
        if problem is not None:
            raise ValueError(problem)
        change = self.layout_change(state)
        kept = ("heat_LE", "drift_L", "var_LE") + (("pressure_LG", "last_load_LG") if change is None else ())
        for key in kept:         # float64 copies: the view never shares the state's tensors
            setattr(self, key, state[key].to(torch.float64).clone())
        self.updates_L = state["updates_L"].to(torch.long).clone()
        self.steps = int(state["steps"])
        if change is not None:
            self.pressure_LG = self.expert_to_device_load(self.heat_LE)
            self.last = Tally.zeros(self.L, self.E)
            self.last_load_LG = torch.zeros(self.L, self.G, dtype=torch.float64)
            return change
        self.last = Tally.unpack(state["last_tally"].to(torch.float64).clone(), self.E, int(state["last_devices"]))
        return None


def ew_step(mean: torch.Tensor, var: torch.Tensor, x: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the exponentially weighted mean and the variance that goes with it (the view's heat and
    swing; the replay's copy of the serving rule)."""
    return (1 - alpha) * mean + alpha * x, (1 - alpha) * (var + alpha * (x - mean) ** 2)


def _mix_distance(a_LE: torch.Tensor, b_LE: torch.Tensor) -> torch.Tensor:
    """[L] total variation between each layer's expert mix in a and in b: 0 the same shares, 1 disjoint experts
    (how far the hot set moved; a row without routes counts as no move)."""
    p = a_LE / a_LE.sum(1, keepdim=True).clamp_min(1e-300)
    q = b_LE / b_LE.sum(1, keepdim=True).clamp_min(1e-300)
    both_L = (a_LE.sum(1) > 0) & (b_LE.sum(1) > 0)
    return torch.where(both_L, 0.5 * (p - q).abs().sum(1), 0.0).clamp(0.0, 1.0)


def why_tensors_unfit(state: dict, what: str, shapes: dict[str, tuple[int, ...]],
                   ranges: dict[str, tuple[float, float]] | None = None) -> str | None:
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
