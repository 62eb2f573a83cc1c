"""Balance logging and `eb report`: JSONL records, namespaced keys, PNGs that hold the run's numbers."""
import json
import os

import pytest

from eb_deepspeed.observe.monitor import JsonlLogger, flatten_record
from eb_deepspeed.observe.report import CURVES, FILE_NAMES, curve_figure, read_log, render_report
from eb_deepspeed.tools.cli import main as eb_main

pytestmark = pytest.mark.unit

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def records():
    return [{"step": s, "device_max_over_mean": [1.0 + s / 100, 1.5], "max_vio": [0.1 * s, 0.2],
             "device_loss_weight": [1.5, 0.5], "aux_loss": [1.01, 1.02],
             "bias_spread": [0.02 * s, 0.0],
             "layer_token_drop_rate": [0.1, 0.0],
             "expert_max_over_mean": [1.3, 1.1], "device_util_std": 0.05 * s, "token_drop_rate": 0.05,
             "device_max_over_mean_p90": 1.4, "pressure_LG": [[10.0, 5.0], [7.0, 8.0]]} for s in (5, 10, 15)]


def test_the_jsonl_logger_appends_one_record_per_line(tmp_path):
    log = JsonlLogger(str(tmp_path))
    for r in records():
        log.log(r, r["step"])
    log.close()
    assert read_log(str(tmp_path)) == records()
    assert read_log(str(tmp_path / "balance.jsonl"))[0]["step"] == 5


def test_flattened_keys_are_namespaced_per_layer():
    flat = flatten_record(records()[0])
    assert flat["easybalance_layer_00/device_max_over_mean"] == 1.05
    assert flat["easybalance_layer_01/device_loss_weight"] == 0.5
    assert flat["easybalance/device_util_std"] == 0.25
    assert "easybalance/pressure_LG" not in flat


