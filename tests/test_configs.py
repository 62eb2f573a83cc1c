"""Every shipped config runs as the README shows it: training configs through eb_deepspeed.initialize with the
config's own optimizer (no client optimizer), the serving config through init_inference; 2 gloo ranks."""
import os

import pytest

from conftest import ROOT

pytestmark = pytest.mark.distributed

# every DeepSpeed-MoE config in configs/ (megatron_cpu.json is the Megatron-Core example's, run by
# tests/test_quickstart.py; train_hf_cpu_2rank.json the HF AutoEP example's, run by tests/test_hf_job.py;
# trainer_cpu_2rank.json the Trainer example's, run by tests/test_trainer.py)
OTHERS = ("megatron_cpu.json", "train_hf_cpu_2rank.json", "trainer_cpu_2rank.json")
CONFIGS = sorted(c for c in os.listdir(os.path.join(ROOT, "configs")) if c not in OTHERS)
TRAIN = [c for c in CONFIGS if c.startswith("train_")]
SERVE = [c for c in CONFIGS if c.startswith("infer_")]


def test_the_shipped_configs_initialize_a_tiny_model_train_and_serve_on_cpu(run_dist):
    ranks = run_dist("shipped_configs", 2, train=TRAIN, serve=SERVE, serve_training=["train_cpu_2rank.json"])
    for rank in ranks:
        for name in TRAIN:
            row = rank[name]
            assert len(row["losses"]) == 2 and all(0 < loss < 20 for loss in row["losses"]), (name, row)
            assert row["view_steps"] == 2, (name, row)
        assert rank["train_8gpu.json"]["optimizer"] != "NoneType"     # the config's optimizer block was built
        assert len(TRAIN) + len(SERVE) == len(CONFIGS)                 # no config of another kind slipped in
        assert rank["infer_cpu_2rank.json"]["finite"]
        # the training config serves as it is (before: DeepSpeed's ValidationError on its training keys)
        served = rank["serve_train_cpu_2rank.json"]
        assert served["finite"] and len(served["notes"]) == 1 and "train_micro_batch_size_per_gpu" in served["notes"][0]
