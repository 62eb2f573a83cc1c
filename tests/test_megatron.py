"""The Megatron-Core adapter on real gloo ranks (megatron-core 0.16.1 on CPU through tests/megatron_shim.py)."""
import pytest
import torch

from eb_deepspeed import ConfigError

@pytest.fixture
def run_megatron(run_dist):
    return lambda scenario, **params: run_dist(scenario, 2, worker="megatron_worker.py", **params)


@pytest.mark.distributed
def test_observe_and_disabled_give_plain_megatrons_losses_gradients_and_parameters(run_megatron):
    ranks = run_megatron("equivalence")
    for rank in ranks:
        plain = rank["plain"]
        for variant in ("disabled", "observe", "observe_spec"):
            got = rank[variant]
            assert got["losses"] == plain["losses"], variant
            for g, g0 in zip(got["grads"], plain["grads"]):
                assert g.keys() == g0.keys() and all(torch.equal(g[k], g0[k]) for k in g), variant
            assert all(torch.equal(got["params"][k], t) for k, t in plain["params"].items()), variant
        assert rank["disabled"]["router_class"] == "TopKRouter" and not rank["disabled"]["balancer"]
        view = rank["observe"]["view"]
        assert rank["observe"]["router_class"] == "EBRouter" and rank["observe"]["built_as"] == "TopKRouter"
        assert rank["observe_spec"]["built_as"] == rank["observe_spec"]["router_class"] == "EBRouter"
        assert rank["observe_spec"]["view"]["tokens_L"].tolist() == [48.0, 48.0]
        assert view["steps"] == 3                                  # the optimizer hook: once per step
        assert view["tokens_L"].tolist() == [48.0, 48.0]           # 2 ranks x 24 tokens, each counted once
        for key in ("pressure_LG", "heat_LE"):                     # one all-reduce: every rank the same view
            assert torch.equal(view[key], ranks[0]["observe"]["view"][key])


@pytest.mark.distributed
def test_under_megatrons_activation_recompute_each_route_is_counted_once(run_megatron):
    for rank in run_megatron("recompute"):
        plain, recomputed = rank[False], rank[True]
        assert recomputed["losses"] == plain["losses"] and recomputed["steps"] == plain["steps"] == 2
        assert torch.equal(recomputed["tally"], plain["tally"])      # not doubled by the re-run in backward


@pytest.mark.distributed
def test_the_device_loss_adds_a_gradient_linear_in_its_weight(run_megatron):
    for rank in run_megatron("device_loss"):
        base, one, two = rank[0.0], rank[1.0], rank[2.0]
        extra = one - base
        assert extra.abs().sum() > 1e-6 * base.abs().sum()
        assert torch.allclose(two - base, 2.0 * extra, rtol=1e-4, atol=1e-9)


@pytest.mark.distributed
def test_the_selection_bias_changes_routes_never_the_combine_probabilities_or_the_aux_loss(run_megatron):
    for rank in run_megatron("bias"):
        plain, biased = rank[False], rank[True]
        assert not torch.equal(plain["map"], biased["map"]) and bool(biased["map"][:, 3].all())
        # each chosen expert's weight is the softmax over the token's chosen unbiased logits (top-2)
        logits = biased["logits"]
        chosen = biased["map"]
        expect = torch.where(chosen, logits, float("-inf")).softmax(1) * chosen
        assert torch.allclose(biased["probs"], expect, atol=1e-6)
        assert torch.allclose(biased["aux_grad"], plain["aux_grad"], atol=1e-9)   # aux loss from unbiased logits


@pytest.mark.distributed
def test_the_balancer_state_round_trips_through_its_state_file(run_megatron):
    for rank in run_megatron("checkpoint"):
        assert rank["loaded"] and rank["steps"] == 3
        saved, restored = rank["saved"], rank["restored"]
        for key in ("pressure_LG", "heat_LE", "updates_L"):
            assert torch.equal(restored["view"][key], saved["view"][key]), key
        assert torch.equal(restored["aux"]["bias_LE"], saved["aux"]["bias_LE"]) and saved["aux"]["bias_LE"].abs().sum() > 0
        assert torch.equal(rank["gate_bias"], saved["aux"]["bias_LE"][1].float().double())   # handed to the router


@pytest.mark.distributed
def test_a_rank_with_another_config_makes_every_rank_raise_before_any_router_changes(run_megatron):
    for rank in run_megatron("disagree"):
        assert rank["error"] is not None and "disagrees with rank" in rank["error"] and "ema_alpha" in rank["error"]
        assert rank["router_class"] == "TopKRouter"


@pytest.mark.unit
def test_a_bad_config_is_a_config_error_with_its_path_before_any_router_changes():
    from eb_deepspeed.adapters.megatron import attach
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"easybalance\.aux\.policy \('sometimes'\) must be one of"):
        attach(model, {"easybalance": {"aux": {"policy": "sometimes"}}})
    assert not hasattr(model, "easybalance")
    assert attach(model, {"easybalance": {"enabled": False}}) is None     # off: nothing attached
    with pytest.raises(ConfigError, match=r"easybalance\.ema_alpha \(2\.0\) must be in"):
        attach(model, {"ema_alpha": 2.0})                                   # the block on its own works too


@pytest.mark.unit
def test_eb_router_spec_puts_ebrouter_in_every_moe_layer_of_a_copy_and_refuses_a_dense_spec():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.router import TopKRouter

    from eb_deepspeed.adapters.megatron import EBRouter, eb_router_spec
    plain = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    spec = eb_router_spec(plain)
    assert spec.submodules.mlp.submodules.router is EBRouter
    assert plain.submodules.mlp.submodules.router is TopKRouter            # the caller's spec is left as it was
    assert eb_router_spec([plain, plain])[1].submodules.mlp.submodules.router is EBRouter
    with pytest.raises(ValueError, match="holds no MoE layer"):
        eb_router_spec(get_gpt_layer_local_spec())
