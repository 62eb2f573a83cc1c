"""What every adapter on a DeepSpeed engine shares (DeepSpeed-MoE models and AutoEP-converted HF models):
the per-step hook, the per-step reduce, and the balancer state in DeepSpeed's checkpoints.

* `StepHook`: a step post-hook on the innermost torch optimizer (a public door), once per `engine.global_steps`
  (DeepSpeed steps it at each accumulation boundary, once per parameter group under ZeRO, in `DeepSpeedEngine.step`
  and `PipelineEngine.train_batch`); the routes of a step DeepSpeed skips are dropped when a forward sees
  `global_steps` move past it; a batch the user skips: `engine.easybalance.discard_tally()`.
* `reduce_for`: one all-reduce a step of the [L, W] tally over DeepSpeed's data-parallel group (one tensor-parallel
  lane's under AutoEP folding: each token counted once), or every rank for a pipeline (each stage fills its layers'
  rows). World size 1: no communication.
* `wrap_checkpointing`: the balancer state in DeepSpeed's `client_state` under `STATE_KEY` (the engine's methods
  wrapped: DeepSpeed has no checkpoint hook); a tag whose save was killed is refused."""
from __future__ import annotations

import inspect
import os
import pickle
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist

from ...core.balancer import Balancer
from ..common import dist_rank, dist_ready, reduce_over, shared_problem, torch_optimizer, write_atomically

__all__ = ["StepHook", "wrap_checkpointing"]

STATE_KEY = "easybalance"  # key of the balancer state in DeepSpeed's checkpoint client_state
INCOMPLETE = "eb_save_incomplete"  # in a checkpoint tag's folder while a save into it runs (`_save_guarded`)


def is_pipeline(engine) -> bool:
    from deepspeed.runtime.pipe.engine import PipelineEngine
    return isinstance(engine, PipelineEngine)


def reduce_for(engine):
    """The per-step all-reduce (None for world size 1). See the module doc for the groups."""
    if not dist_ready() or dist.get_world_size() == 1:
        return None
    if is_pipeline(engine):
        # every rank, so every stage's rows reach every rank; one copy per tensor-parallel slice
        contributes = engine.grid.get_slice_parallel_rank() == 0

        def reduce(packed_LW: torch.Tensor) -> None:
            if not contributes:
                packed_LW.zero_()
            dist.all_reduce(packed_LW)
        return reduce
    # the ranks that see different tokens of the same layers: data parallel (x expert parallel), and the
    # sequence-parallel split too when that is on (DeepSpeed's own group for gradient reduction)
    return reduce_over(engine.seq_data_parallel_group)


class StepHook:
    """Runs `balancer.step()` once per optimizer step of `engine` (see the module doc), and drops the
    routes of a step DeepSpeed skipped (its optimizer never stepped) before the next one counts."""

    def __init__(self, engine, balancer: Balancer):
        self.engine, self.balancer = engine, balancer
        self.last_step: Optional[int] = None
        self.last_skipped = 0
        self.warned_missed = False
        self.open_step: Optional[int] = None    # global_steps of the forwards tallied since the last step
        self.discarded_steps = 0
        engine.module.register_forward_pre_hook(self.before_forward)
        optimizer = torch_optimizer(getattr(engine, "optimizer", None))
        if optimizer is None:
            warnings.warn("easybalance: the engine has no torch optimizer to hook; call engine.easybalance.step() "
                          "on every rank after each optimizer step yourself")
        else:
            optimizer.register_step_post_hook(self)

    def __call__(self, optimizer, args, kwargs) -> None:
        step = int(self.engine.global_steps)       # DeepSpeed increments it after the optimizer step
        if step == self.last_step:                  # ZeRO steps the optimizer once per parameter group
            return
        skipped = int(getattr(self.engine, "skipped_steps", 0))
        accounted = max(skipped - self.last_skipped, self.discarded_steps)   # skipped steps, routes dropped
        missed = 0 if self.last_step is None else step - self.last_step - 1 - accounted
        if missed > 0 and not self.warned_missed:  # a DeepSpeed path that stepped another optimizer
            self.warned_missed = True
            warnings.warn(f"easybalance: {missed} optimizer step(s) before step {step} did not reach the step hook "
                          "(an optimizer DeepSpeed steps outside the hooked one?); their routes count with this step")
        self.last_step, self.last_skipped, self.discarded_steps = step, skipped, 0
        self.balancer.step(samples=int(self.engine.global_samples) + int(self.engine.train_batch_size()))
        self.open_step = None

    def before_forward(self, module, args) -> None:
        """A training forward after a boundary that never reached the optimizer (DeepSpeed skipped the
        step: fp16 overflow, an inf gradient under torch_autocast's scaler): that step's routes go."""
        if not module.training:
            return
        step = int(self.engine.global_steps)
        if self.open_step is not None and step != self.open_step:
            self.balancer.discard_tally()
            self.discarded_steps += step - self.open_step
        self.open_step = step

    def reset(self) -> None:
        """After a checkpoint load `global_steps` may repeat a value already seen, and routes tallied
        before the load belong to the history it replaced."""
        self.last_step, self.open_step = None, None
        self.balancer.discard_tally()


