"""PR-MoE (DeepSpeed-MoE's Pyramid-Residual MoE: more experts in deeper layers, a residual dense branch)
with real DeepSpeed engines on gloo ranks: plain equivalence, identical views, checkpoints, EP 1 vs 2,
EP groups of different sizes. The model is examples/moe_lm.py's with per-layer expert counts."""
import pytest
import torch

from eb_deepspeed.core.tally import Tally

from test_distributed import assert_tensors_equal

pytestmark = pytest.mark.distributed

PR_MOE = {"experts": [2, 4]}          # DeepSpeed's TestPRMoE shape: 2 then 4 experts, ep_size 2
PYRAMID = {"layers": 3, "experts": [2, 4, 8]}


def test_pr_moe_seeded_once_as_a_user_runs_it_is_bit_identical_in_observe_and_balance(run_dist):
    for rank in run_dist("user_equivalence", 2, residual=True, model=PR_MOE):
        params = rank["plain"]["params"]
        assert any("coefficient" in name for name in params)                   # the residual branch is there
        assert {n.split(".deepspeed_experts.")[1].split(".")[0] for n in params if "blocks.1.moe" in n
                and ".deepspeed_experts." in n} == {"0", "1"}                   # 4 experts / 2 ranks in layer 1
        for name in ("observe", "balance"):
            assert [float(x) for x in rank[name]["losses"]] == [float(x) for x in rank["plain"]["losses"]], name
            assert_tensors_equal(rank[name]["params"], rank["plain"]["params"], name)


def test_layers_of_2_4_and_8_experts_train_with_the_view_identical_on_every_rank(run_dist):
    steps = 4
    ranks = run_dist("view", 2, accum=1, steps=steps, mode="balance", policy="bias_cross_layer", model=PYRAMID)
    first = ranks[0]
    view = first["view"]
    assert view["heat_LE"].shape == (3, 8) and view["pressure_LG"].shape == (3, 2)
    for rank_index, rank in enumerate(ranks):
        for key in ("pressure_LG", "heat_LE", "updates_L", "last_tally", "bias_LE", "log_w_L"):
            assert torch.equal(rank["view"][key], view[key]), f"rank {rank_index} {key}"
    last = Tally.unpack(view["last_tally"], 8)
    tokens = 2 * 4 * 16
    assert last.tokens_L.tolist() == [tokens] * 3
    # every route of each layer went to one of its own experts: padding stays empty, demand = tokens * k
    assert last.routed_LE.sum(1).tolist() == [tokens * 2] * 3
    assert last.routed_LE[0, 2:].abs().sum() == 0 and last.routed_LE[1, 4:].abs().sum() == 0
    assert view["bias_LE"][0, 2:].abs().sum() == 0 and view["bias_LE"][1, 4:].abs().sum() == 0
    gate_bias = view["gate_bias"]
    assert [b.shape[0] for b in gate_bias] == [2, 4, 8]
    for layer, b in enumerate(gate_bias):          # each gate holds its layer's row of the controller's bias
        assert torch.equal(b.double(), view["bias_LE"][layer, :b.shape[0]].float().double())
    # top-2 of 2 experts routes every token to both: layer 0 is balanced by construction and its bias stays 0
    assert gate_bias[0].abs().sum() == 0 and gate_bias[1].abs().sum() > 0 and gate_bias[2].abs().sum() > 0
    assert all(w > 0 for w in view["gate_device_loss"])                        # the device loss per layer, own map
    metrics = first["metrics"]
    assert len(metrics["expert_max_over_mean"]) == 3 and all(m >= 1 for m in metrics["expert_max_over_mean"])


