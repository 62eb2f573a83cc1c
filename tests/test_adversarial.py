"""Hostile input, tried as a hostile user would: every bad value gets a clear error naming where it is,
and nothing half-applied. Property tests (hypothesis) over the planners. (The config's: test_config.py.)"""
import copy
import json
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.unit


# ---- the planner and steering: bad values are refused, huge ones still give legal placements ----

from eb_deepspeed import plan_placement, steer  # noqa: E402
from eb_deepspeed.planning.flows import steered_load  # noqa: E402
from eb_deepspeed.planning.placement import Placement, static_placement  # noqa: E402


def assert_legal(plan, E):
    assert bool((plan.logcnt >= 1).all()), "an expert without a replica"
    assert bool((plan.holds_mask().sum(1) == plan.logcnt).all()), "two replicas of one expert on a device"
    assert bool(((plan.phy2log >= -1) & (plan.phy2log < E)).all())


@pytest.mark.parametrize("peak", [1e-300, 1e-9, 1e15, 1e30, 1e300])
def test_plan_placement_is_legal_and_scale_free_for_loads_of_any_size(peak):
    g = torch.Generator().manual_seed(3)
    load = torch.rand(4, 8, generator=g, dtype=torch.float64) ** 3 + 0.01
    ref = plan_placement(load, 4, 3)
    prev = plan_placement(load.flip(1), 4, 3)
    plan = plan_placement(load * peak, 4, 3, previous=prev)
    assert_legal(plan, 8)
    # the same problem in other units: as good a placement (ties may break differently)
    scaled = plan_placement(load * peak, 4, 3)
    assert torch.allclose(steered_load(scaled, load).amax(1), steered_load(ref, load).amax(1), rtol=1e-9)


@pytest.mark.parametrize("kwargs, message", [
    (dict(load=torch.zeros(0, 8)), "at least one"),
    (dict(load=torch.zeros(3, 0)), "at least one"),
    (dict(load=torch.ones(3, 8, dtype=torch.complex64)), "real"),
    (dict(load=torch.full((3, 8), float("nan"))), "finite"),
    (dict(load=-torch.ones(3, 8)), "non-negative"),
    (dict(num_nodes=2.0), "num_nodes.*integer"),
    (dict(num_devices=4.0), "num_devices.*integer"),
    (dict(num_nodes=3), "num_nodes"),
    (dict(slots_per_device=10 ** 7), "more than the planner takes"),
    (dict(load=torch.ones(5000, 8), slots_per_device=1000), "more than the planner takes"),
])
def test_plan_placement_refuses_bad_shapes_and_sizes_with_a_clear_error(kwargs, message):
    args = dict(load=torch.rand(3, 8), num_devices=4, slots_per_device=3)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        plan_placement(args.pop("load"), args.pop("num_devices"), args.pop("slots_per_device"), **args)


def test_plan_placement_refuses_a_malformed_previous_placement():
    load = torch.rand(3, 8)
    good = plan_placement(load, 4, 3)
    wrong_layers = plan_placement(torch.rand(2, 8), 4, 3)
    bad_ids = Placement(good.phy2log.clone(), good.log2phy, good.logcnt, 4, 3)
    bad_ids.phy2log[0, 0] = 99
    for prev in (wrong_layers, bad_ids, "a plan", static_placement(3, 8, 2)):
        with pytest.raises(ValueError, match="previous"):
            plan_placement(load, 4, 3, previous=prev)
    assert_legal(plan_placement(load, 4, 3, previous=good), 8)


def steer_args():
    counts = torch.tensor([[10, 0, 30], [5, 7, 0]])
    devices = torch.tensor([[0, 1], [1, -1], [0, 1]])
    return counts, devices


