"""The cross-layer view over MoE layers of different shapes (PR-MoE): per-layer expert counts padded
with a mask, smaller EP groups copied across the view's devices, controls per layer. One process."""
import pytest
import torch

from eb_deepspeed.core import Balancer, EasyBalanceConfig, LayerControls, LayerTally, ModelShape, Tally
from eb_deepspeed.core import metrics as M
from eb_deepspeed.core.policies import bias_update
from eb_deepspeed.core.tally import TallyLayout, widen_row
from eb_deepspeed.core.view import LoadView
from benchmarks.sim.model import tally_of

pytestmark = pytest.mark.unit


def padded(rows, width):
    """Ragged per-layer rows as one [L, width] tensor, zeros beyond each row."""
    out = torch.zeros(len(rows), width, dtype=torch.float64)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.as_tensor(row, dtype=torch.float64)
    return out


def test_layers_of_2_4_and_8_experts_share_one_view_over_their_devices():
    view = LoadView(3, [2, 4, 8], 2)
    assert (view.E, view.G) == (8, 2) and view.mask_LE.sum(1).tolist() == [2, 4, 8]
    # DeepSpeed's contiguous layout per layer: expert e of layer l on rank e // (E_l / 2)
    assert [view.layer_map(i).tolist() for i in range(3)] == [[0, 1], [0, 0, 1, 1], [0] * 4 + [1] * 4]
    routed = [[6, 2], [1, 2, 3, 6], [1, 1, 1, 1, 1, 1, 1, 9]]
    valid = view.update(tally_of(padded(routed, 8)))
    assert valid.tolist() == [True, True, True]
    assert view.pressure_LG.tolist() == [[6.0, 2.0], [3.0, 9.0], [4.0, 12.0]]
    metrics = view.metrics()
    # expert metrics over each layer's own experts only (padding would pull the means down)
    for i, row in enumerate(routed):
        alone = M.max_over_mean(torch.tensor([row], dtype=torch.float64))
        assert metrics["expert_max_over_mean"][i] == pytest.approx(float(alone))
        assert metrics["max_vio"][i] == pytest.approx(float(alone) - 1)
    means = [sum(r) / len(r) for r in routed]
    assert metrics["expert_balancedness"] == pytest.approx(sum(means) / sum(max(r) for r in routed))
    assert metrics["device_max_over_mean"] == pytest.approx([1.5, 1.5, 1.5])


def test_a_tally_that_counts_a_layer_s_missing_experts_is_refused_and_changes_nothing():
    view = LoadView(2, [2, 4], 2)
    view.update(tally_of(padded([[1, 1], [1, 1, 1, 1]], 4)))
    before = view.state_dict()
    with pytest.raises(ValueError, match=r"experts a layer does not have \(experts per layer \[2, 4\]\)"):
        view.update(tally_of(padded([[1, 1, 5], [1, 1, 1, 1]], 4)))
    after = view.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if isinstance(before[k], torch.Tensor))
    assert view.steps == 1


def test_a_smaller_ep_group_is_copied_across_the_view_devices():
    # layer 0: 2 experts on ep_size 1 (every rank holds both); layer 1: 4 experts on ep_size 2
    view = LoadView(2, [2, 4], [1, 2])
    assert view.G == 2 and view.copies_L.tolist() == [2, 1]
    # without device tallies a copied layer's load is split evenly over its copies
    view.update(tally_of(padded([[6, 2], [1, 2, 3, 6]], 4)))
    assert view.pressure_LG.tolist() == [[4.0, 4.0], [3.0, 9.0]]
    # with them (each rank tallies its own copy) the exact load: rank 0 routed 7 tokens, rank 1 one
    exact = LoadView(2, [2, 4], [1, 2])
    exact.update(tally_of(padded([[6, 2], [1, 2, 3, 6]], 4), device_LG=[[7.0, 1.0], [3.0, 9.0]]))
    assert exact.pressure_LG.tolist() == [[7.0, 1.0], [3.0, 9.0]]
    # an expert with copies: the mean of its devices; padded experts 0
    x_LG = torch.tensor([[1.0, 3.0], [5.0, 7.0]])
    assert exact.expert_device_mean(x_LG).tolist() == [[2.0, 2.0, 0.0, 0.0], [5.0, 5.0, 7.0, 7.0]]


def test_ep_sizes_that_do_not_divide_the_largest_are_refused():
    with pytest.raises(ValueError, match=r"must divide the largest \(3\), got \[2, 3\]"):
        LoadView(2, 6, [2, 3])
    with pytest.raises(ValueError, match=r"num_experts \(\[2, 3\]\) must be divisible by num_devices \(2\)"):
        LoadView(2, [2, 3], 2)


