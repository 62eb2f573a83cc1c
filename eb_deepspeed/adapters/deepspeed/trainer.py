"""The Hugging Face Trainer's side (and TRL's trainers, built on it): `BalanceCallback`, which `patch_deepspeed` adds
to every Trainer made after it.

  * the balance curves go into the Trainer's own logs at its global step (`on_log`: the scalars `flatten_record`
    names, on each training log), so they land wherever `report_to` sends the loss: W&B (the same run), TensorBoard;
  * with `train_placement`, the experts are in AutoEP's own layout whenever the Trainer takes the model's state dict:
    home from the moment a save may come until it has saved (a save decided at a step's or an epoch's end, or an
    evaluation that saves at a new best: back at the next step if it did not), and home when training ends (a
    `trainer.save_model()` after it). DeepSpeed's checkpoint it writes carries the balancer's state.
"""
from __future__ import annotations

from transformers import TrainerCallback

from ...observe.monitor import flatten_record

__all__ = ["BalanceCallback"]


class BalanceCallback(TrainerCallback):
    """Finds the balancer on the Trainer's model (`model.easybalance`); does nothing where there is none."""

    def __init__(self):
        self._placed = None         # the placement to go back to after a save (the experts home meanwhile)

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        balancer = getattr(model, "easybalance", None)
        if balancer is not None and logs is not None and "loss" in logs and balancer.view.steps:
            logs.update(flatten_record(balancer.log.record(balancer)))

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self._back(model)           # home for an evaluation that found no new best: no save came

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self._home_if_saving(args, control, model)

    def on_epoch_end(self, args, state, control, model=None, **kwargs):
        self._home_if_saving(args, control, model)      # save_strategy "epoch" decides here

    def on_save(self, args, state, control, model=None, **kwargs):
        self._back(model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        placement = _placement(model)
        if placement is not None:
            self._placed = None
            placement.move_or_raise(placement.home, "home at the end of training")

    def _home_if_saving(self, args, control, model) -> None:
        """Home when the Trainer may save next: a save decided, or an evaluation that saves at a new best."""
        placement = _placement(model)
        may_save = control.should_save or (control.should_evaluate and args.save_strategy == "best")
        if placement is not None and may_save and self._placed is None:
            placed = placement.resident
            placement.move_or_raise(placement.home, "home for the Trainer's save")
            self._placed = placed

    def _back(self, model) -> None:
        placed, self._placed = self._placed, None
        if placed is not None:
            _placement(model).move_or_raise(placed, "back after the Trainer's save (what it wrote is whole)")


def _placement(model):
    return getattr(getattr(model, "easybalance", None), "placement", None)
