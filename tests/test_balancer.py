"""The framework-neutral loop in one process: gates that only speak the BalancedGate protocol."""
import warnings

import pytest
import torch

from eb_deepspeed.core import Balancer, EasyBalanceConfig, Tally, TallyRecorder
from eb_deepspeed.core import record as R
from eb_deepspeed.core.balancer import check_agreement

pytestmark = pytest.mark.unit
E = 4


class ToyGate:
    """The smallest BalancedGate: routes token t to expert t % E, records through a TallyRecorder."""

    def __init__(self):
        self.num_experts = E
        self.recorder = TallyRecorder(E)
        self.aux_weight, self.bias_E, self.weights_T, self.device_loss = 1.0, None, None, 0.0

    def forward(self, experts_T: torch.Tensor) -> None:
        routed_E = torch.bincount(experts_T, minlength=E).double()
        self.recorder.record(routed_E, experts_T, experts_T.numel(), torch.tensor(0), torch.tensor(1.0),
                             None if self.weights_T is None else self.weights_T)

    def discard_tally(self, last_forward_only=False):
        self.recorder.discard(last_forward_only)

    def take_tally(self, device="cpu"):
        return self.recorder.take(device)

    def set_aux_weight(self, weight):
        self.aux_weight = weight

    def set_selection_bias(self, bias_E):
        self.bias_E = bias_E

    def set_device_loss(self, weight, expert_to_device_E):
        self.device_loss = weight

    def set_token_weights(self, weights_T):
        self.weights_T = weights_T

    def set_batch_scope(self, scope, share):
        self.scope, self.share = scope, share


def config(**block):
    return EasyBalanceConfig.from_ds_config({"easybalance": {"warmup_batches": 1, **block}})


def test_one_step_drains_every_gate_reduces_once_and_updates_the_view():
    gates = [ToyGate(), ToyGate()]
    reduced = []
    balancer = Balancer(config(mode="observe"), gates, 2, reduce=lambda t: reduced.append(t.clone()))
    gates[0].forward(torch.tensor([0, 0, 0, 1]))       # layer 0: experts 0, 1 on device 0
    gates[1].forward(torch.tensor([3, 3, 2, 1]))       # layer 1: 3 routes on device 1, 1 on device 0
    balancer.step()
    assert len(reduced) == 1 and reduced[0].shape == (2, Tally.zeros(1, E).pack().shape[1])
    assert balancer.view.pressure_LG.tolist() == [[4.0, 0.0], [1.0, 3.0]]
    assert balancer.view.last.tokens_L.tolist() == [4.0, 4.0] and balancer.view.steps == 1
    balancer.step()                                    # nothing recorded since: an empty step, layers skipped
    assert balancer.view.updates_L.tolist() == [1, 1] and balancer.view.steps == 2


def test_the_reduce_sums_what_other_ranks_saw():
    gates = [ToyGate()]

    def reduce(packed_LW):   # another rank routed the same again
        packed_LW.mul_(2)
    balancer = Balancer(config(mode="observe"), gates, 2, reduce=reduce)
    gates[0].forward(torch.tensor([0, 3]))
    balancer.step()
    assert balancer.view.pressure_LG.tolist() == [[2.0, 2.0]] and balancer.view.last.tokens_L.tolist() == [4.0]


def test_a_step_in_flight_is_taken_when_it_is_read_or_at_the_next_step_and_waits_only_then():
    gates = [ToyGate()]
    balancer = Balancer(config(mode="observe"), gates, 2)
    waits = []

    class Work:        # a posted all-reduce: another rank's routes arrive when it is waited for
        def __init__(self, packed_LW):
            self.packed_LW = packed_LW

        def wait(self):
            waits.append(1)
            self.packed_LW.mul_(2)
    gates[0].forward(torch.tensor([0, 3]))
    balancer.step_async(Work)
    assert waits == [] and balancer.view_so_far.steps == 0          # nothing waited for yet
    gates[0].forward(torch.tensor([0, 0]))                              # the next interval is being counted
    assert balancer.view.steps == 1 and waits == [1]                    # a read takes the step in flight
    assert balancer.view.pressure_LG.tolist() == [[2.0, 2.0]]           # with what the reduce brought
    balancer.step_async(Work)
    balancer.step_async(None)          # the next step first takes the one in flight
    assert waits == [1, 1] and balancer.view_so_far.steps == 2 and balancer.settle() is not None
    assert balancer.view.steps == 3 and balancer.settle() is None


