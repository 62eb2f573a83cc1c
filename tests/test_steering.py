"""The exact split: each batch's routes to an expert over its copies, the busiest rank as low as it goes."""
import pytest
import torch

from benchmarks.exact import steered_max_load
from eb_deepspeed.planning.placement import plan_placement
from eb_deepspeed.planning.steering import Fill, fill_of, rank_share, split, steer, water_fill

pytestmark = pytest.mark.unit


def random_case(seed, G=4, E=8, S=3):
    g = torch.Generator().manual_seed(seed)
    load = torch.rand(1, E, generator=g).pow(-1 / 1.2) * 100  # Pareto(1, 1.2)
    plan = plan_placement(load, G, S)
    counts_GE = torch.poisson(load.expand(G, E) / G, generator=g).long()
    return plan.expert_devices()[0], counts_GE


def device_loads(split_GER, devices_ER, G):
    return torch.zeros(G + 1, dtype=torch.long).index_add_(
        0, torch.where(devices_ER >= 0, devices_ER, G).flatten(), split_GER.sum(0).flatten())[:G]


@pytest.mark.parametrize("seed", range(5))
def test_the_split_conserves_each_ranks_routes_and_only_uses_copies_that_exist(seed):
    devices_ER, counts_GE = random_case(seed)
    split_GER = steer(counts_GE, devices_ER)
    assert torch.equal(split_GER.sum(2), counts_GE)
    assert bool((split_GER[:, devices_ER < 0] == 0).all()) and bool((split_GER >= 0).all())
    assert torch.equal(steer(counts_GE, devices_ER), split_GER)                  # deterministic


