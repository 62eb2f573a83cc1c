"""The aux control laws (core/policies.py) against hand-derived cases, and their registry."""
import pytest
import torch

from eb_deepspeed import EasyBalanceConfig, LoadView
from eb_deepspeed.core.policies import (POLICIES, AuxController, bias_update, clip_mean_one, device_scores,
                                        integral_weights)
from benchmarks.sim.model import tally_of

pytestmark = pytest.mark.unit


def test_device_scores_weigh_excess_load_by_how_hot_the_device_is_across_the_window():
    # layer 0: devices [3, 1] -> per-device / mean = [1.5, 0.5], excess [0.5, 0]
    # window pressure [6, 2] -> hot [1.5, 0.5]; score 0.5 * 1.5 = 0.75
    pressure = torch.tensor([[3.0, 1.0]])
    assert device_scores(pressure, torch.tensor([[6.0, 2.0]])).tolist() == [pytest.approx(0.75)]
    # the same excess on a device that is *cold* across the window counts less: hot [0.5, 1.5]
    assert device_scores(pressure, torch.tensor([[2.0, 6.0]])).tolist() == [pytest.approx(0.25)]
    assert device_scores(torch.tensor([[2.0, 2.0]]), torch.tensor([[6.0, 2.0]])).tolist() == [0.0]


def test_clip_mean_one_keeps_mean_one_and_the_range():
    w = clip_mean_one(torch.tensor([1.0, 1.0, 1.0, 9.0]), 0.5, 2.0)
    # unclipped it would be [1/3, 1/3, 1/3, 3]; clipped: 2.0 at the top, the rest equal at (4 - 2) / 3
    assert w.tolist() == pytest.approx([2 / 3, 2 / 3, 2 / 3, 2.0])
    assert w.mean().item() == pytest.approx(1.0)
    assert clip_mean_one(torch.tensor([5.0, 5.0]), 0.5, 2.0).tolist() == pytest.approx([1.0, 1.0])


def test_integral_weights_accumulate_persistent_skew_relative_to_the_other_layers():
    log_w = torch.zeros(2, dtype=torch.float64)
    score = torch.tensor([0.3, 0.1])          # mean 0.2 -> errors [+0.5, -0.5]
    step = integral_weights(log_w, score, gain=0.1, w_min=0.25, w_max=4.0)
    w = step.exp()
    assert w[0] > 1.0 > w[1] and w.mean().item() == pytest.approx(1.0)
    assert (w[0] / w[1]).item() == pytest.approx(torch.tensor(0.1).exp().item(), rel=1e-6)   # e^{0.05} / e^{-0.05}
    for _ in range(200):                      # persistent: keeps growing until the range stops it
        step = integral_weights(step, score, gain=0.1, w_min=0.25, w_max=4.0)
    assert step.exp().tolist() == pytest.approx([1.75, 0.25])    # the floor binds; mean 1 holds
    # no wind-up: one step the other way moves it back at once
    back = integral_weights(step, score.flip(0), gain=0.1, w_min=0.25, w_max=4.0)
    assert back.exp()[0] < 1.75
    assert torch.equal(integral_weights(step, torch.zeros(2), gain=0.1, w_min=0.25, w_max=4.0), step)  # balanced: hold


def test_integral_weights_let_alternating_noise_cancel():
    log_w = torch.zeros(2, dtype=torch.float64)
    for i in range(100):                      # the same skew flips between layers every step: noise, not skew
        score = torch.tensor([0.3, 0.1]) if i % 2 == 0 else torch.tensor([0.1, 0.3])
        log_w = integral_weights(log_w, score, gain=0.1, w_min=0.25, w_max=4.0)
    assert log_w.exp().tolist() == pytest.approx([1.0, 1.0], abs=1e-9)


