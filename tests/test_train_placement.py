"""Training-time expert placement under DeepSpeed's real AutoEP (`easybalance.train_placement`): experts and their
optimizer state re-placed over gloo EP ranks, routing untouched — losses and gradients equal plain AutoEP's."""
import json

import pytest
import torch

pytestmark = pytest.mark.distributed


def run(tmp_path, scenario, world_size=2, **params):
    from conftest import launch
    return launch(scenario, world_size, tmp_path, worker="autoep_worker.py", **params)


# Equal, not bit-identical: an expert's rows sit at another offset of its rank's grouped GEMM after a move, and the
# GEMM may block its sum over them differently (fp32 rounding); k = 2 combines add two terms, in either order alike.
# The bounds below are what the runs must hold; the first runs here differed by about a tenth of them.
def assert_close(a, b, what, rtol=1e-5, atol=1e-6):
    assert a.keys() == b.keys(), what
    for key in a:
        assert torch.allclose(a[key].float(), b[key].float(), rtol=rtol, atol=atol), \
            f"{what} {key}: {float((a[key].float() - b[key].float()).abs().max())}"


def assert_same_training(plain: dict, placed: dict, atol: float = 1e-6, rtol: float = 1e-6, mean_atol=None):
    losses = torch.stack(plain["losses"]), torch.stack(placed["losses"])
    assert torch.allclose(*losses, rtol=rtol, atol=0), ((losses[0] - losses[1]) / losses[0]).abs().max()
    assert len(plain["grads"]) == len(placed["grads"])
    for step, (a, b) in enumerate(zip(plain["grads"], placed["grads"])):
        assert_close(a, b, f"gradient of micro-batch {step}", atol=1e-7)
    assert_close(plain["params"], placed["params"], "weights after 5 steps", atol=atol)
    if mean_atol is not None:       # most weights as plain's, whatever a few did
        diff = torch.cat([(plain["params"][k].float() - placed["params"][k].float()).abs().flatten() for k in plain["params"]])
        assert float(diff.mean()) <= mean_atol, float(diff.mean())


@pytest.mark.parametrize("world, ep, zero, accum, bf16", [(2, 2, 0, 2, False), (2, 2, 2, 2, False), (2, 2, 1, 1, False),
                                                         (4, 4, 0, 2, False), (4, 2, 2, 1, True)])
def test_three_re_placements_keep_plain_autoeps_losses_gradients_and_weights(tmp_path, world, ep, zero, accum, bf16):
    for rank in run(tmp_path, "placement", world, zero=zero, accum=accum, ep=ep, bf16=bf16):
        plain, placed = rank["plain"], rank["placed"]
        assert placed["applied"] == [True] * 4
        replans, moves, moved_bytes, failed = placed["moves"]
        assert replans == 4 and moves > 0 and moved_bytes > 0 and failed == 0
        assert len(plain["grads"]) == (5 * accum if zero == 0 else 0)
        # bf16 weights: a one-ulp difference in a bf16 weight is 2^-8 relative
        assert_same_training(plain, placed, atol=1e-2 if bf16 else 1e-6)


@pytest.mark.parametrize("fault", ["verify", "read"])
def test_a_move_that_fails_on_one_rank_keeps_every_rank_on_the_old_placement_and_state(tmp_path, fault):
    for rank in run(tmp_path, "placement", 2, zero=0, accum=1, ep=2, fault=fault):
        plain, placed = rank["plain"], rank["placed"]
        assert placed["applied"] == [True, False, True, True]       # the second move failed, on every rank
        assert placed["moves"][3] == 1
        assert_same_training(plain, placed)


@pytest.mark.parametrize("zero, replicas", [(0, 0), (2, 1)])
def test_the_view_re_places_hot_experts_by_itself_and_checkpoints_stay_in_autoeps_layout(tmp_path, zero, replicas):
    for rank in run(tmp_path, "placement_auto", 2, zero=zero, replicas=replicas):
        assert rank["slots"] == 2 + replicas and torch.allclose(torch.stack(rank["plain"]),
                                                                 torch.stack(rank["placed"]), rtol=1e-6, atol=0)
        if replicas:     # each micro-batch's replica balances the ranks from the first step (expert 0: half the routes)
            assert max(max(r) for r in rank["ratios"]) <= 1.1, rank["ratios"]
        else:
            before, after = max(rank["ratios"][1]), max(rank["ratios"][-1])
            assert rank["replans"] >= 1 and after < 0.8 * before, rank["ratios"]
            assert not torch.equal(rank["phy2log"], torch.arange(4).expand(2, 4))   # still placed after the save
        # a checkpoint written with replicas (homes only, AutoEP's layout) resumes in plain AutoEP with equal
        # losses, and in a placed engine at another replica count (1 <-> 0)
        placed, plain, fresh = rank["next"]      # two steps on from the checkpoint: weights, then moments
        assert plain == pytest.approx(placed, rel=1e-6) and fresh == pytest.approx(placed, rel=1e-6)
    records = [json.loads(line) for line in open(f"{rank['records']}/balance.jsonl")]
    assert max(r.get("replans", 0) for r in records) >= 1 and max(r.get("moved_bytes", 0) for r in records) > 0 \
        or replicas
    from eb_deepspeed.observe.monitor import flatten_record
    from eb_deepspeed.observe.report import summary_panels
    assert "replans" in summary_panels(records)                       # the moves beside the balance curves
    assert {"easybalance/replans", "easybalance/moved_bytes"} <= set(flatten_record(records[-1]))   # and in W&B



