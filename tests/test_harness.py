"""The multi-rank test harness itself (tests/conftest.py): a hung launch fails with what every rank wrote."""
import pytest

from conftest import launch

pytestmark = pytest.mark.distributed      # real process pairs (and one that hangs on purpose)


def test_a_hung_multi_rank_launch_fails_with_every_ranks_last_lines(tmp_path):
    # workers write unbuffered (PYTHONUNBUFFERED), so what a rank printed before it hung is in the message
    worker = tmp_path / "hang.py"
    worker.write_text("import os, time\nprint('rank', os.environ['RANK'], 'got this far')\ntime.sleep(120)\n")
    with pytest.raises(pytest.fail.Exception) as failed:
        launch("hang", 2, tmp_path, timeout=8, worker=str(worker))
    message = str(failed.value)
    assert "hang with 2 ranks hung for 8 s" in message
    assert "rank 0 got this far" in message and "rank 1 got this far" in message


def test_a_launch_whose_port_another_process_took_starts_again_on_a_new_one(tmp_path, monkeypatch):
    # the free port is chosen before rank 0 binds it; another job on the machine may take it in between
    import socket

    import conftest
    worker = tmp_path / "store.py"
    worker.write_text("import os, sys, torch, torch.distributed as dist\n"
                      "dist.init_process_group('gloo')\n"
                      "torch.save({'port': int(os.environ['MASTER_PORT'])}, os.path.join(sys.argv[2], f'rank{dist.get_rank()}.pt'))\n"
                      "dist.barrier()\n")
    busy = socket.socket()
    busy.bind(("", 0))
    busy.listen()
    taken = busy.getsockname()[1]
    ports = iter([taken])
    real = conftest.free_port
    monkeypatch.setattr(conftest, "free_port", lambda: next(ports, None) or real())
    try:
        results = launch("store", 2, tmp_path, timeout=120, worker=str(worker))
    finally:
        busy.close()
    assert results[0]["port"] == results[1]["port"] != taken       # both ranks ran, on the new port