class _TimedWork:
    """A posted reduce that records the timeout it was waited for with."""

    def __init__(self, timeouts: list):
        self.timeouts = timeouts

    def wait(self, timeout=None):
        self.timeouts.append(timeout)


def test_a_step_still_in_flight_at_exit_is_taken_there_and_its_work_let_go(monkeypatch):
    import atexit

    from eb_deepspeed.core.balancer import _at_exit
    registered = []
    monkeypatch.setattr(atexit, "register", lambda fn, *args: registered.append((fn, args)))
    gates = [ToyGate()]
    balancer = Balancer(config(mode="observe"), gates, 2)     # no logger: before, nothing ran at exit
    assert registered == []
    timeouts = []
    gates[0].forward(torch.tensor([0, 3]))
    balancer.step_async(lambda packed_LW: _TimedWork(timeouts))
    balancer.step_async(lambda packed_LW: _TimedWork(timeouts))
    ours = [(fn, args) for fn, args in registered if fn is _at_exit]
    assert len(ours) == 1                                             # once
    ours[0][0](*ours[0][1])                                           # what the interpreter runs at exit
    assert not balancer.in_flight and balancer.view_so_far.steps == 2
    assert timeouts[-1] is not None                                   # a gone peer cannot hang the exit


def test_a_balancer_collected_with_a_step_in_flight_waits_for_its_reduce_first():
    import gc
    gates = [ToyGate()]
    balancer = Balancer(config(mode="observe"), gates, 2)
    timeouts = []
    gates[0].forward(torch.tensor([0, 3]))
    balancer.step_async(lambda packed_LW: _TimedWork(timeouts))
    del balancer, gates
    gc.collect()
    assert len(timeouts) == 1 and timeouts[0] is not None   # no reduce of ours left in flight for the group's teardown


def test_a_rank_holding_some_layers_fills_their_rows_and_controls_only_its_gates():
    # pipeline stage 1 of 2: global layers 2, 3 of 4; the reduce brings the other stage's rows
    gates = [ToyGate(), ToyGate()]

    def other_stage(packed_LW):
        assert packed_LW[:2].abs().sum() == 0 and packed_LW[2:].abs().sum() > 0
        packed_LW[:2] = packed_LW[2:]
    balancer = Balancer(config(aux={"policy": "cross_layer", "smoothing": 1.0}), gates, 2, reduce=other_stage,
                        layers=[2, 3], num_layers=4)
    gates[0].forward(torch.tensor([0, 0, 0, 0, 2]))
    gates[1].forward(torch.tensor([0, 2, 3, 1]))
    balancer.step()
    assert balancer.view.updates_L.tolist() == [1] * 4
    layer_w_L = balancer.controller.layer_w_L
    assert abs(float(layer_w_L.mean()) - 1.0) < 1e-9 and layer_w_L[2] > layer_w_L[3]
    assert [g.device_loss for g in gates] == [float(layer_w_L[2]), float(layer_w_L[3])]   # device_scale 1
    assert [g.aux_weight for g in gates] == [1.0, 1.0]


