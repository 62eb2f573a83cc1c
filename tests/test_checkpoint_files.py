"""Checkpoint files a killed save leaves behind: what a load refuses, and the error that names the way out."""
import os

import pytest

from eb_deepspeed.adapters.common import write_atomically
from eb_deepspeed.adapters.deepspeed.hooks import INCOMPLETE, incomplete_problem, refuse
from eb_deepspeed.adapters.deepspeed.serving import load_moe_checkpoint

pytestmark = pytest.mark.unit


def _checkpoint(root, tag, incomplete=False):
    os.makedirs(root / tag)
    (root / tag / "mp_rank_00_model_states.pt").write_bytes(b"")
    if incomplete:
        (root / tag / INCOMPLETE).write_text("x")


def test_a_tag_whose_save_did_not_finish_is_refused_with_the_complete_tags_named(tmp_path):
    _checkpoint(tmp_path, "global_step2")
    _checkpoint(tmp_path, "global_step3", incomplete=True)
    write_atomically(str(tmp_path / "latest"), "global_step3")
    problem = incomplete_problem(str(tmp_path), None)
    assert "global_step3 is incomplete" in problem
    assert incomplete_problem(str(tmp_path), "global_step2") is None
    error = refuse(str(tmp_path), problem)
    assert "complete ones in" in str(error) and "['global_step2']" in str(error)


def test_an_empty_latest_is_refused_instead_of_a_silent_fresh_start(tmp_path):
    _checkpoint(tmp_path, "global_step2")
    (tmp_path / "latest").write_text("")
    assert "latest is empty" in incomplete_problem(str(tmp_path), None)
    assert incomplete_problem(str(tmp_path), "global_step2") is None      # an explicit tag needs no `latest`


def test_write_atomically_replaces_the_whole_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "latest"
    path.write_text("global_step1-and-a-longer-old-name")
    write_atomically(str(path), "global_step2")
    assert path.read_text() == "global_step2" and os.listdir(tmp_path) == ["latest"]


def test_load_moe_checkpoint_refuses_a_folder_a_killed_save_left(tmp_path):
    _checkpoint(tmp_path, "served", incomplete=True)
    with pytest.raises(ValueError, match="served is incomplete.*Nothing was loaded"):
        load_moe_checkpoint(None, str(tmp_path), "served")


def test_write_atomically_takes_what_torch_save_takes(tmp_path):
    import torch
    write_atomically(str(tmp_path / "state.pt"), {"heat_LE": torch.ones(2, 3)})
    assert torch.equal(torch.load(tmp_path / "state.pt", weights_only=True)["heat_LE"], torch.ones(2, 3))


def test_a_torn_megatron_balancer_state_is_a_clear_error(tmp_path):
    import torch

    from eb_deepspeed.adapters.megatron.attach import load_state
    path = tmp_path / "balancer.pt"
    torch.save({"heat_LE": torch.ones(64, 64)}, path)
    path.write_bytes(path.read_bytes()[:1000])          # what a kill half-way through a plain torch.save leaves
    with pytest.raises(ValueError, match="not a readable balancer state.*nothing was loaded"):
        load_state(None, str(path))
