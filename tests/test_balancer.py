"""The framework-neutral loop in one process: gates that are only a tally and controls (`BalancedGate`)."""
import warnings

import pytest
import torch

from eb_deepspeed.core import Balancer, EasyBalanceConfig, LayerControls, LayerTally, ModelShape, Tally
from eb_deepspeed.core import record as R
from eb_deepspeed.core.balancer import check_agreement
from benchmarks.sim.model import tally_of

pytestmark = pytest.mark.unit
E = 4


class ToyGate:
    """The smallest BalancedGate: routes token t to expert t % E into its tally; reads nothing of its controls."""

    def __init__(self):
        self.tally = LayerTally(E)
        self.controls = LayerControls(E)

    def forward(self, experts_T: torch.Tensor) -> None:
        self.tally.add_routes(experts_T[:, None], l_aux=torch.tensor(1.0))


def shape(layers=None, num_layers=None, G=2):
    return ModelShape.uniform(num_layers or len(layers or [0]), E, G, local_layers=layers)


def make(block, gates, **kwargs):
    """A balancer of `gates` as the whole model (or kwargs["shape"]) on 2 devices."""
    kwargs.setdefault("shape", ModelShape.uniform(len(gates), E, 2))
    return Balancer(block if isinstance(block, EasyBalanceConfig) else config(**block), gates, **kwargs)


def config(**block):
    return EasyBalanceConfig.from_ds_config({"easybalance": {"warmup_batches": 1, **block}})


def test_one_step_drains_every_gate_reduces_once_and_updates_the_view():
    gates = [ToyGate(), ToyGate()]
    reduced = []
    balancer = make({"mode": "observe"}, gates, reduce=lambda t: reduced.append(t.clone()))
    gates[0].forward(torch.tensor([0, 0, 0, 1]))       # layer 0: experts 0, 1 on device 0
    gates[1].forward(torch.tensor([3, 3, 2, 1]))       # layer 1: 3 routes on device 1, 1 on device 0
    balancer.step()
    assert len(reduced) == 1 and reduced[0].shape == (2, Tally.zeros(1, E).pack().shape[1])
    assert balancer.view.pressure_LG.tolist() == [[4.0, 0.0], [1.0, 3.0]]
    assert balancer.view.last.tokens_L.tolist() == [4.0, 4.0] and balancer.view.steps == 1
    balancer.step()                                    # nothing counted since: an empty step, layers skipped
    assert balancer.view.updates_L.tolist() == [1, 1] and balancer.view.steps == 2


def test_the_reduce_sums_what_other_ranks_saw():
    gates = [ToyGate()]
    balancer = make({"mode": "observe"}, gates, reduce=lambda packed_LW: packed_LW.mul_(2))   # another rank alike
    gates[0].forward(torch.tensor([0, 3]))
    balancer.step()
    assert balancer.view.pressure_LG.tolist() == [[2.0, 2.0]] and balancer.view.last.tokens_L.tolist() == [4.0]


def test_a_rank_holding_some_layers_fills_their_rows_and_controls_only_its_gates():
    # pipeline stage 1 of 2: global layers 2, 3 of 4; the reduce brings the other stage's rows
    gates = [ToyGate(), ToyGate()]

    def other_stage(packed_LW):
        assert packed_LW[:2].abs().sum() == 0 and packed_LW[2:].abs().sum() > 0
        packed_LW[:2] = packed_LW[2:]
    balancer = make({"aux": {"policy": "cross_layer"}}, gates, reduce=other_stage,
                    shape=ModelShape.uniform(4, E, 2, local_layers=[2, 3]))
    gates[0].forward(torch.tensor([0, 0, 0, 0, 2]))
    gates[1].forward(torch.tensor([0, 2, 3, 1]))
    balancer.step()
    assert balancer.view.updates_L.tolist() == [1] * 4
    w_L = balancer.controller.device_loss_weights()
    assert abs(float(w_L.mean()) - 1.0) < 1e-9 and w_L[2] > w_L[3]
    assert [g.controls.device_loss_weight for g in gates] == [float(w_L[2]), float(w_L[3])]
    assert gates[0].controls.expert_to_device_E.tolist() == [0, 0, 1, 1]       # the device loss's map