def test_a_hot_expert_is_split_so_that_its_two_devices_level():
    # expert 0 has copies on devices 0 and 2, which holds expert 2 (50 routes): 400 split x / 400 - x with
    # x = 50 + 400 - x: x = 225, both devices at 225
    devices_ER = torch.tensor([[0, 2], [1, -1], [2, -1], [3, -1]])
    counts_GE = torch.tensor([[400, 100, 50, 100], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    split = steer(counts_GE, devices_ER)
    assert split[0, 0].tolist() == [225, 175] and device_loads(split, devices_ER, 4).tolist() == [225, 100, 225, 100]


def test_a_route_never_lands_where_there_is_no_copy_even_when_float_drift_zeroes_an_experts_share():
    # 1e17 routes on expert 0 (copies on both ranks) swamp float64: expert 1's 3 routes on its one copy (rank 1)
    # float to nothing, and the whole routes added back must go to that copy, not to rank 0
    holds_LGE = torch.tensor([[[True, False], [True, True]]])
    n_LGE = split(torch.tensor([[10 ** 17, 3]]), holds_LGE)
    assert n_LGE[0, :, 1].tolist() == [0, 3] and torch.equal(n_LGE.sum(1), torch.tensor([[10 ** 17, 3]]))

@pytest.mark.parametrize("seed", range(8))
def test_the_busiest_rank_is_within_two_percent_and_a_route_of_the_exact_optimum(seed):
    devices_ER, counts_GE = random_case(seed)
    G, E = 4, devices_ER.shape[0]
    holds_GE = [[bool((devices_ER[e] == g).any()) for e in range(E)] for g in range(G)]
    best = steered_max_load(holds_GE, counts_GE.sum(0).tolist())       # Hall's theorem: the LP's optimum
    busiest = int(device_loads(steer(counts_GE, devices_ER), devices_ER, G).max())
    assert busiest <= max(1.02 * best, best + 1)


def holds(devices_ER, G):
    """[G, E] rank g holds a copy of expert e."""
    return torch.stack([(devices_ER == g).any(1) for g in range(G)])


def n_of(devices_ER, counts_E, G, rounds=16):
    """The split's routes per copy [E, R], copies as devices_ER orders them."""
    n_GE = split(counts_E[None], holds(devices_ER, G)[None], Fill(rounds))[0]
    return torch.where(devices_ER >= 0, n_GE.T.gather(1, devices_ER.clamp_min(0)), 0)


def test_each_rank_sends_its_own_part_of_every_copy():
    devices_ER = torch.tensor([[0, 1], [1, -1]])
    counts_GE = torch.tensor([[3, 1], [5, 0]])            # expert 0: 8 routes, 3 from rank 0 then 5 from rank 1
    n_ER = n_of(devices_ER, counts_GE.sum(0), 2)
    # device 0 takes x, device 1 8 - x + 1 (expert 1): level at x = 4.5, rounded half to even: 4 and 4
    assert n_ER.tolist() == [[4, 4], [1, 0]]
    # rank 0's 3 routes are the first 3 of copy 0; rank 1's 5 are copy 0's last one and copy 1's 4
    assert rank_share(counts_GE, n_ER).tolist() == [[[3, 0], [1, 0]], [[1, 4], [0, 0]]]


def test_every_expert_needs_a_copy():
    with pytest.raises(ValueError, match=r"a first copy for every expert"):
        steer(torch.ones(2, 2, dtype=torch.long), torch.tensor([[0], [-1]]))


def test_a_placement_takes_the_rounds_its_copies_need_and_no_split_is_worse_for_it():
    # experts 0 and 1 each on two ranks no other flex expert shares: one round levels each pair exactly
    apart = torch.tensor([[0, 1], [2, 3], [0, -1], [1, -1], [2, -1], [3, -1]]), 4
    # expert 0 on ranks 0-1, expert 1 on 1-2, expert 2 on 2-3: each level moves its neighbours'
    chained = torch.tensor([[0, 1], [1, 2], [2, 3], [0, -1], [3, -1]]), 4
    wide = random_case(0, G=16, E=32, S=3)[0], 16
    fills = [fill_of(holds(*case)) for case in (apart, chained, wide)]
    rounds = [fill.rounds for fill in fills]
    assert rounds[0] == 1 and 1 < rounds[1] <= 16 and rounds[2] > rounds[0]
    g = torch.Generator().manual_seed(3)
    for (devices_ER, G), f in zip((apart, chained, wide), fills):
        for _ in range(5):
            counts_E = torch.randint(0, 1000, (devices_ER.shape[0], ), generator=g)
            loads = [split(counts_E[None], holds(devices_ER, G)[None], fill)[0].sum(1).max() for fill in (f, Fill())]
            assert float(loads[0]) <= float(loads[1]) * 1.01 + 2       # 16 rounds gain nothing on it
    assert fill_of(holds(torch.tensor([[0], [1]]), 2)).rounds == 0               # no copies to split


def test_with_the_copies_ranks_each_rank_fills_its_own_copy_first_and_every_sum_holds():
    devices_ER = torch.tensor([[1, 0], [1, -1]])
    counts_GE = torch.tensor([[3, 1], [5, 0]])
    n_ER = torch.tensor([[4, 4], [1, 0]])
    # in order, rank 0's 3 routes would go to copy 0 on rank 1; its own copy (copy 1) takes them instead
    assert rank_share(counts_GE, n_ER)[0].tolist() == [[3, 0], [1, 0]]
    own = rank_share(counts_GE, n_ER, devices_ER=devices_ER)
    assert own.tolist() == [[[0, 3], [1, 0]], [[4, 1], [0, 0]]]
    for seed in range(5):
        devices, counts = random_case(seed)
        n = n_of(devices, counts.sum(0), 4)
        share = rank_share(counts, n, devices_ER=devices)
        assert torch.equal(share.sum(2), counts) and torch.equal(share.sum(0), n) and bool((share >= 0).all())
        off = lambda s: int((s * (devices[None] != torch.arange(4)[:, None, None])).sum())     # routes that leave
        assert off(share) <= off(rank_share(counts, n))
        assert torch.equal(steer(counts, devices), share)                 # the public split is the runtime's


def test_the_count_exchange_is_taken_over_at_one_layers_call_site_and_nowhere_else():
    import types
    from deepspeed.module_inject import auto_ep_layer
    from eb_deepspeed.adapters.autoep.routes import _take_over_count_exchange
    original = auto_ep_layer.compute_split_plan
    scope = {"compute_split_plan": original}     # AutoEP's call site: `_forward` calls its module's function by name
    exec("def _forward(self, *args, **kwargs):\n    return compute_split_plan(*args, **kwargs)", scope)
    Layer = type("Layer", (), {"_forward": scope["_forward"]})
    ours, plain, routes = Layer(), Layer(), types.SimpleNamespace(_splits=None)
    _take_over_count_exchange(ours, routes)
    assert auto_ep_layer.compute_split_plan is original and scope["compute_split_plan"] is original
    assert Layer._forward is scope["_forward"] and "_forward" not in vars(plain)     # the class, other layers: as they were
    selected_TK = torch.tensor([[0, 1], [1, 3]])
    counts_E = torch.tensor([1, 2, 0, 1], dtype=torch.int32)
    for layer in (ours, plain):
        for args, kwargs in (((selected_TK, 4, 1, 4, None), {}), ((selected_TK, 4, 1, 4, None, counts_E), {}),
                             ((selected_TK, 4, 1, 4, None), {"num_tokens_per_expert": counts_E})):
            plan = layer._forward(*args, **kwargs)               # nothing staged: DeepSpeed's own answer
            assert plan.input_splits == [4] and plan.local_counts_by_source.tolist() == [[1, 2, 0, 1]]
    routes._splits = (torch.tensor([[3, 1], [2, 2]]), torch.tensor([[1, 1], [0, 0]]))
    plan = ours._forward(selected_TK, 4, 2, 2, None, num_tokens_per_expert=counts_E)
    assert (plan.input_splits, plan.output_splits) == ([3, 1], [2, 2])           # no exchange: the staged sizes
    assert plan.local_counts_by_source.dtype == torch.int32 and plan.local_counts_by_source.tolist() == [[1, 1], [0, 0]]
    assert routes._splits is None                                 # taken once, by this forward


@pytest.mark.parametrize("seed", range(4))
def test_a_level_reads_only_the_most_copies_lowest_loads_and_splits_as_if_it_read_every_rank(seed):
    devices_ER, counts_GE = random_case(seed, G=16, E=32, S=4)
    holds_LGE = holds(devices_ER, 16)[None]
    fill = fill_of(holds_LGE[0], 16)
    assert fill.copies == int(holds_LGE.sum(1).max()) and len(fill.flex_F) == int((holds_LGE.sum(1) > 1).sum())
    n_LGE = split(counts_GE.sum(0)[None], holds_LGE, fill)
    assert torch.equal(n_LGE, split(counts_GE.sum(0)[None], holds_LGE, fill._replace(copies=None)))   # bit for bit
    assert torch.equal(n_LGE, plain_split(counts_GE.sum(0)[None], holds_LGE, fill.flex_F))   # as the plain rounds do
    c_LF, holds_LGF = counts_GE.sum(0)[None, fill.flex_F].double(), holds_LGE[:, :, fill.flex_F]
    x_LGF, fixed_LG = holds_LGF * (c_LF / holds_LGF.sum(1)).unsqueeze(1), torch.rand(1, 16) * 100
    assert torch.equal(water_fill(c_LF, holds_LGF, x_LGF, fill, fixed_LG), plain_fill(c_LF, holds_LGF, x_LGF, fixed_LG))
    assert fill.copies > 2 and not torch.equal(n_LGE, split(counts_GE.sum(0)[None], holds_LGE, fill._replace(copies=2)))


def plain_fill(c_LF, holds_LGF, x_LGF, fixed_LG, rounds=16):
    """The water filling as first written (a full sort of every rank's base each round), the reference."""
    G, load = holds_LGF.shape[1], x_LGF.sum(2) + fixed_LG
    k = torch.arange(1, G + 1, dtype=torch.float64).view(1, G, 1)
    for _ in range(rounds):
        base = torch.where(holds_LGF, load.unsqueeze(2) - x_LGF, torch.finfo(torch.float64).max / 4)
        level = (base.sort(1).values.cumsum(1) + c_LF.unsqueeze(1)).div(k).amin(1, keepdim=True)
        move = (level - base).clamp_min(0.0) - x_LGF
        move_G = move.sum(2)
        step = (-(load * move_G).sum(1) / (move_G * move_G).sum(1).clamp_min(1e-30)).clamp(0.0, 1.0)
        x_LGF, load = x_LGF + move * step.view(-1, 1, 1), load + move_G * step.view(-1, 1)
    return x_LGF


def plain_split(counts_LE, holds_LGE, flex_F):
    """The split as first written: the flex experts filled by `plain_fill`, every expert rounded."""
    c = counts_LE.double()
    x = holds_LGE * (c / holds_LGE.sum(1).clamp_min(1)).unsqueeze(1)
    h, cf = holds_LGE[:, :, flex_F], c[:, flex_F]
    x = x.index_copy(2, flex_F, plain_fill(cf, h, x[:, :, flex_F], x.index_fill(2, flex_F, 0.0).sum(2)))
    ends = torch.minimum(x.clamp_min(0.0).cumsum(1).round(), c.unsqueeze(1))
    n = torch.diff(ends, dim=1, prepend=torch.zeros_like(ends[:, :1])).long()
    return n.scatter_add_(1, x.argmax(1, keepdim=True), (counts_LE.long() - n.sum(1)).unsqueeze(1))
