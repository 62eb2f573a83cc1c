"""Per-layer aux-loss weights and the device-aware selection bias, as pure control laws.

Shape legend: L MoE layers, E experts per layer, G EP ranks (devices).

Seed 000 §6: feed the cross-layer load view into training and adjust each layer's auxiliary-loss
weight, instead of one fixed coefficient for all layers. Three policies (`easybalance.aux.policy`):

  fixed        every weight 1.0: DeepSpeed's behaviour, the baseline.
  cross_layer  w_l from the view: layers whose imbalance lands on devices that are hot across the
               window get more weight, balanced layers less; mean 1 over layers (the user's
               coefficient keeps its meaning), clipped to `weight_range`, smoothed over steps.
  bias         aux-loss-free balancing (Wang et al. 2024, DeepSeek-V3): a per-expert bias added to
               the selection scores only (never to the gate values), moved by `bias_rate` towards
               balance with a sign update and re-centred to mean 0, made device-aware by the view;
               every layer's l_aux keeps weight `aux_scale` (a small aux loss can stay on).

`POLICIES` is the registry: each entry names the `aux.*` options it reads (the config takes its
choices and its "ignored option" warnings from it) and holds its control step.
`AuxController.update(view)` runs once per gradient-accumulation boundary, after the view update,
on every rank with the same reduced view, so every rank computes the same weights and bias.
"""
from __future__ import annotations

import torch

from . import metrics as M
from .tally import tensor_problem

__all__ = ["POLICIES", "AuxPolicy", "cross_layer_scores", "cross_layer_weights", "clip_mean_one", "bias_update",
           "AuxController"]

_SCORE_FLOOR = 0.05  # a perfectly balanced layer still scores this much, so its weight never hits 0 alone


def cross_layer_scores(pressure_LG: torch.Tensor, cross_LG: torch.Tensor, heat_LE: torch.Tensor) -> torch.Tensor:
    """How much each layer stalls the cluster. [L, G], [L, G], [L, E] -> [L]

    1. excess_lg = max(0, P_lg / mean_g P_lg - 1): load above the layer's mean on each device;
    2. hot_lg = C_lg / mean_g C_lg: how hot that device is across the window around l (1 = average);
    3. device score = sum_g excess_lg * hot_lg: imbalance that lands on already-hot devices counts more;
    4. plus the layer's MaxVio at expert granularity (what the aux loss itself acts on).
    """
    excess_LG = (_over_row_mean(pressure_LG) - 1.0).clamp_min(0.0)
    hot_LG = _over_row_mean(cross_LG)
    return (excess_LG * hot_LG).sum(1) + M.max_vio(heat_LE)


def _over_row_mean(x_LX: torch.Tensor) -> torch.Tensor:
    """Each row divided by its mean (rows of zeros give ones). [L, X] -> [L, X]"""
    x_LX = x_LX.to(torch.float64)
    mean_L1 = x_LX.mean(1, keepdim=True)
    return torch.where(mean_L1 > 0, x_LX / mean_L1.clamp_min(1e-300), torch.ones_like(x_LX))


def clip_mean_one(raw_L: torch.Tensor, w_min: float, w_max: float, iters: int = 60) -> torch.Tensor:
    """Scale [L] positive scores to weights with mean 1, each in [w_min, w_max] (w_min <= 1 <= w_max).

    Finds the scale c with mean(clip(c * raw, w_min, w_max)) = 1 by bisection (monotone in c).
    """
    assert w_min <= 1.0 <= w_max and bool((raw_L > 0).all())
    lo, hi = torch.tensor(0.0, dtype=torch.float64), torch.tensor(w_max / float(raw_L.min()), dtype=torch.float64)
    raw_L = raw_L.to(torch.float64)
    for _ in range(iters):
        mid = (lo + hi) / 2
        too_big = (raw_L * mid).clamp(w_min, w_max).mean() > 1.0
        lo, hi = torch.where(too_big, lo, mid), torch.where(too_big, mid, hi)
    return (raw_L * (lo + hi) / 2).clamp(w_min, w_max)