def test_the_bias_policy_writes_each_gates_bias_and_observe_writes_nothing():
    gates = [ToyGate()]
    balancer = make({"aux": {"policy": "bias", "bias_rate": 0.1}}, gates)
    gates[0].forward(torch.tensor([0, 0, 0, 1]))
    balancer.step()
    bias_E = gates[0].controls.bias_E
    assert bias_E is not None and bias_E[0] < 0 < bias_E[2] and gates[0].controls.device_loss_weight == 0.0
    quiet = [ToyGate()]
    observer = make({"mode": "observe", "aux": {"policy": "bias_cross_layer"}}, quiet)
    quiet[0].forward(torch.tensor([0, 0, 0, 1]))
    observer.step()
    assert quiet[0].controls == LayerControls(E) and observer.device_loss_weights() == [0.0]   # untouched


def test_every_record_key_is_in_the_one_table():
    gates = [ToyGate()]
    balancer = make({"mode": "observe"}, gates)
    gates[0].forward(torch.tensor([0, 1, 2, 3]))
    balancer.step()
    record = balancer.log.record(balancer)
    table = set(R.META) | set(R.PER_LAYER) | set(R.SCALARS) | set(R.MATRICES)
    # serving adds two, training placement three, a run's first log one, the training loop's note the rest
    assert set(record) == table - {"replans", "weight_moves", "moved_bytes", "run_start", *R.NOTES}
    balancer.log.extra = lambda: {"replans": 2, "weight_moves": 5, "moved_bytes": 8}
    balancer.note(lm_loss=2.5)
    record = balancer.log.record(balancer)
    assert set(record) == table - {"run_start"} and record["lm_loss"] == 2.5


@pytest.mark.parametrize("kwargs, message", [(dict(loss=1.0), "takes lm_loss"), (dict(lm_loss="2"), "finite"),
                                             (dict(lm_loss=True), "finite")])
def test_notes_are_checked(kwargs, message):
    gates = [ToyGate()]
    balancer = make({"mode": "observe"}, gates)
    gates[0].forward(torch.tensor([0, 1, 2, 3]))
    balancer.step()
    with pytest.raises(ValueError, match=message):
        balancer.note(**kwargs)
    record = balancer.log.record(balancer)
    assert "lm_loss" not in record and "loss" not in record      # a refused note logs nothing


def test_a_non_finite_note_is_recorded_as_null_with_one_warning_and_never_raised(tmp_path):
    from eb_deepspeed.observe.monitor import JsonlLogger, flatten_record
    from eb_deepspeed.observe.report import render_report
    gates = [ToyGate()]
    balancer = make({"mode": "observe", "log": {"interval": 1}}, gates, logger=JsonlLogger(str(tmp_path)))
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
        record = balancer.log.record(balancer)
        if step in (1, 2):
            assert record["lm_loss"] is None and "easybalance/lm_loss" not in flatten_record(record)
    assert balancer.log.record(balancer)["lm_loss"] == 2.0
    balancer.close()
    assert render_report(str(tmp_path))                    # the report draws a loss curve with a gap


class ListLogger(R.BalanceLogger):
    def __init__(self):
        self.records = []

    def log(self, record, step):
        self.records.append(record)


def test_a_runs_first_record_says_where_the_run_started_fresh_or_resumed():
    gates, logger = [ToyGate()], ListLogger()
    balancer = make({"mode": "observe", "log": {"interval": 1}}, gates, logger=logger)
    for _ in range(3):
        gates[0].forward(torch.tensor([0, 1, 2, 3]))
        balancer.step()
    assert [r.get("run_start") for r in logger.records] == [0, None, None]
    resumed = make({"mode": "observe", "log": {"interval": 1}}, gates, logger=ListLogger())
    resumed.load_state_dict(balancer.state_dict())
    resumed.close()                             # nothing new to log at the checkpoint's own step
    resumed.log = R.BalanceLog(ListLogger(), 1)
    resumed.log.resumed(3)
    gates[0].forward(torch.tensor([0, 1]))
    resumed.step()
    assert [(r["step"], r.get("run_start")) for r in resumed.log.logger.records] == [(4, 3)]