def test_the_bias_policy_hands_each_gate_its_layers_bias_and_observe_hands_nothing():
    gates = [ToyGate()]
    balancer = Balancer(config(aux={"policy": "bias", "bias_rate": 0.1}), gates, 2)
    gates[0].forward(torch.tensor([0, 0, 0, 1]))
    balancer.step()
    assert gates[0].bias_E is not None and gates[0].bias_E[0] < 0 < gates[0].bias_E[2]
    quiet = [ToyGate()]
    observer = Balancer(config(mode="observe", aux={"policy": "bias"}), quiet, 2)
    quiet[0].forward(torch.tensor([0, 0, 0, 1]))
    observer.step()
    assert quiet[0].bias_E is None and quiet[0].aux_weight == 1.0 and observer.aux_weights() == [1.0]


def test_sequence_lengths_reach_every_gate_as_token_weights():
    gates = [ToyGate(), ToyGate()]
    balancer = Balancer(config(mode="observe", seq_len_weighting=True), gates, 2)
    balancer.set_sequence_lengths(torch.tensor([2, 1]), seq_len=2)
    assert all(torch.allclose(g.weights_T, torch.tensor([4 / 3, 4 / 3, 2 / 3, 2 / 3], dtype=torch.float64))
               for g in gates)
    with pytest.raises(ValueError, match="set_sequence_lengths\\(\\) needs easybalance.seq_len_weighting = true"):
        Balancer(config(mode="observe"), [ToyGate()], 2).set_sequence_lengths(torch.tensor([1]), 1)


def test_every_record_key_is_in_the_one_table():
    gates = [ToyGate()]
    balancer = Balancer(config(mode="observe"), gates, 2)
    gates[0].forward(torch.tensor([0, 1, 2, 3]))
    balancer.step()
    record = balancer.record()
    table = set(R.META) | set(R.PER_LAYER) | set(R.SCALARS) | set(R.MATRICES)
    # serving adds two, a run's first log one, the training loop's note the rest
    assert set(record) == table - {"replans", "weight_moves", "run_start", *R.NOTES}
    serving = Balancer(config(mode="observe"), [ToyGate()], 2, extra_metrics=lambda: {"replans": 2, "weight_moves": 5})
    serving.gates[0].forward(torch.tensor([0, 1, 2, 3]))
    serving.step()
    serving.note(lm_loss=2.5)
    assert set(serving.record()) == table - {"run_start"} and serving.record()["lm_loss"] == 2.5


@pytest.mark.parametrize("kwargs, message", [(dict(loss=1.0), "takes lm_loss"), (dict(lm_loss="2"), "finite"),
                                             (dict(lm_loss=True), "finite")])
def test_notes_are_checked(kwargs, message):
    gates = [ToyGate()]
    balancer = Balancer(config(mode="observe"), gates, 2)
    gates[0].forward(torch.tensor([0, 1, 2, 3]))
    balancer.step()
    with pytest.raises(ValueError, match=message):
        balancer.note(**kwargs)
    assert "lm_loss" not in balancer.record() and "loss" not in balancer.record()   # a refused note logs nothing


def test_a_non_finite_note_is_recorded_as_null_with_one_warning_and_never_raised(tmp_path):
    from eb_deepspeed.observe.monitor import JsonlLogger, flatten_record
    from eb_deepspeed.observe.report import render_report
    gates = [ToyGate()]
    balancer = Balancer(config(mode="observe"), gates, 2, logger=JsonlLogger(str(tmp_path)))
    for step, loss in enumerate([2.5, float("nan"), float("inf"), 2.0]):
        gates[0].forward(torch.tensor([0, 1, 2, 3]))
        if step == 1:
            with pytest.warns(UserWarning, match=r"note\(lm_loss=nan\) at step 1: recorded as null"):
                balancer.note(lm_loss=loss)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("error")             # the second non-finite value warns no more
                balancer.note(lm_loss=loss)
        balancer.step()
        if step in (1, 2):
            assert balancer.record()["lm_loss"] is None and "easybalance/lm_loss" not in flatten_record(balancer.record())
        balancer.flush_log()
    assert balancer.record()["lm_loss"] == 2.0
    balancer.logger.close()
    assert render_report(str(tmp_path))                    # the report draws a loss curve with a gap