@pytest.mark.parametrize("change, message", [
    (lambda c, d: (c * -1, d), "non-negative"),
    (lambda c, d: (torch.where(c == 10, float("nan"), c.double()), d), "whole numbers"),
    (lambda c, d: (c + 0.5, d), "whole numbers"),
    (lambda c, d: (c, torch.tensor([[0, 1], [-1, 1], [0, 1]])), "a first copy for every expert"),
    (lambda c, d: (c, torch.tensor([[0, -1, 1], [1, -1, -1], [0, 1, -1]])), "a -1 before a copy"),
    (lambda c, d: (c, torch.tensor([[0, 2], [1, -1], [0, 1]])), "outside"),
    (lambda c, d: (c, torch.tensor([[0, -2], [1, -1], [0, 1]])), "outside"),
    (lambda c, d: (c, d[:2]), "experts"),
    (lambda c, d: (c[0], d), "dimension"),
    (lambda c, d: (c.to(torch.complex64), d), "integers"),
])
def test_steer_refuses_counts_and_maps_that_would_lose_or_invent_tokens(change, message):
    with pytest.raises(ValueError, match=message):
        steer(*change(*steer_args()))


def test_steer_conserves_huge_counts():
    counts, devices = steer_args()
    counts = counts * (2 ** 40)
    split = steer(counts, devices)
    assert torch.equal(split.sum(2), counts) and bool((split >= 0).all())


from eb_deepspeed.tools.cli import main as eb_main  # noqa: E402
from benchmarks.__main__ import main as bench_main  # noqa: E402


@pytest.mark.parametrize("argv, message", [
    (["simulate", "--workload", "trace"], "--trace FILE goes with --workload trace"),
    (["simulate", "--trace", "x.pt"], "--trace FILE goes with --workload trace"),
    (["simulate", "--steps", "0"], "--steps: 0 must be >= 1"),
    (["simulate", "--devices", "-2"], "--devices: -2 must be >= 1"),
    (["gate", "--experts", "16", "0"], "--experts: 0 must be >= 1"),
    (["gate", "--tokens", "1000000000000"], "--tokens: 1000000000000 must be <= 65536"),     # before: a raw OOM
    (["infer", "--batches", "1000000000"], "--batches: 1000000000 must be <= 10000"),       # before: ran until killed
])
def test_cli_arguments_out_of_range_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench_main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


# ---- the balance log: bounded on disk and in memory, survives a kill, no repeated steps ----

from eb_deepspeed.observe.monitor import JsonlLogger  # noqa: E402
from eb_deepspeed.observe.report import read_log, render_report  # noqa: E402


def record(step, **extra):
    return {"step": step, "device_max_over_mean": [1.0 + step / 1000], "device_util_std": 0.1,
            "expert_counts_LE": [[step] * 64] * 8, "pressure_LG": [[float(step), 1.0]], **extra}


def test_the_log_rotates_past_max_mb_and_readers_see_both_parts(tmp_path):
    log = JsonlLogger(str(tmp_path), max_mb=0.01)          # ~10 KiB; a record is ~1.6 KiB
    for step in range(1, 31):
        log.log(record(step), step)
    log.close()
    main, old = tmp_path / "balance.jsonl", tmp_path / "balance.jsonl.1"
    assert main.stat().st_size <= 0.01 * 2 ** 20 and old.stat().st_size <= 0.01 * 2 ** 20
    steps = [r["step"] for r in read_log(str(tmp_path))]
    assert steps == list(range(steps[0], 31)) and 1 < steps[0] < 25    # oldest records rotated out, no gaps


def test_the_log_writer_never_follows_a_link_nor_writes_into_a_non_regular_file(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep me\nno newline at the end")
    run = tmp_path / "run"
    run.mkdir()
    (run / "balance.jsonl").symlink_to(target)
    with pytest.raises(ValueError, match="balance.jsonl is a symbolic link"):
        JsonlLogger(str(run))
    assert target.read_text() == "keep me\nno newline at the end"      # not truncated, not appended to
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "balance.jsonl")
    with pytest.raises(ValueError, match="not a regular file"):
        JsonlLogger(str(fifo))
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ValueError, match=r"easybalance\.log\.dir \('.*a_file'\) names a file, not a directory"):
        JsonlLogger(str(tmp_path / "a_file"))


