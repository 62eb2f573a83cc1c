"""The expert-level balance loss on its own (the device-level one: tests/test_aux_control.py)."""
import pytest
import torch

from eb_deepspeed.core.controls import expert_balance_loss

pytestmark = pytest.mark.unit


def test_the_expert_loss_is_one_at_balance_and_e_times_f_dot_p_otherwise():
    probs_TE = torch.full((4, 2), 0.5)
    assert float(expert_balance_loss(probs_TE, torch.tensor([2, 2]), k=1)) == pytest.approx(1.0)
    probs_TE = torch.tensor([[0.9, 0.1], [0.7, 0.3], [0.6, 0.4], [0.8, 0.2]])      # P = (0.75, 0.25)
    # f = (3, 1) / 4: 2 x (0.75 x 0.75 + 0.25 x 0.25) = 1.25
    assert float(expert_balance_loss(probs_TE, torch.tensor([3, 1]), k=1)) == pytest.approx(1.25)
    # padding left out: the last two tokens do not count, P = (0.8, 0.2), f = (2, 0) / 2: 2 x 0.8
    valid_T = torch.tensor([True, True, False, False])
    assert float(expert_balance_loss(probs_TE, torch.tensor([2, 0]), k=1, valid_T=valid_T)) == pytest.approx(1.6)