def cross_layer_weights(pressure_LG: torch.Tensor, cross_LG: torch.Tensor, heat_LE: torch.Tensor,
                        prev_w_L: torch.Tensor, *, w_min: float, w_max: float, smoothing: float) -> torch.Tensor:
    """Next per-layer aux weights [L]: scores -> mean-1 clipped target -> moved `smoothing` of the way.

    A convex mix of two mean-1 vectors in [w_min, w_max] is again mean 1 and in range, so the
    smoothed weights keep both properties without re-normalising.
    """
    target_L = clip_mean_one(cross_layer_scores(pressure_LG, cross_LG, heat_LE) + _SCORE_FLOOR, w_min, w_max)
    return (1.0 - smoothing) * prev_w_L.to(torch.float64) + smoothing * target_L


def bias_update(bias_LE: torch.Tensor, counts_LE: torch.Tensor, cross_LG: torch.Tensor,
                expert_to_device_E: torch.Tensor, *, rate: float, device_weight: float) -> torch.Tensor:
    """One sign step of the selection bias. [L, E] bias, [L, E] routed counts, [L, G] window pressure.

    Per expert: +1 if it got fewer routes than its layer's mean, -1 if more (0 at the mean); the
    device-aware term does the same for the window pressure of the device holding it. The step is
    rate * (expert_sign + device_weight * device_sign) / (1 + device_weight), then each layer's bias
    is re-centred to mean 0. Layers with no routes this step are left as they are.
    """
    counts_LE = counts_LE.to(torch.float64)
    expert_sign_LE = torch.sign(counts_LE.mean(1, keepdim=True) - counts_LE)
    dev_LE = cross_LG.to(torch.float64)[:, expert_to_device_E]
    device_sign_LE = torch.sign(cross_LG.to(torch.float64).mean(1, keepdim=True) - dev_LE)
    step_LE = rate * (expert_sign_LE + device_weight * device_sign_LE) / (1.0 + device_weight)
    active_L1 = (counts_LE.sum(1, keepdim=True) > 0)
    new_LE = bias_LE.to(torch.float64) + torch.where(active_L1, step_LE, 0.0)
    return new_LE - new_LE.mean(1, keepdim=True)


class AuxPolicy:
    """One training control law. `options`: the `easybalance.aux.*` keys it reads."""
    name = ""
    options: tuple[str, ...] = ()
    uses_bias = False          # hands a selection bias to the gates
    uses_view = False          # acts on the view (so `window` and `warmup_batches` matter)

    def initial_weight(self, cfg) -> float:
        return 1.0

    def step(self, ctl: "AuxController", view, valid_L: torch.Tensor) -> bool:
        """One control step from the warm view; returns whether anything changed. valid_L [L]: the
        layers the view took this step (the others' routes were non-finite or absent)."""
        return False

    def conform(self, ctl: "AuxController") -> list[str]:
        """Make restored state obey the current config (after a resume); returns what changed."""
        return []


class FixedPolicy(AuxPolicy):
    name = "fixed"


class CrossLayerPolicy(AuxPolicy):
    name = "cross_layer"
    options = ("weight_range", "smoothing")
    uses_view = True

    def step(self, ctl, view, valid_L) -> bool:
        if not bool(valid_L.all()):   # weights share one mean: hold them all while a layer's view is frozen
            return False
        lo, hi = ctl.cfg.weight_range
        ctl.weight_L = cross_layer_weights(view.pressure_LG, view.cross_layer_pressure(), view.heat_LE, ctl.weight_L,
                                           w_min=lo, w_max=hi, smoothing=ctl.cfg.smoothing)
        return True

    def conform(self, ctl) -> list[str]:
        lo, hi = ctl.cfg.weight_range
        if bool(((ctl.weight_L >= lo - 1e-12) & (ctl.weight_L <= hi + 1e-12)).all()):
            return []
        ctl.weight_L = clip_mean_one(ctl.weight_L.clamp_min(1e-12), lo, hi)
        return [f"aux weights re-clipped to weight_range [{lo}, {hi}] (mean 1)"]