def test_eb_report_writes_pngs_whose_curves_hold_the_logged_numbers(tmp_path, capsys):
    (tmp_path / "balance.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records()))
    assert eb_main(["report", str(tmp_path)]) == 0
    paths = capsys.readouterr().out.split()
    names = {p.rsplit("/", 1)[-1] for p in paths}
    assert names == {FILE_NAMES.get(k, f"{k}.png") for k in CURVES} | {"summary.png", "pressure_heatmap.png"}
    for path in paths:
        with open(path, "rb") as f:
            assert f.read(8) == PNG_MAGIC
    fig = curve_figure(records(), "max_vio", "MaxVio")
    lines = fig.axes[0].lines                                     # per layer: the logged values, then the trailing mean
    assert [list(line.get_ydata()) for line in lines[0:4:2]] == [[0.5, 1.0, 1.5], [0.2, 0.2, 0.2]]
    assert list(lines[1].get_ydata()) == pytest.approx([0.5, 0.75, 1.0])
    assert list(fig.axes[0].lines[0].get_xdata()) == [5, 10, 15]


def test_a_malformed_or_missing_log_gives_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no balance log at"):
        render_report(str(tmp_path))
    (tmp_path / "balance.jsonl").write_text('{"step": 1}\n{not json\n')
    with pytest.raises(ValueError, match=r"balance.jsonl:2: not a JSON record"):
        read_log(str(tmp_path))


def test_plots_say_what_they_show_and_the_heatmap_is_anchored_at_the_layer_mean():
    from eb_deepspeed.observe.report import heatmap_figure
    records = [{"step": s, "mode": "balance", "policy": "bias", "device_max_over_mean": [1.2 - 0.01 * s, 1.1]}
               for s in range(1, 11)]
    fig = curve_figure(records, "device_max_over_mean", "device max/mean per layer")
    ax = fig.axes[0]
    assert ax.get_ylabel() == "device max/mean per layer" and "mode balance, policy bias" in ax.get_title()
    assert any(list(line.get_ydata()) == [1.0, 1.0] for line in ax.get_lines())          # the balanced line
    assert len(ax.get_lines()) == 2 * 2 + 1                                             # raw + smoothed per layer
    # a 15 % spread around a mean of ~1850 tokens: shown as 0.85 .. 1.15 of the mean, centred at 1
    fig = heatmap_figure([[1700.0, 2000.0], [1850.0, 1850.0]])
    image = fig.axes[0].get_images()[0]
    low, high = image.get_clim()
    assert low == pytest.approx(2 - high) and high == pytest.approx(2000 / 1850)
    assert "1 = balanced" in fig.axes[1].get_ylabel()


def test_the_selection_bias_is_drawn_only_for_runs_that_have_one():
    with_bias = [{"step": s, "mode": "balance", "policy": "bias", "bias_spread": [0.03 * s, 0.01]} for s in (1, 2)]
    without = [{"step": s, "mode": "balance", "policy": "fixed", "bias_spread": [0.0, 0.0]} for s in (1, 2)]
    assert curve_figure(with_bias, "bias_spread", "selection bias") is not None
    assert curve_figure(without, "bias_spread", "selection bias") is None


def test_the_summary_puts_the_lm_loss_beside_balance_when_the_loop_noted_it(tmp_path):
    rows = records()
    for r in rows:
        r.update(mode="balance", policy="bias", lm_loss=3.0 - r["step"] / 10)
    with open(tmp_path / "balance.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    import matplotlib.pyplot as plt
    saved = []
    original = plt.Figure.savefig

    def keep(fig, path, *a, **k):
        saved.append((str(path), [ax.get_title() for ax in fig.axes]))
        return original(fig, path, *a, **k)
    plt.Figure.savefig = keep
    try:
        render_report(str(tmp_path))
    finally:
        plt.Figure.savefig = original
    titles = dict(saved)[str(tmp_path / "plots" / "summary.png")]
    assert any("LM loss" in t for t in titles) and len(titles) == 4


def test_a_new_run_appended_to_a_log_is_announced_when_written_and_when_read(tmp_path):
    first = JsonlLogger(str(tmp_path))
    for step in (1, 2, 3):
        first.log({"step": step, **({"run_start": 0} if step == 1 else {})}, step)
    first.close()
    with pytest.warns(UserWarning, match="already holds another run's records"):
        second = JsonlLogger(str(tmp_path))
    second.log({"step": 1, "run_start": 0}, 1)               # a fresh run (before: appended without a word)
    second.close()
    with pytest.warns(UserWarning, match="holds 2 runs.*shown is the last"):
        assert [r["step"] for r in read_log(str(tmp_path))] == [1]


def test_a_relative_log_dir_says_where_it_lands(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    JsonlLogger("runs/a").close()
    assert f"balance records go to {tmp_path / 'runs' / 'a' / 'balance.jsonl'}" in capsys.readouterr().err
    JsonlLogger(str(tmp_path / "b")).close()         # an absolute one is where the user said: nothing to say
    assert "balance records go to" not in capsys.readouterr().err


def test_a_resume_that_continues_its_log_reads_without_a_warning(tmp_path):
    import warnings
    log = JsonlLogger(str(tmp_path))
    for step in (1, 2):
        log.log({"step": step, **({"run_start": 0} if step == 1 else {})}, step)
    log.log({"step": 3, "run_start": 2}, 3)                  # resumed from the step-2 checkpoint
    log.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [r["step"] for r in read_log(str(tmp_path))] == [1, 2, 3]


def test_eb_report_takes_an_example_run_directory_as_eb_report_compare_does(tmp_path, capsys):
    # before: `eb report runs/main` was refused ("holds no records yet") where --compare accepted it
    (tmp_path / "balance").mkdir()
    (tmp_path / "balance" / "balance.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records()))
    assert eb_main(["report", str(tmp_path)]) == 0
    paths = capsys.readouterr().out.split()
    assert paths and all(os.path.dirname(p) == str(tmp_path / "plots") for p in paths)


def test_a_serving_log_gets_serving_plots_not_the_training_ones(tmp_path, capsys):
    # before: x axis "optimizer step", the training policy in titles, device-loss-weight panels
    served = [{**r, "phase": "serve", "mode": "balance", "policy": "bias_cross_layer", "replans": i // 2}
              for i, r in enumerate(records())]
    (tmp_path / "balance.jsonl").write_text("".join(json.dumps(r) + "\n" for r in served))
    assert eb_main(["report", str(tmp_path)]) == 0
    names = {p.rsplit("/", 1)[-1] for p in capsys.readouterr().out.split()}
    assert names == {"device_max_over_mean.png", "expert_max_over_mean.png", "token_drop_rate.png", "summary.png",
                     "pressure_heatmap.png"}
    fig = curve_figure(served, "device_max_over_mean", "device max/mean")
    assert fig.axes[0].get_xlabel().startswith("view update") and "serving, mode balance" in fig.axes[0].get_title()
    assert "bias_cross_layer" not in fig.axes[0].get_title()
    assert curve_figure(served, "device_loss_weight", "device-loss weight") is None


def test_the_balancer_marks_its_records_as_training_or_serving():
    from eb_deepspeed.core import Balancer, EasyBalanceConfig, LayerTally, ModelShape

    class Gate:
        tally, controls = LayerTally(2), None
    config = EasyBalanceConfig.from_block({"mode": "observe"})
    for train, phase in ((True, "train"), (False, "serve")):
        balancer = Balancer(config, [Gate()], ModelShape.uniform(1, 2, 2), train=train)
        assert balancer.log.record(balancer)["phase"] == phase


def test_a_flat_curve_says_why_it_is_flat():
    # before: a curve held at one value (a weight a policy keeps) was lines under one flat line, no word why
    flat = [{"step": s, "aux_loss": [1.0, None if s == 2 else 1.0], "mode": "balance", "policy": "bias_cross_layer"}
            for s in (1, 2, 3)]
    title = curve_figure(flat, "aux_loss", "aux loss per layer").axes[0].get_title()
    assert "flat: mode balance, policy bias_cross_layer keeps it at 1 every step" in title
    assert "flat" not in curve_figure(records(), "device_loss_weight", "device-loss weight").axes[0].get_title()


def test_eb_report_compare_draws_each_layer_the_lm_loss_and_a_map_per_run(tmp_path):
    from eb_deepspeed.observe.report import render_compare
    for name, loss in (("baseline", 2.0), ("balanced", 2.1)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "balance.jsonl").write_text(
            "".join(json.dumps({**r, "lm_loss": loss}) + "\n" for r in records()))
    import matplotlib.pyplot as plt
    created = []
    real = plt.subplots
    plt.subplots = lambda *a, **k: created.append(real(*a, **k)) or created[-1]
    try:
        render_compare([str(tmp_path / "baseline"), str(tmp_path / "balanced")], str(tmp_path / "compare.png"))
    finally:
        plt.subplots = real
    rows = [[ax.get_title() for ax in row] for row in created[-1][1]]
    assert rows[0][:2] == ["layer 0: expert max/mean", "layer 1: expert max/mean"]
    assert rows[1][:2] == ["layer 0: busiest rank's load / mean", "layer 1: busiest rank's load / mean"]
    summary, maps = rows[2][:4], rows[2][4:]
    assert [t.split(" (")[0] for t in summary] == ["device utilisation std", "token drop rate",
                                                   "p90 over layers of device max/mean", "LM loss"]
    assert [t.split(" (")[0] for t in maps] == ["baseline", "balanced"]     # layers x ranks, one per run
    assert all("load / layer mean, second half" in t for t in maps)


def test_eb_report_compare_takes_a_run_resumed_on_more_ranks_and_names_the_png_it_wrote(tmp_path, capsys):
    # a run on 3 EP ranks (steps 5-15) resumed at 15 on 2 (steps 20, 25): the second half holds both; the map is
    # the last run's
    resumed = [{**r, "pressure_LG": [[4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]} for r in records()]
    resumed += [{**r, "step": 15 + r["step"], **({"run_start": 15} if r["step"] == 5 else {})} for r in records()[:2]]
    for name, rows in (("resumed", resumed), ("plain", records())):
        (tmp_path / name).mkdir()
        (tmp_path / name / "balance.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert eb_main(["report", "--compare", str(tmp_path / "resumed"), str(tmp_path / "plain"),
                    "--out", str(tmp_path / "both")]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == str(tmp_path / "both.png") and open(printed, "rb").read(8) == PNG_MAGIC
    from eb_deepspeed.observe.report import _second_half_loads
    assert _second_half_loads(read_log(str(tmp_path / "resumed"))) == [[20.0, 10.0], [14.0, 16.0]]   # 20 + 25


def test_a_run_of_one_record_draws_its_point():
    from eb_deepspeed.observe.report import _panel, _plt
    fig, ax = _plt().subplots()
    _panel(ax, [([(5, 1.2)], "one")], "device_max_over_mean", "one record")
    assert [line.get_marker() for line in ax.get_lines()][-2] == "o"      # the solid line of the one point
    _plt().close(fig)


def test_a_new_run_after_a_long_one_is_kept_whole_when_the_log_is_thinned(tmp_path):
    # 400 records thinned to about 50 (stride 8), then a new run from step 0 replaces them: its 40 all kept
    rows = [{"step": s, "device_util_std": 0.1} for s in range(1, 401)]
    rows += [{"step": s, "device_util_std": 0.2, **({"run_start": 0} if s == 1 else {})} for s in range(1, 41)]
    (tmp_path / "balance.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.warns(UserWarning, match="holds 2 runs"):
        kept = read_log(str(tmp_path), max_records=50)
    assert [r["step"] for r in kept] == list(range(1, 41))
