"""Per-batch steering among replicas, and the opt-in near-tie re-routing."""
import pytest
import torch

from eb_deepspeed.core.topology import hop_cost
from eb_deepspeed.planning.placement import plan_placement
from eb_deepspeed.planning import steering
from eb_deepspeed.planning.steering import reroute_near_ties, split_device_loads, steer

pytestmark = pytest.mark.unit

NODE_2x2 = torch.tensor([0, 0, 1, 1])  # 4 ranks on 2 nodes


def test_hop_cost_is_zero_on_the_same_rank_then_node_then_network():
    assert hop_cost(NODE_2x2, 0.3).tolist() == [[0, 0.3, 1, 1], [0.3, 0, 1, 1], [1, 1, 0, 0.3], [1, 1, 0.3, 0]]


def random_case(seed, G=4, E=8, S=3):
    g = torch.Generator().manual_seed(seed)
    load = torch.rand(1, E, generator=g).pow(-1 / 1.2) * 100  # Pareto(1, 1.2)
    plan = plan_placement(load, G, S, num_nodes=2)
    counts_GE = torch.poisson(load.expand(G, E) / G, generator=g).long()
    return plan.expert_devices()[0], counts_GE


@pytest.mark.parametrize("seed", range(5))
def test_steering_conserves_tokens_and_only_uses_slots_that_hold_the_expert(seed):
    devices_ER, counts_GE = random_case(seed)
    split_GER = steer(counts_GE, devices_ER, NODE_2x2, pressure_G=torch.rand(4), decision_batch=8)
    assert torch.equal(split_GER.sum(2), counts_GE)
    assert bool((split_GER[:, devices_ER < 0] == 0).all())
    assert bool((split_GER >= 0).all())


def test_steering_is_deterministic():
    devices_ER, counts_GE = random_case(1)
    p = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert torch.equal(steer(counts_GE, devices_ER, NODE_2x2, pressure_G=p),
                       steer(counts_GE, devices_ER, NODE_2x2, pressure_G=p))


def test_a_hot_expert_is_split_over_its_replicas_to_shrink_the_slowest_device():
    # expert 0 (hot) has replicas on devices 0 and 2; experts 1..3 one replica each on devices 1, 2, 3
    devices_ER = torch.tensor([[0, 2], [1, -1], [2, -1], [3, -1]])
    counts_GE = torch.tensor([[400, 100, 50, 100], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    split = steer(counts_GE, devices_ER, torch.tensor([0, 0, 0, 0]), weights=(1.0, 0.0, 0.0))
    load = split_device_loads(split, devices_ER, 4)
    all_on_first = torch.tensor([400.0, 100, 50, 100])
    assert float(load.max()) < float(all_on_first.max()) and float(load.max()) <= 0.5 * 450 + 50


def test_communication_cost_keeps_tokens_on_the_senders_node_when_load_does_not_matter():
    devices_ER = torch.tensor([[0, 2]])      # replicas on node 0 (device 0) and node 1 (device 2)
    counts_GE = torch.tensor([[64], [64], [64], [64]])
    split = steer(counts_GE, devices_ER, NODE_2x2, weights=(0.0, 0.0, 1.0), topology="multi_node")
    assert split[:, 0, 0].tolist() == [64, 64, 0, 0] and split[:, 0, 1].tolist() == [0, 0, 64, 64]


def messages(split_GER, devices_ER, G):
    """Messages of an All-to-All: (source, other device) pairs that carry at least one token."""
    per_GG = torch.zeros(G, G, dtype=torch.long)
    valid_ER = devices_ER >= 0
    for s in range(G):
        per_GG[s].index_add_(0, devices_ER[valid_ER], split_GER[s][valid_ER])
    return int(((per_GG > 0) & ~torch.eye(G, dtype=torch.bool)).sum())


def test_the_aggregation_bonus_keeps_a_small_chunk_where_its_source_sends_anyway(monkeypatch):
    # devices 0, 1, 2 on one node. Source 0 sends 16 tokens to expert 0 (replicas on devices 1, 2) and 16 to
    # expert 1 (device 1 only); source 2 sends 8 to expert 2 (device 2 only). Even split: expert 0 gives 8 to
    # each replica, loads d1 = 24, d2 = 16, mean 40 / 3.
    # Without aggregation: d1 costs 0.2 * (24 - 16) / 13.3 = 0.12 more, so 4 tokens move to d2 (costs meet at
    # 20 / 20) and source 0 keeps two messages (to d1 and d2).
    # With aggregation 1: d1 carries source 0's expert-1 tokens, so it costs 0.8 less; d2 only expert 0's own
    # chunk: 0.8 - 0.12 = 0.68 in favour of d1, all 8 move there and the message to d2 disappears (d1 32, d2 8).
    devices_ER = torch.tensor([[1, 2], [1, -1], [2, -1]])
    counts_GE = torch.tensor([[16, 16, 0], [0, 0, 0], [0, 0, 8]])
    node_G = torch.zeros(3, dtype=torch.long)
    runs = {}
    for agg in (0.0, 1.0):
        monkeypatch.setattr(steering, "AGGREGATION", agg)
        runs[agg] = steer(counts_GE, devices_ER, node_G, weights=(0.2, 0.0, 0.8), decision_batch=1)
    assert runs[0.0][0, 0].tolist() == [4, 12] and split_device_loads(runs[0.0], devices_ER, 3).tolist() == [0, 20, 20]
    assert runs[1.0][0, 0].tolist() == [16, 0] and split_device_loads(runs[1.0], devices_ER, 3).tolist() == [0, 32, 8]
    assert messages(runs[1.0], devices_ER, 3) == 1 < messages(runs[0.0], devices_ER, 3) == 2


def test_every_expert_needs_a_replica():
    with pytest.raises(ValueError, match=r"every expert needs at least one replica"):
        steer(torch.ones(2, 2, dtype=torch.long), torch.tensor([[0], [-1]]), torch.tensor([0, 0]))


def test_near_tie_rerouting_moves_only_within_the_gap_and_reports_the_fraction():
    probs = torch.tensor([[0.50, 0.30, 0.15, 0.05], [0.40, 0.38, 0.20, 0.02]])
    topk = torch.tensor([[0, 1], [0, 1]])
    expert_device = torch.tensor([0, 0, 1, 1])
    load = torch.tensor([100.0, 10.0])  # device 0 is hot
    same, frac = reroute_near_ties(topk, probs, load, expert_device, gap=0.0)
    assert torch.equal(same, topk) and frac == 0.0
    new, frac = reroute_near_ties(topk, probs, load, expert_device, gap=0.2)
    # token 0: expert 1 (0.30) -> expert 2 (0.15, within 0.2, on the cold device); expert 0 has no tie
    # token 1: expert 0 (0.40) -> expert 2 (0.20, within 0.2); expert 1 (0.38) -> expert 3? 0.02 < 0.18: no
    assert new.tolist() == [[0, 2], [2, 1]] and frac == pytest.approx(0.5)
    for row in new.tolist():
        assert len(set(row)) == len(row)
