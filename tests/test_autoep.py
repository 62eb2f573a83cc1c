"""Hugging Face MoE models under DeepSpeed's real AutoEP on 2 gloo ranks: observe equals plain AutoEP, the tally
equals an independent count (checkpointing, accumulation, padding, eval forwards), every preset family trains
in balance mode, checkpoints round-trip the balancer at ZeRO 0 and 3."""
import pytest
import torch

pytestmark = pytest.mark.distributed


def run(tmp_path, scenario, world_size=2, **params):
    from conftest import launch
    return launch(scenario, world_size, tmp_path, worker="autoep_worker.py", **params)


def assert_same(a: dict, b: dict, what: str):
    assert a.keys() == b.keys(), what
    for key in a:
        assert torch.equal(a[key], b[key]), f"{what}: {key} differs"


@pytest.mark.parametrize("family, zero, accum", [("qwen3_moe", 3, 2)])    # Mixtral: every other AutoEP test
def test_observe_and_no_block_give_plain_autoeps_losses_gradients_and_weights(tmp_path, family, zero, accum):
    for rank in run(tmp_path, "equivalence", family=family, zero=zero, accum=accum):
        plain = rank["plain"]
        assert not plain["has_balancer"] and not rank["no_block"]["has_balancer"] and rank["observe"]["has_balancer"]
        assert rank["observe"]["routed"] > 0                 # observe did watch
        for name in ("no_block", "observe"):
            assert [float(x) for x in rank[name]["losses"]] == [float(x) for x in plain["losses"]], name
            assert len(rank[name]["grads"]) == len(plain["grads"])
            for step, (g, g_plain) in enumerate(zip(rank[name]["grads"], plain["grads"])):
                assert_same(g, g_plain, f"{name} micro-step {step} grads")
            assert_same(rank[name]["params"], plain["params"], f"{name} weights after 3 steps")
        if zero == 0:
            assert len(plain["grads"]) == 3 * accum and plain["grads"][0]


def test_tensor_parallel_folding_counts_each_token_once_and_gives_the_unfolded_models_gradients(tmp_path):
    # 4 ranks, autotp_size 2 x autoep_size 2 (tensor-parallel peers route the same tokens) against 2 unfolded ranks
    # fed the same data-parallel batches
    folded, unfolded = run(tmp_path, "folded", 4, tp=2), run(tmp_path, "folded", 2, tp=1)
    plain = folded[0]["plain"]
    for rank in folded:
        same = unfolded[rank["dp_rank"]]
        assert rank["observe"]["losses"] == rank["plain"]["losses"]        # observe: bit-identical to plain folding
        for g, g_plain in zip(rank["observe"]["router_grads"], rank["plain"]["router_grads"]):
            assert torch.equal(g, g_plain)
        assert_same(rank["observe"]["params"], rank["plain"]["params"], "observe weights after 3 steps")
        for name in ("balance", ):
            # each token counted once: the view of the unfolded job, and half of what the 4 ranks' routers chose
            own_world = [sum(r[name]["own"][step] for r in folded) for step in range(3)]
            for step in range(3):
                assert torch.equal(rank[name]["view"][step], own_world[step] / 2), f"{name} step {step}"
                assert torch.equal(rank[name]["view"][step], same[name]["view"][step]), f"{name} step {step}"
            # the balance loss's gradient on the routers: the unfolded model's (and not zero)
            for layer, (g, g_unfolded) in enumerate(zip(rank[name]["router_grads"], same[name]["router_grads"])):
                torch.testing.assert_close(g, g_unfolded, rtol=1e-5, atol=1e-9, msg=f"{name} router {layer}")
                assert (g - rank["plain"]["router_grads"][layer]).abs().max() > 1e-5
            assert torch.equal(rank[name]["bias"][-1], folded[0][name]["bias"][-1])     # one bias on every rank
            assert rank[name]["bias"][-1].abs().sum() > 0
            assert rank[name]["losses"] == pytest.approx(same[name]["losses"], rel=1e-5)
    assert plain["losses"] != folded[0]["balance"]["losses"]