def test_a_run_shorter_than_the_log_interval_leaves_its_last_record_at_exit_even_if_dropped(tmp_path, monkeypatch):
    import atexit
    import gc

    from eb_deepspeed.observe.monitor import JsonlLogger
    from eb_deepspeed.observe.report import read_log
    registered = []
    monkeypatch.setattr(atexit, "register", lambda fn, *args: registered.append((fn, args)))
    monkeypatch.setattr(atexit, "unregister", lambda fn: registered.remove((fn, ())))

    def train_in_a_function():                 # an engine built and trained inside a function, then dropped
        gates = [ToyGate()]
        balancer = make({"mode": "observe", "log": {"interval": 10}}, gates, logger=JsonlLogger(str(tmp_path)))
        for _ in range(3):                      # 3 steps, interval 10
            gates[0].forward(torch.tensor([0, 1, 2, 3]))
            balancer.step()
    train_in_a_function()
    gc.collect()
    assert len(registered) == 1 and (tmp_path / "balance.jsonl").read_text() == ""   # nothing written yet
    fn, args = registered[0]
    fn(*args)                                   # what the interpreter runs at exit
    fn(*args)                                   # twice: still one record
    assert [r["step"] for r in read_log(str(tmp_path))] == [3]
    assert make({"mode": "observe"}, [ToyGate()]) and len(registered) == 1   # no logger: nothing to run at exit


def test_close_writes_the_last_step_once_and_leaves_nothing_for_exit(tmp_path, monkeypatch):
    import atexit

    from eb_deepspeed.observe.monitor import JsonlLogger
    from eb_deepspeed.observe.report import read_log
    registered = []
    monkeypatch.setattr(atexit, "register", lambda fn, *args: registered.append(fn))
    monkeypatch.setattr(atexit, "unregister", lambda fn: registered.remove(fn))
    gates = [ToyGate()]
    balancer = make({"mode": "observe", "log": {"interval": 2}}, gates, logger=JsonlLogger(str(tmp_path)))
    for _ in range(3):
        gates[0].forward(torch.tensor([0, 1, 2, 3]))
        balancer.step()
    balancer.close()
    assert [r["step"] for r in read_log(str(tmp_path))] == [2, 3] and registered == []


def test_a_state_of_another_format_is_refused_without_changing_anything():
    gates = [ToyGate()]
    balancer = make({}, gates)
    gates[0].forward(torch.tensor([0, 1]))
    balancer.step()
    before = balancer.state_dict()
    for version in (1, 3):
        with pytest.raises(ValueError, match=f"balancer state format {version} is not the one this eb_deepspeed "
                                             "reads \\(2\\)"):
            balancer.load_state_dict({"version": version, "view": {}, "aux": {}})
    assert torch.equal(balancer.view.pressure_LG, before["view"]["pressure_LG"])


def _trained(block, steps=3):
    gates = [ToyGate(), ToyGate()]
    balancer = make(block, gates)
    for _ in range(steps):
        gates[0].forward(torch.tensor([0, 0, 0, 0, 0, 1]))
        gates[1].forward(torch.tensor([0, 1, 2, 3]))
        balancer.step()
    return balancer


@pytest.mark.parametrize("damage, message", [
    (lambda s: s["view"].update(shape=(3, 4, 2)), r"load view is \(layers, experts, devices\) = \(3, 4, 2\)"),
    (lambda s: s["view"].update(shape=(2, 4, 1)), r"pressure_LG has shape \(2, 2\), this model \(2, 1\)"),
    (lambda s: s["view"].update(heat_LE=torch.zeros(2, 3)), r"heat_LE has shape \(2, 3\), this model \(2, 4\)"),
    (lambda s: s["view"]["pressure_LG"].fill_(float("nan")), r"pressure_LG holds NaN or inf"),
    (lambda s: s["view"].pop("last_load_LG"), r"last_load_LG is not a real tensor"),
    (lambda s: s["view"].update(steps=-1), r"steps is -1"),
    (lambda s: s["aux"].update(bias_LE=torch.zeros(1, 4)), r"aux bias_LE has shape \(1, 4\), this model \(2, 4\)"),
    (lambda s: s.update(aux=None), r"aux state is not a dict"),
    (lambda s: s.update(version="2"), r"version '2' is not an integer"),
    # finite but impossible
    (lambda s: s["aux"]["bias_LE"].fill_(1e30), r"aux bias_LE .*outside the plausible \[-10000, 10000\]"),
    (lambda s: s["aux"].update(updates=-3), r"aux updates is -3, expected an integer >= 0"),
    (lambda s: s["aux"]["log_w_L"].fill_(99.0), r"aux log_w_L .*outside the plausible \[-28, 14\]"),
    (lambda s: s["view"]["heat_LE"].fill_(-1.0), r"load view heat_LE .*outside the plausible \[0, inf\]"),
    (lambda s: s["view"]["updates_L"].fill_(-2), r"load view updates_L .*outside the plausible \[0, inf\]"),
])
def test_a_state_that_does_not_fit_is_refused_before_anything_changes(damage, message):
    state = _trained({"aux": {"policy": "bias_cross_layer"}}).state_dict()
    damage(state)
    gates = [ToyGate(), ToyGate()]
    other = make({"aux": {"policy": "bias_cross_layer"}}, gates)
    before = other.state_dict()
    assert other.why_unfit(state) is not None
    with pytest.raises(ValueError, match=message):
        other.load_state_dict(state)
    after = other.state_dict()
    assert all(torch.equal(after["view"][k], before["view"][k]) for k in ("heat_LE", "pressure_LG", "last_tally"))
    assert after["view"]["steps"] == before["view"]["steps"] and torch.equal(after["aux"]["bias_LE"], before["aux"]["bias_LE"])
    assert gates[0].controls.bias_E.abs().sum() == 0