class ListLogger(R.BalanceLogger):
    def __init__(self):
        self.records = []

    def log(self, record, step):
        self.records.append(record)


def test_a_runs_first_record_says_where_the_run_started_fresh_or_resumed():
    gates, logger = [ToyGate()], ListLogger()
    balancer = Balancer(config(mode="observe"), gates, 2, logger=logger)
    for _ in range(3):
        gates[0].forward(torch.tensor([0, 1, 2, 3]))
        balancer.step()
        balancer.flush_log()
    assert [r.get("run_start") for r in logger.records] == [0, None, None]
    state = balancer.state_dict()
    resumed, logger = Balancer(config(mode="observe"), gates, 2, logger=ListLogger()), None
    resumed.load_state_dict(state)
    resumed.flush_log()                         # nothing new to log at the checkpoint's own step
    gates[0].forward(torch.tensor([0, 1]))
    resumed.step()
    resumed.flush_log()
    assert [(r["step"], r.get("run_start")) for r in resumed.logger.records] == [(4, 3)]


def test_a_state_of_an_older_format_is_refused_without_changing_anything():
    gates = [ToyGate()]
    balancer = Balancer(config(), gates, 2)
    gates[0].forward(torch.tensor([0, 1]))
    balancer.step()
    before = balancer.state_dict()
    assert balancer.load_state_dict({"version": 1, "view": {}, "aux": {}}) is False
    assert torch.equal(balancer.view.pressure_LG, before["view"]["pressure_LG"])
    with pytest.raises(ValueError, match="balancer state format 3 is newer than this eb_deepspeed reads \\(2\\)"):
        balancer.load_state_dict({"version": 3})


@pytest.mark.parametrize("damage, message", [
    (lambda s: s["view"].update(shape=(1, 4, 1)), r"load view is \(layers, experts, devices\) = \(1, 4, 1\)"),
    (lambda s: s["view"].update(heat_LE=torch.zeros(1, 3)), r"heat_LE has shape \(1, 3\), this model \(1, 4\)"),
    (lambda s: s["view"]["pressure_LG"].fill_(float("nan")), r"pressure_LG holds NaN or inf"),
    (lambda s: s["view"].pop("last_load_LG"), r"last_load_LG is not a real tensor"),
    (lambda s: s["view"].update(steps=-1), r"steps is -1"),
    (lambda s: s["aux"].update(bias_LE=torch.zeros(2, 4)), r"aux bias_LE has shape \(2, 4\), this model \(1, 4\)"),
    (lambda s: s.update(aux=None), r"aux state is not a dict"),
    (lambda s: s.update(version="2"), r"version '2' is not an integer"),
])
def test_a_state_that_does_not_fit_is_refused_before_anything_changes(damage, message):
    gates = [ToyGate()]
    balancer = Balancer(config(), gates, 2)
    gates[0].forward(torch.tensor([0, 1, 1, 3]))
    balancer.step()
    state = balancer.state_dict()
    damage(state)
    other = Balancer(config(), [ToyGate()], 2)
    before = other.state_dict()
    assert other.why_unfit(state) is not None
    with pytest.raises(ValueError, match=message):
        other.load_state_dict(state)
    after = other.state_dict()
    assert all(torch.equal(after["view"][k], before["view"][k]) for k in ("heat_LE", "pressure_LG", "last_tally"))
    assert after["view"]["steps"] == before["view"]["steps"] and torch.equal(after["aux"]["weight_L"], before["aux"]["weight_L"])


def test_when_one_rank_disagrees_every_rank_raises():
    same = {"config": {"ema_alpha": 0.3}}
    other = {"config": {"ema_alpha": 0.2}}
    check_agreement([same, same], 0)
    for rank in (0, 1, 2):
        with pytest.raises(ValueError, match="disagrees with rank .*ema_alpha"):
            check_agreement([same, same, other], rank)