def test_a_killed_writer_loses_only_its_partial_record(tmp_path):
    path = tmp_path / "balance.jsonl"
    path.write_text("".join(json.dumps(record(s)) + "\n" for s in (1, 2)) + json.dumps(record(3))[:40])
    with pytest.warns(UserWarning, match="partial last record"):
        assert [r["step"] for r in read_log(str(tmp_path))] == [1, 2]
    with pytest.warns(UserWarning, match="partial record"):
        log = JsonlLogger(str(tmp_path))                    # the resumed run cuts the fragment off
    log.log(record(3, run_start=2), 3)
    log.close()
    assert [r["step"] for r in read_log(str(tmp_path))] == [1, 2, 3]
    path.write_text(path.read_text() + "{broken\n" + json.dumps(record(4)) + "\n")
    with pytest.raises(ValueError, match=r"balance.jsonl:4: not a JSON record"):   # mid-file: not a kill
        read_log(str(tmp_path))


def test_a_resumed_run_supersedes_the_steps_logged_after_its_checkpoint(tmp_path):
    log = JsonlLogger(str(tmp_path))
    for step in (10, 20, 30, 40):                              # killed after 40; checkpoint at 20
        log.log(record(step, **({"run_start": 0} if step == 10 else {})), step)
    for step in (30, 40, 50):
        log.log(record(step, **({"run_start": 20} if step == 30 else {})), step)
    log.close()
    records = read_log(str(tmp_path))
    assert [r["step"] for r in records] == [10, 20, 30, 40, 50]
    assert records[2].get("run_start") == 20                 # the resumed run's 30, not the lost one


def test_eb_report_streams_a_long_log_into_a_bounded_number_of_points(tmp_path):
    with open(tmp_path / "balance.jsonl", "w") as f:
        for step in range(1, 10001):
            f.write(json.dumps(record(step)) + "\n")
    records = read_log(str(tmp_path), keys=("device_max_over_mean", ), max_records=500)
    steps = [r["step"] for r in records]
    assert 250 <= len(records) <= 501 and steps == sorted(steps) and steps[-1] == 10000
    assert set(records[0]) == {"step", "device_max_over_mean"} and "pressure_LG" in records[-1]
    gaps = {b - a for a, b in zip(steps[:-2], steps[1:-1])}
    assert len(gaps) == 1                                      # evenly spaced
    assert len(render_report(str(tmp_path))) >= 2


# ---- the planning API names the argument and what it takes for any other object ----

import numpy as np  # noqa: E402

from eb_deepspeed.planning import expected_padded_cost, expected_slot_ratio, index_maps, steered_load  # noqa: E402


def planned():
    load = torch.rand(3, 8, generator=torch.Generator().manual_seed(0)) + 0.1
    return load, plan_placement(load, 4, 3)


@pytest.mark.parametrize("load, error, message", [
    (np.array([[1, "a"]], dtype=object), TypeError, "load_LE must be a tensor, NumPy array or nested list of real"),
    (np.ones((3, 8), dtype=object), TypeError, "load_LE .* got a NumPy array of object"),
    ("abc", TypeError, "load_LE .* got str"),
    (None, TypeError, "load_LE .* got NoneType"),
    ({"a": 1}, TypeError, "load_LE .* got dict"),
    ([[1.0, 2.0], [3.0]], TypeError, "load_LE .* got list"),
    (torch.ones(1, 3, 8), ValueError, r"load_LE must be \[layers, experts\] \(2 dimensions\), got shape \(1, 3, 8\)"),
    (torch.ones(3, 8, dtype=torch.bool), ValueError, "load_LE must hold real numbers, got torch.bool"),
])
def test_plan_placement_names_load_le_and_what_it_takes_for_any_other_object(load, error, message):
    with pytest.raises(error, match=message):
        plan_placement(load, 4, 3)