def test_when_one_rank_disagrees_every_rank_raises():
    same = {"config": {"ema_alpha": 0.3}}
    other = {"config": {"ema_alpha": 0.2}}
    check_agreement([same, same], 0)
    for rank in (0, 1, 2):
        with pytest.raises(ValueError, match="disagrees with rank .*ema_alpha"):
            check_agreement([same, same, other], rank)


def test_bad_layer_layouts_are_refused():
    with pytest.raises(ValueError, match=r"layers \(\[0, 0\]\) must be 2 distinct indices in \[0, 4\)"):
        make({}, [ToyGate(), ToyGate()], shape=ModelShape.uniform(4, E, 2, local_layers=[0, 0]))
    with pytest.raises(ValueError, match=r"num_experts \(gate, model\) differ: layer 0: 4 vs 8"):
        make({}, [ToyGate()], shape=ModelShape.uniform(1, 8, 2))


@pytest.mark.parametrize("saved, resumed, says", [
    # another policy: its state is not this policy's; the bias and weights start fresh
    ({"aux": {"policy": "bias_cross_layer", "gain": 1.0}}, {"aux": {"policy": "fixed"}},
     r"easybalance\.aux\.policy 'bias_cross_layer' -> 'fixed'.*weights and bias start fresh"),
    # the same policy in a narrower range: the weights are re-clipped with mean 1
    ({"aux": {"policy": "bias_cross_layer", "gain": 1.0, "weight_range": [0.1, 10.0]}},
     {"aux": {"policy": "bias_cross_layer", "weight_range": [0.9, 1.1]}},
     r"weight_range \[0\.1, 10\.0\] -> \[0\.9, 1\.1\].*re-clipped"),
])
def test_resuming_under_another_config_re_derives_the_controls_and_says_so(saved, resumed, says):
    state = _trained(saved).state_dict()
    assert float(state["aux"]["log_w_L"].exp().max()) > 1.1 and state["aux"]["bias_LE"].abs().sum() > 0
    gates = [ToyGate(), ToyGate()]
    fresh = make(resumed, gates)
    with pytest.warns(UserWarning, match=says):
        fresh.load_state_dict(state)
    assert torch.equal(fresh.view.pressure_LG, state["view"]["pressure_LG"])   # the view itself is kept
    w_L = fresh.controller.device_loss_weights()
    if resumed["aux"]["policy"] == "fixed":
        assert fresh.controller.bias_LE.abs().sum() == 0 and gates[0].controls.bias_E is None
    else:
        lo, hi = resumed["aux"]["weight_range"]
        assert float(w_L.max()) <= hi + 1e-9 and float(w_L.min()) >= lo - 1e-9 and abs(float(w_L.mean()) - 1) < 1e-9
        assert [g.controls.device_loss_weight for g in gates] == w_L.tolist()
        assert torch.equal(gates[0].controls.bias_E, state["aux"]["bias_LE"][0].float())


def test_resuming_under_the_same_config_restores_exactly_and_stays_quiet():
    trained = _trained({"aux": {"policy": "bias_cross_layer"}})
    fresh = make({"aux": {"policy": "bias_cross_layer"}, "log": {"dir": "elsewhere"}}, [ToyGate(), ToyGate()])
    state = trained.state_dict()
    state["config"]["window"] = "auto"               # as states saved before the default was null say it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.load_state_dict(state)
    for key in ("bias_LE", "log_w_L"):
        assert torch.equal(getattr(fresh.controller, key), getattr(trained.controller, key)), key