def wrap_checkpointing(engine, balancer: Balancer, hook: StepHook) -> None:
    """Save the balancer state in DeepSpeed's client_state; restore it on load.

    Stored in client_state rather than in module buffers so that model state dicts stay exactly
    DeepSpeed's (checkpoints load both ways between plain DeepSpeed and eb_deepspeed). Before DeepSpeed
    loads anything, the saved balancer state is read and checked against this model: one that does
    not fit (another expert or layer count) stops the load with the model untouched, or, with
    `easybalance.checkpoint: "ignore_mismatch"`, is dropped with a warning after the model loads (a universal
    checkpoint: DeepSpeed's own shape checks speak first, `_universal`). One of another EP size loads: its
    per-expert state carries over (`Balancer.load_state_dict`)."""
    original_save, original_load = engine.save_checkpoint, engine.load_checkpoint
    save_sig, load_sig = inspect.signature(original_save), inspect.signature(original_load)
    mode = balancer.config.checkpoint

    def save_checkpoint(*args, **kwargs):
        bound = save_sig.bind(*args, **kwargs)
        client_state = dict(bound.arguments.get("client_state") or {})
        client_state[STATE_KEY] = balancer.state_dict()
        bound.arguments["client_state"] = client_state
        if is_decoupled(engine):           # an asynchronous checkpoint engine commits later: DeepSpeed's own rules
            return original_save(*bound.args, **bound.kwargs)
        return _save_guarded(engine, original_save, bound)

    def load_checkpoint(*args, **kwargs):
        bound = load_sig.bind(*args, **kwargs)
        load_dir, tag = bound.arguments["load_dir"], bound.arguments.get("tag")
        # every rank stops, before anything loads, when any rank finds the checkpoint incomplete (one all-gather)
        problem = shared_problem(incomplete_problem(load_dir, tag, "latest_universal" if _universal(engine) else "latest"))
        if problem:
            raise refuse(load_dir, problem)
        path, state = saved_state(engine, load_dir, tag)
        problem = None if state is None else balancer.why_unfit(state)
        if problem is not None and mode == "strict" and not _universal(engine):
            raise ValueError(f"easybalance: {path}: {problem}. Nothing was loaded. To load the model and drop this "
                             'balancer state, set "easybalance": {"checkpoint": "ignore_mismatch"}')
        load_path, client_state = original_load(*args, **kwargs)
        if load_path is None or client_state is None:
            return load_path, client_state
        hook.reset()
        state = client_state.pop(STATE_KEY, None)
        problem = None if state is None else balancer.why_unfit(state)
        if state is None:
            warnings.warn(f"easybalance: checkpoint {load_path} holds no balancer state; the load view starts cold")
        elif problem is not None and mode == "ignore_mismatch":
            warnings.warn(f"easybalance: {load_path}: {problem}; easybalance.checkpoint is \"ignore_mismatch\": the "
                          "model was loaded, the balancer keeps its own state")
        elif problem is not None:      # the file could not be read ahead (an unusual layout): DeepSpeed loaded it
            raise ValueError(f"easybalance: {load_path}: {problem}. The model was loaded, the balancer state was not; "
                             'set "easybalance": {"checkpoint": "ignore_mismatch"} to go on without it')
        else:
            balancer.load_state_dict(state)
        return load_path, client_state

    engine.save_checkpoint, engine.load_checkpoint = save_checkpoint, load_checkpoint


def _universal(engine) -> bool:
    """The engine loads universal checkpoints (`checkpoint.load_universal`): DeepSpeed re-slices every saved
    tensor for this model and refuses one of another shape itself, with its own message (our refusal would
    come first and hide it); a balancer state that still does not fit is refused after DeepSpeed's load."""
    check = getattr(engine, "load_universal_checkpoint", None)
    return bool(check()) if callable(check) else False


def is_decoupled(engine) -> bool:
    check = getattr(getattr(engine, "checkpoint_engine", None), "is_decoupled", None)
    return bool(check()) if callable(check) else False