class BiasPolicy(AuxPolicy):
    name = "bias"
    options = ("bias_rate", "device_weight", "aux_scale")
    uses_bias = True
    uses_view = True

    def initial_weight(self, cfg) -> float:
        return float(cfg.aux_scale)

    def conform(self, ctl) -> list[str]:
        if bool((ctl.weight_L == ctl.cfg.aux_scale).all()):
            return []
        ctl.weight_L = torch.full_like(ctl.weight_L, float(ctl.cfg.aux_scale))
        return [f"aux weights set to aux_scale {ctl.cfg.aux_scale}"]

    def step(self, ctl, view, valid_L) -> bool:
        counts_LE = torch.where(valid_L[:, None], view.last.routed_LE, 0.0)   # a layer with no counts holds its bias
        ctl.bias_LE = bias_update(ctl.bias_LE, counts_LE, view.cross_layer_pressure(),
                                  view.expert_to_device_E, rate=ctl.cfg.bias_rate,
                                  device_weight=ctl.cfg.device_weight)
        return True


POLICIES: dict[str, AuxPolicy] = {p.name: p for p in (FixedPolicy(), CrossLayerPolicy(), BiasPolicy())}


class AuxController:
    """Holds the per-layer weights [L] and bias [L, E]; `update(view)` applies the configured policy."""

    def __init__(self, num_layers: int, num_experts: int, aux_config):
        self.cfg = aux_config
        self.policy = POLICIES[aux_config.policy]
        self.weight_L = torch.full((num_layers, ), self.policy.initial_weight(aux_config), dtype=torch.float64)
        self.bias_LE = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self.updates = 0

    @property
    def uses_bias(self) -> bool:
        return self.policy.uses_bias

    def update(self, view, valid_L: torch.Tensor | None = None) -> bool:
        """One control step from the (reduced, identical) view; returns whether anything changed.

        valid_L [L]: the layers the view took this step (`LoadView.update`'s answer; None = all). Controls
        of the others hold, as their view does: nothing is learned from non-finite routes.
        """
        if not self.policy.uses_view or not view.ready:
            return False
        valid_L = torch.ones(view.L, dtype=torch.bool) if valid_L is None else valid_L.to(torch.bool)
        if not bool(valid_L.any()):
            return False
        changed = self.policy.step(self, view, valid_L)
        self.updates += int(changed)
        return changed

    def state_dict(self) -> dict[str, object]:
        return {"policy": self.cfg.policy, "weight_L": self.weight_L.clone(), "bias_LE": self.bias_LE.clone(),
                "updates": self.updates}

    def state_problem(self, state: object) -> str | None:
        """Why `state` cannot be this controller's (None: it can)."""
        if not isinstance(state, dict) or not isinstance(state.get("policy"), str) \
                or not isinstance(state.get("updates"), int):
            return "the aux state is not a dict with a policy and an update count"
        return tensor_problem(state, "aux", {"weight_L": tuple(self.weight_L.shape), "bias_LE": tuple(self.bias_LE.shape)})

    def load_state_dict(self, state: dict[str, object]) -> list[str]:
        """Restore the saved weights and bias, made to obey the current config; returns what that changed.

        A checkpoint of another policy is not this policy's state: the controller starts fresh.
        """
        problem = self.state_problem(state)
        if problem is not None:
            raise ValueError(problem)
        if state["policy"] != self.cfg.policy:
            return [f"aux.policy was \"{state['policy']}\": weights and bias start fresh"]
        self.weight_L = state["weight_L"].to(torch.float64).clone()
        self.bias_LE = state["bias_LE"].to(torch.float64).clone()
        self.updates = int(state["updates"])
        return self.policy.conform(self)