@pytest.mark.parametrize("policy", ["bias", "cross_layer"])
def test_a_pr_moe_checkpoint_restores_the_view_and_controls_exactly(run_dist, policy):
    for rank in run_dist("checkpoint", 2, policy=policy, model=PR_MOE):
        assert rank["loaded"] and rank["plain_loaded"]
        for key in ("pressure_LG", "heat_LE", "updates_L", "bias_LE", "log_w_L"):
            assert torch.equal(rank["restored"][key], rank["saved"][key]), key
            assert torch.equal(rank["after_b"][key], rank["after_a"][key]), key
        assert rank["saved"]["heat_LE"].shape == (2, 4)


def test_pr_moe_on_ep_size_1_and_2_gives_the_same_losses_and_gradients(run_dist):
    ranks = run_dist("ep_equivalence", 2, drop_tokens=False, model=PR_MOE)
    local = {"blocks.0.moe": 1, "blocks.1.moe": 2}                   # 2 and 4 experts over 2 ranks
    for rank_index, rank in enumerate(ranks):
        ep1, ep2 = rank["ep1"], rank["ep2"]
        assert torch.allclose(ep1["loss"], ep2["loss"], atol=1e-6)
        checked = 0
        for name, g2 in ep2["grads"].items():
            if ".deepspeed_experts." in name:
                head, tail = name.split(".deepspeed_experts.")
                i, rest = tail.split(".", 1)
                nle = local[head.rsplit(".deepspeed_moe.experts", 1)[0]]
                g1 = ep1["grads"][f"{head}.deepspeed_experts.{rank_index * nle + int(i)}.{rest}"]
                checked += 1
            else:
                g1 = ep1["grads"][name]
            assert torch.allclose(g1, g2, atol=1e-6, rtol=1e-5), name
        assert checked == 4 * (1 + 2)              # up and down, weight and bias, of each of this rank's 1 + 2 experts


def test_ep_groups_of_two_sizes_get_the_exact_device_load_and_stay_bit_identical_to_plain(run_dist):
    # layer 0: 2 experts on ep_size 1 (each rank holds both: a copy per rank), layer 1: 4 experts on ep_size 2, top-1;
    # rank 0 routes 64 tokens, rank 1 32, so an even split of layer 0's load over its copies would be wrong
    ranks = run_dist("mixed_ep", 2)
    k, tokens = 1, (64, 32)
    for name in ("observe", "balance"):
        for rank in ranks:
            assert rank[name]["experts_L"] == [2, 4] and rank[name]["devices_L"] == [1, 2]
        for step in range(3):
            first = ranks[0][name]["views"][step]
            for other in ranks[1:]:
                for key in ("pressure_LG", "heat_LE", "last_tally", "bias_LE"):
                    assert torch.equal(other[name]["views"][step][key], first[key]), f"{name} step {step} {key}"
            last = Tally.unpack(first["last_tally"], 4, 2)
            # layer 0: each rank's routes stay on its own copy; layer 1: experts 0-1 on rank 0, 2-3 on rank 1
            assert last.device_LG[0].tolist() == [tokens[0] * k, tokens[1] * k]
            counts = [rank[name]["counts"][step] for rank in ranks]
            layer1 = sum(c[1] for c in counts).double()
            assert last.device_LG[1].tolist() == [float(layer1[:2].sum()), float(layer1[2:].sum())]
            assert last.routed_LE[0].tolist() == (counts[0][0] + counts[1][0]).double().tolist()
        assert ranks[0][name]["last_load_LG"][0].tolist() == [64.0, 32.0]
        assert ranks[0][name]["metrics"]["device_max_over_mean"][0] == pytest.approx(64 / 48)
    bias = ranks[0]["balance"]["views"][-1]["gate_bias"]
    assert [b.shape[0] for b in bias] == [2, 4] and all(b.abs().sum() > 0 for b in bias)
    for rank in ranks:   # observe changes nothing; balance with bias changes routing after its first step
        assert [float(x) for x in rank["observe"]["losses"]] == [float(x) for x in rank["plain"]["losses"]]
        assert_tensors_equal(rank["observe"]["params"], rank["plain"]["params"], "observe params")