def test_bad_layer_layouts_are_refused():
    with pytest.raises(ValueError, match=r"layers \(\[0, 0\]\) must be 2 distinct indices in \[0, 4\)"):
        Balancer(config(), [ToyGate(), ToyGate()], 2, layers=[0, 0], num_layers=4)
    with pytest.raises(ValueError, match="the model has no MoE layers"):
        Balancer(config(), [], 2)


def _trained(block, steps=3):
    gates = [ToyGate(), ToyGate()]
    balancer = Balancer(config(**block), gates, 2)
    for _ in range(steps):
        gates[0].forward(torch.tensor([0, 0, 0, 0, 0, 1]))
        gates[1].forward(torch.tensor([0, 1, 2, 3]))
        balancer.step()
    return balancer


@pytest.mark.parametrize("saved, resumed, weights, says", [
    # another policy: its state is not this policy's; fixed means 1.0 everywhere, bias starts at zero
    ({"aux": {"policy": "cross_layer", "smoothing": 1.0}}, {"aux": {"policy": "fixed"}}, [1.0, 1.0],
     r"easybalance\.aux\.policy 'cross_layer' -> 'fixed'.*weights and bias start fresh"),
    # the same policy with another aux_scale: the weights are what the new config defines
    ({"aux": {"policy": "bias", "bias_rate": 0.1}}, {"aux": {"policy": "bias", "bias_rate": 0.1, "aux_scale": 0.2}},
     [0.2, 0.2], r"easybalance\.aux\.aux_scale 1\.0 -> 0\.2.*aux weights set to aux_scale 0\.2"),
])
def test_resuming_under_another_config_re_derives_the_controls_and_says_so(saved, resumed, weights, says):
    state = _trained(saved).state_dict()
    gates = [ToyGate(), ToyGate()]
    fresh = Balancer(config(**resumed), gates, 2)
    with pytest.warns(UserWarning, match=says):
        fresh.load_state_dict(state)
    assert fresh.controller.weight_L.tolist() == weights and [g.aux_weight for g in gates] == weights
    assert torch.equal(fresh.view.pressure_LG, state["view"]["pressure_LG"])   # the view itself is kept
    if resumed["aux"]["policy"] == "bias":
        assert torch.equal(fresh.controller.bias_LE, state["aux"]["bias_LE"]) and fresh.controller.bias_LE.abs().sum() > 0


def test_resuming_cross_layer_weights_into_a_narrower_range_re_clips_them_with_mean_one():
    state = _trained({"aux": {"policy": "cross_layer", "smoothing": 1.0, "gain": 1.0,
                              "weight_range": [0.1, 10.0]}}).state_dict()
    assert float(state["aux"]["layer_w_L"].max()) > 1.2
    gates = [ToyGate(), ToyGate()]
    fresh = Balancer(config(aux={"policy": "cross_layer", "weight_range": [0.9, 1.1]}), gates, 2)
    with pytest.warns(UserWarning, match=r"weight_range \[0\.1, 10\.0\] -> \[0\.9, 1\.1\].*re-clipped"):
        fresh.load_state_dict(state)
    for w in (fresh.controller.layer_w_L, fresh.controller.log_w_L.exp()):
        assert float(w.max()) <= 1.1 + 1e-9 and float(w.min()) >= 0.9 - 1e-9 and abs(float(w.mean()) - 1.0) < 1e-9
    assert [g.device_loss for g in gates] == fresh.controller.layer_w_L.tolist()


def test_resuming_under_the_same_config_restores_exactly_and_stays_quiet():
    trained = _trained({"aux": {"policy": "cross_layer", "smoothing": 1.0}})
    fresh = Balancer(config(aux={"policy": "cross_layer", "smoothing": 1.0}, log={"dir": "elsewhere"}),
                     [ToyGate(), ToyGate()], 2)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.load_state_dict(trained.state_dict())
    for key in ("weight_L", "layer_w_L", "log_w_L"):
        assert torch.equal(getattr(fresh.controller, key), getattr(trained.controller, key)), key


