"""CrossLayerGate against DeepSpeed's TopKGate, in one process: same routing, plus tallies."""
import itertools

import pytest
import torch
from deepspeed.moe.experts import Experts
from deepspeed.moe.sharded_moe import MOELayer, TopKGate

from eb_deepspeed import CrossLayerGate, LoadView
from eb_deepspeed.core.tally import Tally

pytestmark = pytest.mark.unit
M, E = 16, 8


def taken(gate) -> Tally:
    """The gate's tally since the last call, by name."""
    return Tally.unpack(gate.tally.take()[None], E)


def pair(k, **kw):
    torch.manual_seed(0)
    ds = TopKGate(M, E, k=k, **kw)
    return ds, CrossLayerGate.from_topk_gate(ds, layer_index=0)


def call(gate, x, seed, sparse, used_token=None):
    torch.manual_seed(seed)
    return gate(x, used_token, True, False) if sparse else gate(x, used_token)


def assert_same(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        if isinstance(u, torch.Tensor):
            assert torch.equal(u, v)
        else:
            assert u == v


CASES = list(itertools.product([1, 2, 3], [True, False], [True, False]))  # k, drop_tokens, sparse


@pytest.mark.parametrize("k, drop_tokens, sparse", CASES)
def test_routing_and_l_aux_equal_deepspeeds_topkgate(k, drop_tokens, sparse):
    ds, eb = pair(k, capacity_factor=1.0, eval_capacity_factor=1.5, min_capacity=2, drop_tokens=drop_tokens)
    x = torch.randn(64, M)
    for training in (True, False):
        ds.train(training), eb.train(training)
        assert_same(call(ds, x, 1, sparse), call(eb, x, 1, sparse))


@pytest.mark.parametrize("policy, use_rts", [("Jitter", True), ("RSample", False), (None, True)])
def test_noisy_gate_policies_and_rts_draw_the_same_random_numbers_as_deepspeed(policy, use_rts):
    ds, eb = pair(1, noisy_gate_policy=policy, use_rts=use_rts, min_capacity=2)
    x = torch.randn(64, M)
    assert_same(call(ds, x, 7, True), call(eb, x, 7, True))
    assert_same(call(ds, x, 7, False), call(eb, x, 7, False))


def test_sparse_and_dense_returns_describe_the_same_routing():
    for k in (1, 2, 3):
        _, eb = pair(k, min_capacity=2)
        x = torch.randn(48, M)
        l_s, C, _, idx_KT, loc_KT, gates_KT, counts_s = call(eb, x, 3, True)
        l_d, combine_TEC, dispatch_TEC, counts_d = call(eb, x, 3, False)
        assert torch.equal(l_s, l_d) and torch.equal(counts_s, counts_d) and int(C) == combine_TEC.shape[2]
        rebuilt = torch.zeros_like(combine_TEC)
        for kk in range(idx_KT.shape[0]):
            t = torch.nonzero(idx_KT[kk] >= 0).squeeze(1)
            rebuilt[t, idx_KT[kk, t].long(), loc_KT[kk, t].long()] += gates_KT[kk, t]
        assert torch.allclose(rebuilt, combine_TEC, atol=1e-6)


@pytest.mark.parametrize("k, sparse", [(1, True), (2, True), (3, True), (2, False)])
def test_the_tally_holds_demand_kept_routes_and_tokens(k, sparse):
    _, eb = pair(k, capacity_factor=0.5, min_capacity=1)
    x = torch.randn(40, M)
    out = call(eb, x, 5, sparse)
    part = taken(eb)
    assert part.routed_LE[0].tolist() == out[-1].double().tolist()
    if sparse:
        kept = torch.bincount(out[3][out[3] >= 0].long(), minlength=E)
    else:
        kept = out[2].any(2).sum(0)
    assert part.kept_LE[0].tolist() == kept.double().tolist()
    assert part.tokens_L.item() == 40 and part.nonfinite_L.item() == 0
    assert part.kept_LE.sum() < part.routed_LE.sum()  # capacity factor 0.5 drops routes
    assert eb.tally.take().abs().sum() == 0  # taking the tally resets it


def test_the_gate_accumulates_over_micro_batches_and_only_in_training():
    _, eb = pair(2, min_capacity=2)
    x = torch.randn(32, M)
    call(eb, x, 0, True)
    call(eb, x, 1, True)
    eb.eval()
    call(eb, x, 2, True)
    part = taken(eb)
    assert part.tokens_L.item() == 64 and part.routed_LE.sum().item() == 128


def test_the_device_loss_is_one_when_devices_are_balanced_and_hand_derived_otherwise():
    from eb_deepspeed.core.controls import device_balance_loss
    e2d = torch.tensor([0, 0, 1, 1])
    # uniform router, 2 tokens x top-1 spread one per device: f' = [1, 1], P' = [1/2, 1/2] -> 1
    logits = torch.zeros(2, 4)
    two = torch.tensor([2, 2])                          # experts on each device
    assert device_balance_loss(logits.softmax(1), torch.tensor([1, 0, 1, 0]), e2d, two, 1).item() == pytest.approx(1.0)
    # both routes on device 0: f = [4, 0, 0, 0] * ... f_e = routed_e * E / (k T) = [4, 0, 0, 0]; f' = [2, 0];
    # P' = [1/2, 1/2] -> 1.0; with the router leaning to device 0 (P' = [0.8, 0.2]) -> 1.6
    assert device_balance_loss(logits.softmax(1), torch.tensor([2, 0, 0, 0]), e2d, two, 1).item() == pytest.approx(1.0)
    lean = torch.log(torch.tensor([[0.4, 0.4, 0.1, 0.1]])).expand(2, 4)
    assert device_balance_loss(lean.softmax(1), torch.tensor([2, 0, 0, 0]), e2d, two, 1).item() == pytest.approx(1.6)


def test_the_device_loss_weight_adds_the_device_loss_and_pushes_probability_off_the_hot_device():
    from eb_deepspeed.core.controls import device_balance_loss
    ds, eb = pair(2, min_capacity=2)
    x = torch.randn(32, M)
    plain = call(eb, x, 0, True)
    assert_same(plain, call(ds, x, 0, True))            # weight 0: DeepSpeed's output, nothing computed
    e2d = torch.arange(E) // (E // 2)
    eb.controls.set_device_map(e2d)
    eb.controls.device_loss_weight = 0.7
    out = call(eb, x, 0, True)
    logits = torch.nn.functional.linear(x, eb.wg.weight)
    extra = device_balance_loss(logits.softmax(1), out[6], e2d, torch.tensor([E // 2, E // 2]), 2)
    assert torch.allclose(out[0], plain[0] + 0.7 * extra)
    assert_same(out[1:], plain[1:])                     # routing untouched
    eb.wg.weight.grad = None
    (out[0] - plain[0].detach()).backward()             # the device term's gradient alone
    routed_G = torch.zeros(2).index_add_(0, e2d, out[6].float())
    hot = int(routed_G.argmax())
    with torch.no_grad():                               # a small step down the gradient
        eb.wg.weight -= 0.5 * eb.wg.weight.grad
    probs_after = torch.softmax(torch.nn.functional.linear(x, eb.wg.weight), 1).mean(0)
    probs_before = torch.softmax(logits, 1).mean(0)
    assert probs_after[e2d == hot].sum() < probs_before[e2d == hot].sum()
    eb.eval()
    assert_same(call(eb, x, 0, True), call(ds.eval(), x, 0, True))   # never in eval: no loss to weigh


def test_nonfinite_logits_are_counted_and_keep_the_layer_out_of_the_view():
    _, eb = pair(2, min_capacity=2)
    x = torch.randn(32, M)
    x[3, 0] = float("nan")
    x[9, 1] = float("inf")
    call(eb, x, 0, True)
    part = taken(eb)
    assert part.nonfinite_L.item() == 2
    view = LoadView(1, E, 2)
    assert view.update(part).tolist() == [False]
    assert view.pressure_LG.abs().sum() == 0 and torch.isfinite(view.heat_LE).all()


@pytest.mark.parametrize("k, drop_tokens", [(1, True), (2, True), (2, False), (3, True)])
def test_an_empty_batch_gives_a_well_formed_result_through_deepspeeds_moe_layer(k, drop_tokens):
    torch.manual_seed(0)
    gate = CrossLayerGate(M, E, k=k, min_capacity=4, drop_tokens=drop_tokens)
    layer = MOELayer(gate, Experts(torch.nn.Linear(M, M), E, "ep_size_1"), "ep_size_1", 1, E)
    x = torch.randn(2, 0, M, requires_grad=True)
    out = layer(x, None)  # MoE.forward passes (hidden_states, used_token)
    assert out.shape == (2, 0, M)
    (out.sum() + layer.l_aux).backward()
    assert layer.l_aux.item() == 0.0
    assert gate.wg.weight.grad is not None and gate.wg.weight.grad.abs().sum() == 0
    assert gate.tally.take().abs().sum() == 0  # nothing counted, nothing poisoned
    l_aux, combine_TEC, dispatch_TEC, counts = gate(torch.randn(0, M))
    assert combine_TEC.shape[0] == 0 and counts.tolist() == [0] * E


def test_from_topk_gate_keeps_the_parameter_object_and_its_name():
    ds, eb = pair(2, capacity_factor=1.25, eval_capacity_factor=2.0, min_capacity=3, drop_tokens=False,
                  use_rts=False, noisy_gate_policy="Jitter")
    assert eb.wg is ds.wg
    assert [n for n, _ in eb.named_parameters()] == [n for n, _ in ds.named_parameters()] == ["wg.weight"]
    assert (eb.k, eb.capacity_factor, eb.eval_capacity_factor, eb.min_capacity, eb.drop_tokens, eb.use_rts,
            eb.noisy_gate_policy) == (2, 1.25, 2.0, 3, False, False, "Jitter")
    with pytest.raises(TypeError, match="expected deepspeed TopKGate, got Linear"):
        CrossLayerGate.from_topk_gate(torch.nn.Linear(2, 2), 0)


def test_no_gate_buffer_name_mentions_expert():
    _, eb = pair(2)
    assert not [n for n, _ in eb.named_buffers() if "expert" in n]
    assert list(eb.state_dict()) == ["wg.weight"]


@pytest.mark.parametrize("k, sparse", list(itertools.product([1, 2, 3], [True, False])))
def test_the_selection_bias_changes_which_experts_are_chosen_but_never_the_gate_values(k, sparse):
    _, eb = pair(k, capacity_factor=float(E), min_capacity=1, use_rts=False)  # capacity >= T: nothing dropped
    x = torch.randn(64, M)
    probs = torch.softmax(eb.wg(x), 1)
    eb.controls.set_bias(torch.zeros(E).index_fill_(0, torch.tensor([3]), 50.0))  # expert 3 wins every first choice
    out = call(eb, x, 0, sparse)
    if sparse:
        idx_KT, gates_KT = out[3].long(), out[5]
        assert (idx_KT == 3).any(0).all()
        chosen = probs.gather(1, idx_KT.t()).t()
        expected = chosen if k == 1 else chosen / chosen.sum(0, keepdim=True)
        assert torch.allclose(gates_KT, expected)
    else:
        picked_TE = out[1].sum(2)
        sel = picked_TE > 0
        assert sel[:, 3].all()
        expected = probs * sel if k == 1 else probs * sel / (probs * sel).sum(1, keepdim=True)
        assert torch.allclose(picked_TE, expected)
    # l_aux from the unbiased mean probabilities and the (biased) first choices, DeepSpeed's formula
    me = probs.mean(0)
    if k == 2:
        ce = torch.nn.functional.one_hot(torch.full((64, ), 3), E).float().mean(0)
        assert torch.allclose(out[0], (me * ce).mean() * E * E)
    else:
        ce = out[-1].float() / 64
        assert torch.allclose(out[0], (me * ce).sum() * E if k == 1 else (me * ce).mean() * E * E / k)


@pytest.mark.parametrize("k, drop_tokens, sparse", CASES)
def test_a_zero_bias_routes_exactly_like_deepspeed(k, drop_tokens, sparse):
    ds, eb = pair(k, capacity_factor=1.0, min_capacity=2, drop_tokens=drop_tokens)
    eb.controls.set_bias(torch.zeros(E))
    x = torch.randn(64, M)
    theirs, ours = call(ds, x, 4, sparse), call(eb, x, 4, sparse)
    for a, b in zip(theirs, ours):
        assert torch.allclose(a, b, atol=1e-7) if isinstance(a, torch.Tensor) and a.is_floating_point() \
            else (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b)


def test_the_gate_uses_its_selection_bias_and_counts_the_biased_routes():
    _, eb = pair(2, min_capacity=2, capacity_factor=float(E))
    eb.controls.set_bias(torch.zeros(E).index_fill_(0, torch.tensor([5]), 50.0))
    out = call(eb, torch.randn(32, M), 0, True)
    assert (out[3] == 5).any(0).all()
    part = taken(eb)
    assert part.kept_LE[0, 5].item() == 32 and part.forwards_L.item() == 1
    assert part.aux_L.item() == pytest.approx(out[0].item())


def test_swapping_a_gate_draws_no_random_number():
    ds, _ = pair(2)
    torch.manual_seed(11)
    expected = torch.rand(4)
    torch.manual_seed(11)
    CrossLayerGate.from_topk_gate(ds, layer_index=0)
    assert torch.equal(torch.rand(4), expected)


def _checkpointed_layer(kind):
    torch.manual_seed(0)
    gate = CrossLayerGate(M, E, k=2, min_capacity=2, capacity_factor=float(E))
    layer = MOELayer(gate, Experts(torch.nn.Linear(M, M), E, "ep_size_1"), "ep_size_1", 1, E).train()
    x = torch.randn(1, 24, M, requires_grad=True)
    if kind == "none":
        return gate, layer(x, None)
    if kind == "deepspeed":
        import deepspeed
        return gate, deepspeed.checkpointing.checkpoint(lambda h: layer(h, None), x)
    return gate, torch.utils.checkpoint.checkpoint(lambda h: layer(h, None), x, use_reentrant=kind == "reentrant")


@pytest.mark.parametrize("kind", ["deepspeed", "reentrant", "non_reentrant"])
def test_under_activation_checkpointing_each_route_is_counted_once(kind):
    plain_gate, plain_out = _checkpointed_layer("none")
    plain_out.sum().backward()
    expected = taken(plain_gate)
    gate, out = _checkpointed_layer(kind)
    out.sum().backward()          # re-runs the gate's forward during backward
    assert gate.wg.weight.grad is not None and gate.wg.weight.grad.abs().sum() > 0
    part = taken(gate)
    assert part.tokens_L.item() == 24 and part.forwards_L.item() == 1
    assert torch.equal(part.routed_LE, expected.routed_LE) and torch.equal(part.kept_LE, expected.kept_LE)


@pytest.mark.parametrize("mode", ["observe", "balance"])
def test_moe_layers_whose_ep_sizes_do_not_nest_are_refused_before_anything_changes(mode):
    # layers may differ in num_experts and ep_size (PR-MoE), but an ep_size that does not divide the largest
    # (2 and 3 on 6 ranks) has no place in one [layers x devices] view: a clear error naming each layer, raised
    # before the gates are swapped and before deepspeed.initialize (which would need a process group)
    import eb_deepspeed
    from deepspeed.moe.layer import MoE
    model = torch.nn.ModuleList([MoE(8, torch.nn.Linear(8, 8), num_experts=6, ep_size=e, k=1) for e in (2, 3)])
    with pytest.raises(ValueError, match=r"ep_size must divide the largest \(3\) .* 0: 6 experts, ep_size 2, 1: 6 experts, "
                                         r"ep_size 3\. Nothing was changed"):
        eb_deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                config={"train_micro_batch_size_per_gpu": 1, "easybalance": {"mode": mode}})
    assert all(type(m.deepspeed_moe.gate) is TopKGate for m in model)
