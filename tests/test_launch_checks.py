"""What `eb_deepspeed.initialize` / `init_inference` check about the launch before DeepSpeed starts."""
import pytest
import torch

import eb_deepspeed

pytestmark = pytest.mark.unit


def _model(ep_size: int):
    from deepspeed.moe.layer import MoE
    return torch.nn.Sequential(MoE(8, torch.nn.Linear(8, 8), num_experts=4, ep_size=ep_size, k=1))


@pytest.mark.parametrize("block", [None, {"mode": "observe"}])
def test_an_ep_size_that_does_not_divide_the_world_size_is_one_clear_error_before_deepspeed(monkeypatch, block):
    # before: DeepSpeed's bare `AssertionError: 3 is not divisible by 2`, once per rank
    monkeypatch.setenv("WORLD_SIZE", "3")
    config = {"train_micro_batch_size_per_gpu": 1, **({"easybalance": block} if block else {})}
    with pytest.raises(ValueError, match=r"ep_size must divide the world size \(3 ranks\): 0: ep_size 2\. "
                                         r"With 3 ranks ep_size can be one of \[1, 3\]"):
        eb_deepspeed.initialize(model=_model(2), model_parameters=[], config=config)
    with pytest.raises(ValueError, match=r"ep_size must divide the world size \(3 ranks\)"):
        eb_deepspeed.init_inference(_model(2), config={"easybalance": block} if block else None)
