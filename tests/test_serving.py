"""Serving on real gloo ranks: replicated MoE layers, steering in the gate, re-planning between batches,
against DeepSpeed's own exact expert-parallel eval forward."""
import os

import pytest
import torch

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("world_size, replica_slots, split", [(2, 0, "view"), (2, 1, "view"), (2, 1, "exact"),
                                                              (4, 1, "view")])
def test_replicated_serving_gives_deepspeeds_outputs_through_re_plans_with_unequal_batches(
        run_dist, world_size, replica_slots, split):
    ranks = run_dist("serve_equivalence", world_size, replica_slots=replica_slots, split=split, batches=4)
    for rank in ranks:
        assert rank["S_max"] == 2 + replica_slots
        assert all(row["equal"] for row in rank["rows"]), [row["maxdiff"] for row in rank["rows"]]
    if replica_slots:   # re-plans happened, and every rank flipped to the same placement at the same batch
        assert ranks[0]["rows"][-1]["replans"] >= 1 and ranks[0]["moves"] > 0
        for b in range(4):
            assert len({r["rows"][b]["replans"] for r in ranks}) == 1
            assert all(torch.equal(r["rows"][b]["phy2log"], ranks[0]["rows"][b]["phy2log"]) for r in ranks)
        placement = ranks[0]["rows"][-1]["phy2log"]
        assert placement.shape == (2, 2 * (2 + replica_slots))    # the replicated plan serves
        for layer in placement:   # every expert keeps a live replica; no rank holds an expert twice
            assert set(layer.tolist()) >= {0, 1, 2, 3}
            for dev in layer.view(2, -1):
                live = [e for e in dev.tolist() if e >= 0]
                assert len(live) == len(set(live))
    assert os.path.exists(os.path.join(ranks[0]["log"], "balance.jsonl"))
    assert ranks[0]["metrics"]["steps"] == 4


def test_init_inference_without_a_block_is_deepspeeds_forward_made_correct(run_dist):
    for rank in run_dist("serve_no_block", 2):
        assert rank["equal"]
        for drop in (False, True):   # unequal batches serve in both drop modes (DeepSpeed aborts with drops)
            assert rank[f"finite_drop_{drop}"] and not rank[f"training_drop_{drop}"]
            assert not rank[f"has_balancer_drop_{drop}"]


def test_a_failed_weight_move_keeps_the_old_placement_on_every_rank_and_the_outputs_right(run_dist):
    ranks = run_dist("serve_move_fault", 2)
    for rank in ranks:
        assert rank["failed"] == 1
        assert all(row["equal"] for row in rank["rows"])
        first = rank["rows"][0]     # still DeepSpeed's layout: expert e in slot e
        assert first["replans"] == 0 and torch.equal(first["phy2log"], torch.arange(4).expand(2, 4))
        assert rank["replans"] >= 1          # the next re-plan went through
    for b in range(4):
        assert torch.equal(ranks[0]["rows"][b]["phy2log"], ranks[1]["rows"][b]["phy2log"])


def test_a_plain_deepspeed_checkpoint_loads_into_replicas_and_saves_back_to_the_same_tensors(run_dist):
    ranks = run_dist("serve_checkpoint", 2)
    for rank in ranks:
        assert rank["replans"] >= 1 and all(row["equal"] for row in rank["rows"])
        assert rank["latest"] == "served"
        original, saved = rank["original"], rank["saved"]
        assert set(saved) == set(original) and len(saved) == 1 + 2 * 4   # module + 2 layers x 4 experts, once each
        for name in original:
            assert original[name].keys() == saved[name].keys(), name
            for key in original[name]:
                assert torch.equal(original[name][key], saved[name][key]), f"{name}: {key}"


@pytest.mark.parametrize("split", ["view", "exact"])
def test_an_empty_batch_on_one_rank_serves_without_a_hang(run_dist, split):
    ranks = run_dist("serve_empty", 2, split=split)
    assert [row["shape"] for row in ranks[1]["rows"]] == [(1, 0, 16)] * 3
    assert all(row["equal"] for row in ranks[0]["rows"])
    assert ranks[0]["steps"] == ranks[1]["steps"] == 3