def test_plan_placement_takes_numpy_arrays_and_nested_lists_as_it_takes_tensors():
    load, plan = planned()
    for same in (load.numpy(), load.tolist(), load.double().requires_grad_()):
        assert torch.equal(plan_placement(same, 4, 3).phy2log, plan.phy2log)


@pytest.mark.parametrize("fields, error, message", [
    (lambda p: dict(phy2log=p.phy2log.double()), TypeError, "previous.phy2log must be a 2-D integer torch tensor, got "
                                                            "torch.float64"),
    (lambda p: dict(phy2log=p.phy2log.numpy()), TypeError, "previous.phy2log .* got ndarray"),
    (lambda p: dict(phy2log=p.phy2log.tolist()), TypeError, "previous.phy2log .* got list"),
    (lambda p: dict(phy2log=np.array(p.phy2log.tolist(), dtype=object)), TypeError, "previous.phy2log"),
    (lambda p: dict(phy2log=p.phy2log > 0), TypeError, "previous.phy2log .* torch.bool"),
    (lambda p: dict(phy2log=p.phy2log[0]), TypeError, r"previous.phy2log .* \(12,\)"),
    (lambda p: dict(logcnt=None), TypeError, "previous.logcnt"),
    (lambda p: dict(logcnt=p.logcnt[0]), TypeError, "previous.logcnt"),
    (lambda p: dict(logcnt=p.logcnt[:, :5]), ValueError, "previous's maps disagree"),
    (lambda p: dict(log2phy=torch.zeros(1)), TypeError, "previous.log2phy"),
    (lambda p: dict(num_devices=4.0), ValueError, r"previous.num_devices \(4.0\) must be an integer >= 1"),
    (lambda p: dict(slots_per_device=3.0), ValueError, r"previous.slots_per_device \(3.0\)"),
    (lambda p: dict(slots_per_device=0), ValueError, r"previous.slots_per_device \(0\)"),
])
def test_plan_placement_names_the_malformed_field_of_a_previous_placement(fields, error, message):
    load, good = planned()
    previous = Placement(good.phy2log, good.log2phy, good.logcnt, 4, 3)
    for name, value in fields(good).items():   # changed after construction, as a caller might
        setattr(previous, name, value)
    with pytest.raises(error, match=message):
        plan_placement(load, 4, 3, previous=previous)


def test_a_previous_placement_is_read_from_its_phy2log_alone():
    # int32 ids, a non-contiguous phy2log and a logcnt that does not count it: the maps are derived afresh
    load, good = planned()
    previous = Placement(good.phy2log.int().t().contiguous().t(), good.log2phy, torch.ones_like(good.logcnt), 4, 3)
    assert_legal(plan_placement(load, 4, 3, previous=previous), 8)


@pytest.mark.parametrize("args, error, message", [
    (lambda p: (p.phy2log.numpy(), p.log2phy, p.logcnt, 4, 3), TypeError, "Placement.phy2log must be a 2-D integer"),
    (lambda p: (p.phy2log.double(), p.log2phy, p.logcnt, 4, 3), TypeError, "Placement.phy2log .* torch.float64"),
    (lambda p: (p.phy2log, p.log2phy, p.logcnt.tolist(), 4, 3), TypeError, "Placement.logcnt"),
    (lambda p: (p.phy2log, p.log2phy, p.logcnt, 5, 3), ValueError, r"Placement's maps disagree: phy2log \(3, 12\)"),
    (lambda p: (p.phy2log, p.log2phy, p.logcnt, 4, True), ValueError, r"Placement.slots_per_device \(True\)"),
])
def test_a_placement_is_refused_at_construction_unless_its_maps_are_integer_tensors_of_matching_shapes(
        args, error, message):
    with pytest.raises(error, match=message):
        Placement(*args(planned()[1]))


