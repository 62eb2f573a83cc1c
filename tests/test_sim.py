"""The cluster simulator, its workloads and trace importers."""
import json

import pytest
import torch

from benchmarks import sim
from benchmarks.sim import ClusterModel, SimConfig, TOPOLOGIES
from benchmarks.sim.workloads import Workload

pytestmark = pytest.mark.unit


def test_a_balanced_workload_makes_every_strategy_equal():
    # exactly balanced: every source sends the same number of routes to every expert
    w = Workload("uniform", torch.full((5, 4, 4, 16), 256 * 2 // 16, dtype=torch.long), k=2)
    cfg = SimConfig(model=ClusterModel(decision_s=0.0), extra_slots=0, warmup=1, replan_every=2)
    table = sim.run_table(w, cfg)
    for name, row in table["rows"].items():
        assert row["relative_throughput"] == pytest.approx(1.0, rel=1e-9), name
        assert row["device_util_std"] == pytest.approx(0.0, abs=1e-12) and row["balancedness"] == pytest.approx(1.0)


def test_layer_cost_grows_with_tokens_bytes_and_messages_and_network_hops():
    m = ClusterModel(topology=TOPOLOGIES["multi_node"])
    G = 8
    zero = torch.zeros(G, dtype=torch.float64)
    traffic = torch.full((G, G), 100.0, dtype=torch.float64)
    base = m.layer_times(traffic, torch.full((G, ), 800.0), zero, zero)
    assert bool((m.layer_times(traffic * 2, torch.full((G, ), 800.0), zero, zero) > base).all())      # bytes
    assert bool((m.layer_times(traffic, torch.full((G, ), 1600.0), zero, zero) > base).all())       # tokens
    assert bool((m.layer_times(traffic, torch.full((G, ), 800.0), zero + 7, zero) > base).all())    # messages
    assert bool((m.layer_times(traffic, torch.full((G, ), 800.0), zero, zero + 100) > base).all())  # decisions
    # the same bytes cost more across nodes (12.5 GB/s) than inside one (150 GB/s): devices 0-3 / 4-7
    intra = torch.zeros(G, G, dtype=torch.float64)
    intra[0, 1] = 1000.0
    inter = torch.zeros(G, G, dtype=torch.float64)
    inter[0, 5] = 1000.0
    assert m.layer_times(inter, zero, zero, zero)[0] > m.layer_times(intra, zero, zero, zero)[0]


def test_run_ahead_never_takes_longer_than_synchronised_execution():
    times = torch.rand(16, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    sync = ClusterModel(run_ahead=1).step_time(times)
    assert sync == pytest.approx(float(times.amax(1).sum()))
    assert ClusterModel(run_ahead=4).step_time(times) <= sync
    flat = torch.ones(16, 4, dtype=torch.float64)
    assert ClusterModel(run_ahead=4).step_time(flat) == pytest.approx(16.0)


def test_synthetic_workloads_conserve_tokens_and_correlate_hot_experts_across_layers():
    w = sim.synthetic_workload(layers=6, experts=16, devices=4, steps=3, tokens_per_rank=128, k=2, correlation=1.0)
    assert w.counts_NLGE.shape == (3, 6, 4, 16)
    assert bool((w.counts_NLGE.sum(3) == 256).all())
    hottest = w.counts_NLGE.sum((0, 2)).argmax(1)
    assert len(set(hottest.tolist())) == 1  # correlation 1: the same hot expert in every layer
    drifting = sim.synthetic_workload(layers=2, experts=16, devices=2, steps=20, drift=0.2, seed=1)
    first, last = drifting.counts_NLGE[0].sum(1).double(), drifting.counts_NLGE[-1].sum(1).double()
    assert torch.nn.functional.cosine_similarity(first, last, dim=1).mean() < 0.99


def test_eb_placement_and_steering_beat_the_static_layout_on_a_skewed_workload():
    w = sim.synthetic_workload(layers=4, experts=16, devices=4, steps=8, tokens_per_rank=512)
    table = sim.run_table(w, SimConfig(warmup=2, replan_every=4), strategies=("static", "placement_steering"))
    ours = table["rows"]["placement_steering"]
    assert ours["relative_throughput"] > 1.2 and ours["device_util_std"] < table["rows"]["static"]["device_util_std"]


def test_replicas_with_an_even_split_gain_and_a_measured_steering_cost_takes_back_what_steering_gains():
    w = sim.synthetic_workload(layers=4, experts=16, devices=4, steps=8, tokens_per_rank=512)
    table = sim.run_table(w, SimConfig(warmup=2, replan_every=4), strategies=("static", "placement_view",
                                                                              "placement_steering"))
    assert table["rows"]["placement_view"]["relative_throughput"] > 1.2
    free = table["rows"]["placement_steering"]["step_ms"]
    costly = sim.simulate(w, "placement_steering", SimConfig(model=ClusterModel(steer_s=1e-3), warmup=2,
                                                             replan_every=4))["step_ms"]
    assert costly == pytest.approx(free + 4 * 1e-3 * 1e3 * (8 - 2) / 8, rel=1e-6)   # 1 ms a layer once steering


def test_trace_workload_spreads_a_logical_trace_over_ranks_without_losing_tokens():
    trace = torch.tensor([[[10.0, 3.0, 0.0], [1.0, 1.0, 7.0]]])
    w = sim.trace_workload(trace, devices=4)
    assert torch.equal(w.counts_NLGE.sum(2).double(), trace)
    assert int(w.counts_NLGE.max() - w.counts_NLGE.min()) <= 3


# ---------------------------------------------------------------------- importers
def test_sglang_dumps_are_read_with_or_without_a_step_dimension(tmp_path):
    counts = torch.randint(0, 50, (5, 3, 8), dtype=torch.int32)
    torch.save({"rank": 0, "logical_count": counts, "average_utilization_rate_over_window": None}, tmp_path / "a.pt")
    assert torch.equal(sim.load_trace(str(tmp_path / "a.pt")), counts.double())
    torch.save({"logical_count": counts[0]}, tmp_path / "b.pt")
    assert sim.load_trace(str(tmp_path / "b.pt")).shape == (1, 3, 8)


def test_vllm_physical_loads_are_mapped_to_logical_experts(tmp_path):
    load = torch.tensor([[[4, 1, 2, 3]], [[1, 1, 1, 1]]], dtype=torch.int32)        # [window 2, layer 1, physical 4]
    p2l = torch.tensor([[0, 1, 0, 2]])                                               # physical 0 and 2 hold expert 0
    torch.save({"expert_load_window": load, "physical_to_logical_map": p2l}, tmp_path / "v.pt")
    assert sim.load_trace(str(tmp_path / "v.pt")).tolist() == [[[6.0, 1.0, 3.0]], [[2.0, 1.0, 1.0]]]
    torch.save({"global_expert_load": torch.ones(2, 4, dtype=torch.int64)}, tmp_path / "g.pt")
    assert sim.load_trace(str(tmp_path / "g.pt")).shape == (1, 2, 4)


def test_our_own_balance_log_is_a_trace(tmp_path):
    rows = [{"step": s, "expert_counts_LE": [[s, 1, 2], [0, s, 1]]} for s in (1, 2)]
    (tmp_path / "balance.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert sim.load_trace(str(tmp_path)).tolist() == [[[1, 1, 2], [0, 1, 1]], [[2, 1, 2], [0, 2, 1]]]


@pytest.mark.parametrize("content, message", [
    ("text", r"not a torch.save file readable with weights_only=True"),
    (torch.ones(3), r"expected a dict of tensors, got Tensor"),
    ({"something": torch.ones(2)}, r"no expert load found; .* keys present: \['something'\]"),
    ({"logical_count": torch.ones(2, 2, 2, 2)}, r"'logical_count' must be a tensor with 2 or 3 dimensions, got Tensor\(2, 2, 2, 2\)"),
    ({"logical_count": -torch.ones(2, 2)}, r"'logical_count' must be finite and non-negative"),
    ({"expert_load_pass": torch.ones(2, 4)}, r"'physical_to_logical_map' is missing"),
    ({"expert_load_pass": torch.ones(2, 4), "physical_to_logical_map": torch.zeros(2, 3)},
     r"physical_to_logical_map must be a tensor of shape \(2, 4\)"),
])
def test_malformed_trace_files_give_clear_errors(tmp_path, content, message):
    path = tmp_path / "bad.pt"
    if isinstance(content, str):
        path.write_text(content)
    else:
        torch.save(content, path)
    with pytest.raises(ValueError, match=message):
        sim.load_trace(str(path))


@pytest.mark.parametrize("counts, message", [
    ([[1, float("nan")], [0, 1]], r"expert_counts_LE must be finite and non-negative"),
    ([[1, -3], [0, 1]], r"expert_counts_LE must be finite and non-negative"),
    ([[1, 2], [0]], r"different expert counts \(\[2, 1\], a PR-MoE run\)"),
    ([[1, 2], ["x", 0]], r"expert_counts_LE of step 1 must be a \[layers, experts\] list of numbers"),
    ([1, 2], r"expert_counts_LE must be \[layers, experts\], got \(2,\) at step 1"),
])
def test_a_balance_log_with_bad_counts_is_refused_like_the_other_importers(tmp_path, counts, message):
    # one validation path for every importer: our own log gets the same checks as a .pt dump
    (tmp_path / "balance.jsonl").write_text(json.dumps({"step": 1, "expert_counts_LE": counts}) + "\n")
    with pytest.raises(ValueError, match=message):
        sim.load_trace(str(tmp_path))


def test_a_strategy_is_its_named_switches_and_an_unknown_name_is_refused():
    from benchmarks.sim.strategies import STRATEGY_SPECS, Strategy
    assert set(STRATEGY_SPECS) == set(sim.STRATEGY_LABELS) and set(sim.STRATEGIES) < set(STRATEGY_SPECS)
    w = sim.synthetic_workload(layers=2, experts=8, devices=2, steps=4, tokens_per_rank=64)
    cfg = SimConfig(warmup=1, replan_every=2)
    # the same switches by name or as an object give the same row
    assert sim.simulate(w, "aggregated", cfg) == sim.simulate(w, Strategy(rebalance=True, aggregate=True), cfg)
    with pytest.raises(ValueError, match=r"strategy \('magic'\) must be one of: static, per_token"):
        sim.simulate(w, "magic", cfg)
