"""The balancing loop, framework-neutral: tally -> reduce -> view -> control.

Shape legend: L MoE layers (all of the model's, over every pipeline stage), E experts per layer (the
most of any layer when layers differ: PR-MoE), G EP ranks (devices; the largest EP group when layers
differ), W packed tally width.

An adapter hands the `Balancer` its gates and one `reduce` function, and calls `step()` once per optimizer step
(gradient-accumulation boundary) on every rank:

    balancer = Balancer(config, gates, ModelShape.uniform(L, E, G), reduce=lambda t: dist.all_reduce(t, group=g))
    ...forwards...                # each gate adds its routes to its `tally`
    balancer.step()               # one reduce of the stacked [L, W] tally, then view and controls

A gate is a `BalancedGate`: a `tally` its forwards add to and the `controls` it reads. With pipeline parallelism
a rank holds some of the model's layers (`ModelShape.local_layers`): the other layers' tally rows stay 0 here and
a `reduce` over every rank fills them in. World size 1 is `reduce=None`: no communication at all."""
from __future__ import annotations

import atexit
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from .config import EasyBalanceConfig
from .controls import LayerControls
from .policies import AuxController
from .record import BalanceLog, BalanceLogger
from .tally import LayerTally, TallyLayout, take_all, widen_row
from .view import LoadView

__all__ = ["Balancer", "BalancedGate", "ModelShape"]


class BalancedGate(Protocol):
    """What the loop needs from a gate: two fields (`controls` None for serving's gates). The balancer drains
    the one and writes the other; it holds no module."""
    tally: LayerTally
    controls: Optional[LayerControls]


@dataclass
class ModelShape:
    """The model's MoE layers as the view sees them (the same on every rank), and which of them this rank holds.
    Layers may differ (PR-MoE); every EP size must divide the largest."""
    experts_L: list[int]                    # [L] experts of every layer of the model
    devices_L: list[int]                    # [L] EP ranks of every layer
    local_layers: Optional[list[int]] = None    # global index of each of this rank's gates, in order (None: all)
    # [E] or [L, E] group-local EP rank of each expert (None: DeepSpeed's contiguous layout, e // (E / G))
    expert_to_device_LE: Optional[torch.Tensor] = None
    rank_to_node: list[int] = field(default_factory=lambda: [0])    # node of each rank

    @classmethod
    def uniform(cls, num_layers: int, num_experts: int, num_devices: int, **kwargs) -> "ModelShape":
        return cls([int(num_experts)] * num_layers, [int(num_devices)] * num_layers, **kwargs)

    @property
    def num_layers(self) -> int:
        return len(self.experts_L)


def check_agreement(gathered: Sequence[dict[str, Any]], rank: int) -> None:
    """Raise the same ValueError on every rank when any rank's summary differs from this rank's.

    gathered: every rank's summary (model shape and config), from one all-gather at start-up. A rank
    that disagreed would make the per-step reduce mismatch or hang; this turns it into one error."""
    mine = gathered[rank]
    for other, theirs in enumerate(gathered):
        if theirs != mine:
            diff = {k: (mine.get(k), theirs.get(k)) for k in sorted(set(mine) | set(theirs))
                    if mine.get(k) != theirs.get(k)}
            raise ValueError(f"rank {other} disagrees with rank {rank} on the MoE model or easybalance config "
                             f"(mine, theirs): {diff}")


