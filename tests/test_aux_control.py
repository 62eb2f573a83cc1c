"""The aux control laws (core/policies.py) against hand-derived cases, and their registry."""
import pytest
import torch

from eb_deepspeed import EasyBalanceConfig, LoadView
from eb_deepspeed.core.policies import (POLICIES, AuxController, bias_update, clip_mean_one, cross_layer_scores,
                                        cross_layer_weights)
from eb_deepspeed.core.tally import Tally

pytestmark = pytest.mark.unit


def test_cross_layer_scores_weigh_excess_load_by_how_hot_the_device_is_across_the_window():
    # layer 0: devices [3, 1] -> per-device / mean = [1.5, 0.5], excess [0.5, 0]
    # window pressure [6, 2] -> hot [1.5, 0.5]; device score 0.5 * 1.5 = 0.75
    # experts [2, 1, 1, 0] -> MaxVio = 2 / 1 - 1 = 1
    pressure = torch.tensor([[3.0, 1.0]])
    cross = torch.tensor([[6.0, 2.0]])
    heat = torch.tensor([[2.0, 1.0, 1.0, 0.0]])
    assert cross_layer_scores(pressure, cross, heat).tolist() == [pytest.approx(1.75)]
    # the same excess on a device that is *cold* across the window counts less: hot [0.5, 1.5]
    assert cross_layer_scores(pressure, torch.tensor([[2.0, 6.0]]), heat).tolist() == [pytest.approx(1.25)]


def test_clip_mean_one_keeps_mean_one_and_the_range():
    w = clip_mean_one(torch.tensor([1.0, 1.0, 1.0, 9.0]), 0.5, 2.0)
    # unclipped it would be [1/3, 1/3, 1/3, 3]; clipped: 2.0 at the top, the rest equal at (4 - 2) / 3
    assert w.tolist() == pytest.approx([2 / 3, 2 / 3, 2 / 3, 2.0])
    assert w.mean().item() == pytest.approx(1.0)
    assert clip_mean_one(torch.tensor([5.0, 5.0]), 0.5, 2.0).tolist() == pytest.approx([1.0, 1.0])


def test_cross_layer_weights_push_the_stalling_layer_and_relax_the_balanced_one():
    pressure = torch.tensor([[3.0, 1.0], [2.0, 2.0]])  # layer 0 imbalanced, layer 1 balanced
    cross = pressure.sum(0, keepdim=True).expand(2, 2)  # window covers both: [5, 3]
    heat = torch.tensor([[3.0, 1.0], [2.0, 2.0]])
    prev = torch.ones(2, dtype=torch.float64)
    target = cross_layer_weights(pressure, cross, heat, prev, w_min=0.25, w_max=4.0, smoothing=1.0)
    assert target[0] > 1.0 > target[1] and target.mean().item() == pytest.approx(1.0)
    half = cross_layer_weights(pressure, cross, heat, prev, w_min=0.25, w_max=4.0, smoothing=0.5)
    assert half.tolist() == pytest.approx(((prev + target) / 2).tolist())  # smoothed: half way


def test_bias_update_is_a_sign_step_re_centred_with_a_device_term():
    counts = torch.tensor([[4.0, 2.0, 2.0, 0.0]])  # mean 2 -> expert signs [-1, 0, 0, +1]
    cross = torch.tensor([[10.0, 2.0]])            # device 0 (experts 0, 1) hot -> device signs [-1, -1, +1, +1]
    e2d = torch.tensor([0, 0, 1, 1])
    plain = bias_update(torch.zeros(1, 4), counts, cross, e2d, rate=0.1, device_weight=0.0)
    assert plain.tolist() == [pytest.approx([-0.1, 0.0, 0.0, 0.1])]
    aware = bias_update(torch.zeros(1, 4), counts, cross, e2d, rate=0.1, device_weight=1.0)
    # steps 0.1 * ([-1, 0, 0, 1] + [-1, -1, 1, 1]) / 2 = [-0.1, -0.05, 0.05, 0.1], mean 0 already
    assert aware.tolist() == [pytest.approx([-0.1, -0.05, 0.05, 0.1])]
    assert aware.sum().item() == pytest.approx(0.0)
    idle = bias_update(aware, torch.zeros(1, 4), cross, e2d, rate=0.1, device_weight=1.0)
    assert torch.equal(idle, aware)  # a layer with no routes keeps its bias