def test_a_recorder_takes_token_weights_of_any_float_type():
    recorder = TallyRecorder(E)
    recorder.record(torch.tensor([1.0, 1, 0, 0]), torch.tensor([0, 1]), 2, torch.tensor(0), torch.tensor(0.5),
                    token_w_R=torch.tensor([0.5, 1.5], dtype=torch.float32))
    part = Tally.unpack(recorder.take()[None], E)
    assert part.load_LE.tolist() == [[0.5, 1.5, 0.0, 0.0]] and part.kept_LE.tolist() == [[1.0, 1.0, 0.0, 0.0]]


def test_device_metrics_are_of_the_device_load_the_view_took():
    from eb_deepspeed.core import LoadView
    view = LoadView(1, E, 2)
    view.update(Tally.build([[4.0, 0, 0, 0]]), device_load_LG=torch.tensor([[2.0, 2.0]]))
    assert view.metrics()["device_max_over_mean"] == [1.0] and view.metrics()["expert_max_over_mean"] == [4.0]


def test_a_skipped_batch_can_be_discarded_whole_or_just_its_last_forward():
    gates = [ToyGate()]
    balancer = Balancer(config(mode="observe"), gates, 2)
    reference = Balancer(config(mode="observe"), [ToyGate()], 2)
    gates[0].forward(torch.tensor([0, 0, 0, 1]))             # a micro-batch that reaches the step
    gates[0].forward(torch.tensor([3, 3, 3, 3, 3, 3]))       # a skipped micro-batch (NaN loss, no backward)
    balancer.discard_tally(last_forward_only=True)
    balancer.discard_tally(last_forward_only=True)           # nothing more to forget: only one forward is undone
    balancer.step()
    reference.gates[0].forward(torch.tensor([0, 0, 0, 1]))
    reference.step()
    assert torch.equal(balancer.view.last.pack(), reference.view.last.pack())
    gates[0].forward(torch.tensor([2, 2]))                    # a whole skipped step
    balancer.discard_tally()
    gates[0].forward(torch.tensor([0, 1]))
    balancer.step()
    reference.gates[0].forward(torch.tensor([0, 1]))
    reference.step()
    assert torch.equal(balancer.view.last.pack(), reference.view.last.pack())
    assert torch.equal(balancer.view.heat_LE, reference.view.heat_LE)


def nan_forward(gate, tokens=8):
    """What a gate records when its logits were NaN: every token on expert 0 (argmax of NaN), all counted
    non-finite."""
    experts_T = torch.zeros(tokens, dtype=torch.long)
    gate.recorder.record(torch.bincount(experts_T, minlength=E).double(), experts_T, tokens,
                         torch.tensor(tokens), torch.tensor(float("nan")))