@pytest.mark.parametrize("kwargs, message", [
    (dict(refine_rounds=1.5), r"refine_rounds \(1.5\) must be an integer or None"),
    (dict(refine_rounds="2"), r"refine_rounds \('2'\) must be an integer or None"),
])
def test_plan_placement_refuses_options_of_the_wrong_type_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_placement(planned()[0], 4, 3, **kwargs)


@pytest.mark.parametrize("change, error, message", [
    (lambda c, d: (np.array(c.tolist(), dtype=object), d), TypeError,
     "counts_GE must be a tensor, NumPy array or nested list of integers"),
    (lambda c, d: (None, d), TypeError, "counts_GE .* got NoneType"),
    (lambda c, d: ("abc", d), TypeError, "counts_GE .* got str"),
    (lambda c, d: ([[1, 2, 3], [4]], d), TypeError, "counts_GE .* got list"),
    (lambda c, d: (c, np.array(d.tolist(), dtype=object)), TypeError, "devices_ER"),
    (lambda c, d: (c[:0], d), ValueError, "at least one rank"),
])
def test_steer_names_the_map_that_is_not_an_array_of_integers(change, error, message):
    with pytest.raises(error, match=message):
        steer(*change(*steer_args()))


def test_steer_takes_numpy_arrays_and_nested_lists_as_it_takes_tensors():
    counts, devices = steer_args()
    assert torch.equal(steer(counts.numpy(), devices.tolist()), steer(counts, devices))


@pytest.mark.parametrize("args, message", [
    ((2, 8, 0), r"num_devices \(0\) must be an integer >= 1"),
    ((0, 8, 4), r"num_layers \(0\) must be an integer >= 1"),
    ((2, 0, 4), r"num_experts \(0\) must be an integer >= 1"),
    ((-1, 8, 4), r"num_layers \(-1\)"),
    ((2.0, 8, 4), r"num_layers \(2.0\)"),
    ((True, 8, 4), r"num_layers \(True\)"),
    ((10 ** 6, 10 ** 6, 1), "more than the planner takes"),
])
def test_static_placement_refuses_sizes_that_are_not_positive_integers_it_can_hold(args, message):
    with pytest.raises(ValueError, match=message):
        static_placement(*args)


@pytest.mark.parametrize("measure", [expected_slot_ratio, expected_padded_cost])
@pytest.mark.parametrize("heat, error, message", [
    (torch.rand(3, 5), ValueError, r"heat_LE must be \[layers, experts\] = \(3, 8\) for this plan, got \(3, 5\)"),
    (torch.rand(2, 8), ValueError, r"heat_LE must be \[layers, experts\] = \(3, 8\) for this plan, got \(2, 8\)"),
    (torch.rand(8), ValueError, r"heat_LE must be \[layers, experts\] \(2 dimensions\)"),
    (torch.full((3, 8), float("nan")), ValueError, "heat_LE must be finite and non-negative"),
    (-torch.ones(3, 8), ValueError, "heat_LE must be finite and non-negative"),
    (torch.ones(3, 8, dtype=torch.bool), ValueError, "heat_LE must hold real numbers"),
    (np.ones((3, 8), dtype=object), TypeError, "heat_LE must be a tensor"),
])
def test_the_padded_cost_measures_name_a_heat_that_does_not_fit_the_plan(measure, heat, error, message):
    with pytest.raises(error, match=message):
        measure(heat, planned()[1])


def test_the_measures_refuse_what_is_not_a_placement_and_index_maps_ids_it_cannot_hold():
    load, plan = planned()
    for measure in (expected_slot_ratio, expected_padded_cost, steered_load):
        with pytest.raises(TypeError, match="plan must be a Placement, got str"):
            measure("plan", load) if measure is steered_load else measure(load, "plan")
    with pytest.raises(ValueError, match=r"load_LE must be \[layers, experts\] = \(3, 8\) for this plan"):
        steered_load(plan, torch.rand(3, 5))
    with pytest.raises(ValueError, match=r"phy2log must be .* with expert ids in \[-1, 8\)"):
        index_maps(torch.tensor([[0, 9]]), 8, 2, 1)
