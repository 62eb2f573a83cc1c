"""The balancing loop, framework-neutral: tally -> reduce -> view -> control -> apply -> report.

Shape legend: L MoE layers (all of the model's, over every pipeline stage), E experts per layer (the
most of any layer when layers differ: PR-MoE), G EP ranks (devices; the largest EP group when layers
differ), W packed tally width, B sequences, T tokens.

An adapter (DeepSpeed, Megatron-Core) hands the `Balancer` its gates and one `reduce` function,
and calls `step()` once per optimizer step (gradient-accumulation boundary) on every rank:

    balancer = Balancer(config, gates, num_devices, reduce=lambda t: dist.all_reduce(t, group=g))
    ...forwards...                # each gate's TallyRecorder adds its routes
    balancer.step()               # one reduce of the stacked [L, W] tally, view + controls + log

Gates are anything with the small `BalancedGate` protocol below. With pipeline parallelism a rank
holds some of the model's layers: `layers` gives their global indices, the tally rows of the other
layers stay 0 on this rank, and a `reduce` over every rank fills them in, so every rank holds the
whole view. World size 1 is `reduce=None`: no communication at all.
"""
from __future__ import annotations

import atexit
import datetime
import functools
import math
import numbers
import warnings
import weakref
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from .losses import GlobalShares
from .config import EasyBalanceConfig
from .policies import AuxController
from .record import EXPERT_COUNTS, NOTES, PRESSURE, BalanceLogger, NullLogger
from .tally import TallyLayout, widen_row
from .view import LoadView, sequence_length_weights

__all__ = ["Balancer", "BalancedGate", "check_agreement"]


