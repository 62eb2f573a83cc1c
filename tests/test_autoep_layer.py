"""The AutoEP adapter's per-layer logic in one process, on DeepSpeed's real `TokenChoiceTopKRouter`: the
tally, the selection bias, the attached balance loss, checkpoint re-runs; and the refusals made before
DeepSpeed touches a model."""
import pytest
import torch
import torch.nn.functional as F
from deepspeed.moe.ep_router import TokenChoiceTopKRouter
from torch import nn
from torch.utils.checkpoint import checkpoint

from eb_deepspeed.adapters.autoep import AutoEPBalance, attach_loss, check_versions, expert_to_device
from eb_deepspeed.core.controls import device_balance_loss
from eb_deepspeed.core.tally import Tally

pytestmark = pytest.mark.unit
H, E, K, T = 16, 8, 2, 64


class Layer(nn.Module):
    """What AutoEPBalance reads of an AutoEPMoELayer, and its call `self.router(x, self.expert_bias)`."""

    def __init__(self, score_func="softmax", correction=None):
        super().__init__()
        self.router = TokenChoiceTopKRouter(H, E, None, None, K, score_func, route_norm=True, route_scale=1.0,
                                            gate_bias=False)
        if correction is not None:         # as AutoEP copies DeepSeek's pretrained buffer
            del self.router.e_score_correction_bias
            self.router.register_buffer("e_score_correction_bias", correction)
        self.num_experts, self.top_k, self.expert_bias = E, K, None

    def forward(self, x):
        return self.router(x, self.expert_bias)


def make(score_func="softmax", balance=True, correction=None, scale=lambda: 1.0, coeff=0.1):
    torch.manual_seed(0)
    layer = Layer(score_func, correction)
    gate = AutoEPBalance(layer, 0, loss_coeff=coeff, grad_scale=scale, balance=balance)
    return layer, gate


def counts(gate) -> Tally:
    return Tally.unpack(gate.tally.take()[None], E)


def test_the_tally_counts_every_route_of_a_training_forward_once_and_no_eval_or_no_grad_forward():
    layer, gate = make()
    x = torch.randn(T, H)
    _, selected, _ = layer(x)
    with torch.no_grad():
        layer(x)                     # a no-grad forward in training mode: not training steps
    layer.eval()
    layer(x)
    tally = counts(gate)
    expected = torch.bincount(selected.flatten(), minlength=E).double()
    assert torch.equal(tally.routed_LE[0], expected) and torch.equal(tally.kept_LE[0], expected)
    assert float(tally.tokens_L[0]) == T and float(tally.forwards_L[0]) == 1


def test_padding_tokens_stay_out_of_the_tally():
    layer, gate = make()
    x = torch.randn(T, H)
    valid_T = torch.arange(T) % 4 != 0
    gate.valid_T = valid_T
    _, selected, _ = layer(x)
    tally = counts(gate)
    assert torch.equal(tally.routed_LE[0], torch.bincount(selected[valid_T].flatten(), minlength=E).double())
    assert float(tally.tokens_L[0]) == int(valid_T.sum())


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_counts_each_route_once(reentrant):
    layer, gate = make()
    x = torch.randn(T, H, requires_grad=True)
    top, selected, _ = checkpoint(layer, x, use_reentrant=reentrant)
    (top.sum() * 1.0).backward()
    tally = counts(gate)
    assert torch.equal(tally.routed_LE[0], torch.bincount(selected.flatten(), minlength=E).double())
    assert float(tally.forwards_L[0]) == 1


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_the_bias_moves_the_top_k_as_biased_logits_and_never_the_gate_values(score_func):
    layer, gate = make(score_func)
    x = torch.randn(T, H)
    bias_E = torch.linspace(-0.3, 0.3, E)
    gate.controls.set_bias(bias_E)
    top, selected, _ = layer(x)
    logits = layer.router.gate(x).float()
    # the same choice as the top-k of the biased logits (sets: AutoEP's top-k is unsorted)
    want = (logits + bias_E).topk(K, dim=1).indices.sort(1).values
    assert torch.equal(selected.sort(1).values, want)
    assert not torch.equal(want, logits.topk(K, dim=1).indices.sort(1).values)   # the bias did move some
    scores = F.softmax(logits, 1) if score_func == "softmax" else torch.sigmoid(logits)
    unbiased = scores.gather(1, selected)
    torch.testing.assert_close(top, unbiased / unbiased.sum(1, keepdim=True), rtol=0, atol=1e-6)


def test_a_pretrained_score_correction_bias_is_kept_and_ours_adds_to_it():
    correction_E = torch.linspace(0.2, -0.2, E)
    layer, gate = make("sigmoid", correction=correction_E.clone())
    x = torch.randn(T, H)
    bias_E = torch.linspace(-0.3, 0.3, E)
    gate.controls.set_bias(bias_E)
    _, selected, _ = layer(x)
    logits = layer.router.gate(x).float()
    want = (torch.sigmoid(logits + bias_E) + correction_E).topk(K, dim=1).indices.sort(1).values
    assert torch.equal(selected.sort(1).values, want)
    assert torch.equal(layer.router.e_score_correction_bias, correction_E)   # untouched
    assert layer.expert_bias is None                                          # AutoEP's own: still off


