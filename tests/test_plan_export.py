"""`eb plan`: load files in, our plan JSON and SGLang's --init-expert-location JSON out, read back by a
re-implementation of SGLang's parsing (tests/sglang_format.py)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from eb_deepspeed.planning.export import balance_table, placement_json, sglang_mapping
from eb_deepspeed.planning.placement import index_maps, plan_placement, trivial_placement
from benchmarks.bench import pareto_loads
from eb_deepspeed.tools.cli import main
from sglang_format import read_init_expert_location

pytestmark = pytest.mark.unit


def read_plan(path):
    """Our plan file back as a Placement: its index maps rebuilt from phy2log (as docs/serving.md shows)."""
    doc = json.loads(open(path).read())
    return index_maps(torch.tensor(doc["phy2log"]), doc["num_experts"], doc["num_devices"], doc["slots_per_device"])


def _sglang_stat_dump(path, steps=5, layers=4, experts=16, dense_first=True, seed=0):
    """A file in SGLang's `stat` dump format: {rank, logical_count int32 [steps, num_hidden_layers, experts],
    average_utilization_rate_over_window}; a dense first layer records zeros."""
    g = torch.Generator().manual_seed(seed)
    heat = pareto_loads(layers, experts, seed)
    counts = torch.poisson(heat.expand(steps, layers, experts) * 50, generator=g).to(torch.int32)
    if dense_first:
        counts[:, 0] = 0
    torch.save({"rank": 0, "logical_count": counts, "average_utilization_rate_over_window": None}, path)
    return counts


def test_a_plan_from_an_sglang_dump_loads_in_sglangs_parser_and_dispatches_on_our_devices(tmp_path, capsys):
    dump = tmp_path / "expert_distribution_recorder_1732900000.0.pt"
    counts = _sglang_stat_dump(dump)
    L, E, G = counts.shape[1], counts.shape[2], 4
    out, sg = tmp_path / "plan.json", tmp_path / "sglang.json"
    assert main(["plan", str(dump), "--devices", str(G), "--redundant", "4", "--nodes", "2",
                 "--out", str(out), "--sglang", str(sg)]) == 0
    printed = capsys.readouterr().out
    assert "before (slot p holds expert p % E)" in printed and "planned (dispatch=uniform)" in printed
    meta = read_init_expert_location(str(sg), num_layers=L, num_logical=E, ep_size=G, gpus_per_node=2)
    ours = read_plan(out)
    assert meta["physical_to_logical_map"].tolist() == ours.phy2log.tolist()
    assert meta["num_local_physical_experts"] == ours.slots_per_device == (E + 4) // G
    assert bool((meta["logical_to_all_physical_map_num_valid"] == ours.logcnt).all())
    for l in range(L):
        for e in range(E):
            sg_slots = meta["logical_to_all_physical_map"][l, e]
            assert sorted(sg_slots[sg_slots >= 0].tolist()) == sorted(ours.log2phy[l, e][ours.log2phy[l, e] >= 0].tolist())
    # every rank's static dispatch goes to a replica of the right expert, on its own GPU when it holds one
    disp = meta["logical_to_rank_dispatch_physical_map"]
    devices = ours.expert_devices()
    for r in range(G):
        assert bool((ours.phy2log.gather(1, disp[r]) == torch.arange(E)).all())
        own = (devices == r).any(2)
        assert bool(((disp[r] // ours.slots_per_device == r) | ~own).all())


def test_sglangs_parser_refuses_what_we_must_never_write(tmp_path):
    plan = plan_placement(pareto_loads(2, 8, 1), 4, 3)
    extra = tmp_path / "extra.json"
    extra.write_text(json.dumps({**sglang_mapping(plan), "logcnt": plan.logcnt.tolist()}))
    with pytest.raises(TypeError):                       # SGLang splats the dict into init_by_mapping(**...)
        read_init_expert_location(str(extra), num_layers=2, num_logical=8, ep_size=4, gpus_per_node=4)
    assert list(sglang_mapping(plan)) == ["physical_to_logical_map"]
    empty = index_maps(torch.tensor([[0, 1, 2, 3, -1, -1]]), 4, 2, 3)
    with pytest.raises(ValueError, match="SGLang needs an expert in every physical slot"):
        sglang_mapping(empty)                            # empty slots, and no load to fill them by


def test_an_sglang_map_fills_the_slots_our_plan_leaves_empty_with_the_copies_that_cost_least(tmp_path):
    # 4 experts, loads 8 / 4 / 2 / 0 on 2 devices x 3 slots; device 0 holds 0 and 3, device 1 holds 1, 2 and
    # 0's copy: even split 4 + 0 = 4 and 2 + 4 + 4 = 10. Device 0's empty slot: a copy of 1 makes 4 + 2 = 6 and
    # 2 + 2 + 4 = 8, of 2 makes 5 and 9 (1, 2 already on device 1: only 1 and 2 may go to device 0) -> 1
    plan = index_maps(torch.tensor([[0, 3, -1, 1, 2, 0]]), 4, 2, 3)
    mapping = sglang_mapping(plan, torch.tensor([[8.0, 4, 2, 0]]))["physical_to_logical_map"]
    assert mapping == [[0, 3, 1, 1, 2, 0]]
    (tmp_path / "s.json").write_text(json.dumps({"physical_to_logical_map": mapping}))
    meta = read_init_expert_location(str(tmp_path / "s.json"), num_layers=1, num_logical=4, ep_size=2, gpus_per_node=2)
    assert meta["logical_to_all_physical_map_num_valid"].tolist() == [[2, 2, 1, 1]]


def test_our_plan_file_round_trips(tmp_path):
    plan = plan_placement(pareto_loads(3, 12, 2), 4, 4, num_nodes=2)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(placement_json(plan, dispatch="steered", num_nodes=2)))
    back = read_plan(path)
    assert back.phy2log.tolist() == plan.phy2log.tolist() and back.log2phy.tolist() == plan.log2phy.tolist()
    assert json.loads(path.read_text())["logcnt"] == plan.logcnt.tolist()


def test_sglang_per_pass_records_and_vllm_style_loads_plan_the_same_as_their_logical_counts(tmp_path):
    g = torch.Generator().manual_seed(4)
    L, E, G, S = 3, 8, 4, 3
    p2l = torch.stack([torch.randperm(G * S, generator=g) % E for _ in range(L)])
    phys = torch.randint(0, 40, (6, L, G * S), generator=g)
    logical = torch.zeros(6, L, E, dtype=torch.long).scatter_add_(2, p2l.expand(6, L, G * S), phys)
    torch.save({"records": [{"forward_pass_id": i, "rank": 0, "gatherer_key": "primary", "global_physical_count": phys[i]}
                            for i in range(6)], "last_physical_to_logical_map": p2l}, tmp_path / "per_pass_0.pt")
    torch.save({"expert_load_window": phys, "physical_to_logical_map": p2l}, tmp_path / "vllm.pt")
    torch.save({"logical_count": logical.to(torch.int32)}, tmp_path / "stat.pt")
    plans = []
    for name in ("per_pass_0.pt", "vllm.pt", "stat.pt"):
        assert main(["plan", str(tmp_path / name), "--devices", str(G), "--slots", str(S), "--json",
                     "--out", str(tmp_path / f"{name}.json")]) == 0
        plans.append(read_plan(tmp_path / f"{name}.json").phy2log.tolist())
    assert plans[0] == plans[1] == plans[2]


def test_the_balance_table_shows_the_planned_layout_better_under_both_dispatch_models():
    load = pareto_loads(6, 16, 3)
    plan = plan_placement(load, 4, 5)
    table = balance_table(load, {"before": trivial_placement(6, 16, 4, 5), "after": plan})
    for d in ("uniform", "steered"):
        assert table["after"][d]["aggregate"] >= table["before"][d]["aggregate"]
    assert table["after"]["uniform"]["aggregate"] > table["before"]["uniform"]["aggregate"]
    assert all(0 < v <= 1 for row in table.values() for d in row.values() for v in d.values())


def test_eb_plan_reads_our_own_balance_log(tmp_path):
    from eb_deepspeed.core.record import EXPERT_COUNTS
    log = tmp_path / "balance.jsonl"
    counts = pareto_loads(4, 8, 6) * 100
    with open(log, "w") as f:
        for step in (5, 10):
            f.write(json.dumps({"step": step, EXPERT_COUNTS: counts.round().tolist()}) + "\n")
    res = subprocess.run([sys.executable, "-m", "eb_deepspeed.tools.cli", "plan", str(tmp_path), "--devices", "2",
                          "--redundant", "2", "--json"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["steps"] == 2 and doc["slots_per_device"] == 5 and doc["layers"] == 4
    assert doc["balance"]["planned (dispatch=uniform)"]["uniform"]["aggregate"] >= \
        doc["balance"]["before (slot p holds expert p % E)"]["uniform"]["aggregate"]


@pytest.mark.parametrize("args, message", [
    (["--devices", "3", "--redundant", "2"], "must be divisible by --devices 3"),
    (["--devices", "2", "--slots", "1"], "must be >= num_experts"),
])
def test_eb_plan_user_errors_are_one_line_not_a_traceback(tmp_path, args, message, capsys):
    from eb_deepspeed.tools.cli import main
    _sglang_stat_dump(tmp_path / "d.pt", layers=2, experts=8, dense_first=False)
    assert main(["plan", str(tmp_path / "d.pt"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert main(["plan", str(tmp_path / "missing.pt"), "--devices", "2", "--slots", "4"]) == 2
    err = capsys.readouterr().err
    assert "missing.pt" in err and len(err.strip().splitlines()) == 1, err


def test_eb_plan_writes_no_file_when_a_document_cannot_be_made(tmp_path, monkeypatch):
    import eb_deepspeed.planning.export as export
    _sglang_stat_dump(tmp_path / "d.pt", layers=2, experts=8, dense_first=False)

    def refuse(plan, load_LE):
        raise ValueError("SGLang needs an expert in every physical slot; this plan leaves some empty")
    monkeypatch.setattr(export, "sglang_mapping", refuse)
    assert main(["plan", str(tmp_path / "d.pt"), "--devices", "2", "--slots", "5", "--out", str(tmp_path / "a.json"),
                 "--sglang", str(tmp_path / "b.json")]) == 2
    assert not (tmp_path / "a.json").exists() and not (tmp_path / "b.json").exists()


def test_eb_plan_never_writes_over_its_input_or_one_output_over_the_other(tmp_path):
    from eb_deepspeed.core.record import EXPERT_COUNTS
    log = tmp_path / "balance.jsonl"
    log.write_text(json.dumps({"step": 1, EXPERT_COUNTS: (pareto_loads(2, 8, 1) * 100).round().tolist()}) + "\n")
    before = log.read_text()
    (tmp_path / "link.json").symlink_to(log)
    for args in (["--out", str(log)], ["--sglang", str(tmp_path / "link.json")],
                 ["--out", str(tmp_path / "p.json"), "--sglang", str(tmp_path / "p.json")]):
        source = str(tmp_path) if "--sglang" in args[:1] else str(log)
        assert main(["plan", source, "--devices", "2", "--slots", "5", *args]) == 2, args
    assert log.read_text() == before and not (tmp_path / "p.json").exists()
    assert main(["plan", str(log), "--devices", "2", "--slots", "5", "--out", str(tmp_path / "p.json")]) == 0


def test_eb_plan_refuses_an_output_that_is_a_fifo_and_replaces_a_link_instead_of_writing_through_it(tmp_path):
    import os
    from eb_deepspeed.core.record import EXPERT_COUNTS
    log = tmp_path / "balance.jsonl"
    log.write_text(json.dumps({"step": 1, EXPERT_COUNTS: (pareto_loads(2, 8, 1) * 100).round().tolist()}) + "\n")
    os.mkfifo(tmp_path / "fifo")
    assert main(["plan", str(log), "--devices", "2", "--slots", "5", "--out", str(tmp_path / "fifo")]) == 2   # no block
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text("keep")
    (tmp_path / "plan.json").symlink_to(elsewhere)
    assert main(["plan", str(log), "--devices", "2", "--slots", "5", "--out", str(tmp_path / "plan.json")]) == 0
    assert elsewhere.read_text() == "keep" and not (tmp_path / "plan.json").is_symlink()
    assert json.loads((tmp_path / "plan.json").read_text())["num_devices"] == 2


def test_eb_plan_reads_a_long_log_holding_the_counts_it_plans_from_not_the_records(tmp_path):
    # 2000 records of 16 x 64 five-digit counts: ~12 MB of JSON. Before, the reader kept every record's Python
    # lists (about 6x the file, --last or not); now each record becomes a float64 tensor as it is read (about
    # 1.3x), and --last 10 keeps ten of them
    import numpy as np
    counts = np.random.default_rng(0).integers(10000, 99999, size=(2000, 16, 64)).tolist()
    with open(tmp_path / "balance.jsonl", "w") as f:
        for step, counts_LE in enumerate(counts, 1):
            f.write(json.dumps({"step": step, "expert_counts_LE": counts_LE}) + "\n")
    size_mb = os.path.getsize(tmp_path / "balance.jsonl") / 2 ** 20
    probe = ("import resource, sys\n"
             "import eb_deepspeed.observe.traces, eb_deepspeed.observe.report, eb_deepspeed.planning.placement\n"
             "from eb_deepspeed.tools.cli import main\n"
             "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
             "assert main(['plan', sys.argv[1], '--devices', '4', '--slots', '20', '--json', *sys.argv[2:]]) == 0\n"
             "print('extra_mb', (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)\n")
    extra = {}
    for name, args in (("all", []), ("last10", ["--last", "10"])):
        res = subprocess.run([sys.executable, "-c", probe, str(tmp_path), *args], capture_output=True, text=True,
                             timeout=600)
        assert res.returncode == 0, res.stderr[-2000:]
        extra[name] = float(res.stdout.split("extra_mb")[-1])
    assert extra["all"] < 2.0 * size_mb and extra["last10"] < 0.5 * size_mb, (extra, size_mb)