@pytest.mark.parametrize("family, checkpointing, accum, pad", [
    ("mixtral", "non_reentrant", 2, True),
    ("deepseek_v3", "reentrant", 1, True),        # sigmoid scores, a reentrant re-run
])
def test_the_view_counts_each_route_of_the_routers_once(tmp_path, family, checkpointing, accum, pad):
    ranks = run(tmp_path, "tally", family=family, checkpointing=checkpointing, accum=accum, pad=pad)
    for rank in ranks:
        for step, (view_LE, own_LE) in enumerate(zip(rank["view"], rank["own"])):
            assert own_LE.sum() > 0
            assert torch.equal(view_LE, own_LE), f"{family} step {step}: view {view_LE} vs routes {own_LE}"
        # tokens of one step over both ranks: 2 rows x 16 per micro-batch, minus 5 padded per micro-batch
        assert rank["tokens"] == 2 * accum * (2 * 16 - (5 if pad else 0))
        assert max(rank["spreads"][-1]) > 0                  # the default policy's bias moved
        assert all(torch.isfinite(torch.tensor(rank["losses"])))
    assert ranks[0]["spreads"] == ranks[1]["spreads"]        # one view, the same controls on every rank


@pytest.mark.parametrize("zero", [3])
def test_a_checkpoint_round_trips_the_balancer_and_plain_autoep_loads_it(tmp_path, zero):
    for rank in run(tmp_path, "checkpoint", family="mixtral", zero=zero):
        saved, loaded = rank["saved"], rank["loaded"]
        assert rank["path"] is not None and rank["client_step"] == 4 and rank["plain_path"] is not None
        assert saved["view"]["steps"] == loaded["view"]["steps"] == 4
        for key in ("heat_LE", "pressure_LG"):
            assert torch.equal(saved["view"][key], loaded["view"][key]), key
        assert torch.equal(saved["aux"]["bias_LE"], loaded["aux"]["bias_LE"]) and saved["aux"]["bias_LE"].abs().sum() > 0
        for layer, bias_E in enumerate(rank["bias_of_gates"]):      # the restored bias reached every router
            assert torch.equal(bias_E.double(), loaded["aux"]["bias_LE"][layer].float().double())
        assert rank["fresh_loss"] == pytest.approx(rank["next_loss"], rel=1e-5)   # same model, same state


@pytest.mark.parametrize("to", [4, 1])
def test_a_checkpoint_resumes_at_another_ep_size_with_the_expert_state_and_a_rebuilt_device_state(tmp_path, to):
    # saved at autoep_size 2 on 4 ranks; resumed at `to` through DeepSpeed's universal checkpoint (ZeRO 3) and by a
    # plain resume of the module (ZeRO 0)
    for rank in run(tmp_path, "resize", 4, to=to):
        for name in ("universal", "plain"):
            got, saved = rank[name], rank[name]["saved"]
            assert got["path"] is not None and got["G"] == to and saved["view"]["shape"] == (2, 4, 2)
            for key in ("heat_LE", "updates_L"):
                assert torch.equal(got["state"]["view"][key], saved["view"][key]), f"{name} {key}"
            assert got["state"]["view"]["steps"] == saved["view"]["steps"] == 3
            for key in ("bias_LE", "log_w_L"):
                assert torch.equal(got["state"]["aux"][key], saved["aux"][key]), f"{name} {key}"
            assert saved["aux"]["bias_LE"].abs().sum() > 0
            for layer, bias_E in enumerate(got["bias_of_gates"]):     # the carried bias reached every router
                assert torch.equal(bias_E.double(), saved["aux"]["bias_LE"][layer].float().double())
            heat_LE = saved["view"]["heat_LE"]     # rebuilt: each expert's heat on its rank at the new size
            assert torch.allclose(got["state"]["view"]["pressure_LG"], heat_LE.view(2, to, 4 // to).sum(2))
            assert len(got["warned"]) == 1 and f"EP ranks per layer 2 -> {to}" in got["warned"][0]
            # the same weights and bias route the next batch as the saved engine did
            assert got["loss"] == pytest.approx(got["saved_next_loss"], rel=1e-5)
        assert "(layers, experts, devices) = (2, 4, 2), this model has (3, 4, " in rank["refused"]
        assert "Nothing was loaded" in rank["refused"] and rank["untouched"]
