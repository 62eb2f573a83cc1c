"""Real DeepSpeed engines in real processes (gloo, CPU): equivalence, view identity, checkpoints, errors."""
import os

import pytest
import torch
from conftest import launch

from eb_deepspeed.core.tally import Tally

pytestmark = pytest.mark.distributed


def assert_tensors_equal(a, b, what):
    assert a.keys() == b.keys(), what
    for key in a:
        assert torch.equal(a[key], b[key]), f"{what}: {key} differs"


@pytest.mark.parametrize("accum, residual", [(2, False)])     # the residual branch: test_pr_moe.py
def test_disabled_and_observe_mode_give_plain_deepspeeds_losses_and_gradients(run_dist, accum, residual):
    # residual: DeepSpeed-MoE's residual MoE (use_residual=True: a dense MLP and its coefficient beside the experts)
    for rank in run_dist("equivalence", 2, accum=accum, residual=residual):
        plain = rank["plain"]
        assert any("coefficient" in name for name in plain["params"]) == residual
        assert plain["gate"] == "TopKGate" and not plain["has_balancer"]
        for name in ("no_block", "disabled"):
            assert rank[name]["gate"] == "TopKGate" and not rank[name]["has_balancer"]
        for name in ("observe", "balance"):
            assert rank[name]["gate"] == "CrossLayerGate" and rank[name]["has_balancer"]
        for name in ("no_block", "disabled", "observe", "balance"):
            assert [float(x) for x in rank[name]["losses"]] == [float(x) for x in plain["losses"]], name
            for step, (g, g_plain) in enumerate(zip(rank[name]["grads"], plain["grads"])):
                assert g and g.keys() == g_plain.keys()
                assert_tensors_equal(g, g_plain, f"{name} step {step} grads")
            assert_tensors_equal(rank[name]["params"], plain["params"], f"{name} params after 3 steps")


@pytest.mark.parametrize("drop_tokens", [True])     # with drops: the capacity differs between the EP sizes
def test_ep_size_1_and_2_give_the_same_losses_and_gradients(run_dist, drop_tokens):
    ranks = run_dist("ep_equivalence", 2, drop_tokens=drop_tokens)
    for rank_index, rank in enumerate(ranks):
        ep1, ep2 = rank["ep1"], rank["ep2"]
        assert torch.allclose(ep1["loss"], ep2["loss"], atol=1e-6)
        local = 2  # 4 experts over 2 ranks
        checked_experts = 0
        for name, g2 in ep2["grads"].items():
            if ".deepspeed_experts." in name:
                head, tail = name.split(".deepspeed_experts.")
                i, rest = tail.split(".", 1)
                g1 = ep1["grads"][f"{head}.deepspeed_experts.{rank_index * local + int(i)}.{rest}"]
                checked_experts += 1
            else:
                g1 = ep1["grads"][name]
            assert torch.allclose(g1, g2, atol=1e-6, rtol=1e-5), name
        assert checked_experts > 0


BF16_ZERO2 = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}


