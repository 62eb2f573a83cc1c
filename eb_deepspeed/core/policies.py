"""Per-layer aux-loss weights and the device-aware selection bias, as pure control laws.

Shape legend: L MoE layers, E experts per layer, G EP ranks (devices).

The EasyBalance article, §6: feed the cross-layer load view into training and adjust each layer's auxiliary-loss
weight, instead of one fixed coefficient for all layers. Four policies (`easybalance.aux.policy`); every
layer's l_aux keeps the user's coefficient in all of them:

  fixed             no device loss, no bias: DeepSpeed's behaviour, the baseline.
  cross_layer       each layer's l_aux gets a device-level balance loss (DeepSeek-V2's, computed in the gate)
                    weighted per layer from the view by integral action (`integral_weights` of `device_scores`):
                    up where the layer's imbalance on hot devices stays high, down where it stays low;
                    clipped to `weight_range`, kept at mean 1.
  bias              aux-loss-free balancing (Wang et al. 2024, DeepSeek-V3): a per-expert bias added to
                    the selection scores only (never to the gate values), moved by `bias_rate` towards
                    balance with a sign update and re-centred to mean 0, made device-aware by the view.
  bias_cross_layer  both: the bias selects, the per-layer device loss takes the residual.

`POLICIES` is the registry (`AuxPolicy`; the config takes its choices and warnings from it). `AuxController.update`
runs after the view update on every rank with the same reduced view, so every rank computes the same controls."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .view import why_tensors_unfit

__all__ = ["POLICIES", "AuxController"]

_ERROR_CLIP = 1.0   # one step moves a log-weight by at most gain x this (a single outlier step cannot jump it)
# The bias's device term (the window pressure of the expert's EP rank, the article §2.2) against its expert term:
# half as strong. Not measured apart from the policy it belongs to (a constant, not a key; 0 is DeepSeek-V3's bias).
DEVICE_WEIGHT = 0.5


def device_scores(pressure_LG: torch.Tensor, cross_LG: torch.Tensor) -> torch.Tensor:
    """How much each layer's device imbalance stalls the cluster. [L, G], [L, G] -> [L]

    1. excess_lg = max(0, P_lg / mean_g P_lg - 1): load above the layer's mean on each device;
    2. hot_lg = C_lg / mean_g C_lg: how hot that device is across the window around l (1 = average);
    3. score_l = sum_g excess_lg * hot_lg: imbalance that lands on already-hot devices counts more."""
    excess_LG = (_over_row_mean(pressure_LG) - 1.0).clamp_min(0.0)
    return (excess_LG * _over_row_mean(cross_LG)).sum(1)


def _over_row_mean(x_LX: torch.Tensor) -> torch.Tensor:
    """Each row divided by its mean (rows of zeros give ones). [L, X] -> [L, X]"""
    x_LX = x_LX.to(torch.float64)
    mean_L1 = x_LX.mean(1, keepdim=True)
    return torch.where(mean_L1 > 0, x_LX / mean_L1.clamp_min(1e-300), torch.ones_like(x_LX))


def clip_mean_one(raw_L: torch.Tensor, w_min: float, w_max: float) -> torch.Tensor:
    """Scale [L] positive scores to weights with mean 1, each in [w_min, w_max] (w_min <= 1 <= w_max).

    Finds the scale c with f(c) = mean(clip(c * raw, w_min, w_max)) = 1, exactly and without iterating:
    1. f is piecewise linear and non-decreasing in c, with breakpoints at w_min / raw_l and w_max / raw_l;
    2. evaluate f at all 2L breakpoints at once ([2L, L]) and take the first one where f reaches 1;
    3. f is linear between it and the breakpoint before: solve for c there."""
    assert w_min <= 1.0 <= w_max and bool((raw_L > 0).all())
    raw_L = raw_L.to(torch.float64)
    c_B = torch.cat([w_min / raw_L, w_max / raw_L]).sort().values                       # [2L] breakpoints
    f_B = (c_B[:, None] * raw_L[None, :]).clamp(w_min, w_max).mean(1)                   # f at each, non-decreasing
    j = int(torch.searchsorted(f_B, torch.tensor([1.0], dtype=torch.float64)).clamp(max=len(f_B) - 1))
    if j == 0 or f_B[j] <= f_B[j - 1]:
        c = c_B[j]
    else:
        c = c_B[j - 1] + (1.0 - f_B[j - 1]) * (c_B[j] - c_B[j - 1]) / (f_B[j] - f_B[j - 1])
    return (raw_L * c).clamp(w_min, w_max)


def integral_weights(log_w_L: torch.Tensor, score_L: torch.Tensor, *, gain: float, w_min: float,
                     w_max: float) -> torch.Tensor:
    """One integral step of the per-layer log-weights [L]; returns the new log-weights.

    error_l = score_l / mean score - 1, clipped to [-1, 1] (push where a layer stalls the cluster more than the
    others); log w_l += gain * error_l; the weights exp(log w) are clipped to [w_min, w_max] and rescaled to
    mean 1 (the same total device push, placed better), and the log-weights follow the clipped weights (no
    wind-up past a limit). A layer that stays worse keeps accumulating; zero-mean step noise adds up only as a
    random walk (docs/training.md has the measurement behind the default gain). One step moves a weight by at
    most a factor exp(gain): no further smoothing is needed."""
    reference = float(score_L.mean())
    if reference <= 0:                       # nothing imbalanced anywhere: hold
        return log_w_L.clone()
    error_L = (score_L.to(torch.float64) / reference - 1.0).clamp(-_ERROR_CLIP, _ERROR_CLIP)
    w_L = (log_w_L.to(torch.float64) + gain * error_L).exp().clamp(w_min, w_max)
    return clip_mean_one(w_L, w_min, w_max).log()


def bias_update(bias_LE: torch.Tensor, counts_LE: torch.Tensor, cross_LG: torch.Tensor, device_LE: torch.Tensor, *,
                rate: float, device_weight: float, mask_LE: torch.Tensor | None = None) -> torch.Tensor:
    """One sign step of the selection bias. [L, E] bias, [L, E] routed counts, [L, G] window pressure.

    Per expert: +1 if it got fewer routes than its layer's mean, -1 if more (0 at the mean); the
    device-aware term does the same for the window pressure of the device holding it. The step is
    rate * (expert_sign + device_weight * device_sign) / (1 + device_weight), then each layer's bias
    is re-centred to mean 0. Layers with no routes this step are left as they are.
    device_LE [L, E]: the window pressure at each expert's device, looked up (`cross_LG[:, expert_to_device_E]`;
    an expert with copies on several devices: their mean, `LoadView.expert_device_mean`). mask_LE [L, E]: the
    experts each layer has when layers differ in size (the rest is padding: held at 0, left out of every mean);
    None: all."""
    counts_LE = counts_LE.to(torch.float64)
    cross_LG = cross_LG.to(torch.float64)
    mask_LE = torch.ones_like(counts_LE, dtype=torch.bool) if mask_LE is None else mask_LE.to(torch.bool)
    n_L1 = mask_LE.sum(1, keepdim=True).clamp_min(1)
    mean_L1 = torch.where(mask_LE, counts_LE, 0.0).sum(1, keepdim=True) / n_L1
    expert_sign_LE = torch.sign(mean_L1 - counts_LE)
    device_sign_LE = torch.sign(cross_LG.mean(1, keepdim=True) - device_LE.to(torch.float64))
    step_LE = rate * (expert_sign_LE + device_weight * device_sign_LE) / (1.0 + device_weight)
    active_L1 = (counts_LE.sum(1, keepdim=True) > 0)
    new_LE = torch.where(mask_LE, bias_LE.to(torch.float64) + torch.where(active_L1, step_LE, 0.0), 0.0)
    return torch.where(mask_LE, new_LE - new_LE.sum(1, keepdim=True) / n_L1, 0.0)


@dataclass(frozen=True)
class AuxPolicy:
    """One training control law."""
    name: str
    options: tuple[str, ...] = ()           # the `easybalance.aux.*` keys it reads
    uses_bias: bool = False                 # it hands the gates a selection bias
    uses_device_loss: bool = False          # it weighs a device-level balance loss per layer

    @property
    def uses_view(self) -> bool:
        """It acts on the view (so `window` and `warmup_batches` matter)."""
        return self.uses_bias or self.uses_device_loss

    def step(self, ctl: "AuxController", view, valid_L: torch.Tensor) -> bool:
        """One control step from the warm view; returns whether anything changed. valid_L [L]: the
        layers the view took this step (the others' routes were non-finite or absent)."""
        if self.uses_bias:      # one sign step from the last step's routes and the window pressure
            counts_LE = torch.where(valid_L[:, None], view.last.routed_LE, 0.0)   # no counts: the layer holds its bias
            cross_LG = view.window_pressure()
            ctl.bias_LE = bias_update(ctl.bias_LE, counts_LE, cross_LG, view.expert_device_mean(cross_LG),
                                      rate=ctl.cfg.bias_rate, device_weight=DEVICE_WEIGHT, mask_LE=view.mask_LE)
        # one integrator step of the device-loss weights, relative to each other: all held while a layer is out
        if weighed := self.uses_device_loss and bool(valid_L.all()):
            lo, hi = ctl.cfg.weight_range
            ctl.log_w_L = integral_weights(ctl.log_w_L, device_scores(view.pressure_LG, view.window_pressure()),
                                           gain=ctl.cfg.gain, w_min=lo, w_max=hi)
        return self.uses_bias or weighed


POLICIES: dict[str, AuxPolicy] = {p.name: p for p in (
    AuxPolicy("fixed"),
    AuxPolicy("cross_layer", ("weight_range", "gain"), uses_device_loss=True),
    AuxPolicy("bias", ("bias_rate", ), uses_bias=True),
    AuxPolicy("bias_cross_layer", ("bias_rate", "weight_range", "gain"), uses_bias=True, uses_device_loss=True))}


# What a saved control state can hold: a bias of 1e4 logits is far past any a run can use (a softmax saturates near
# 100: past that every token of a layer goes to one expert), so more is a damaged state; the integrator is the log
# of weights in weight_range (<= 1e6).
BIAS_BOUND = 1e4
STATE_RANGES = {"bias_LE": (-BIAS_BOUND, BIAS_BOUND), "log_w_L": (-28.0, 14.0)}


class AuxController:
    """Holds the control state; `update(view)` applies the configured policy.

    bias_LE [L, E]: the selection bias. log_w_L [L]: log of the per-layer device-loss weights (mean 1)."""

    def __init__(self, num_layers: int, num_experts: int, aux_config):
        self.cfg = aux_config
        self.policy = POLICIES[aux_config.policy]
        self.bias_LE = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self.log_w_L = torch.zeros(num_layers, dtype=torch.float64)
        self.updates = 0

    def device_loss_weights(self) -> torch.Tensor:
        """Weight of each layer's device-level balance loss [L] (zeros when the policy has none)."""
        return self.log_w_L.exp() if self.policy.uses_device_loss else torch.zeros_like(self.log_w_L)

    def update(self, view, valid_L: torch.Tensor | None = None) -> bool:
        """One control step from the (reduced, identical) view; returns whether anything changed.

        valid_L [L]: the layers the view took this step (`LoadView.update`'s answer; None = all). Controls
        of the others hold, as their view does: nothing is learned from non-finite routes."""
        if not self.policy.uses_view or not view.ready:
            return False
        valid_L = torch.ones(view.L, dtype=torch.bool) if valid_L is None else valid_L.to(torch.bool)
        if not bool(valid_L.any()):
            return False
        changed = self.policy.step(self, view, valid_L)
        self.updates += int(changed)
        return changed

    def state_dict(self) -> dict[str, object]:
        return {"policy": self.cfg.policy, "bias_LE": self.bias_LE.clone(), "log_w_L": self.log_w_L.clone(),
                "updates": self.updates}

    def why_unfit(self, state: object) -> str | None:
        """Why `state` cannot be this controller's (None: it can)."""
        if not isinstance(state, dict) or not isinstance(state.get("policy"), str) \
                or not isinstance(state.get("updates"), int) or isinstance(state.get("updates"), bool):
            return "the aux state is not a dict with a policy and an update count"
        if state["updates"] < 0:
            return f"the checkpointed aux updates is {state['updates']}, expected an integer >= 0"
        shapes = {"bias_LE": tuple(self.bias_LE.shape), "log_w_L": tuple(self.log_w_L.shape)}
        return why_tensors_unfit(state, "aux", shapes, STATE_RANGES)

    def load_state_dict(self, state: dict[str, object]) -> list[str]:
        """Restore the saved bias and weights, made to obey the current config; returns what that changed.

        A checkpoint of another policy is not this policy's state: the controller starts fresh."""
        problem = self.why_unfit(state)
        if problem is not None:
            raise ValueError(problem)
        if state["policy"] != self.cfg.policy:
            return [f"aux.policy was \"{state['policy']}\": weights and bias start fresh"]
        self.bias_LE = state["bias_LE"].to(torch.float64).clone()
        self.log_w_L = state["log_w_L"].to(torch.float64).clone()
        self.updates = int(state["updates"])
        lo, hi = self.cfg.weight_range
        w_L = self.log_w_L.exp()
        if self.policy.uses_device_loss and not (bool(((w_L >= lo - 1e-9) & (w_L <= hi + 1e-9)).all())
                                          and abs(float(w_L.mean()) - 1.0) <= 1e-6):
            self.log_w_L = clip_mean_one(w_L.clamp(max(lo, 1e-12), hi), lo, hi).log()
            return [f"device-loss weights re-clipped to weight_range [{lo}, {hi}] with mean 1"]
        return []