class Balancer:
    """Owns the view and the controller; `step()` runs the loop once.

    Args:
        config: the parsed `easybalance` block.
        gates: this rank's gates (`BalancedGate`), in layer order.
        shape: the model's MoE layers (`ModelShape`).
        reduce: sums a tensor in place over every rank that holds a copy of the model's layers (the
            data-parallel group; every rank under pipeline parallelism); None for world size 1.
        logger: where records go (rank 0's; None: nowhere). Written every `log.interval` steps and at exit.
        device: where the tally is stacked and reduced (the process group's device).
        train: training (`balance` mode runs the `aux` policy) or serving (no loss to weigh: no controls)."""

    VERSION = 2     # of the checkpointed state

    def __init__(self, config: EasyBalanceConfig, gates: Sequence[BalancedGate], shape: ModelShape, *,
                 reduce: Optional[Callable[[torch.Tensor], Any]] = None, logger: Optional[BalanceLogger] = None,
                 device: torch.device | str = "cpu", train: bool = True):
        L = shape.num_layers
        layers = list(range(len(gates))) if shape.local_layers is None else [int(i) for i in shape.local_layers]
        if L < 1 or len(layers) != len(gates) or len(set(layers)) != len(layers) or not all(0 <= i < L for i in layers):
            raise ValueError(f"layers ({layers}) must be {len(gates)} distinct indices in [0, {L})")
        wrong = {i: (g.tally.layout.num_experts, shape.experts_L[i]) for i, g in zip(layers, gates)
                 if g.tally.layout.num_experts != shape.experts_L[i]}
        if wrong:
            raise ValueError("MoE layers' num_experts (gate, model) differ: "
                             + ", ".join(f"layer {i}: {a} vs {b}" for i, (a, b) in sorted(wrong.items())))
        self.config, self.shape, self.layers, self.reduce, self.train = config, shape, layers, reduce, train
        self.tallies = [g.tally for g in gates]
        self.controls: list[Optional[LayerControls]] = [g.controls for g in gates]
        self.experts_L = [int(e) for e in shape.experts_L]
        self.num_experts = max(self.experts_L)              # the tally's width: smaller layers are padded
        devices = {t.layout.num_devices for t in self.tallies}
        if len(devices) > 1:
            raise ValueError(f"the gates' tallies count {sorted(devices)} devices: one number for every layer")
        self.counted_devices = devices.pop() if devices else 0   # > 0: the gates count routes per EP rank themselves
        self.device = torch.device(device)
        self._view = LoadView(L, self.experts_L, shape.devices_L, ema_alpha=config.ema_alpha,
                             window=config.window_for(L), warmup_batches=config.warmup_batches,
                             expert_to_device_E=shape.expert_to_device_LE)
        self.controller = AuxController(L, self.num_experts, config.aux)
        # a step whose reduce runs elsewhere in the background (serving's `ServingEngine.settle`): reads of `view`
        # take it first, so what a user reads is never a step behind
        self.settle: Optional[Callable[[], None]] = None
        self.placement = None             # training-time expert placement (AutoEP's `TrainPlacement`), if on
        self.controls_on = config.balance and train    # observe, and serving, change no loss and no route
        self.samples = 0                  # the adapter's sample count, for log steps
        self._nonfinite = {"warned_at": None, "steps": 0, "layers": set()}
        self.log = BalanceLog(logger, config.log.interval)
        self._set_maps()
        self.apply_controls()
        if self.log.on:                   # a run shorter than log.interval still leaves its last record
            atexit.register(self._at_exit)

    def _set_maps(self) -> None:
        """Each layer's expert -> EP rank map on its controls (the device loss reads it)."""
        if self.controls_on and self.controller.policy.uses_device_loss:
            for layer, ctl in zip(self.layers, self.controls):
                ctl.set_device_map(self._view.layer_map(layer), self.device)

    def move_experts(self, expert_to_device_LE: torch.Tensor) -> None:
        """Experts re-placed over the EP ranks (training placement): the view sums loads onto their new ranks, its
        device pressure is rebuilt from the heat for them, and the device loss reads the new (home) map."""
        self._view.move_experts(expert_to_device_LE)
        self._set_maps()

    @property
    def view(self) -> LoadView:
        """The cross-layer load view (a step in flight elsewhere taken first: `settle`)."""
        if self.settle is not None:
            self.settle()
        return self._view

    @property
    def num_layers(self) -> int:
        return self._view.L

    @property
    def num_nodes(self) -> int:
        return max(self.shape.rank_to_node) + 1

    def gather(self) -> torch.Tensor:
        """Drain every local tally into one packed [L, W] tensor on `device` (rows of other ranks' layers are 0)."""
        # every layer here: all in one fold when their forwards agree in shape (and every layer has every expert)
        packed_LW = take_all(self.tallies, self.device) if self.layers == list(range(self.num_layers)) else None
        if packed_LW is None:
            width = TallyLayout(self.num_experts, self.counted_devices).width
            packed_LW = torch.zeros(self.num_layers, width, dtype=torch.float64, device=self.device)
            for layer, tally in zip(self.layers, self.tallies):
                packed_LW[layer] = widen_row(tally.take(self.device), self.experts_L[layer], self.num_experts,
                                             self.counted_devices)
        return packed_LW

    def discard_tally(self, last_forward_only: bool = False) -> None:
        """Forget the routes counted since the last step, on this rank: call it when a batch is skipped
        (no optimizer step), so that the view holds only the micro-batches that reach a step boundary.

        last_forward_only: forget only the last forward's routes (one skipped micro-batch under gradient
        accumulation; the step's other micro-batches stay counted). Local: no communication."""
        for tally in self.tallies:
            tally.discard(last_forward_only)

    def step(self, samples: Optional[int] = None) -> torch.Tensor:
        """Tally -> one reduce -> view -> control. Returns valid_L [L] bool.

        samples: the adapter's sample count after this step (the log's x axis; None: the step count)."""
        if samples is not None:
            self.samples = int(samples)
        packed_LW = self.gather()
        if self.reduce is not None:
            self.reduce(packed_LW)
        return self.take(packed_LW)

    def take(self, packed_LW: torch.Tensor) -> torch.Tensor:
        """The view and the controls take one step's reduced tally [L, W] (`gather`'s, reduced). Returns
        valid_L [L]: the layers the view took."""
        # the reduced buffer is this step's alone: the view takes it as it is (one host copy from an accelerator)
        valid_L = self._view.update_packed(packed_LW.to("cpu", torch.float64), self.counted_devices)
        if self.controls_on and self.controller.update(self._view, valid_L):
            self.apply_controls()
        self._warn_nonfinite([i for i, n in enumerate(self._view.last.nonfinite_L.tolist()) if n > 0])
        self.log.after_step(self)
        return valid_L

    def _warn_nonfinite(self, bad: list[int]) -> None:
        """One warning at the first step with non-finite router logits, then at most one per log interval
        while they go on, saying how many steps they hit."""
        if not bad:
            return
        seen = self._nonfinite
        seen["steps"] += 1
        seen["layers"].update(bad)
        if seen["warned_at"] is not None and self._view.steps - seen["warned_at"] < self.config.log.interval:
            return
        warnings.warn(f"easybalance: non-finite router logits in MoE layers {sorted(seen['layers'])} at "
                      f"{seen['steps']} step(s) up to step {self._view.steps}; those layers were left out of the "
                      "load view and their controls held for those steps (repeated at most once per log interval)")
        self._nonfinite = {"warned_at": self._view.steps, "steps": 0, "layers": set()}

    def apply_controls(self) -> None:
        """Write the controller's bias and device-loss weights into the gates' controls (`balance` mode only)."""
        if not self.controls_on:
            return
        device_L = self.controller.device_loss_weights().tolist()
        # every layer's bias in one host-to-device copy per step; each gate holds a view of its row
        rows_E = self.controller.bias_LE[self.layers].to(self.device, torch.float32).unbind(0) \
            if self.controller.policy.uses_bias else None
        for row, (layer, ctl) in enumerate(zip(self.layers, self.controls)):
            if rows_E is not None:
                E = self.experts_L[layer]
                ctl.set_bias(rows_E[row] if E == self.num_experts else rows_E[row][:E])
            ctl.device_loss_weight = device_L[layer]

    def device_loss_weights(self) -> list[float]:
        """Per-layer weight of the device-level balance loss in effect [L] (0.0 where there is none)."""
        return self.controller.device_loss_weights().tolist() if self.controls_on else [0.0] * self.num_layers

    def bias_spreads(self) -> list[float]:
        """Per-layer spread (max - min over experts) of the selection bias in effect [L]: how far the `bias`
        policies tilt routing (0.0 where there is no bias)."""
        if not self.controls_on or not self.controller.policy.uses_bias:
            return [0.0] * self.num_layers
        bias_LE, mask_LE = self.controller.bias_LE, self._view.mask_LE
        spread_L = torch.where(mask_LE, bias_LE, -math.inf).amax(1) - torch.where(mask_LE, bias_LE, math.inf).amin(1)
        return [float(v) for v in spread_L]

    def metrics(self) -> dict[str, object]:
        """The view's metrics plus the per-layer device-loss weights and selection-bias spread (`LoadView.metrics`)."""
        out = self.view.metrics()
        out["device_loss_weight"] = self.device_loss_weights()
        out["bias_spread"] = self.bias_spreads()
        return out

    def note(self, **scalars: float) -> None:
        """Scalars of the training loop to log beside the balance numbers, e.g. `note(lm_loss=loss.item())`
        before `engine.step()` (`BalanceLog.note`)."""
        self.log.note(self._view.steps, **scalars)

    def close(self) -> None:
        """Write the last step's record if it was not written (also done at interpreter exit), and close the log."""
        atexit.unregister(self._at_exit)
        self.log.close(self)

    def _at_exit(self) -> None:
        try:
            self.log.close(self)
        except Exception as e:   # noqa: BLE001 - a closed logger at exit must not turn a clean exit into a traceback
            warnings.warn(f"easybalance: the last balance record could not be written at exit ({e})")

    def state_dict(self) -> dict[str, object]:
        return {"version": self.VERSION, "view": self._view.state_dict(), "aux": self.controller.state_dict(),
                "config": self.config.to_dict()}

    def why_unfit(self, state: object) -> Optional[str]:
        """Why a saved state cannot be restored into this balancer (None: it can). Checks everything before anything
        is changed."""
        if not isinstance(state, dict):
            return f"the balancer state is a {type(state).__name__}, not a dict"
        version = state.get("version", 0)
        if not isinstance(version, int):
            return f"the balancer state's version {version!r} is not an integer"
        if version != self.VERSION:
            return f"the balancer state format {version} is not the one this eb_deepspeed reads ({self.VERSION})"
        return self._view.why_unfit(state.get("view")) or self.controller.why_unfit(state.get("aux"))

    def load_state_dict(self, state: dict[str, object]) -> bool:
        """Restore a saved state; returns True.

        A state that does not fit (`why_unfit`) raises ValueError and changes nothing. A state saved at another
        EP size (or expert layout) restores what is per expert or per layer (heat, bias, device-loss weights,
        step counts) and rebuilds the device pressure for this layout (`LoadView.load_state_dict`). A state saved
        under another config is restored as far as the current config allows. One warning says what differs and
        what that changed (see `AuxController.load_state_dict`)."""
        problem = self.why_unfit(state)
        if problem is not None:
            raise ValueError(problem)
        layout = self._view.load_state_dict(state["view"])
        self.log.resumed(self._view.steps)
        changed = self.controller.load_state_dict(state["aux"])
        self._set_maps()
        self.apply_controls()
        saved, now = dict(state.get("config", {})), self.config.to_dict()
        if saved.get("window") == "auto":                     # how states saved before null was its default say it
            saved["window"] = None
        for key in ("log", "checkpoint"):                     # where records go, how to load: not balancer state
            saved.pop(key, None), now.pop(key, None)
        differ = _differences(saved, now, "easybalance")
        notes = []
        if layout is not None:
            notes.append(f"resumed at another expert layout ({layout}): expert heat, bias and per-layer weights carried "
                         "over; the device pressure was rebuilt from the expert heat and the last step's tally reset")
        if differ:
            notes.append("resumed under another config (" + "; ".join(differ) + ")"
                         + (": " + "; ".join(changed) if changed else ""))
        if notes:
            warnings.warn("easybalance: " + "; ".join(notes))
        return True


def _differences(saved: dict, now: dict, path: str) -> list[str]:
    """`path.key saved -> now` for every leaf that differs between two config dicts (a key only one of them has
    is an option of another version: not a difference)."""
    out = []
    for key in sorted(set(saved) & set(now)):
        a, b = saved.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{path}.{key}")
        elif a != b:
            out.append(f"{path}.{key} {a!r} -> {b!r}")
    return out