@pytest.mark.parametrize("policy", ["cross_layer", "bias"])
def test_non_finite_logits_freeze_the_layers_controls_and_keep_garbage_out_of_the_record(policy, tmp_path):
    import json

    from eb_deepspeed.observe.monitor import JsonlLogger, flatten_record
    from eb_deepspeed.observe.report import render_report
    gates = [ToyGate(), ToyGate()]
    balancer = Balancer(config(aux={"policy": policy}, log={"interval": 10}), gates, 2,
                        logger=JsonlLogger(str(tmp_path)))
    for _ in range(3):
        gates[0].forward(torch.tensor([0, 0, 0, 1, 2, 3]))
        gates[1].forward(torch.tensor([3, 3, 2, 1]))
        balancer.step()
    assert balancer.controller.updates == 3
    before = balancer.controller.state_dict()
    pressure = balancer.view.pressure_LG.clone()
    with pytest.warns(UserWarning, match=r"non-finite router logits in MoE layers \[1\] at 1 step"):
        gates[0].forward(torch.tensor([0, 0, 0, 1, 2, 3]))
        nan_forward(gates[1])
        balancer.step()
    after = balancer.controller.state_dict()
    assert torch.equal(balancer.view.pressure_LG[1], pressure[1])
    assert torch.equal(after["bias_LE"][1], before["bias_LE"][1])     # the NaN layer's controls hold
    if policy == "cross_layer":                                        # weights share a mean: all hold
        assert torch.equal(after["layer_w_L"], before["layer_w_L"]) and torch.equal(after["log_w_L"], before["log_w_L"])
    else:                                                              # the healthy layer's bias moved on
        assert not torch.equal(after["bias_LE"][0], before["bias_LE"][0])
    record = balancer.record()
    assert record["nonfinite_layer_ids"] == [1] and "expert_counts_LE" not in record
    assert record["device_max_over_mean"][1] is None and record["device_max_over_mean"][0] is not None
    assert record["aux_loss"][1] is None and record["device_util_std"] is not None
    flat = flatten_record(record)
    assert "easybalance_layer_01/device_max_over_mean" not in flat and "easybalance_layer_00/max_vio" in flat
    balancer.flush_log()
    balancer.logger.close()
    line = (tmp_path / "balance.jsonl").read_text().splitlines()[-1]
    assert "NaN" not in line and json.loads(line)["max_vio"][1] is None
    assert len(render_report(str(tmp_path))) >= 2                    # plots draw a gap


