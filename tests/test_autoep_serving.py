"""Serving Hugging Face MoE models that DeepSpeed's real AutoEP converted, on gloo ranks: replicas inside AutoEP's
own layer, re-planned from the view of a skewed router, give plain AutoEP's logits (and `generate`'s tokens);
an empty batch on one rank serves; a weight move that fails anywhere keeps every rank on the old placement."""
import pytest
import torch

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-5     # fp32 rounding of grouped GEMMs over differently grouped rows


def run(tmp_path, scenario, world_size=2, **params):
    from conftest import launch
    return launch(scenario, world_size, tmp_path, worker="autoep_worker.py", **params)


@pytest.mark.parametrize("split, world_size, experts", [("view", 2, 4), ("exact", 4, 8)])
def test_replicas_in_autoeps_layer_give_plain_autoeps_logits_before_and_after_re_plans(tmp_path, split, world_size,
                                                                                         experts):
    ranks = run(tmp_path, "serve", world_size, split=split, ep=world_size, experts=experts)
    for rank in ranks:
        rows = rank["rows"]
        assert rank["replicated_slots"] == rank["S_max"] == rank["H"] + 1        # a re-plan put replicas in
        assert any(r["slots"] == rank["S_max"] for r in rows)                     # and they served batches
        assert rows[0]["slots"] == rank["H"] and rows[0]["equal"]                 # AutoEP's own layout: bit for bit
        assert rank["moves"] > 0 and rank["returned"]
        assert rows[-2]["slots"] == rank["H"]                        # back to AutoEP's layout (then re-planned)
        for r in rows:
            assert r["maxdiff"] <= TOLERANCE, r
        assert rank["generate_equal"] and rank["flips"] == [True, True]   # greedy tokens through two weight moves
        assert rank["uneven_equal"] and rank["uneven_tokens"] == 2 + 2 * rank["rank"]   # no rank left waiting
        assert rank["num_local_experts"] == rank["w1_rows"] == rank["S_max"]
        assert rank["record"]["replans"] >= 1 and rank["record"]["phase"] == "serve"
        assert min(rank["first"]["device_max_over_mean"]) > 1.2     # the view saw the skew per EP rank
    assert len({tuple(r["slots"] for r in rank["rows"]) for rank in ranks}) == 1   # every rank flipped together
    if split == "view" and world_size == 2:
        _plan_exports_sglangs_expert_location(ranks[0]["logged"], tmp_path)


def _plan_exports_sglangs_expert_location(log_dir, tmp_path):
    """`eb plan` reads the served AutoEP model's balance log and writes SGLang's --init-expert-location."""
    import json

    from eb_deepspeed.tools.cli import main
    from sglang_format import read_init_expert_location
    sglang = tmp_path / "sglang.json"
    assert main(["plan", log_dir, "--devices", "2", "--redundant", "2", "--sglang", str(sglang)]) == 0
    meta = read_init_expert_location(str(sglang), num_layers=2, num_logical=4, ep_size=2, gpus_per_node=2)
    physical_LP = torch.tensor(json.loads(sglang.read_text())["physical_to_logical_map"])
    assert physical_LP.shape == (2, 6) and meta is not None
    for layer in range(2):
        assert sorted(set(physical_LP[layer].tolist())) == [0, 1, 2, 3]       # every expert has a slot


@pytest.mark.parametrize("split", ["exact"])     # its all-gather: the collective an empty batch could miss
def test_an_empty_batch_on_one_rank_serves_without_a_hang(tmp_path, split):
    ranks = run(tmp_path, "serve_empty", split=split)
    assert all(rank["replicated"] for rank in ranks)
    assert [r["shape"] for r in ranks[1]["rows"]] == [(1, 0, 32)] * 3
    assert all(r["shape"] == (1, 12, 32) and r["maxdiff"] <= TOLERANCE for r in ranks[0]["rows"])


@pytest.mark.parametrize("phase", ["post"])    # every phase: test_serving.py (the engine is one; this is its AutoEP store)
def test_a_failed_weight_move_keeps_every_rank_on_the_old_placement(tmp_path, phase):
    ranks = run(tmp_path, "serve_move_fault", phase=phase)
    for rank in ranks:
        assert rank["failed"] == 1 and rank["replans"] >= 1      # the failed move, then one that went through
        assert all(r["maxdiff"] <= TOLERANCE for r in rank["rows"])
    assert [r["slots"] for r in ranks[0]["rows"]] == [r["slots"] for r in ranks[1]["rows"]]


def test_deepspeed_checkpoints_load_into_and_save_from_a_served_autoep_model(tmp_path):
    ranks = run(tmp_path, "serve_checkpoint")
    # a load that failed on rank 1 only: rank 1 raised DeepSpeed's error, rank 0 one naming rank 1, and both serve
    # the weights they had (after_refusal)
    assert ranks[1]["one_failed"] and "loading the checkpoint failed on rank 1" in ranks[0]["one_failed"]
    for rank in ranks:
        assert rank["path"] and rank["saved"] and rank["fresh_path"]
        assert rank["kept"] and rank["S"] == rank["H"] + 1            # replicas serving through the load
        for r in rank["rows"] + rank["fresh_rows"]:
            assert r["maxdiff"] <= TOLERANCE, r                       # the checkpoint's weights, not the old ones
        # an 8-expert checkpoint into the 4-expert model: refused, and every weight is as it was (before: the
        # embeddings, attention and lm_head were overwritten before the size mismatch, logits moved by 0.59)
        assert rank["refused"] is not None and "size" in rank["refused"].lower(), rank["refused"]
        for r in rank["after_refusal"]:
            assert r["maxdiff"] <= TOLERANCE, r
