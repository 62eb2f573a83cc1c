"""Which placement serving chooses from the view (pure: no ranks)."""
import pytest
import torch

from eb_deepspeed.adapters.deepspeed.serving import MIN_GAIN, choose_placement
from eb_deepspeed.planning.placement import expected_padded_cost, plan_placement, static_placement

pytestmark = pytest.mark.unit
HOME = static_placement(1, 4, 2)                       # 4 experts on 2 ranks, DeepSpeed's layout


def plan(heat):
    return plan_placement(heat, 2, 3, previous=HOME)    # one extra slot per rank


def test_a_hot_expert_moves_serving_to_replicas():
    # home: 4 slots x 80 = 320; replicated: 6 slots x 40 (the hot expert on both ranks) = 240, 25 % less
    heat = torch.tensor([[80.0, 30, 25, 25]])
    choice = choose_placement(heat, HOME, HOME, 1.5, plan)
    assert choice is not HOME and choice.slots_per_device == 3
    assert float(expected_padded_cost(heat, choice).sum()) < (1 - MIN_GAIN) * 320


def test_balanced_traffic_keeps_deepspeeds_layout_and_a_small_gain_is_not_taken():
    assert choose_placement(torch.tensor([[40.0, 40, 40, 40]]), HOME, HOME, 1.5, plan) is None   # below the threshold
    # above the threshold but replicas gain < 10 %: home 4 x 60 = 240 against 6 x 39 = 234 at best
    heat = torch.tensor([[60.0, 39, 39, 22]])
    assert choose_placement(heat, HOME, HOME, 1.2, plan) is HOME


def test_serving_returns_to_deepspeeds_layout_when_the_hot_expert_cools():
    replicated = plan(torch.tensor([[80.0, 30, 25, 25]]))
    balanced = torch.tensor([[40.0, 40, 40, 40]])
    # replicated costs 6 x 40 = 240 on balanced traffic, home 4 x 40 = 160: back home, below any threshold
    assert choose_placement(balanced, replicated, HOME, 1.5, plan) is HOME