def test_a_state_of_the_earlier_aux_format_restores_its_bias_and_weights():
    state = _trained({"aux": {"policy": "bias_cross_layer"}}).state_dict()
    state["aux"].update(weight_L=torch.ones(2, dtype=torch.float64),           # what earlier versions also saved
                        layer_w_L=state["aux"]["log_w_L"].exp())
    fresh = make({"aux": {"policy": "bias_cross_layer"}}, [ToyGate(), ToyGate()])
    fresh.load_state_dict(state)
    assert torch.equal(fresh.controller.log_w_L, state["aux"]["log_w_L"])


def test_device_metrics_are_of_the_device_load_the_view_took():
    from eb_deepspeed.core import LoadView
    view = LoadView(1, E, 2)
    view.update(tally_of([[4.0, 0, 0, 0]], device_LG=torch.tensor([[2.0, 2.0]])))
    assert view.metrics()["device_max_over_mean"] == [1.0] and view.metrics()["expert_max_over_mean"] == [4.0]


def test_a_skipped_batch_can_be_discarded_whole_or_just_its_last_forward():
    gates, ref = [ToyGate()], [ToyGate()]
    balancer, reference = make({"mode": "observe"}, gates), make({"mode": "observe"}, ref)
    gates[0].forward(torch.tensor([0, 0, 0, 1]))             # a micro-batch that reaches the step
    gates[0].forward(torch.tensor([3, 3, 3, 3, 3, 3]))       # a skipped micro-batch (NaN loss, no backward)
    balancer.discard_tally(last_forward_only=True)
    balancer.discard_tally(last_forward_only=True)           # nothing more to forget: only one forward is undone
    balancer.step()
    ref[0].forward(torch.tensor([0, 0, 0, 1]))
    reference.step()
    assert torch.equal(balancer.view.last.pack(), reference.view.last.pack())
    gates[0].forward(torch.tensor([2, 2]))                    # a whole skipped step
    balancer.discard_tally()
    gates[0].forward(torch.tensor([0, 1]))
    balancer.step()
    ref[0].forward(torch.tensor([0, 1]))
    reference.step()
    assert torch.equal(balancer.view.last.pack(), reference.view.last.pack())
    assert torch.equal(balancer.view.heat_LE, reference.view.heat_LE)


def nan_forward(gate, tokens=8):
    """What a gate counts when its logits were NaN: every token on expert 0 (argmax of NaN), all non-finite."""
    gate.tally.add_routes(torch.zeros(tokens, 1, dtype=torch.long), logit_sums_T=torch.full((tokens,), float("nan")),
                          l_aux=torch.tensor(float("nan")))


@pytest.mark.parametrize("policy", ["cross_layer", "bias"])
def test_non_finite_logits_freeze_the_layers_controls_and_keep_garbage_out_of_the_record(policy, tmp_path):
    import json

    from eb_deepspeed.observe.monitor import JsonlLogger, flatten_record
    from eb_deepspeed.observe.report import render_report
    gates = [ToyGate(), ToyGate()]
    balancer = make({"aux": {"policy": policy}, "log": {"interval": 10}}, gates, logger=JsonlLogger(str(tmp_path)))
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
        assert torch.equal(after["log_w_L"], before["log_w_L"])
    else:                                                              # the healthy layer's bias moved on
        assert not torch.equal(after["bias_LE"][0], before["bias_LE"][0])
    record = balancer.log.record(balancer)
    assert record["nonfinite_layer_ids"] == [1] and "expert_counts_LE" not in record
    assert record["device_max_over_mean"][1] is None and record["device_max_over_mean"][0] is not None
    assert record["aux_loss"][1] is None and record["device_util_std"] is not None
    flat = flatten_record(record)
    assert "easybalance_layer_01/device_max_over_mean" not in flat and "easybalance_layer_00/max_vio" in flat
    balancer.close()
    line = (tmp_path / "balance.jsonl").read_text().splitlines()[-1]
    assert "NaN" not in line and json.loads(line)["max_vio"][1] is None
    assert len(render_report(str(tmp_path))) >= 2                    # plots draw a gap


def test_the_non_finite_warning_repeats_once_per_log_interval_while_it_lasts():
    gates = [ToyGate()]
    balancer = make({"mode": "observe", "log": {"interval": 10}}, gates)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(25):
            nan_forward(gates[0])
            balancer.step()
    messages = [str(w.message) for w in caught if "non-finite" in str(w.message)]
    assert len(messages) == 3                                         # steps 1, 11, 21
    assert "at 1 step(s) up to step 1" in messages[0] and "at 10 step(s) up to step 11" in messages[1]
    record = balancer.log.record(balancer)
    assert record["device_util_std"] is None and record["device_max_over_mean"] == [None]