def test_the_bias_of_a_padded_layer_moves_as_the_layer_alone_would_and_padding_stays_zero():
    counts = padded([[6, 2], [1, 2, 3, 6]], 4)
    cross = torch.tensor([[5.0, 1.0], [2.0, 6.0]])
    view = LoadView(2, [2, 4], 2)
    bias = bias_update(torch.zeros(2, 4), counts, cross, view.expert_device_mean(cross), rate=0.1, device_weight=1.0,
                       mask_LE=view.mask_LE)
    assert bias[0, 2:].tolist() == [0.0, 0.0]
    for layer, width in ((0, 2), (1, 4)):
        alone = bias_update(torch.zeros(1, width), counts[layer:layer + 1, :width], cross[layer:layer + 1],
                            cross[layer:layer + 1, view.layer_map(layer)], rate=0.1, device_weight=1.0)
        assert torch.allclose(bias[layer, :width], alone[0], atol=1e-15)
        assert abs(float(bias[layer, :width].sum())) < 1e-12
    assert bias[0, :2].tolist() == pytest.approx([-0.1, 0.1])   # expert 0: more routes and on the hot device
    # a layer whose steps do not sum to 0 (3 experts in a row of 4): re-centred over its own 3 experts only
    mask = torch.tensor([[True, True, True, False]])
    three = bias_update(torch.zeros(1, 4), torch.tensor([[1.0, 1.0, 7.0, 0.0]]), torch.ones(1, 2), torch.ones(1, 4),
                        rate=0.3, device_weight=0.0, mask_LE=mask)
    alone = bias_update(torch.zeros(1, 3), torch.tensor([[1.0, 1.0, 7.0]]), torch.ones(1, 2), torch.ones(1, 3),
                        rate=0.3, device_weight=0.0)
    assert three[0, :3].tolist() == pytest.approx(alone[0].tolist()) and three[0, 3] == 0
    assert three[0, :3].tolist() == pytest.approx([0.2, 0.2, -0.4])       # steps +0.3, +0.3, -0.3 less their mean


class SizedGate:
    """A BalancedGate of `experts` experts: routes the given expert ids (on the given view devices)."""

    def __init__(self, experts, devices=0):
        self.num_experts = experts
        self.tally = LayerTally(experts, devices)
        self.controls = LayerControls(experts)

    def forward(self, experts_T, devices_T=None):
        self.tally.add_routes(experts_T[:, None], l_aux=torch.tensor(1.0),
                              device_TK=None if devices_T is None else devices_T[:, None])


def config(**block):
    return EasyBalanceConfig.from_ds_config({"easybalance": {"warmup_batches": 1, **block}})


def test_the_balancer_packs_layers_of_different_sizes_into_one_reduce_and_controls_each_at_its_size():
    gates = [SizedGate(2), SizedGate(4), SizedGate(8)]
    reduced = []
    balancer = Balancer(config(mode="balance", aux={"policy": "bias_cross_layer", "bias_rate": 0.05}), gates,
                        ModelShape([2, 4, 8], [2, 2, 2]), reduce=lambda t: reduced.append(t.clone()))
    assert balancer.num_experts == 8 and balancer.experts_L == [2, 4, 8]
    for _ in range(3):
        gates[0].forward(torch.tensor([0, 0, 0, 1]))
        gates[1].forward(torch.tensor([3, 3, 2, 1]))
        gates[2].forward(torch.tensor([7, 7, 7, 0]))
        balancer.step()
    assert len(reduced) == 3 and reduced[0].shape == (3, TallyLayout(8).width)     # one reduce per step
    assert balancer.view.last.routed_LE.tolist()[0] == [3.0, 1.0] + [0.0] * 6
    assert balancer.view.pressure_LG.tolist() == [pytest.approx(r) for r in ([3.0, 1.0], [1.0, 3.0], [1.0, 3.0])]
    for gate in gates:       # each gate: a bias of its own size, its own layer's expert -> device map
        ctl = gate.controls
        assert ctl.bias_E.shape == (gate.num_experts, ) and ctl.bias_E.abs().sum() > 0
        assert ctl.expert_to_device_E.tolist() == balancer.view.layer_map(gates.index(gate)).tolist()
    assert balancer.controller.bias_LE[0, 2:].abs().sum() == 0 and balancer.controller.bias_LE[1, 4:].abs().sum() == 0
    record = balancer.log.record(balancer)
    assert [len(row) for row in record["expert_counts_LE"]] == [2, 4, 8]
    assert all(s > 0 for s in record["bias_spread"])
    # the state round-trips into a balancer of the same shapes, and not into one of other shapes
    twin = Balancer(config(mode="balance", aux={"policy": "bias_cross_layer", "bias_rate": 0.05}),
                    [SizedGate(2), SizedGate(4), SizedGate(8)], ModelShape([2, 4, 8], [2, 2, 2]))
    twin.load_state_dict(balancer.state_dict())
    assert torch.equal(twin.controller.bias_LE, balancer.controller.bias_LE)
    assert torch.equal(twin.view.pressure_LG, balancer.view.pressure_LG)
    other = Balancer(config(mode="observe"), [SizedGate(4), SizedGate(2), SizedGate(8)], ModelShape([4, 2, 8], [2, 2, 2]))
    assert "experts_L per layer is [2, 4, 8], this model's [4, 2, 8]" in other.why_unfit(balancer.state_dict())