@pytest.mark.parametrize("world, ep, zero, victim", [(2, 2, 0, 1), (2, 2, 2, 0), (4, 2, 2, 3)])
def test_a_move_that_fails_anywhere_on_one_rank_leaves_every_rank_on_the_old_placement_without_a_hang(
        tmp_path, world, ep, zero, victim):
    # (4, 2, 2): EP 2 x expert data parallelism 2 under ZeRO 2, where reading a moved expert's state is a
    # collective over its data-parallel peers
    ranks = run(tmp_path, "placement_faults", world, zero=zero, ep=ep, victim=victim)
    for rank in ranks:
        assert rank["applied"] == [False] * 4 + [True]       # prepare, transfer, post, write failed; then a move
        assert rank["unchanged"] == [True] * 4 and rank["failed_moves"] == 4
        losses = rank["losses"]
        assert losses["placed"] == pytest.approx(losses["plain"], rel=1e-6)
        assert "at_home" in rank["refused"]                         # state_dict() of a placed model: refused
        assert rank["export_max_diff"] <= 1e-6 and rank["still_placed"]
    plain, placed = (torch.load(path, weights_only=True) for path in ranks[0]["exported"])
    assert plain.keys() == placed.keys()
    assert max(float((plain[k].float() - placed[k].float()).abs().max()) for k in plain) <= 1e-6


def test_an_optimizer_whose_step_reads_a_whole_tensor_is_refused_at_initialize(tmp_path):
    for rank in run(tmp_path, "placement_refuses", 2):
        assert "Adafactor is not one eb_deepspeed knows to" in rank["error"] and "AdamW" in rank["error"]


@pytest.mark.parametrize("world, ep, zero, accum, bf16, freeze", [
    (2, 2, 0, 2, False, False), (2, 2, 2, 2, False, False), (2, 2, 1, 1, True, False), (4, 4, 0, 1, False, False),
    (4, 2, 2, 2, True, False), (2, 2, 0, 1, False, True)])
def test_replicas_keep_plain_autoeps_losses_gradients_and_weights(tmp_path, world, ep, zero, accum, bf16, freeze):
    for rank in run(tmp_path, "replicas", world, zero=zero, accum=accum, ep=ep, bf16=bf16, freeze=freeze):
        plain, placed = rank["plain"], rank["placed"]
        assert placed["applied"] == [True] * 4
        # bf16: a replica's gradient is its own GEMM's bf16 sum before it is added to its home's (plain: one GEMM's),
        # so the losses drift by about 1e-4 relative; a weight whose gradient is near zero can take Adam's step (about
        # lr = 1e-2: m / sqrt(v) ~ +-1) the other way, up to 2 x lr a step: at most 0.1 apart after 5 steps, the
        # mean weight within 1e-3. Frozen experts leave the embeddings' gradients near zero, where Adam's step turns
        # the fp32 rounding of the split's other grouping (gradients within 1e-7, checked) into ~1e-5 on the weights
        assert_same_training(plain, placed, atol=0.1 if bf16 else 1e-4 if freeze else 1e-6,
                             rtol=5e-4 if bf16 else 1e-6, mean_atol=1e-3 if bf16 else None)
        H = 4 // ep
        assert {len(r) for r in plain["rows"]} == {H} and {len(r) for r in placed["rows"]} == {H + 1}
        assert sum(r[-1] for r in placed["rows"]) > 0                            # replicas computed routes


def test_a_plain_autoep_model_beside_ours_is_untouched_and_a_failed_forward_leaves_no_replica_rows(tmp_path):
    for rank in run(tmp_path, "isolation", 2):
        assert rank["module_untouched"] and rank["layers_untouched"]      # DeepSpeed's count exchange, its layers
        assert torch.equal(torch.stack(rank["alone"]), torch.stack(rank["beside"]))      # bit for bit
        assert "raised" in rank and rank["shapes"][0] == rank["shapes"][1]               # [H, ...] as before
        assert all(torch.isfinite(x) for x in rank["after"]) and rank["saved"]


@pytest.mark.parametrize("fault, zero, bf16", [("fetch", 0, False), ("grad", 2, False), ("fetch", 1, True)])
def test_a_replica_transfer_that_fails_on_one_rank_stops_every_rank_before_the_step_and_training_goes_on(
        tmp_path, fault, zero, bf16):
    what = "fetching replica weights" if fault == "fetch" else "sending replica gradients home"
    for index, rank in enumerate(run(tmp_path, "replica_fault", 2, fault=fault, zero=zero, bf16=bf16)):
        assert "a replica transfer failed" in rank["error"] and rank["unchanged"]       # raised, nothing stepped
        says = f"{what} failed on rank 1: RuntimeError: injected" if index == 1 else "on another rank"
        assert says in rank["error"]
        # caught: DeepSpeed's optimizer whole (ZeRO 1/2 too), the failed batch's gradients dropped
        assert rank["steps"] == (3, 3)
        assert rank["losses"]["placed"] == pytest.approx(rank["losses"]["plain"], rel=5e-4 if bf16 else 1e-6)
        assert rank["weights_max_diff"] <= (0.05 if bf16 else 1e-5)


def test_replica_slots_beside_eval_generate_serving_and_a_size_they_cannot_fill(tmp_path):
    for rank in run(tmp_path, "replicas_beside", 2):
        assert rank["eval_max_diff"] <= 1e-5 and rank["generated"][0] == rank["generated"][1]   # the homes compute
        assert "replica_slots (1)" in rank["serve_refused"] and "loads its checkpoint" in rank["serve_refused"]
        assert rank["served_max_diff"] <= 1e-5                              # a permutation: home, AutoEP's layout
        assert "replica_slots (20000) must be <= 2 for 4 experts over 2 EP ranks" in rank["slots_20000"]
        assert "replica_slots (70000) must be <= 65535" in rank["slots_70000"]