class BalancedGate(Protocol):
    """What the loop needs from a gate (DeepSpeed's `CrossLayerGate`, Megatron's router adapter)."""
    num_experts: int

    def take_tally(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """This layer's packed tally row [W] since the last call (see `TallyRecorder.take`)."""

    def discard_tally(self, last_forward_only: bool = False) -> None:
        """Forget the routes tallied since the last `take_tally` (or only the last forward's)."""

    def set_aux_weight(self, weight: float) -> None:
        """Multiply the layer's l_aux by `weight` from the next forward on."""

    def set_selection_bias(self, bias_E: Optional[torch.Tensor]) -> None:
        """Add `bias_E` [E] to the selection scores only (None: route as the framework does)."""

    def set_device_loss(self, weight: float, expert_to_device_E: torch.Tensor) -> None:
        """Add `weight` x the device-level balance loss (the layer's experts on the ranks of its own EP group,
        `expert_to_device_E` [E_l]) to the layer's l_aux from the next forward on; only called by policies
        that use it."""

    def set_token_weights(self, weights_T: Optional[torch.Tensor]) -> None:
        """Load weight of each token of the next forward [T] (None: every token counts 1)."""

    def set_batch_scope(self, scope: str, share: Optional[Callable[..., Optional[torch.Tensor]]]) -> None:
        """`aux.batch_scope` other than "micro" (`core.losses`); called once, before training. "sequence":
        the loss is sequence-wise. The global scopes: the loss takes its expert frequencies f_E from
        `share(routed_E)` (first run of a training forward; every rank calls it for the same forwards) or
        `share(rerun=True)` (a checkpointed forward's re-run), None meaning the forward's own
        (`GlobalShares.share`, bound to the gate's layer)."""


def check_agreement(gathered: Sequence[dict[str, Any]], rank: int) -> None:
    """Raise the same ValueError on every rank when any rank's summary differs from this rank's.

    gathered: every rank's summary (model shape and config), from one all-gather at start-up. A rank
    that disagreed would make the per-step reduce mismatch or hang; this turns it into one error.
    """
    mine = gathered[rank]
    for other, theirs in enumerate(gathered):
        if theirs != mine:
            diff = {k: (mine.get(k), theirs.get(k)) for k in sorted(set(mine) | set(theirs))
                    if mine.get(k) != theirs.get(k)}
            raise ValueError(f"rank {other} disagrees with rank {rank} on the MoE model or easybalance config "
                             f"(mine, theirs): {diff}")


EXIT_WAIT_S = 30     # at exit, how long a step in flight may wait for its reduce (its peers may be gone)


def _at_exit(ref: "weakref.ref[Balancer]") -> None:
    """At interpreter exit: take a step in flight (its reduce waited for at most EXIT_WAIT_S, and its work
    object let go before the process group is torn down), then log the last step if it was not logged (a run
    that ended between log intervals, or before the first). Never raises: the process is ending."""
    balancer = ref()
    if balancer is None:
        return
    try:
        packed_LW, balancer._pending = balancer._pending, None
        if packed_LW is not None:
            _wait_posted(balancer._posted)
            balancer._take_step(packed_LW)
        if not isinstance(balancer.logger, NullLogger):
            balancer.flush_log()
    except Exception as e:   # noqa: BLE001 - a closed logger or a gone peer at exit must not turn a clean exit into a traceback
        warnings.warn(f"easybalance: the last balance step or record could not be taken at exit ({e})")


def _wait_posted(posted: list) -> None:
    """Wait (at most EXIT_WAIT_S) for a reduce still posted and let its work object go. Runs at exit or when a
    balancer with a step in flight is collected, so no collective of ours is in flight while the process group
    is torn down: its peers posted the same reduce, so it completes."""
    while posted:
        work = posted.pop()
        try:
            work.wait(timeout=datetime.timedelta(seconds=EXIT_WAIT_S))
        except Exception as e:   # noqa: BLE001 - a gone peer at exit must not turn a clean exit into a traceback
            warnings.warn(f"easybalance: a balance reduce in flight did not complete ({e})")


class Balancer:
    """Owns the view and the controller; `step()` runs the loop once.

    config: the parsed `easybalance` block. gates: this rank's gates, in layer order.
    num_devices: EP ranks of a layer (G), or one number per layer of the model when layers differ (each
    must divide the largest; see `LoadView`). reduce: sums a tensor in place over every rank that holds
    a copy of the model's layers (the data-parallel group; every rank under pipeline parallelism);
    None for world size 1. layers: global index of each gate (default 0 .. len(gates) - 1);
    num_layers: layers of the whole model (default len(gates)). rank_to_node: node of each rank.
    expert_to_device_E: [E] or [L, E] EP rank (within the layer's group) holding each expert (default
    DeepSpeed's contiguous layout).
    num_experts: E, or one number per layer of the model when layers differ in size (PR-MoE); needed
    when this rank does not hold every layer (a pipeline stage) and the layers differ, or it holds none.
    Without it the gates say (one E for all, or theirs in layer order when they are the whole model).
    device_tally: the gates also tally kept routes per EP rank (`Tally.device_LG`): gates of replicated
    experts, whose routes are not where `expert_to_device_E` says; the view's pressure then comes from it.
    train_controls: run the `aux` policy in `balance` mode (False when serving: there is no loss to weigh).
    extra_metrics: an adapter's own numbers for each record (serving: re-plans, weight moves).
    """

    def __init__(self, config: EasyBalanceConfig, gates: Sequence[BalancedGate], num_devices: int | Sequence[int], *,
                 reduce: Optional[Callable[[torch.Tensor], Any]] = None, layers: Optional[Sequence[int]] = None,
                 num_layers: Optional[int] = None, rank_to_node: Optional[Sequence[int]] = None,
                 expert_to_device_E: Optional[torch.Tensor] = None, logger: Optional[BalanceLogger] = None,
                 tally_device: torch.device | str = "cpu", num_experts: Optional[int] = None,
                 device_tally: bool = False, train_controls: bool = True,
                 extra_metrics: Optional[Callable[[], dict]] = None):
        if not gates and num_experts is None:
            raise ValueError("easybalance is enabled but the model has no MoE layers")
        self.config = config
        self.gates = list(gates)
        self.layers = list(range(len(gates))) if layers is None else [int(i) for i in layers]
        self.num_layers = len(gates) if num_layers is None else int(num_layers)
        if self.num_layers < 1 or len(self.layers) != len(gates) or len(set(self.layers)) != len(self.layers) \
                or not all(0 <= i < self.num_layers for i in self.layers):
            raise ValueError(f"layers ({self.layers}) must be {len(gates)} distinct indices in [0, {self.num_layers})")
        self.experts_L = self._experts_per_layer(num_experts)
        self.num_experts = max(self.experts_L)            # the tally's width: smaller layers are padded
        devices = [int(num_devices)] * self.num_layers if isinstance(num_devices, numbers.Integral) \
            else [int(g) for g in num_devices]
        self.num_devices = max(devices)
        self.reduce = reduce
        self.train_controls = train_controls
        # the aux policy acts: `balance` mode in training (observe, and serving, change no loss and no route)
        self.controls_on = config.mode == "balance" and train_controls
        self.tally_devices = self.num_devices if device_tally else 0
        self.rank_to_node = list(rank_to_node or [0])
        # a step whose reduce runs in the background (`step_async`): its packed tally, and the reduce's work
        # object apart, so that a finalizer can wait for it even if this balancer is collected first
        self._pending: Optional[torch.Tensor] = None
        self._posted: list = []
        self._view = LoadView(self.num_layers, self.experts_L, devices, ema_alpha=config.ema_alpha,
                             window=config.window_for(self.num_layers), warmup_batches=config.warmup_batches,
                             expert_to_device_E=expert_to_device_E)
        self.controller = AuxController(self.num_layers, self.num_experts, config.aux)
        # one tensor per layer, kept: a gate copies its expert -> device map only when it gets a new object
        self._layer_maps = [self.view.layer_map(layer).clone() for layer in range(self.num_layers)]
        self.logger: BalanceLogger = logger or NullLogger()
        self.tally_device = torch.device(tally_device)
        self.samples = 0                  # the adapter's sample count, for log steps
        self._nonfinite_warned_at: Optional[int] = None     # view step of the last non-finite warning
        self._nonfinite_steps, self._nonfinite_layers = 0, set()
        self.extra_metrics = extra_metrics    # an adapter's own numbers for the record
        self._notes: dict[str, Optional[float]] = {}                # the user's scalars for the next record (`note`)
        self._nonfinite_notes: set[str] = set()                     # keys already warned about
        self._logged_step = 0
        self._run_start: Optional[int] = 0    # put on the next record: where this run's log starts
        self.apply_controls()
        self.global_shares: Optional[GlobalShares] = None
        scope = config.aux.batch_scope
        if self.controls_on and scope != "micro":
            if scope.startswith("global"):
                self.global_shares = GlobalShares(scope, [self.experts_L[i] for i in self.layers], reduce,
                                                  self.tally_device)
            for index, gate in enumerate(self.gates):
                gate.set_batch_scope(scope, None if self.global_shares is None else
                                     functools.partial(self.global_shares.share, index))
        self._exit_hook = False
        if not isinstance(self.logger, NullLogger):       # a run shorter than log.interval still leaves a record
            self._register_exit()

    def _register_exit(self) -> None:
        """Once per balancer: `_at_exit` runs at interpreter exit."""
        if not self._exit_hook:
            atexit.register(_at_exit, weakref.ref(self))
            weakref.finalize(self, _wait_posted, self._posted)
            self._exit_hook = True

    def _experts_per_layer(self, num_experts) -> list[int]:
        """[L] experts of every layer of the model, checked against this rank's gates."""
        local = {layer: int(g.num_experts) for layer, g in zip(self.layers, self.gates)}
        if num_experts is None:
            if not local:
                raise ValueError("easybalance is enabled but the model has no MoE layers")
            if len(set(local.values())) == 1:
                num_experts = next(iter(local.values()))
            elif len(local) == self.num_layers:
                num_experts = [local[layer] for layer in range(self.num_layers)]
            else:
                raise ValueError(f"the MoE layers differ in num_experts ({sorted(set(local.values()))}) and this rank "
                                 "holds only some of them: pass num_experts per layer of the model")
        experts_L = [int(num_experts)] * self.num_layers if isinstance(num_experts, numbers.Integral) \
            else [int(e) for e in num_experts]
        if len(experts_L) != self.num_layers or min(experts_L) < 1:
            raise ValueError(f"num_experts ({num_experts}) must be one number >= 1 or one per layer ({self.num_layers})")
        wrong = {layer: (e, experts_L[layer]) for layer, e in local.items() if e != experts_L[layer]}
        if wrong:
            raise ValueError("MoE layers' num_experts (gate, model) differ: "
                             + ", ".join(f"layer {layer}: {a} vs {b}" for layer, (a, b) in sorted(wrong.items())))
        return experts_L

    @property
    def num_nodes(self) -> int:
        return max(self.rank_to_node) + 1

    # ------------------------------------------------------------------ per forward
    def set_sequence_lengths(self, lengths_B: torch.Tensor, seq_len: int) -> None:
        """Real lengths of the sequences in the next micro-batch ([B]); weights the view by length.

        Only with `easybalance.seq_len_weighting: true`; call before each forward.
        """
        if not self.config.seq_len_weighting:
            raise ValueError("set_sequence_lengths() needs easybalance.seq_len_weighting = true")
        weights_T = sequence_length_weights(lengths_B, seq_len)
        for gate in self.gates:
            gate.set_token_weights(weights_T)

    # ------------------------------------------------------------------ per step
    def gather_tally(self) -> torch.Tensor:
        """Drain every local gate into one packed [L, W] tensor (rows of other ranks' layers are 0)."""
        width = TallyLayout(self.num_experts, self.tally_devices).width
        packed_LW = torch.zeros(self.num_layers, width, dtype=torch.float64, device=self.tally_device)
        for layer, gate in zip(self.layers, self.gates):
            packed_LW[layer] = widen_row(gate.take_tally(self.tally_device), self.experts_L[layer], self.num_experts,
                                         self.tally_devices)
        if self.global_shares is not None:
            self.global_shares.new_step()
        return packed_LW

    def discard_tally(self, last_forward_only: bool = False) -> None:
        """Forget the routes counted since the last step, on this rank: call it when a batch is skipped
        (no optimizer step), so that the view holds only the micro-batches that reach a step boundary.

        last_forward_only: forget only the last forward's routes (one skipped micro-batch under gradient
        accumulation; the step's other micro-batches stay counted). Local: no communication.
        """
        for gate in self.gates:
            gate.discard_tally(last_forward_only)
        if self.global_shares is not None and not last_forward_only:
            self.global_shares.new_step()

    @property
    def view(self) -> LoadView:
        """The cross-layer load view, with a step in flight (`step_async`) taken first."""
        self.settle()
        return self._view

    @property
    def in_flight(self) -> bool:
        """A step's reduce was posted (`step_async`) and the view has not taken it yet."""
        return self._pending is not None

    @property
    def view_so_far(self) -> LoadView:
        """The view as of the last step taken, without waiting for one in flight (`step_async`)."""
        return self._view

    def step(self, samples: Optional[int] = None) -> torch.Tensor:
        """Tally -> one reduce -> view -> control -> apply -> log. Returns valid_L [L] bool.

        samples: the adapter's sample count after this step (the log's x axis; None: the step count)."""
        if samples is not None:
            self.samples = int(samples)
        self.settle()
        packed_LW = self.gather_tally()
        if self.reduce is not None:
            self.reduce(packed_LW)
        return self._take_step(packed_LW)

    def step_async(self, post: Optional[Callable[[torch.Tensor], Any]]) -> None:
        """A step whose reduce overlaps what runs next: take the step in flight (if any), drain the gates,
        and post the reduce (`post(packed_LW)`: an in-place all-reduce with async_op=True, its work object,
        or None for no communication). The view takes this step at the next read of `view`, `settle()` or
        step: serving's view runs one step behind its tally, and no rank waits for the others here."""
        self.settle()
        self._register_exit()   # a step still in flight at exit is taken there, before the process group goes
        packed_LW = self.gather_tally()
        work = post(packed_LW) if post is not None else None
        if work is not None:
            self._posted.append(work)
        self._pending = packed_LW

    def settle(self) -> Optional[torch.Tensor]:
        """Take the step in flight (`step_async`): wait for its reduce, then view, control, log. Returns its
        valid_L [L], or None when none is in flight."""
        if self._pending is None:
            return None
        packed_LW, self._pending = self._pending, None
        while self._posted:
            self._posted.pop().wait()
        return self._take_step(packed_LW)

    def _take_step(self, packed_LW: torch.Tensor) -> torch.Tensor:
        # the reduced buffer is this step's alone: the view takes it as it is (one host copy from an accelerator)
        valid_L = self._view.update_packed(packed_LW.to("cpu", torch.float64), self.tally_devices)
        tally = self._view.last
        if self.controls_on and self.controller.update(self.view, valid_L):
            self.apply_controls()
        if self.global_shares is not None:
            self.global_shares.after_view(self._view.last.routed_LE[self.layers], valid_L[self.layers])
        self._warn_nonfinite([i for i, n in enumerate(tally.nonfinite_L.tolist()) if n > 0])
        if self.view.steps % self.config.log.interval == 0:
            self.flush_log()
        return valid_L

    def _warn_nonfinite(self, bad: list[int]) -> None:
        """One warning at the first step with non-finite router logits, then at most one per log interval
        while they go on, saying how many steps they hit."""
        if not bad:
            return
        self._nonfinite_steps += 1
        self._nonfinite_layers.update(bad)
        if self._nonfinite_warned_at is not None and self.view.steps - self._nonfinite_warned_at < self.config.log.interval:
            return
        warnings.warn(f"easybalance: non-finite router logits in MoE layers {sorted(self._nonfinite_layers)} at "
                      f"{self._nonfinite_steps} step(s) up to step {self.view.steps}; those layers were left out of the "
                      "load view and their controls held for those steps (repeated at most once per log interval)")
        self._nonfinite_warned_at, self._nonfinite_steps = self.view.steps, 0
        self._nonfinite_layers.clear()

    def flush_log(self) -> None:
        """Log the current record unless this step's is logged already (call at the end of a run, so the
        log ends on its last step)."""
        if self.view.steps and self.view.steps != self._logged_step:
            self._logged_step = self.view.steps
            record = self.record()
            if self._run_start is not None:
                record["run_start"], self._run_start = self._run_start, None
            self.logger.log(record, self.samples or self.view.steps)

    def apply_controls(self) -> None:
        """Hand the controller's weights (and bias) to the local gates; observe mode touches nothing."""
        if not self.controls_on:
            return
        for layer, gate in zip(self.layers, self.gates):
            gate.set_aux_weight(float(self.controller.weight_L[layer]))
            if self.controller.uses_bias:
                gate.set_selection_bias(self.controller.bias_LE[layer, :self.experts_L[layer]])
        if self.controller.uses_device_loss:
            device_L = self.controller.device_loss_weights()
            for layer, gate in zip(self.layers, self.gates):   # each layer over its own EP group's ranks
                gate.set_device_loss(float(device_L[layer]), self._layer_maps[layer])

    # ------------------------------------------------------------------ reads
    def aux_weights(self) -> list[float]:
        """Per-layer aux weight in effect [L] (1.0 everywhere outside `balance` mode)."""
        if not self.controls_on:
            return [1.0] * self.num_layers
        return [float(w) for w in self.controller.weight_L]

    def device_loss_weights(self) -> list[float]:
        """Per-layer weight of the device-level balance loss in effect [L] (0.0 where there is none)."""
        if not self.controls_on:
            return [0.0] * self.num_layers
        return [float(w) for w in self.controller.device_loss_weights()]

    def note(self, **scalars: float) -> None:
        """Scalars of the training loop to log beside the balance numbers, e.g. `note(lm_loss=loss.item())`
        before `engine.step()`: they go into the next records (JSONL, W&B, `eb report`'s summary) until
        noted again. Keys must be in `record.NOTES`; values must be real numbers. A NaN or infinite value (a
        diverging step on one rank) is recorded as null with one warning per key, never raised: the loop
        goes on, as it does for non-finite router logits."""
        for key, value in scalars.items():
            if key not in NOTES:
                raise ValueError(f"note({key}=...): the balance record takes {', '.join(NOTES)}")
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"note({key}={value!r}): a finite number is needed")
            if not math.isfinite(float(value)):
                if key not in self._nonfinite_notes:
                    self._nonfinite_notes.add(key)
                    warnings.warn(f"easybalance: note({key}={float(value)}) at step {self.view.steps}: recorded as null "
                                  "(warned once per key)")
                self._notes[key] = None
                continue
            self._notes[key] = float(value)

    def bias_spreads(self) -> list[float]:
        """Per-layer spread (max - min over experts) of the selection bias in effect [L]: how far the `bias`
        policies tilt routing (0.0 where there is no bias)."""
        if not self.controls_on or not self.controller.uses_bias:
            return [0.0] * self.num_layers
        bias_LE, mask_LE = self.controller.bias_LE, self.view.mask_LE
        spread_L = torch.where(mask_LE, bias_LE, -math.inf).amax(1) - torch.where(mask_LE, bias_LE, math.inf).amin(1)
        return [float(v) for v in spread_L]

    def metrics(self) -> dict[str, object]:
        """The view's metrics plus the per-layer aux and device-loss weights and selection-bias spread (see
        `LoadView.metrics`)."""
        out = self.view.metrics()
        out["aux_weight"] = self.aux_weights()
        out["device_loss_weight"] = self.device_loss_weights()
        out["bias_spread"] = self.bias_spreads()
        return out

    def record(self) -> dict[str, object]:
        """One balance record (keys: `record.py`)."""
        out = {"step": self.view.steps, "samples": self.samples, "mode": self.config.mode,
               "policy": self.config.aux.policy, "phase": "train" if self.train_controls else "serve"}
        out.update(self.metrics())
        if self.extra_metrics is not None:
            out.update(self.extra_metrics())
        out.update(self._notes)
        out[PRESSURE] = [[round(x, 3) for x in row] for row in self.view.pressure_LG.tolist()]
        if not out["nonfinite_layer_ids"]:      # a trace replays real demand, never NaN-routed counts
            counts_LE = self.view.last.routed_LE.round().long().tolist()
            out[EXPERT_COUNTS] = [row[:e] for row, e in zip(counts_LE, self.experts_L)]   # each layer its own experts
        return out

    # ------------------------------------------------------------------ checkpoint
    VERSION = 2

    def state_dict(self) -> dict[str, object]:
        return {"version": self.VERSION, "view": self.view.state_dict(), "aux": self.controller.state_dict(),
                "config": self.config.to_dict()}

    def why_unfit(self, state: object) -> Optional[str]:
        """Why a saved state cannot be restored into this balancer (None: it can, or it is of an older
        format, which `load_state_dict` skips). Checks everything before anything is changed."""
        if not isinstance(state, dict):
            return f"the balancer state is a {type(state).__name__}, not a dict"
        version = state.get("version", 0)
        if not isinstance(version, int):
            return f"the balancer state's version {version!r} is not an integer"
        if version < self.VERSION:
            return None
        if version != self.VERSION:
            return (f"the balancer state format {version} is newer than this eb_deepspeed reads ({self.VERSION}); "
                    "upgrade eb_deepspeed")
        return self.view.why_unfit(state.get("view")) or self.controller.why_unfit(state.get("aux"))

    def load_state_dict(self, state: dict[str, object]) -> bool:
        """Restore a saved state; returns False (and changes nothing) for a state of an older format.

        A state that does not fit (`why_unfit`) raises ValueError and changes nothing. A state saved
        under another config is restored as far as the current config allows, and one warning says
        which options differ and what that changed (see `AuxController.load_state_dict`).
        """
        problem = self.why_unfit(state)
        if problem is not None:
            raise ValueError(problem)
        if state.get("version", 0) < self.VERSION:
            return False
        self.view.load_state_dict(state["view"])
        self._layer_maps = [self.view.layer_map(layer).clone() for layer in range(self.num_layers)]
        self._run_start = self._logged_step = self.view.steps
        changed = self.controller.load_state_dict(state["aux"])
        self.apply_controls()
        saved, now = dict(state.get("config", {})), self.config.to_dict()
        for key in ("log", "checkpoint"):                     # where records go, how to load: not balancer state
            saved.pop(key, None), now.pop(key, None)
        differ = _differences(saved, now, "easybalance")
        if differ:
            warnings.warn("easybalance: resumed under another config (" + "; ".join(differ) + ")"
                          + (": " + "; ".join(changed) if changed else ""))
        return True


def _differences(saved: dict, now: dict, path: str) -> list[str]:
    """`path.key saved -> now` for every leaf that differs between two config dicts (a key the saved config
    lacks is an option its version did not have: not a difference)."""
    out = []
    for key in sorted(set(saved) & set(now)):
        a, b = saved.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{path}.{key}")
        elif a != b:
            out.append(f"{path}.{key} {a!r} -> {b!r}")
    return out
