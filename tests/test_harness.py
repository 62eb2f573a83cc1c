"""The multi-rank test harness itself (tests/conftest.py): a hung launch fails with what every rank wrote."""
import pytest

from conftest import launch

pytestmark = pytest.mark.unit


def test_a_hung_multi_rank_launch_fails_with_every_ranks_last_lines(tmp_path):
    # workers write unbuffered (PYTHONUNBUFFERED), so what a rank printed before it hung is in the message
    worker = tmp_path / "hang.py"
    worker.write_text("import os, time\nprint('rank', os.environ['RANK'], 'got this far')\ntime.sleep(120)\n")
    with pytest.raises(pytest.fail.Exception) as failed:
        launch("hang", 2, tmp_path, timeout=8, worker=str(worker))
    message = str(failed.value)
    assert "hang with 2 ranks hung for 8 s" in message
    assert "rank 0 got this far" in message and "rank 1 got this far" in message
