"""The cross-layer load view: EMA, window pressure, warm-up, weighting, guards, checkpoint state."""
import pytest
import torch

from eb_deepspeed import LoadView
from eb_deepspeed.core.tally import Tally
from benchmarks.sim.model import tally_of

pytestmark = pytest.mark.unit
E = 4  # experts 0, 1 on device 0; experts 2, 3 on device 1


def tally(routed, kept=None, tokens=None, nonfinite=0.0):
    """One layer's tally from readable parts (a [1, E] Tally)."""
    return tally_of([routed], kept_LE=None if kept is None else [kept], tokens_L=tokens, nonfinite_L=nonfinite)


def stack(*rows):
    return Tally.unpack(torch.cat([r.pack() for r in rows]), E)


def test_the_first_update_sets_the_view_and_later_ones_follow_the_ema():
    view = LoadView(1, E, 2, ema_alpha=0.5)
    view.update(tally([4, 0, 2, 2]))
    assert view.pressure_LG.tolist() == [[4.0, 4.0]]       # devices: 4+0, 2+2
    view.update(tally([8, 0, 0, 0]))
    assert view.pressure_LG.tolist() == [[6.0, 2.0]]       # 0.5*8 + 0.5*4, 0.5*0 + 0.5*4
    assert view.heat_LE.tolist() == [[6.0, 0.0, 1.0, 1.0]]


def test_the_drift_is_how_far_the_steps_expert_mix_moved_from_the_heat():
    view = LoadView(1, E, 2, ema_alpha=0.5)
    view.update(tally([4, 0, 0, 0]))
    assert view.metrics()["heat_drift"] == [0.0]                  # nothing to move from yet
    view.update(tally([8, 0, 0, 0]))
    assert view.metrics()["heat_drift"] == [0.0]                  # twice the tokens, the same mix
    view.update(tally([0, 0, 0, 4]))
    assert view.metrics()["heat_drift"] == [1.0]                  # the hot expert moved: disjoint mixes
    view.update(tally([2, 0, 0, 2]))                              # heat [3, 0, 0, 2]: mix [.6, 0, 0, .4]
    assert view.metrics()["heat_drift"] == [pytest.approx(0.1)]   # against [.5, 0, 0, .5]
    restored = LoadView(1, E, 2, ema_alpha=0.5)
    restored.load_state_dict(view.state_dict())
    assert restored.metrics()["heat_drift"] == view.metrics()["heat_drift"]


def test_the_swing_is_the_exponentially_weighted_deviation_of_each_experts_count_around_its_heat():
    view = LoadView(1, E, 2, ema_alpha=0.5)
    view.update(tally([4, 0, 1, 1]))
    assert view.swing_LE.tolist() == [[0.0] * 4]                   # one step: nothing swung yet
    view.update(tally([8, 0, 1, 1]))                               # expert 0: 4 off its heat
    assert view.swing_LE.tolist() == [[2.0, 0.0, 0.0, 0.0]]        # sqrt(0.5 * 0.5 * 4^2)
    view.update(tally([6, 0, 1, 1]))                               # on its heat (6): the swing decays
    assert view.swing_LE[0, 0].item() == pytest.approx(2 ** 0.5)
    restored = LoadView(1, E, 2, ema_alpha=0.5)
    restored.load_state_dict(view.state_dict())
    assert torch.equal(restored.swing_LE, view.swing_LE)
    with pytest.raises(ValueError, match="var_LE is not a real tensor"):              # a state without it
        restored.load_state_dict({k: v for k, v in view.state_dict().items() if k != "var_LE"})


def test_device_pressure_counts_kept_routes_and_heat_counts_demand():
    view = LoadView(1, E, 2)
    view.update(tally([10, 0, 2, 2], kept=[6, 0, 2, 2]))
    assert view.pressure_LG.tolist() == [[6.0, 4.0]]
    assert view.heat_LE.tolist() == [[10.0, 0.0, 2.0, 2.0]]
    m = view.metrics()
    assert m["token_drop_rate"] == pytest.approx(4 / 14)