def _save_guarded(engine, original_save, bound: inspect.BoundArguments):
    """DeepSpeed's save, made safe against a kill while it writes (DeepSpeed writes its files, and `latest`,
    in place): rank 0 puts `INCOMPLETE` in the tag's folder before any rank writes (DeepSpeed's save starts
    and ends with a barrier), removes it once every rank has written, and only then points `latest` at the
    tag, atomically (temporary file, fsync, rename). A kill at any moment leaves `latest` on the previous
    complete checkpoint, or the marker in the tag that was being written, which a load refuses."""
    args = bound.arguments
    save_dir, tag = args["save_dir"], args.get("tag")
    tag = str(tag if tag is not None else f"global_step{engine.global_steps}")    # DeepSpeed's default tag
    save_latest = args.get("save_latest", True)
    args["tag"], args["save_latest"] = tag, False
    on_rank0_for_all(lambda: mark_incomplete(os.path.join(save_dir, tag)), "marking the checkpoint incomplete")
    result = original_save(*bound.args, **bound.kwargs)
    # `latest` is written before any rank goes on
    on_rank0_for_all(lambda: mark_complete(save_dir, tag, save_latest), "completing the checkpoint")
    return result


def mark_incomplete(folder: str) -> None:
    """Put `INCOMPLETE` in a checkpoint tag's folder (before anything of the tag is written)."""
    os.makedirs(folder, exist_ok=True)
    write_atomically(os.path.join(folder, INCOMPLETE), "a save_checkpoint into this folder has not finished (see "
                     "eb_deepspeed's docs/reliability.md); eb_deepspeed refuses to load it\n")


def mark_complete(save_dir: str, tag: str, save_latest: bool = True) -> None:
    """Once every rank has written the tag: remove its `INCOMPLETE`, then point `latest` at it atomically."""
    os.remove(os.path.join(save_dir, tag, INCOMPLETE))
    if save_latest:
        write_atomically(os.path.join(save_dir, "latest"), tag)


def on_rank0_for_all(work, what: str) -> None:
    """Rank 0 does `work` (file system only); every rank then learns whether it failed (`shared_problem`) and
    raises the same OSError if it did, instead of rank 0 alone raising while the others wait in a barrier."""
    problem = None
    if dist_rank() == 0:
        try:
            work()
        except OSError as e:
            problem = f"easybalance: {what} failed on rank 0 ({e.strerror or e}: {getattr(e, 'filename', '')})"
    if problem := shared_problem(problem):
        raise OSError(problem)


def incomplete_problem(load_dir: str, tag: Optional[str], latest_name: str = "latest") -> Optional[str]:
    """Why the checkpoint a load of (load_dir, tag) would read is not whole, or None: its folder holds
    `INCOMPLETE` (a save into it never finished), or, for tag None, `latest` is empty (a save outside
    eb_deepspeed killed while writing it). This rank's files only."""
    if tag is None:
        tag = latest_tag(load_dir, latest_name)
        if tag == "":
            return f"{os.path.join(load_dir, latest_name)} is empty (a save was stopped while writing it)"
    if tag is not None and os.path.exists(os.path.join(load_dir, str(tag), INCOMPLETE)):
        return (f"checkpoint {os.path.join(load_dir, str(tag))} is incomplete: a save_checkpoint into it did not "
                "finish (killed or failed while it was written; DeepSpeed writes in place, so its files may be "
                "torn, and what the tag held before is gone)")
    return None


def latest_tag(load_dir: str, name: str = "latest") -> Optional[str]:
    """The tag DeepSpeed's `latest` file of `load_dir` names ("" when empty), or None without the file."""
    latest = os.path.join(load_dir, name)
    if not os.path.isfile(latest):
        return None
    with open(latest, encoding="utf-8", errors="replace") as f:
        return f.read().strip()


def refuse(load_dir: str, problem: str):
    """The error for `incomplete_problem`'s answer, naming the tags that can be loaded instead."""
    complete = sorted(d for d in os.listdir(load_dir) if os.path.isdir(os.path.join(load_dir, d))
                      and not os.path.exists(os.path.join(load_dir, d, INCOMPLETE))) if os.path.isdir(load_dir) else []
    return ValueError(f"easybalance: {problem}. Nothing was loaded; load a complete checkpoint with tag= "
                      f"(complete ones in {load_dir}: {complete or 'none'})")


def saved_state(engine, load_dir: str, tag: Optional[str]) -> tuple[Optional[str], Any]:
    """(file, balancer state) of the checkpoint DeepSpeed is about to load, read without loading it
    (memory-mapped, weights only); (None, None) when the file cannot be found or read ahead."""
    tag = latest_tag(load_dir, "latest_universal" if _universal(engine) else "latest") if tag is None else tag
    if not tag:
        return None, None
    try:
        path = engine._get_ckpt_name(load_dir, tag)
    except (AttributeError, TypeError, RuntimeError):     # a DeepSpeed without it, or no process group yet
        return None, None
    if not os.path.isfile(path):
        return None, None
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (OSError, RuntimeError, ValueError, pickle.UnpicklingError):   # DeepSpeed will say what is wrong
        return None, None
    return path, saved.get(STATE_KEY) if isinstance(saved, dict) else None