def _view(steps, routed_LE, warmup=2):
    view = LoadView(2, 4, 2, warmup_batches=warmup)
    for _ in range(steps):
        view.update(Tally.build(routed_LE, tokens_L=8.0))
    return view


def test_the_controller_waits_for_warm_up_and_fixed_never_moves():
    routed = [[6.0, 2.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]]
    cfg = EasyBalanceConfig.from_ds_config({"easybalance": {"aux": {"policy": "cross_layer", "smoothing": 1.0}}})
    ctl = AuxController(2, 4, cfg.aux)
    assert ctl.update(_view(1, routed)) is False and ctl.weight_L.tolist() == [1.0, 1.0]
    assert ctl.update(_view(2, routed)) is True
    assert ctl.weight_L[0] > 1.0 > ctl.weight_L[1]
    fixed = AuxController(2, 4, EasyBalanceConfig.from_ds_config({"easybalance": {"aux": {"policy": "fixed"}}}).aux)
    assert fixed.update(_view(5, routed)) is False and fixed.weight_L.tolist() == [1.0, 1.0]


def test_the_bias_policy_keeps_aux_scale_weights_and_moves_the_bias():
    cfg = EasyBalanceConfig.from_ds_config({"easybalance": {"aux": {"policy": "bias", "aux_scale": 0.1,
                                                                    "bias_rate": 0.01}}})
    ctl = AuxController(2, 4, cfg.aux)
    assert ctl.weight_L.tolist() == [0.1, 0.1]
    ctl.update(_view(3, [[6.0, 2.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]]))
    assert ctl.bias_LE[0, 0] < 0 < ctl.bias_LE[0, 3]
    assert ctl.bias_LE.sum(1).abs().max() < 1e-12
    restored = AuxController(2, 4, cfg.aux)
    restored.load_state_dict(ctl.state_dict())
    assert torch.equal(restored.bias_LE, ctl.bias_LE) and restored.updates == ctl.updates == 1
    with pytest.raises(ValueError, match=r"checkpointed aux weight_L has shape \(2,\), this model \(3,\)"):
        AuxController(3, 4, cfg.aux).load_state_dict(ctl.state_dict())


@pytest.mark.parametrize("aux, message", [
    ({"policy": "sometimes"}, r"easybalance\.aux\.policy \('sometimes'\) must be one of: fixed, cross_layer, bias"),
    ({"weight_range": [1.5, 2.0]}, r"easybalance\.aux\.weight_range \(\[1\.5, 2\.0\]\) must be \[min, max\] with 0 <= min <= 1 <= max"),
    ({"weight_range": 2}, r"easybalance\.aux\.weight_range \(2\) must be \[min, max\]"),
    ({"smoothing": 0}, r"easybalance\.aux\.smoothing \(0\.0\) must be in \(0, 1\]"),
    ({"bias_rate": -1e-3}, r"easybalance\.aux\.bias_rate \(-0\.001\) must be in \(0, 1\]"),
    ({"rate": 1}, r"easybalance\.aux\.rate: unknown key; valid keys: aux_scale, bias_rate, device_weight, policy"),
])
def test_bad_aux_options_name_their_path(aux, message):
    from eb_deepspeed import ConfigError
    with pytest.raises(ConfigError, match=message):
        EasyBalanceConfig.from_ds_config({"easybalance": {"aux": aux}})


def test_options_the_policy_does_not_use_are_reported_once_each():
    cfg = EasyBalanceConfig.from_ds_config({"easybalance": {"aux": {"policy": "bias", "smoothing": 0.5}}})
    assert cfg.ignored_options("train") == ["easybalance.aux.smoothing"]


def test_the_config_takes_its_policy_choices_and_options_from_the_registry():
    # every option of every policy is a valid aux key, and each policy reports the others' as ignored
    every = sorted({o for p in POLICIES.values() for o in p.options})
    for name, policy in POLICIES.items():
        block = {"aux": {"policy": name, **{o: EasyBalanceConfig().aux.__getattribute__(o) for o in every}}}
        block["aux"]["weight_range"] = list(block["aux"]["weight_range"])
        cfg = EasyBalanceConfig.from_ds_config({"easybalance": block})
        assert cfg.ignored_options("train") == [f"easybalance.aux.{o}" for o in every if o not in policy.options]
    assert tuple(POLICIES) == ("fixed", "cross_layer", "bias")