def test_window_pressure_sums_a_window_of_layers_clipped_at_the_ends():
    view = LoadView(4, E, 2, window=1)
    rows = [tally([1, 0, 0, 0]), tally([2, 0, 0, 0]), tally([3, 0, 0, 0]), tally([4, 0, 0, 0])]
    view.update(stack(*rows))
    # device 0 pressure per layer 1, 2, 3, 4; window 1: [1+2, 1+2+3, 2+3+4, 3+4]
    assert view.window_pressure()[:, 0].tolist() == [3.0, 6.0, 9.0, 7.0]
    assert view.window_pressure(window=0)[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0]


def test_warm_up_needs_that_many_valid_updates_of_every_layer():
    view = LoadView(2, E, 2, warmup_batches=3)
    for _ in range(2):
        view.update(stack(tally([1, 1, 1, 1]), tally([1, 1, 1, 1])))
    assert not view.ready
    view.update(stack(tally([1, 1, 1, 1]), tally([0, 0, 0, 0], tokens=0)))  # layer 1 empty
    assert not view.ready
    view.update(stack(tally([1, 1, 1, 1]), tally([1, 1, 1, 1])))
    assert view.ready


def test_an_empty_batch_or_nonfinite_logits_leave_the_layer_untouched():
    view = LoadView(2, E, 2)
    view.update(stack(tally([4, 0, 0, 0]), tally([0, 0, 4, 0])))
    before = (view.pressure_LG.clone(), view.heat_LE.clone())
    valid = view.update(stack(tally([0, 0, 0, 0], tokens=0), tally([0, 9, 0, 0], nonfinite=3)))
    assert valid.tolist() == [False, False]
    assert torch.equal(view.pressure_LG, before[0]) and torch.equal(view.heat_LE, before[1])
    assert view.updates_L.tolist() == [1, 1]
    assert view.metrics()["nonfinite_tokens"] == 3.0 and view.metrics()["skipped_layers"] == 2


def test_corrupt_tallies_are_refused_without_changing_the_view():
    view = LoadView(1, E, 2)
    view.update(tally([1, 1, 1, 1]))
    before = view.state_dict()
    bad = tally([1, 1, 1, 1])
    bad.routed_LE[0, 0] = float("nan")
    with pytest.raises(ValueError, match="tallies must be finite and non-negative"):
        view.update(bad)
    with pytest.raises(ValueError, match="tallies must be finite and non-negative"):
        view.update(tally_of([[1, 1, 1, 1]], device_LG=torch.tensor([[1.0, -2.0]])))
    with pytest.raises(ValueError, match=r"tally is for \(layers, experts\) = \(1, 3\), the view has \(1, 4\)"):
        view.update(tally([1, 1, 1]))
    with pytest.raises(ValueError, match=r"a packed tally must be \[layers, 14\] for 4 experts, got \(1, 3\)"):
        Tally.unpack(torch.zeros(1, 3), E)
    assert torch.equal(view.pressure_LG, before["pressure_LG"]) and view.steps == before["steps"]


def test_the_tally_packs_and_unpacks_by_name_and_the_layout_has_one_width():
    t = tally([1, 2, 3, 4], kept=[1, 2, 3, 3], tokens=5, nonfinite=1)
    packed = t.pack()
    assert packed.shape == (1, 2 * (E + 1) + 4)   # two per-expert fields, each after a scratch slot, and 4 counts
    back = Tally.unpack(packed, E)
    assert back.routed_LE.tolist() == [[1, 2, 3, 4]] and back.kept_LE.tolist() == [[1, 2, 3, 3]]
    assert back.tokens_L.tolist() == [5] and back.nonfinite_L.tolist() == [1] and back.forwards_L.tolist() == [1]
    assert back.dropped_L().tolist() == [1.0] and back.valid_L().tolist() == [False]


def test_update_does_not_modify_the_callers_tally():
    t = tally([1, 2, 3, 4])
    copy = t.pack().clone()
    view = LoadView(1, E, 2)
    view.update(t)
    view.last.routed_LE += 1          # the view keeps its own copy
    assert torch.equal(t.pack(), copy)


