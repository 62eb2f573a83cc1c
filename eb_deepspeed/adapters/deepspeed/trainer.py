"""The Hugging Face Trainer's side (and TRL's trainers, built on it): `BalanceCallback`, which `patch_deepspeed` adds
to every Trainer made after it.

  * the balance curves go into the Trainer's own logs at its global step (`on_log`: the scalars `flatten_record`
    names, on each training log), so they land wherever `report_to` sends the loss: W&B (the same run), TensorBoard;
  * with `train_placement`, the experts are in AutoEP's own layout whenever the Trainer takes the model's state dict:
    home from the step it decides to save until it has saved (`on_step_end` .. `on_save`), and home when training
    ends (a `trainer.save_model()` after it). DeepSpeed's checkpoint it writes carries the balancer's state.
"""
from __future__ import annotations

from transformers import TrainerCallback

from ...observe.monitor import flatten_record

__all__ = ["BalanceCallback"]


class BalanceCallback(TrainerCallback):
    """Finds the balancer on the Trainer's model (`model.easybalance`); does nothing where there is none."""

    def __init__(self):
        self._home = None           # the `at_home` block a save is inside

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        balancer = getattr(model, "easybalance", None)
        if balancer is not None and logs is not None and "loss" in logs and balancer.view.steps:
            logs.update(flatten_record(balancer.log.record(balancer)))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        placement = getattr(getattr(model, "easybalance", None), "placement", None)
        if placement is not None and control.should_save and self._home is None:
            self._home = placement.at_home("for the Trainer's save")
            self._home.__enter__()

    def on_save(self, args, state, control, **kwargs):
        home, self._home = self._home, None
        if home is not None:
            home.__exit__(None, None, None)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        placement = getattr(getattr(model, "easybalance", None), "placement", None)
        if placement is not None:
            placement.move_or_raise(placement.home, "home at the end of training")
