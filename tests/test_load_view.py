"""The cross-layer load view: EMA, window pressure, warm-up, weighting, guards, checkpoint state."""
import pytest
import torch

from eb_deepspeed import LoadView, sequence_length_weights
from eb_deepspeed.load_view import split_tally, tally_width

E = 4  # experts 0, 1 on device 0; experts 2, 3 on device 1


def tally(routed, kept=None, load=None, tokens=None, nonfinite=0.0):
    """One layer's tally row [3E + 6] from readable parts."""
    kept = routed if kept is None else kept
    load = kept if load is None else load
    tokens = sum(routed) / 2 if tokens is None else tokens
    return torch.tensor(list(routed) + [0.0] + list(kept) + [0.0] + list(load) + [tokens, nonfinite, 0.0, 1.0],
                        dtype=torch.float64)


def test_tally_layout_splits_into_named_parts():
    part = split_tally(tally([1, 2, 3, 4], kept=[1, 2, 3, 3], load=[2, 2, 2, 2], tokens=5, nonfinite=1)[None], E)
    assert part.routed_LE.tolist() == [[1, 2, 3, 4]]
    assert part.kept_LE.tolist() == [[1, 2, 3, 3]]
    assert part.load_LE.tolist() == [[2, 2, 2, 2]]
    assert part.tokens_L.tolist() == [5] and part.nonfinite_L.tolist() == [1]
    assert tally_width(E) == 3 * E + 6


def test_the_first_update_sets_the_view_and_later_ones_follow_the_ema():
    view = LoadView(1, E, 2, ema_alpha=0.5)
    view.update(tally([4, 0, 2, 2])[None])
    assert view.pressure_LG.tolist() == [[4.0, 4.0]]       # devices: 4+0, 2+2
    view.update(tally([8, 0, 0, 0])[None])
    assert view.pressure_LG.tolist() == [[6.0, 2.0]]       # 0.5*8 + 0.5*4, 0.5*0 + 0.5*4
    assert view.heat_LE.tolist() == [[6.0, 0.0, 1.0, 1.0]]


def test_device_pressure_counts_kept_routes_and_heat_counts_demand():
    view = LoadView(1, E, 2)
    view.update(tally([10, 0, 2, 2], kept=[6, 0, 2, 2])[None])
    assert view.pressure_LG.tolist() == [[6.0, 4.0]]
    assert view.heat_LE.tolist() == [[10.0, 0.0, 2.0, 2.0]]
    m = view.metrics()
    assert m["token_drop_rate"] == pytest.approx(4 / 14)


def test_cross_layer_pressure_sums_a_window_of_layers_clipped_at_the_ends():
    view = LoadView(4, E, 2, window=1)
    rows = [tally([1, 0, 0, 0]), tally([2, 0, 0, 0]), tally([3, 0, 0, 0]), tally([4, 0, 0, 0])]
    view.update(torch.stack(rows))
    # device 0 pressure per layer 1, 2, 3, 4; window 1: [1+2, 1+2+3, 2+3+4, 3+4]
    assert view.cross_layer_pressure()[:, 0].tolist() == [3.0, 6.0, 9.0, 7.0]
    assert view.cross_layer_pressure(window=0)[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0]


def test_warm_up_needs_that_many_valid_updates_of_every_layer():
    view = LoadView(2, E, 2, warmup_batches=3)
    for _ in range(2):
        view.update(torch.stack([tally([1, 1, 1, 1]), tally([1, 1, 1, 1])]))
    assert not view.ready
    view.update(torch.stack([tally([1, 1, 1, 1]), tally([0, 0, 0, 0], tokens=0)]))  # layer 1 empty
    assert not view.ready
    view.update(torch.stack([tally([1, 1, 1, 1]), tally([1, 1, 1, 1])]))
    assert view.ready


def test_an_empty_batch_or_nonfinite_logits_leave_the_layer_untouched():
    view = LoadView(2, E, 2)
    view.update(torch.stack([tally([4, 0, 0, 0]), tally([0, 0, 4, 0])]))
    before = (view.pressure_LG.clone(), view.heat_LE.clone())
    valid = view.update(torch.stack([tally([0, 0, 0, 0], tokens=0), tally([0, 9, 0, 0], nonfinite=3)]))
    assert valid.tolist() == [False, False]
    assert torch.equal(view.pressure_LG, before[0]) and torch.equal(view.heat_LE, before[1])
    assert view.updates_L.tolist() == [1, 1]
    assert view.metrics()["nonfinite_tokens"] == 3.0 and view.metrics()["skipped_layers"] == 2


def test_corrupt_tallies_are_refused_without_changing_the_view():
    view = LoadView(1, E, 2)
    view.update(tally([1, 1, 1, 1])[None])
    before = view.state_dict()
    bad = tally([1, 1, 1, 1])[None].clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="tallies must be finite and non-negative"):
        view.update(bad)
    with pytest.raises(ValueError, match=r"tally must be \[layers, 18\] for 4 experts, got \(1, 3\)"):
        view.update(torch.zeros(1, 3))
    assert torch.equal(view.pressure_LG, before["pressure_LG"]) and view.steps == before["steps"]


def test_update_does_not_modify_the_callers_tensor():
    t = tally([1, 2, 3, 4])[None]
    t[0, E] = 5.0  # scratch slot
    copy = t.clone()
    LoadView(1, E, 2).update(t)
    assert torch.equal(t, copy)


def test_sequence_length_weighting_counts_tokens_by_relative_length():
    w = sequence_length_weights(torch.tensor([4, 2]), seq_len=4)
    # mean length 3: tokens of the long sequence weigh 4/3, of the short one 2/3
    assert w.tolist() == pytest.approx([4 / 3] * 4 + [2 / 3] * 4)
    with pytest.raises(ValueError, match=r"sequence lengths must be in \[0, 4\]"):
        sequence_length_weights(torch.tensor([5, 1]), seq_len=4)


def test_state_dict_round_trip_restores_the_view_exactly():
    view = LoadView(3, E, 2, ema_alpha=0.3)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        routed = torch.randint(0, 50, (3, E), generator=g).double()
        view.update(torch.cat([routed, torch.zeros(3, 1), routed, torch.zeros(3, 1), routed,
                               routed.sum(1, keepdim=True) / 2, torch.zeros(3, 1), torch.ones(3, 1), torch.ones(3, 1)], 1))
    restored = LoadView(3, E, 2, ema_alpha=0.3)
    restored.load_state_dict(view.state_dict())
    assert torch.equal(restored.pressure_LG, view.pressure_LG) and torch.equal(restored.heat_LE, view.heat_LE)
    assert restored.steps == view.steps and restored.metrics() == view.metrics()
    with pytest.raises(ValueError, match=r"checkpointed load view is \(layers, experts, devices\) = \(3, 4, 2\)"):
        LoadView(2, E, 2).load_state_dict(view.state_dict())


def test_bad_shapes_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"num_experts \(6\) must be divisible by num_devices \(4\)"):
        LoadView(1, 6, 4)