def test_a_device_load_given_with_the_tally_replaces_the_expert_to_device_sum():
    # replicated placements: experts are not where expert_to_device_E says, the adapter knows the real load
    view = LoadView(1, E, 2)
    view.update(tally_of([[4, 0, 0, 0]], device_LG=torch.tensor([[2.0, 2.0]])))
    assert view.pressure_LG.tolist() == [[2.0, 2.0]] and view.heat_LE.tolist() == [[4.0, 0.0, 0.0, 0.0]]


def test_state_dict_round_trip_restores_the_view_exactly():
    view = LoadView(3, E, 2, ema_alpha=0.3)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        routed = torch.randint(0, 50, (3, E), generator=g).double()
        view.update(tally_of(routed))
    restored = LoadView(3, E, 2, ema_alpha=0.3)
    restored.load_state_dict(view.state_dict())
    assert torch.equal(restored.pressure_LG, view.pressure_LG) and torch.equal(restored.heat_LE, view.heat_LE)
    assert restored.steps == view.steps and restored.metrics() == view.metrics()
    with pytest.raises(ValueError, match=r"checkpointed load view is \(layers, experts, devices\) = \(3, 4, 2\)"):
        LoadView(2, E, 2).load_state_dict(view.state_dict())


@pytest.mark.parametrize("devices", [1, 4])
def test_a_state_of_another_ep_size_keeps_the_expert_heat_and_rebuilds_the_device_pressure(devices):
    view = LoadView(2, E, 2)
    view.update(tally_of([[8.0, 4, 2, 2], [1.0, 1, 1, 5]], device_LG=[[12.0, 4], [2, 6]]))
    view.update(tally_of([[6.0, 4, 2, 4], [1.0, 3, 1, 3]], device_LG=[[10.0, 6], [4, 4]]))
    resumed = LoadView(2, E, devices)
    state = view.state_dict()
    assert resumed.why_unfit(state) is None
    assert resumed.load_state_dict(state) == f"EP ranks per layer 2 -> {devices}"
    assert torch.equal(resumed.heat_LE, view.heat_LE) and torch.equal(resumed.updates_L, view.updates_L)
    assert resumed.steps == 2
    # each expert's heat on the rank that holds it now (this model's contiguous layout)
    per_rank = E // devices
    assert torch.equal(resumed.pressure_LG, view.heat_LE.view(2, devices, per_rank).sum(2))
    assert resumed.last.routed_LE.abs().sum() == 0 and resumed.last_load_LG.abs().sum() == 0
    assert torch.equal(resumed.expert_to_device_LE, LoadView(2, E, devices).expert_to_device_LE)
    # experts on other ranks at the same EP size: the model's layout wins, the pressure follows it
    swapped = LoadView(2, E, 2, expert_to_device_E=torch.tensor([1, 1, 0, 0]))
    assert swapped.load_state_dict(state) == "experts on other EP ranks"
    assert torch.equal(swapped.pressure_LG, view.heat_LE.view(2, 2, 2).sum(2).flip(1))
    # the same layout: everything exactly as saved
    same = LoadView(2, E, 2)
    assert same.load_state_dict(state) is None and torch.equal(same.pressure_LG, view.pressure_LG)


def test_bad_shapes_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"num_experts \(6\) must be divisible by num_devices \(4\)"):
        LoadView(1, 6, 4)


def test_a_tally_with_device_columns_feeds_the_pressure_and_survives_a_checkpoint():
    view = LoadView(1, E, 2)
    view.update(tally_of([[4.0, 0, 0, 0]], device_LG=[[1.0, 3.0]]))   # a replica of expert 0 on device 1
    assert view.pressure_LG.tolist() == [[1.0, 3.0]] and view.heat_LE.tolist() == [[4.0, 0.0, 0.0, 0.0]]
    packed = tally_of([[4.0, 0, 0, 0]], device_LG=[[1.0, 3.0]]).pack()
    assert packed.shape == (1, 2 * (E + 1) + (2 + 1) + 4)
    assert Tally.unpack(packed, E, 2).device_LG.tolist() == [[1.0, 3.0]]
    restored = LoadView(1, E, 2)
    restored.load_state_dict(view.state_dict())
    assert restored.last.device_LG.tolist() == [[1.0, 3.0]] and restored.metrics() == view.metrics()
