"""`AutoEPRoutes.slots` (a served AutoEP layer's route -> physical slot map) and `expected_device_load` (the
planner's dropless cost), on their own: every route goes to a slot of its own expert, in the split's numbers."""
import pytest
import torch

from eb_deepspeed.planning import expected_device_load, index_maps, plan_placement, static_placement

pytestmark = pytest.mark.unit


class _Layer(torch.nn.Module):
    """What AutoEPRoutes reads of an AutoEPMoELayer: num_experts, top_k, ep_group, router.gate."""

    def __init__(self, E: int, k: int):
        super().__init__()
        self.num_experts, self.top_k, self.ep_group = E, k, None
        self.router = torch.nn.Module()
        self.router.gate = torch.nn.Linear(4, E, bias=False)


def _routes(plan, layer_index=0, split="view"):
    from eb_deepspeed.adapters.autoep.routes import AutoEPRoutes
    from eb_deepspeed.adapters.routing import Routing, SlotTable
    G = plan.num_devices
    return AutoEPRoutes(_Layer(plan.num_experts, 2), layer_index, G, plan.slots_per_device,
                        table=SlotTable.even(plan.log2phy[layer_index]), routing=Routing(exact=split == "exact"))


def test_each_route_goes_to_a_slot_of_its_expert_and_replicas_share_its_routes_evenly():
    # 4 experts on 2 ranks, 3 slots each: experts 0 and 1 have a replica on each rank
    plan = index_maps(torch.tensor([[0, 1, 2, 3, 0, 1]]), 4, 2, 3)
    routes = _routes(plan)
    g = torch.Generator().manual_seed(0)
    selected_TK = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(40)]).int()
    selected_TK[:20, 0] = 0                                  # a hot expert 0
    counts_E = torch.bincount(selected_TK.flatten().long(), minlength=4).int()
    slot_TK, counts_P = routes.slots(selected_TK, counts_E)
    assert torch.equal(plan.phy2log[0][slot_TK.long()], selected_TK.long())       # its own expert's slot
    assert torch.equal(counts_P, torch.bincount(slot_TK.flatten(), minlength=6))
    for e in range(4):
        shares = counts_P[plan.log2phy[0, e][plan.log2phy[0, e] >= 0]]
        assert int(shares.sum()) == int(counts_E[e]) and int(shares.max() - shares.min()) <= 1


def test_one_slot_per_expert_maps_routes_through_the_permutation_and_home_needs_no_map():
    perm = index_maps(torch.tensor([[2, 0, 3, 1]]), 4, 2, 2)
    routes = _routes(perm)
    assert routes.one_each and not routes.home_layout
    selected_TK = torch.tensor([[0, 1], [2, 3], [0, 2]], dtype=torch.int32)
    counts_E = torch.bincount(selected_TK.flatten().long(), minlength=4).int()
    slot_TK, counts_P = routes.slots(selected_TK, counts_E)
    assert torch.equal(perm.phy2log[0][slot_TK.long()], selected_TK.long())
    assert counts_P.tolist() == [counts_E[2], counts_E[0], counts_E[3], counts_E[1]]
    assert _routes(static_placement(1, 4, 2)).home_layout


def test_an_empty_batch_maps_to_no_route_and_zero_counts():
    routes = _routes(index_maps(torch.tensor([[0, 1, 2, 3, 0, 1]]), 4, 2, 3))
    slot_TK, counts_P = routes.slots(torch.zeros(0, 2, dtype=torch.int32), torch.zeros(4, dtype=torch.int32))
    assert slot_TK.shape == (0, 2) and counts_P.tolist() == [0] * 6


def test_the_dropless_cost_is_the_busiest_devices_expected_routes():
    heat_LE = torch.tensor([[8.0, 2, 1, 1]], dtype=torch.float64)
    home = static_placement(1, 4, 2)
    assert expected_device_load(heat_LE, home).tolist() == [[10.0, 2.0]]
    replicated = index_maps(torch.tensor([[0, 1, 2, 3, 0, 1]]), 4, 2, 3)     # experts 0 and 1 halved over the ranks
    assert expected_device_load(heat_LE, replicated).tolist() == [[6.0, 6.0]]
    plan = plan_placement(heat_LE, 2, 3, dispatch="uniform")
    assert float(expected_device_load(heat_LE, plan).amax()) <= 6.0
