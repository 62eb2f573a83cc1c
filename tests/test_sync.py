"""No host-device synchronisation of ours in a forward or backward, on every framework (counted on CPU by
`benchmarks.sync_audit`, which infers what would live on the accelerator; 2 gloo ranks, 2 MoE layers).

Each worker runs the framework plain and with the block in balance mode, every control on (bias, device loss, the
global scope where the framework has it), for 3 audited steps after 2 warm ones; serving runs 4 forwards with a view
step after each and re-plans to replicas. A sync of ours that replaces the framework's own (a replicated layer's
agreed capacity instead of DeepSpeed's `int(C)`) counts as none: the totals are compared.
"""
from __future__ import annotations

import pytest

STEPS, FORWARDS, LAYERS = 3, 4, 2


def calls(region: dict, ours: bool = True) -> dict[tuple[str, str, str], int]:
    """{(file, function, what): n} of a region's calls (line numbers dropped)."""
    out: dict[tuple[str, str, str], int] = {}
    for key, n in (region["ours"] if ours else {}).items():
        where, function, what = key.split(" ", 2)
        at = (where.rsplit(":", 1)[0], function, what)
        out[at] = out.get(at, 0) + n
    return out


def region(result: dict, run: str, name: str) -> dict:
    return result[run].get(name, {"ours": {}, "theirs": 0})


# the per-step syncs of training, one each whatever the number of layers: the reduced tally read back for the view,
# and every layer's controls copied to the device in one tensor
TRAIN_STEP = {("eb_deepspeed/core/balancer.py", "take", "device-to-host copy"): STEPS,
              ("eb_deepspeed/core/balancer.py", "apply_controls", "host-to-device copy"): STEPS}
SERVE_STEP = {("eb_deepspeed/core/balancer.py", "take", "device-to-host copy"): FORWARDS}
CAPACITY = ("eb_deepspeed/adapters/deepspeed/replicas.py", "_capacity", "item")
TOKENS = ("eb_deepspeed/adapters/deepspeed/replicas.py", "_agreed_tokens", "item")
# AutoEP's own read of its all-to-all sizes, one per layer, made by us where the exact split takes its count
# exchange over (`adapters.autoep.routes`)
SPLITS = ("eb_deepspeed/adapters/autoep/routes.py", "compute_split_plan", "device-to-host copy")


def assert_training(result: dict) -> None:
    eb, plain = "train_balance", "train_plain"
    assert calls(region(result, eb, "micro-batch")) == {}, "a host sync of ours in forward or backward"
    assert region(result, eb, "micro-batch")["theirs"] == region(result, plain, "micro-batch")["theirs"]
    assert calls(region(result, eb, "step")) == TRAIN_STEP


@pytest.mark.distributed
@pytest.mark.parametrize("framework", ["deepspeed-moe", "autoep", "megatron"])
def test_no_host_sync_of_ours_in_a_training_micro_batch_and_two_per_step_whatever_the_layers(run_dist, framework):
    worker = {"deepspeed-moe": "dist_worker.py", "autoep": "autoep_worker.py",
              "megatron": "megatron_worker.py"}[framework]
    for result in run_dist("sync", 2, worker=worker):
        assert_training(result)
        if framework == "deepspeed-moe":
            # serving with replicas, dropless: the agreed capacity replaces DeepSpeed's own read, one per layer
            assert result["serve_replans"] >= 1
            assert calls(region(result, "serve_serve", "micro-batch")) == {CAPACITY: FORWARDS * LAYERS}
            assert region(result, "serve_plain", "micro-batch")["theirs"] == FORWARDS * LAYERS
            assert calls(region(result, "serve_serve", "step")) == SERVE_STEP
            # with drops DeepSpeed's eval reads nothing (its capacity comes from the local batch's shape, which is
            # why it needs equal batches on every rank); the replicated layers agree on the most tokens of any
            # rank once per forward, whatever the layers (before: once per layer; docs/design.md, "Host syncs")
            assert region(result, "serve_plain_drops", "micro-batch")["theirs"] == 0
            assert calls(region(result, "serve_serve_drops", "micro-batch")) == {TOKENS: FORWARDS}
        if framework == "autoep":
            # the replicated layers' split reads AutoEP's sizes in its place: no more host syncs than plain's
            for run, plain in (("train_replicas", "train_plain"), ("serve_serve", "serve_plain")):
                ours = calls(region(result, run, "micro-batch"))
                assert set(ours) == {SPLITS}, f"{run}: a host sync of ours beyond AutoEP's own read: {ours}"
                assert ours[SPLITS] + region(result, run, "micro-batch")["theirs"] == \
                    region(result, plain, "micro-batch")["theirs"] > 0, run
            assert result["serve_replans"] >= 1
            assert calls(region(result, "serve_serve", "step")) == SERVE_STEP
