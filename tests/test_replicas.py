"""Replica slots chosen from one micro-batch's counts (`planning.replicas`): what a rank may hold, what they buy,
that the split keeps every route, that every rank chooses alike, and that the choice compiles whole."""
import pytest
import torch

from eb_deepspeed.planning.replicas import choose_replicas, copies
from eb_deepspeed.planning.steering import Fill, split as split_over_copies



def random_case(seed: int, L: int = 3, E: int = 16, G: int = 4):
    g = torch.Generator().manual_seed(seed)
    counts_LE = (torch.rand(L, E, generator=g) ** 3 * 400).round().long()     # a few hot experts
    home_LE = torch.stack([torch.randperm(E, generator=g) % G for _ in range(L)])
    return counts_LE, home_LE


@pytest.mark.unit
@pytest.mark.parametrize("seed", range(6))
def test_a_rank_never_holds_two_copies_of_an_expert_and_every_route_stays_on_a_copy(seed):
    counts_LE, home_LE = random_case(seed)
    replica_LGR = choose_replicas(counts_LE, home_LE, 4, 2)
    assert replica_LGR.shape == (3, 4, 2) and bool((replica_LGR >= -1).all()) and bool((replica_LGR < 16).all())
    for layer in range(3):
        for g in range(4):
            held = [int(e) for e in replica_LGR[layer, g] if e >= 0]
            homes = set((home_LE[layer] == g).nonzero().flatten().tolist())
            assert len(set(held)) == len(held) and not set(held) & homes, (layer, g, held, homes)
    holds_LGE = copies(home_LE, replica_LGR, 4)
    n_LGE = split_over_copies(counts_LE, holds_LGE)
    assert torch.equal(n_LGE.sum(1), counts_LE) and bool((n_LGE >= 0).all()) and not bool(n_LGE[~holds_LGE].any())
    assert torch.equal(choose_replicas(counts_LE, home_LE, 4, 2), replica_LGR)          # every rank alike


@pytest.mark.unit
def test_a_hot_experts_routes_spread_over_its_copies_until_the_ranks_are_level():
    # 4 ranks, 2 experts each (homes contiguous); expert 0 takes 160 of 300 routes: its rank 170 against a mean of
    # 75; one replica slot a rank lets three cold ranks take a copy of it: every rank near the mean (75, 76 rounded)
    counts_LE = torch.tensor([[160, 10, 20, 20, 30, 30, 15, 15]])
    home_LE = torch.arange(8).div(2, rounding_mode="floor")[None]
    n_LGE = split_over_copies(counts_LE, copies(home_LE, choose_replicas(counts_LE, home_LE, 4, 1), 4))
    assert int(n_LGE.sum(2).max()) <= 76, n_LGE.sum(2)
    # priced: copies that would take fewer routes than their transfer costs are not made
    priced = choose_replicas(counts_LE, home_LE, 4, 1, min_routes=1000.0)
    assert bool((priced == -1).all())
    assert choose_replicas(counts_LE, home_LE, 4, 0).shape == (1, 4, 0)               # no slots: no choice


@pytest.mark.slow       # inductor's C++ build on the CPU: about 40 s
def test_the_choice_and_the_split_compile_whole_with_equal_results():
    def choose_and_split(counts_LE, home_LE):      # 2 waves and rounds: the same ops as the defaults, unrolled
        holds = copies(home_LE, choose_replicas(counts_LE, home_LE, 4, 1, min_routes=4.0, waves=2, rounds=2), 4)
        return split_over_copies(counts_LE, holds, Fill(2))   # fewer times (the benchmark compiles the defaults)
    compiled = torch.compile(choose_and_split, fullgraph=True)       # no graph break: no host read, fixed shapes
    for seed in range(3):
        counts_LE, home_LE = random_case(seed)
        assert torch.equal(compiled(counts_LE, home_LE), choose_and_split(counts_LE, home_LE))