@pytest.mark.parametrize("world_size, accum, ds", [(4, 3, {}), (2, 1, BF16_ZERO2)])
def test_every_rank_holds_the_same_view_updated_once_per_accumulation_boundary(run_dist, world_size, accum, ds):
    # ZeRO steps the torch optimizer once per parameter group: the hook still runs once per step
    steps = 3
    ranks = run_dist("view", world_size, accum=accum, steps=steps, ds=ds)
    first = ranks[0]
    assert first["optimizer"] == ("DeepSpeedZeroOptimizer" if ds else "SGD")
    # one update per boundary: after micro-step m the hook has run m // accum times
    assert first["counts"] == [(m + 1) // accum for m in range(steps * accum)]
    assert first["view"]["steps"] == steps and first["view"]["updates_L"].tolist() == [steps, steps]
    # the reduction spans every EP x DP rank and every micro-batch: tokens = ranks * accum * batch * seq
    last = Tally.unpack(first["view"]["last_tally"], 4)
    assert last.tokens_L.tolist() == [world_size * accum * 4 * 16] * 2
    assert last.forwards_L.tolist() == [world_size * accum] * 2
    assert first["rank_to_node"] == [0] * world_size
    assert first["view"]["pressure_LG"].sum() > 0
    for rank_index, rank in enumerate(ranks):
        for key in ("pressure_LG", "heat_LE", "updates_L", "last_tally"):
            assert torch.equal(rank["view"][key], first["view"][key]), f"rank {rank_index} {key}"
    # data differs per rank, so routes differ per rank; the view is the sum, not rank 0's copy
    assert ranks[0]["metrics"]["tokens"] == world_size * accum * 4 * 16


def test_controls_change_only_at_accumulation_boundaries_and_are_identical_on_every_rank(run_dist):
    accum, steps = 2, 4
    ranks = run_dist("view", 2, accum=accum, steps=steps, mode="balance", policy="bias_cross_layer")
    controls = ranks[0]["controls"]
    changed = [m for m in range(1, len(controls))
               if not (torch.equal(controls[m][0], controls[m - 1][0]) and torch.equal(controls[m][1], controls[m - 1][1]))]
    # micro-step m (0-based) ends a boundary when (m + 1) % accum == 0; warm-up 1 -> every boundary acts
    assert changed == [m for m in range(1, steps * accum) if (m + 1) % accum == 0]
    log_w_L, bias_LE = controls[-1]       # the per-layer device-loss weights' integrator, the bias
    assert abs(float(log_w_L.exp().mean()) - 1.0) < 1e-9 and not torch.equal(log_w_L, torch.zeros_like(log_w_L))
    assert bias_LE.abs().sum() > 0 and bias_LE.sum(1).abs().max() < 1e-9
    for rank in ranks[1:]:
        for (w, b), (w0, b0) in zip(rank["controls"], controls):
            assert torch.equal(w, w0) and torch.equal(b, b0)
    view = ranks[0]["view"]
    assert ranks[1]["view"]["device_loss_weight"] == view["device_loss_weight"]
    assert view["device_loss_weight"] == [float(x) for x in log_w_L.exp()]
    assert view["gate_device_loss"] == view["device_loss_weight"]     # what the gates use
    assert all(torch.equal(g.double(), b.float().double()) for g, b in zip(view["gate_bias"], view["bias_LE"]))


def test_checkpoint_round_trip_restores_the_view_and_controls_and_the_next_step_matches(run_dist):
    ranks = run_dist("checkpoint", 2, policy="bias_cross_layer")
    for rank in ranks:
        assert rank["loaded"]
        for key in ("pressure_LG", "heat_LE", "updates_L", "last_tally", "bias_LE", "log_w_L"):
            assert torch.equal(rank["restored"][key], rank["saved"][key]), key
            assert torch.equal(rank["after_b"][key], rank["after_a"][key]), f"next step {key}"
        assert rank["restored"]["steps"] == rank["saved"]["steps"] == 3
        assert rank["restored"]["gate_device_loss"] == rank["saved"]["gate_device_loss"]
        # the controller acted before the save: weights are not all 1, the bias not all 0
        assert rank["saved"]["device_loss_weight"] != [1.0, 1.0]
        assert abs(sum(rank["saved"]["device_loss_weight"]) / 2 - 1.0) < 1e-9
        assert rank["saved"]["bias_LE"].abs().sum() > 0
        assert all(torch.equal(g.double(), b.float().double()) for g, b in
                   zip(rank["restored"]["gate_bias"], rank["restored"]["bias_LE"]))
        assert torch.equal(rank["saved"]["log_w_L"], ranks[0]["saved"]["log_w_L"])  # same on every rank
        assert torch.equal(rank["saved"]["bias_LE"], ranks[0]["saved"]["bias_LE"])
        assert rank["client"]["user_key"] == 42 and "easybalance" not in rank["client"]  # ours is taken out
        # the same engine reloaded at a step its hook had already seen still updates on the next step
        for key in ("pressure_LG", "heat_LE", "updates_L", "last_tally", "log_w_L", "bias_LE"):
            assert torch.equal(rank["after_reload"][key], rank["after_a"][key]), f"reload {key}"
        assert rank["after_reload"]["steps"] == 4
        assert rank["plain_loaded"] and "easybalance" in rank["plain_client_keys"]


def test_a_checkpoint_of_another_ep_size_resumes_expert_by_expert_and_one_of_other_layers_stops_before_loading(
        run_dist):
    for rank in run_dist("checkpoint_mismatch", 2):
        other = rank["relayout"]
        saved, resumed = other["saved"], other["resumed"]
        assert other["loaded"]
        # what does not depend on the EP size carries over: heat, bias, per-layer weights, the step count
        for key in ("heat_LE", "updates_L", "bias_LE", "log_w_L"):
            assert torch.equal(resumed[key], saved[key]), key
        assert resumed["steps"] == saved["steps"] == 3 and saved["bias_LE"].abs().sum() > 0
        # the device pressure is rebuilt for one EP rank: every expert's heat on it
        assert saved["pressure_LG"].shape == (2, 2) and torch.equal(resumed["pressure_LG"],
                                                                    saved["heat_LE"].sum(1, keepdim=True))
        assert resumed["last_tally"].abs().sum() == 0
        assert len(other["warned"]) == 1 and "EP ranks per layer 2 -> 1" in other["warned"][0]
        assert "rebuilt" in other["warned"][0] and other["steps_after_train"] == 4
        # layers differ: refused before DeepSpeed loads anything; loaded without the balancer state when asked
        assert rank["error"] is not None and "Nothing was loaded" in rank["error"]
        assert "(layers, experts, devices) = (3, 4, 2), this model has (2, 4, 2)" in rank["error"]
        assert '"checkpoint": "ignore_mismatch"' in rank["error"]
        assert rank["untouched"] and rank["view_kept"]          # not one parameter or view entry overwritten
        assert rank["loaded"] and rank["shared_compared"] > 0   # ignore_mismatch: the model's weights are the saved ones
        assert len(rank["warned"]) == 1 and "(3, 4, 2)" in rank["warned"][0]
        assert rank["steps_after_load"] == 0 and rank["steps_after_train"] == 1


def test_steps_deepspeed_skips_and_batches_the_user_skips_leave_no_counts_behind(run_dist):
    for rank in run_dist("skipped_steps", 2):
        (g0, v0), (g1, v1) = rank["before"], rank["after"]
        assert g1 == g0 + 1 and v1 == v0                     # DeepSpeed counted the step, the optimizer skipped it
        assert rank["params_equal"]                          # so both runs hold the same weights
        for key in ("last_tally", "heat_LE", "pressure_LG", "updates_L"):
            assert torch.equal(rank["view"][key], rank["reference"][key]), key
        assert rank["view"]["steps"] == rank["reference"]["steps"] >= 2


def test_a_rank_with_another_config_makes_every_rank_raise_instead_of_hanging(run_dist):
    for rank in run_dist("disagree", 2):
        assert rank["error"] is not None
        assert "disagrees with rank" in rank["error"] and "ema_alpha" in rank["error"]


def test_a_killed_rank_ends_its_peers_job_in_seconds_and_the_view_keeps_its_last_good_step(run_dist):
    rank0, rank1 = run_dist("killed_rank", 2, exit_codes={1: 3})
    assert rank1 is None and rank0["error"] is not None
    assert rank0["seconds"] < 120        # gloo's own timeout is 30 minutes: the error came from the dead peer
    assert rank0["steps"] == 2           # the step in progress never reached the view


def test_a_kill_during_save_checkpoint_resumes_from_the_last_complete_state_or_refuses_clearly(tmp_path):
    # default tags, rank 0 killed writing `latest` (before: `latest` left empty, no resume);
    # one fixed tag, rank 0 killed half-way through the model file (before: a torn file loaded as far as it went)
    ckpts = {"latest": str(tmp_path / "default_tags" / "ckpt"), "model": str(tmp_path / "fixed_tag" / "ckpt")}
    for where, tag in (("latest", None), ("model", "fixed")):
        launch("torn_save", 2, tmp_path, exit_codes={0: -9, 1: 4}, timeout=240, where=where, tag=tag, ckpt=ckpts[where])
    for rank in launch("torn_resume", 2, tmp_path, timeout=240, ckpts=ckpts):
        default = rank["latest"]
        assert default["error"] is None and default["path"].endswith(os.path.join("global_step2", "mp_rank_00_model_states.pt"))
        assert default["global_steps"] == 2
        for key in ("heat_LE", "pressure_LG", "bias_LE", "updates_L"):
            assert torch.equal(default["state"][key], default["good"][key]), key    # the step-2 balancer state
        assert "fixed is incomplete: a save_checkpoint into it did not finish" in rank["model"]["error"]
        assert "Nothing was loaded" in rank["model"]["error"]


def test_a_nan_loss_noted_on_one_rank_is_recorded_and_the_job_goes_on(run_dist):
    ranks = run_dist("nan_note", 2)
    assert [rank["steps"] for rank in ranks] == [3, 3]
    assert ranks[1]["noted"][1] is None and ranks[0]["noted"][1] is not None
    assert all(isinstance(v, float) for v in ranks[1]["noted"][::2])


def test_ranks_that_disagree_on_whether_the_block_is_on_get_one_error_each_instead_of_a_hang(run_dist):
    ranks = run_dist("block_on_off", 2, timeout=240)
    for rank in ranks:
        for what in ("train", "serve", "patched"):
            assert "easybalance is enabled on ranks [0] and off on ranks [1]" in rank["errors"].get(what, ""), what


def test_a_log_dir_that_is_a_file_is_one_clear_error_on_every_rank(run_dist):
    ranks = run_dist("log_dir_is_a_file", 2, timeout=240)
    for rank in ranks:
        assert rank["error"] is not None and "start-up failed on rank 0: easybalance.log.dir" in rank["error"]
        assert "names a file, not a directory" in rank["error"]


def test_nonfinite_router_logits_on_one_rank_leave_every_view_finite_and_unchanged(run_dist):
    ranks = run_dist("nonfinite", 2)
    for rank in ranks:
        assert rank["nonfinite"] > 0
        assert torch.equal(rank["after"]["pressure_LG"], rank["before"]["pressure_LG"])
        assert torch.equal(rank["after"]["heat_LE"], rank["before"]["heat_LE"])
        assert torch.isfinite(rank["after"]["pressure_LG"]).all()
        assert rank["after"]["steps"] == rank["before"]["steps"] + 1
        assert torch.equal(rank["after"]["pressure_LG"], ranks[0]["after"]["pressure_LG"])
    assert ranks[0]["warned"]


@pytest.mark.parametrize("residual", [False])      # with the residual branch: test_pr_moe.py
def test_as_users_run_it_without_reseeding_observe_and_fixed_balance_equal_plain_deepspeed(run_dist, residual):
    for rank in run_dist("user_equivalence", 2, residual=residual):
        plain = rank["plain"]
        assert any("coefficient" in name for name in plain["params"]) == residual
        for name in ("observe", "balance"):
            assert [float(x) for x in rank[name]["losses"]] == [float(x) for x in plain["losses"]], name
            assert_tensors_equal(rank[name]["params"], plain["params"], f"{name} params after 4 steps")


@pytest.mark.parametrize("layout, stage_layers", [("second_stage", [[], [0, 1]])])   # a stage holding no MoE layer
def test_under_pipeline_parallelism_the_hook_fires_and_every_rank_holds_every_stages_layers(run_dist, layout,
                                                                                           stage_layers):
    ranks = run_dist("pipeline", 2, layout=layout)
    L = sum(len(layers) for layers in stage_layers)
    assert [r["engine"] for r in ranks] == ["PipelineEngine"] * 2 and [r["stage"] for r in ranks] == [0, 1]
    assert [r["layers"] for r in ranks] == stage_layers and [r["gate_layers"] for r in ranks] == stage_layers
    for rank in ranks:
        view = rank["view"]
        assert rank["num_layers"] == L and rank["global_steps"] == 3
        assert view["steps"] == 3 and view["updates_L"].tolist() == [3] * L   # once per train_batch
        # every layer's row was filled by its stage: 2 micro-batches x 2 sequences x 8 tokens
        assert Tally.unpack(view["last_tally"], 4).tokens_L.tolist() == [32.0] * L
        for key in ("pressure_LG", "heat_LE", "bias_LE"):
            assert torch.equal(view[key], ranks[0]["view"][key]), key
        # the controller acted on the whole view; each stage's gates carry their own layers' bias
        bias_LE = view["bias_LE"]
        assert bool((bias_LE.abs().sum(1) > 0).all())
        assert len(rank["gate_bias"]) == len(rank["layers"])
        for gate_bias, layer in zip(rank["gate_bias"], rank["layers"]):
            assert torch.equal(gate_bias, bias_LE[layer].float().double())