def test_the_balance_loss_reaches_the_router_with_its_weights_and_leaves_the_forward_unchanged():
    torch.manual_seed(0)
    plain = Layer()                                           # the same weights, no hooks
    layer, gate = make(coeff=0.1, scale=lambda: 0.5)         # 0.5: e.g. two gradient-accumulation steps
    gate.controls.set_device_map(torch.arange(E) // (E // 2))
    gate.controls.device_loss_weight = 3.0
    x = torch.randn(T, H)
    top, selected, _ = layer(x)
    top_plain, selected_plain, _ = plain(x)
    assert torch.equal(top, top_plain) and torch.equal(selected, selected_plain)
    top.sum().backward()
    # by hand: the user's loss (sum of top) plus 0.5 x 0.1 x (expert-level + 3 x device-level)
    probs = F.softmax(plain.router.gate(x).float(), 1)
    routed = torch.bincount(selected.flatten(), minlength=E)
    own = device_balance_loss(probs, routed, torch.arange(E), torch.ones(E), K)           # one expert per "device"
    device = device_balance_loss(probs, routed, torch.arange(E) // (E // 2), torch.tensor([E // 2, E // 2]), K)
    (top_plain.sum() + 0.5 * 0.1 * (own + 3.0 * device)).backward()
    torch.testing.assert_close(layer.router.gate.weight.grad, plain.router.gate.weight.grad, rtol=1e-5, atol=1e-7)
    assert float(counts(gate).aux_L[0]) == pytest.approx(float(own.detach()), rel=1e-6)   # unweighted, in the record


def test_observe_attaches_nothing():
    layer, gate = make(balance=False)
    x = torch.randn(T, H, requires_grad=True)
    out = layer(x)
    assert out[0].grad_fn.name() != "_AttachLossBackward"
    assert float(counts(gate).routed_LE.sum()) == T * K


def test_attach_loss_passes_the_activation_and_adds_the_scaled_loss_gradient():
    w = torch.tensor(2.0, requires_grad=True)
    a = torch.ones(3, requires_grad=True)
    out = attach_loss(a, w * w, lambda: 0.25)
    assert torch.equal(out, a)
    out.sum().backward()
    assert float(w.grad) == pytest.approx(0.25 * 2 * 2.0) and torch.equal(a.grad, torch.ones(3))


def test_the_expert_map_comes_from_autoeps_placement_descriptor():
    class Placed:
        expert_placement_descriptor = {"num_experts": 4, "ranks": [{"rank": 0, "experts": [0, 3]},
                                                                   {"rank": 1, "experts": [1, 2]}]}
    assert expert_to_device(Placed()).tolist() == [0, 1, 1, 0]
    Placed.expert_placement_descriptor = {"num_experts": 4, "ranks": [{"rank": 0, "experts": [0, 1]},
                                                                      {"rank": 1, "experts": [1, 2]}]}
    with pytest.raises(ValueError, match="expert 1 on two ranks"):
        expert_to_device(Placed())


def test_a_broken_deepspeed_transformers_pair_is_named():
    with pytest.raises(ImportError, match=r"0\.19\.8.*5\.23\.0.*5\.22\.2"):
        check_versions("0.19.8", "5.23.0")
    check_versions("0.19.8", "5.22.2")
    check_versions("0.20.0", "5.23.0")


def test_loss_coeff_on_a_deepspeed_moe_model_warns_that_it_does_nothing_there():
    import eb_deepspeed
    with pytest.warns(UserWarning, match=r"easybalance\.aux\.loss_coeff has no effect on deepspeed\.moe"), \
            pytest.raises(ValueError, match="no deepspeed.moe.layer.MoE layers"):
        eb_deepspeed.initialize(model=nn.Linear(2, 2), config={"easybalance": {"aux": {"loss_coeff": 0.5}}})


@pytest.mark.parametrize("ds_config, message", [
    ({"zero_optimization": {"stage": 3}, "expert_parallel": {"enabled": True, "autoep_size": 2}},
     r"train_placement supports ZeRO stages 0-2.*Nothing was changed"),
    ({"bf16": {"enabled": True}, "expert_parallel": {"enabled": True, "autoep_size": 2}},
     r"train_placement at ZeRO 0 .* use ZeRO 1 or 2 for bf16.*Nothing was changed"),
    ({}, r"train_placement re-places the experts of AutoEP layers.*Nothing was changed")])
def test_training_placement_is_refused_where_it_cannot_move_experts_before_deepspeed_starts(ds_config, message):
    import eb_deepspeed
    block = {"easybalance": {"mode": "observe", "train_placement": {"enabled": True}}}
    with pytest.raises(ValueError, match=message):
        eb_deepspeed.initialize(model=nn.Linear(2, 2), config={**ds_config, **block})


def test_a_non_finite_score_correction_bias_counts_every_token_as_non_finite():
    # DeepSeek-V3's pretrained bias with a NaN: AutoEP then routes every token by NaN scores (2 of 4 experts, every
    # step). Before: no warning, the layer stayed in the view and the bias kept pushing; now the tally flags it
    correction_E = torch.linspace(0.2, -0.2, E)
    correction_E[3] = float("nan")
    layer, gate = make("sigmoid", correction=correction_E)
    layer(torch.randn(T, H))
    tally = counts(gate)
    assert float(tally.nonfinite_L[0]) == T and float(tally.tokens_L[0]) == T
    finite_layer, finite_gate = make("sigmoid", correction=torch.linspace(0.2, -0.2, E))
    finite_layer(torch.randn(T, H))
    assert float(counts(finite_gate).nonfinite_L[0]) == 0