def test_the_non_finite_warning_repeats_once_per_log_interval_while_it_lasts():
    import warnings
    gates = [ToyGate()]
    balancer = Balancer(config(mode="observe", log={"interval": 10}), gates, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(25):
            nan_forward(gates[0])
            balancer.step()
    messages = [str(w.message) for w in caught if "non-finite" in str(w.message)]
    assert len(messages) == 3                                         # steps 1, 11, 21
    assert "at 1 step(s) up to step 1" in messages[0] and "at 10 step(s) up to step 11" in messages[1]
    record = balancer.record()
    assert record["device_util_std"] is None and record["device_max_over_mean"] == [None]


@pytest.mark.parametrize("part, key, value, says", [
    ("aux", "weight_L", -1e6, r"aux weight_L holds values in \[-1e\+06, -1e\+06\], outside the plausible \[0, 1e\+06\]"),
    ("aux", "bias_LE", 1e30, r"aux bias_LE .*outside the plausible \[-10000, 10000\]"),
    ("aux", "updates", -3, r"aux updates is -3, expected an integer >= 0"),
    ("view", "heat_LE", -1.0, r"load view heat_LE .*outside the plausible \[0, inf\]"),
    ("view", "updates_L", -2.0, r"load view updates_L .*outside the plausible \[0, inf\]"),
    ("view", "pressure_LG", -0.5, r"load view pressure_LG"),
])
def test_a_finite_but_impossible_state_is_refused_naming_its_field_and_nothing_changes(part, key, value, says):
    state = _trained({"aux": {"policy": "bias"}}).state_dict()
    if isinstance(state[part][key], torch.Tensor):
        state[part][key] = torch.full_like(state[part][key], value)
    else:
        state[part][key] = value
    gates = [ToyGate(), ToyGate()]
    fresh = Balancer(config(aux={"policy": "bias"}), gates, 2)
    before = fresh.state_dict()
    assert fresh.why_unfit(state) is not None
    with pytest.raises(ValueError, match=says):
        fresh.load_state_dict(state)
    after = fresh.state_dict()
    assert torch.equal(after["view"]["pressure_LG"], before["view"]["pressure_LG"])
    assert torch.equal(after["aux"]["bias_LE"], before["aux"]["bias_LE"]) and after["view"]["steps"] == 0


def test_a_run_shorter_than_the_log_interval_still_leaves_its_last_record_at_exit(tmp_path, monkeypatch):
    import atexit

    from eb_deepspeed.core.balancer import _at_exit
    from eb_deepspeed.observe.monitor import JsonlLogger
    from eb_deepspeed.observe.report import read_log
    registered = []
    monkeypatch.setattr(atexit, "register", lambda fn, *args: registered.append((fn, args)))
    gates = [ToyGate()]
    balancer = Balancer(config(mode="observe", log={"interval": 10}), gates, 2, logger=JsonlLogger(str(tmp_path)))
    for _ in range(3):                      # 3 steps, interval 10: before, the log stayed empty
        gates[0].forward(torch.tensor([0, 1, 2, 3]))
        balancer.step()
    assert registered == [(_at_exit, registered[0][1])]
    fn, args = registered[0]
    fn(*args)                               # what the interpreter runs at exit
    fn(*args)                               # twice (a flush_log of its own first): still one record
    assert [r["step"] for r in read_log(str(tmp_path))] == [3]


def test_global_lagged_hands_each_gate_its_layers_global_frequencies_after_every_step():
    gates = [ToyGate(), ToyGate()]
    cfg = EasyBalanceConfig.from_ds_config({"easybalance": {"warmup_batches": 1, "aux": {"batch_scope": "global_lagged"}}})
    balancer = Balancer(cfg, gates, 2, reduce=lambda packed: packed.mul_(2))     # another rank's routes alike
    assert gates[0].scope == "global_lagged" and gates[0].share() is None        # no step yet: the forward's own
    gates[0].forward(torch.tensor([0, 0, 0, 1]))
    gates[1].forward(torch.tensor([2, 3]))
    balancer.step()
    assert torch.allclose(gates[0].share(), torch.tensor([0.75, 0.25, 0.0, 0.0]))
    assert torch.allclose(gates[1].share(torch.tensor([9.0, 0, 0, 0])), torch.tensor([0.0, 0.0, 0.5, 0.5]))
    gates[0].forward(torch.tensor([1]))
    balancer.step()                                                     # layer 1 saw no routes: its own again
    assert torch.allclose(gates[0].share(), torch.tensor([0.0, 1.0, 0.0, 0.0])) and gates[1].share() is None
    micro = Balancer(config(), [ToyGate()], 2)
    assert not hasattr(micro.gates[0], "scope")                         # the default scope hands nothing


def test_global_exact_reduces_each_forwards_routes_and_counts_the_step_so_far():
    calls = []

    def reduce(t):
        calls.append(t.numel())
        t.mul_(2)                                                       # another rank's routes alike

    gates = [ToyGate()]
    cfg = EasyBalanceConfig.from_ds_config({"easybalance": {"warmup_batches": 1, "aux": {"batch_scope": "global_exact"}}})
    balancer = Balancer(cfg, gates, 2, reduce=reduce)
    share = gates[0].share
    assert torch.allclose(share(torch.tensor([3.0, 1.0, 0.0, 0.0])), torch.tensor([0.75, 0.25, 0.0, 0.0]))
    assert calls == [4]                                                 # one [E] all-reduce
    assert torch.allclose(share(rerun=True), torch.tensor([0.75, 0.25, 0.0, 0.0])) and calls == [4]  # no collective
    # the second micro-batch of the step: f over both
    assert torch.allclose(share(torch.tensor([0.0, 0.0, 0.0, 4.0])), torch.tensor([3, 1, 0, 4]) / 8.0)
    balancer.step()                                                     # a step boundary: counting starts afresh
    assert share(rerun=True) is None
    assert torch.allclose(share(torch.tensor([0.0, 2.0, 2.0, 0.0])), torch.tensor([0.0, 0.5, 0.5, 0.0]))
    balancer.discard_tally()                                            # a skipped step: likewise
    assert share(rerun=True) is None
    assert share(torch.zeros(4)) is None                                # no routes anywhere: the forward's own
