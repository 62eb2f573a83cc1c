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


def test_the_training_ds_config_serves_without_its_training_keys_but_a_misspelled_key_is_kept_for_deepspeed():
    from eb_deepspeed.adapters.deepspeed.serving import _inference_keys
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 0}, "wandb": {"enabled": False},
              "dtype": "fp32", "tensor_paralel": {"tp_size": 1}}
    with pytest.warns(UserWarning, match="training settings it does not take: train_micro_batch_size_per_gpu, "
                                         "wandb, zero_optimization"):
        kept = _inference_keys(config)
    assert kept == {"dtype": "fp32", "tensor_paralel": {"tp_size": 1}}      # DeepSpeed still refuses the typo


@pytest.mark.parametrize("body, code, err", [
    ("return None", 0, ""), ("return 3", 3, ""), ("raise SystemExit('training diverged (NaN loss)')", 1,
                                                  "training diverged (NaN loss)")])
def test_a_launcher_job_leaves_with_its_code_after_the_at_exit_hooks(tmp_path, body, code, err):
    # examples/moe_lm.py run_and_exit: the at-exit hooks (W&B's finish, the last balance record) run, then os._exit
    import subprocess
    import sys
    from conftest import ROOT
    marker = tmp_path / "hook_ran"
    script = (f"import atexit, sys; sys.path.insert(0, {ROOT + '/examples'!r}); from moe_lm import run_and_exit\n"
              f"atexit.register(lambda: open({str(marker)!r}, 'w').write('yes'))\n"
              f"def main():\n    print('done')\n    {body}\n"
              "run_and_exit(main)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == code and proc.stdout == "done\n" and err in proc.stderr
    assert marker.read_text() == "yes"