def test_gates_of_smaller_ep_groups_tally_their_copy_and_the_view_takes_the_exact_device_load():
    # 2 ranks: layer 0 = 2 experts on ep_size 1 (copy 0 on rank 0, copy 1 on rank 1), layer 1 = 4 experts on ep 2
    ranks = [[SizedGate(2, 2), SizedGate(4, 2)] for _ in range(2)]
    balancers = [Balancer(config(mode="observe"), gates, ModelShape([2, 4], [1, 2])) for gates in ranks]
    routes = {0: torch.tensor([0, 0, 1]), 1: torch.tensor([1])}
    rows = []
    for rank, gates in enumerate(ranks):
        gates[0].forward(routes[rank], torch.full_like(routes[rank], rank))     # this rank's copy is view device `rank`
        experts = torch.tensor([0, 3, 3])
        gates[1].forward(experts, experts // 2)
        rows.append(balancers[rank].gather())
    total = rows[0] + rows[1]                                                 # what the all-reduce gives
    tally = Tally.unpack(total, 4, 2)
    view = balancers[0].view
    view.update(tally)
    assert view.pressure_LG.tolist() == [[3.0, 1.0], [2.0, 4.0]]
    assert view.last.routed_LE.tolist() == [[2.0, 2.0, 0.0, 0.0], [2.0, 0.0, 0.0, 4.0]]


def test_a_short_row_widens_into_the_padded_layout_field_by_field():
    tally = LayerTally(2, 2)
    tally.add_routes(torch.tensor([[0, 0], [1, -1]]), routed_E=torch.tensor([2.0, 1.0]),
                     logit_sums_T=torch.tensor([0.0, float("inf")]),
                     l_aux=torch.tensor(0.5), device_TK=torch.tensor([[1, 1], [0, -1]]))
    wide = Tally.unpack(widen_row(tally.take(), 2, 5, 2)[None], 5, 2)
    assert wide.routed_LE.tolist() == [[2.0, 1.0, 0.0, 0.0, 0.0]] and wide.kept_LE.tolist() == [[2.0, 1.0, 0, 0, 0]]
    assert wide.device_LG.tolist() == [[1.0, 2.0]] and wide.tokens_L.tolist() == [2.0]
    assert wide.nonfinite_L.tolist() == [1.0] and wide.aux_L.tolist() == [0.5] and wide.forwards_L.tolist() == [1.0]
    with pytest.raises(ValueError, match="does not fit"):
        widen_row(torch.zeros(TallyLayout(5).width), 5, 2)


def test_a_pr_moe_balance_log_is_refused_as_a_trace_with_the_reason(tmp_path):
    import json

    from eb_deepspeed import load_trace
    (tmp_path / "balance.jsonl").write_text(json.dumps({"step": 1, "expert_counts_LE": [[3, 1], [1, 1, 1, 1]]}) + "\n")
    with pytest.raises(ValueError, match=r"different expert counts \(\[2, 4\], a PR-MoE run\)"):
        load_trace(str(tmp_path))


def test_serving_refuses_layers_of_different_shapes_before_deepspeed_is_touched():
    import torch.distributed as dist
    from deepspeed.moe.layer import MoE

    import eb_deepspeed
    model = torch.nn.ModuleList([MoE(8, torch.nn.Linear(8, 8), num_experts=n, ep_size=1, k=1) for n in (2, 4)])
    with pytest.raises(ValueError, match=r"serving needs every MoE layer to have the same num_experts and ep_size .*"
                                         r"0: 2 experts, ep_size 1, 1: 4 experts, ep_size 1\. Nothing was changed"):
        eb_deepspeed.init_inference(model, config={"easybalance": {"mode": "balance"}})
    assert not dist.is_initialized()          # it never reached deepspeed.init_distributed