def test_bias_update_is_a_sign_step_re_centred_with_a_device_term():
    counts = torch.tensor([[4.0, 2.0, 2.0, 0.0]])  # mean 2 -> expert signs [-1, 0, 0, +1]
    cross = torch.tensor([[10.0, 2.0]])            # device 0 (experts 0, 1) hot -> device signs [-1, -1, +1, +1]
    e2d = torch.tensor([0, 0, 1, 1])
    plain = bias_update(torch.zeros(1, 4), counts, cross, cross[:, e2d], rate=0.1, device_weight=0.0)
    assert plain.tolist() == [pytest.approx([-0.1, 0.0, 0.0, 0.1])]
    aware = bias_update(torch.zeros(1, 4), counts, cross, cross[:, e2d], rate=0.1, device_weight=1.0)
    # steps 0.1 * ([-1, 0, 0, 1] + [-1, -1, 1, 1]) / 2 = [-0.1, -0.05, 0.05, 0.1], mean 0 already
    assert aware.tolist() == [pytest.approx([-0.1, -0.05, 0.05, 0.1])]
    assert aware.sum().item() == pytest.approx(0.0)
    idle = bias_update(aware, torch.zeros(1, 4), cross, cross[:, e2d], rate=0.1, device_weight=1.0)
    assert torch.equal(idle, aware)  # a layer with no routes keeps its bias


def _view(steps, routed_LE, warmup=2):
    view = LoadView(2, 4, 2, warmup_batches=warmup)
    for _ in range(steps):
        view.update(tally_of(routed_LE, tokens_L=8.0))
    return view


def test_the_controller_waits_for_warm_up_and_fixed_never_moves():
    routed = [[6.0, 2.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]]
    cfg = EasyBalanceConfig.from_ds_config({"easybalance": {"aux": {"policy": "cross_layer"}}})
    ctl = AuxController(2, 4, cfg.aux)
    assert ctl.update(_view(1, routed)) is False and ctl.device_loss_weights().tolist() == [1.0, 1.0]
    assert ctl.update(_view(2, routed)) is True
    # layer 0's devices are [8, 0], layer 1's [4, 4]: layer 0's device loss gets more weight, at mean 1
    w_L = ctl.device_loss_weights()
    assert w_L[0] > 1.0 > w_L[1] and w_L.mean().item() == pytest.approx(1.0) and ctl.bias_LE.abs().sum() == 0
    fixed = AuxController(2, 4, EasyBalanceConfig.from_ds_config({"easybalance": {"aux": {"policy": "fixed"}}}).aux)
    assert fixed.update(_view(5, routed)) is False and fixed.device_loss_weights().tolist() == [0.0, 0.0]


def test_bias_cross_layer_moves_the_bias_and_the_device_loss_weights_together_and_restores_them():
    cfg = EasyBalanceConfig.from_ds_config({"easybalance": {"aux": {"policy": "bias_cross_layer", "bias_rate": 0.01}}})
    ctl = AuxController(2, 4, cfg.aux)
    ctl.update(_view(3, [[6.0, 2.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]]))
    assert ctl.bias_LE[0, 0] < 0 < ctl.bias_LE[0, 3] and ctl.bias_LE.sum(1).abs().max() < 1e-12
    assert ctl.device_loss_weights()[0] > 1.0 > ctl.device_loss_weights()[1]
    restored = AuxController(2, 4, cfg.aux)
    assert restored.load_state_dict(ctl.state_dict()) == [] and restored.updates == ctl.updates == 1
    for key in ("bias_LE", "log_w_L"):
        assert torch.equal(getattr(restored, key), getattr(ctl, key)), key
    with pytest.raises(ValueError, match=r"checkpointed aux bias_LE has shape \(2, 4\), this model \(3, 4\)"):
        AuxController(3, 4, cfg.aux).load_state_dict(ctl.state_dict())


def test_options_the_policy_does_not_use_are_reported_once_each():
    # every option of every policy is a valid aux key, and each policy reports the others' as ignored
    # (set to other than their defaults: a key left at its default changes nothing and warns about nothing)
    every = sorted({o for p in POLICIES.values() for o in p.options})
    changed = {"weight_range": [0.5, 2.0], "gain": 0.04, "bias_rate": 0.05}
    assert sorted(changed) == every
    for name, policy in POLICIES.items():
        cfg = EasyBalanceConfig.from_ds_config({"easybalance": {"aux": {"policy": name, **changed}}})
        assert cfg.ignored_options("train") == [f"easybalance.aux.{o}" for o in every if o not in policy.options]
    assert tuple(POLICIES) == ("fixed", "cross_layer", "bias", "bias_cross_layer")
