"""Pinned metric definitions (DESIGN.md) on hand-computed numbers."""
import math

import pytest
import torch

from eb_deepspeed import metrics as M

pytestmark = pytest.mark.unit

# Two layers, four devices. Layer 0: [4, 2, 1, 1] -> mean 2, max 4. Layer 1: [2, 2, 2, 2].
LOAD = torch.tensor([[4.0, 2.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]])


def test_max_over_mean_is_max_divided_by_mean_per_layer():
    assert M.max_over_mean(LOAD).tolist() == [2.0, 1.0]


def test_balancedness_is_mean_over_max_and_the_aggregate_is_sum_of_means_over_sum_of_maxes():
    assert M.balancedness(LOAD).tolist() == [0.5, 1.0]
    # (2 + 2) / (4 + 2) = 2/3, not the mean of the per-layer values (0.75)
    assert M.aggregate_balancedness(LOAD) == pytest.approx(2 / 3)


def test_max_vio_is_max_minus_mean_over_mean():
    assert M.max_vio(LOAD).tolist() == [1.0, 0.0]


def test_cv_is_population_std_over_mean():
    # layer 0: deviations 2, 0, -1, -1 -> variance (4+0+1+1)/4 = 1.5 -> std sqrt(1.5); / mean 2
    assert M.cv(LOAD)[0].item() == pytest.approx(math.sqrt(1.5) / 2)
    assert M.cv(LOAD)[1].item() == 0.0


def test_device_util_std_is_the_std_of_load_over_max_averaged_over_layers():
    # layer 0: util [1, .5, .25, .25], mean .5, var (.25+0+.0625+.0625)/4 = .09375; layer 1: 0
    assert M.device_util_std(LOAD) == pytest.approx(math.sqrt(0.09375) / 2)


def test_token_drop_rate_is_dropped_routes_over_tokens_times_k():
    assert M.token_drop_rate(30, 100, k=2) == 0.15
    assert M.token_drop_rate(0, 0, k=2) == 0.0
    with pytest.raises(ValueError, match=r"k \(0\) must be >= 1"):
        M.token_drop_rate(1, 1, k=0)


def test_an_empty_layer_counts_as_balanced_instead_of_nan():
    empty = torch.zeros(1, 4)
    assert M.max_over_mean(empty).tolist() == [1.0]
    assert M.balancedness(empty).tolist() == [1.0]
    assert M.cv(empty).tolist() == [0.0]
    assert M.device_util_std(empty) == 0.0
    assert M.aggregate_balancedness(empty) == 1.0


def test_a_one_dimensional_load_is_one_layer_and_three_dimensions_are_refused():
    assert M.max_over_mean(torch.tensor([3.0, 1.0])).tolist() == [1.5]
    with pytest.raises(ValueError, match=r"load must be \[layers, devices_or_experts\], got shape \(1, 2, 2\)"):
        M.max_over_mean(torch.zeros(1, 2, 2))


def test_summarize_reports_p90_of_device_max_over_mean():
    s = M.summarize(LOAD, LOAD)
    # quantile 0.9 of [2, 1] with linear interpolation: 1 + 0.9 * (2 - 1) = 1.9
    assert s["device_max_over_mean_p90"] == pytest.approx(1.9)
    assert s["device_balancedness"] == pytest.approx(2 / 3)


def test_deepspeed_capacity_and_dropped_routes_follow_the_capacity_rule():
    # 64 tokens, 8 experts, k = 2, factor 1.0: ceil(64 / 8 * 1.0 * 2) = 16; min capacity wins when larger
    from moe_lm import deepspeed_capacity, dropped_routes     # the example's evaluation (examples/moe_lm.py)
    assert deepspeed_capacity(64, 8, 2, 1.0, 4) == 16
    assert deepspeed_capacity(4, 8, 1, 1.0, 4) == 4
    # experts over capacity 16 lose the excess: (20 - 16) + (17 - 16) = 5
    assert dropped_routes(torch.tensor([[20.0, 17.0, 16.0, 3.0]]), 16).tolist() == [5.0]


def test_summarize_returns_exactly_its_declared_keys_and_the_per_layer_ones_are_record_curves():
    from eb_deepspeed.core import record
    out = M.summarize(torch.tensor([[3.0, 1.0]]), torch.tensor([[2.0, 1.0, 1.0, 0.0]]))
    assert tuple(out) == M.SUMMARY_KEYS
    per_layer = [k for k in out if isinstance(out[k], list)]
    assert per_layer and all(k in record.PER_LAYER for k in per_layer)
    assert all(k in record.SCALARS for k in out if k not in per_layer)
