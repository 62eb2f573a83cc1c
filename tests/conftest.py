"""Shared test helpers: launching real multi-process gloo jobs on CPU.

`launch(scenario, world_size, tmp_path, **params)` starts `world_size` processes of
`tests/dist_worker.py` (RANK / WORLD_SIZE / MASTER_PORT set as `torch.distributed.run` would),
each running the named scenario with a real DeepSpeed engine, and returns every rank's result.
Each rank is a fork of a server that imported torch, DeepSpeed and transformers once (tests/forked_rank.py):
a fresh interpreter per rank spent more of the suite importing them than running the scenarios.
A distinct free port per launch; a hard timeout kills the whole job instead of hanging CI.
Every test carries exactly one of the markers `unit`, `distributed`, `slow` (pytest.ini).
"""
from __future__ import annotations

import contextlib
import glob
import json
import multiprocessing
import os
import sys
import time

import pytest
import torch

import forked_rank
from benchmarks.bench import free_port, unlink_shm_buffers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

# DeepSpeed JIT-compiles its shm comm op on first init (~40-100 s here). launch/setup_cpu.sh builds it
# once into this checkout's venv before any test runs, so no test's timeout pays for it.
EXT_DIR = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(ROOT, ".venv", "torch_extensions")
# A multi-rank job on a busy 2-core machine: DeepSpeed init, a few steps, checkpoints.
LAUNCH_TIMEOUT = 600
MARKERS = ("unit", "distributed", "slow")


def pytest_collection_modifyitems(config, items):
    for item in items:
        marks = [m for m in MARKERS if item.get_closest_marker(m)]
        if len(marks) != 1:
            raise pytest.UsageError(f"{item.nodeid} must carry exactly one of the markers {MARKERS}, has {marks}")


# What a test may leave behind: nothing in /dev/shm (DeepSpeed's CPU shm op never unlinks its buffers; a job's
# launcher must) and nothing new in the checkout (pytest's own caches aside). Checked around every test; the
# run fails at the end naming each test that left something (the buffers are removed either way). Another job
# running meanwhile on the machine (a second test run, a training job) has its buffers counted too: one at a time.
SHM_BUFFERS = "/dev/shm/deepspeed_allreduce_buffer_*"
PYTEST_CACHES = {".pytest_cache", ".hypothesis", "__pycache__"}
LEFT_BEHIND: list[str] = []


def _leftovers() -> tuple[set[str], set[str]]:
    return set(glob.glob(SHM_BUFFERS)), set(os.listdir(ROOT))


@pytest.fixture(autouse=True)
def leaves_nothing_behind(request):
    shm, tree = _leftovers()
    yield
    shm_after, tree_after = _leftovers()
    new_shm, new_tree = shm_after - shm, tree_after - tree - PYTEST_CACHES
    for path in new_shm:
        with contextlib.suppress(OSError):
            os.unlink(path)
    if new_shm or new_tree:
        LEFT_BEHIND.append(f"{request.node.nodeid}: {len(new_shm)} DeepSpeed shm buffers in /dev/shm {sorted(new_shm)[:2]}, "
                           f"{sorted(new_tree)} in the checkout")


def pytest_sessionfinish(session, exitstatus):
    if LEFT_BEHIND:
        print("\ntests that left files behind (the run fails):\n  " + "\n  ".join(LEFT_BEHIND), file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def dist_env(world_size: int, rank: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=EXT_DIR,
               OMP_NUM_THREADS="1", WANDB_MODE="offline", PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
                   [ROOT, os.path.join(ROOT, "examples"), env.get("PYTHONPATH", "")]))
    return env


def _fork_server():
    """multiprocessing's fork server, started once with tests/forked_rank.py (and so torch, DeepSpeed,
    transformers) imported, in the environment every rank shares; each rank is a fork of it."""
    from multiprocessing import forkserver
    if forkserver._forkserver._forkserver_pid is None:
        forkserver.set_forkserver_preload(["forked_rank"])
        saved = dict(os.environ)
        env = dist_env(1, 0, 0)
        os.environ.update({k: v for k, v in env.items() if k not in ("RANK", "LOCAL_RANK", "MASTER_PORT")},
                          PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "tests"), env["PYTHONPATH"]]))
        try:
            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
    return multiprocessing.get_context("forkserver")


def _start(scenario, world_size, out_dir, timeout, worker, params):
    port = free_port()
    procs = []
    for rank in range(world_size):
        # a rank still running shortly before the timeout writes every thread's stack to its log
        stacks = {**params, "stacks_after": max(10, int(timeout) - 20)}
        proc = _fork_server().Process(target=forked_rank.run, args=(
            os.path.join(ROOT, "tests", worker), [scenario, str(out_dir), json.dumps(stacks)],
            dist_env(world_size, rank, port), str(out_dir.parent), str(out_dir / f"rank{rank}.log")))
        proc.start()
        procs.append(proc)
    return procs, port


def _wait(procs, out_dir, scenario: str, world_size: int, timeout: float) -> bool:
    """Wait for every rank; True when rank 0 could not bind the master port (the others are killed)."""
    deadline = time.monotonic() + timeout
    while any(proc.exitcode is None for proc in procs):
        if procs[0].exitcode not in (None, 0) and "EADDRINUSE" in (out_dir / "rank0.log").read_text(errors="replace"):
            for proc in procs:
                proc.kill()
                proc.join()
            return True
        if time.monotonic() > deadline:
            for proc in procs:
                proc.kill()
                proc.join()
            tails = "\n".join(f"--- rank {rank}, last lines:\n" + "\n".join(
                (out_dir / f"rank{rank}.log").read_text(errors="replace").splitlines()[-15:])
                for rank in range(world_size))
            pytest.fail(f"{scenario} with {world_size} ranks hung for {timeout} s; logs in {out_dir}\n{tails}")
        time.sleep(0.2)
    return False


def launch(scenario: str, world_size: int, tmp_path, timeout: float = LAUNCH_TIMEOUT,
           exit_codes: dict[int, int] | None = None, worker: str = "dist_worker.py", **params) -> list[dict | None]:
    """Run `scenario` on `world_size` gloo ranks; each rank's result, or None for a rank that `exit_codes` says
    ends with that code (and writes nothing). A free port can be taken by another process between choosing
    it and rank 0 binding it (another job on the machine): then the job is started again on a new port."""
    exit_codes = exit_codes or {}
    out_dir = tmp_path / f"{scenario}_{world_size}"
    out_dir.mkdir(parents=True, exist_ok=True)
    for _ in range(3):
        procs, port = _start(scenario, world_size, out_dir, timeout, worker, params)
        try:
            port_taken = _wait(procs, out_dir, scenario, world_size, timeout)
        finally:
            unlink_shm_buffers(port)
        if not port_taken:
            break
    results = []
    for rank, proc in enumerate(procs):
        text = (out_dir / f"rank{rank}.log").read_text()
        expected = exit_codes.get(rank, 0)
        assert proc.exitcode == expected, f"rank {rank} of {scenario} exited {proc.exitcode}:\n{text[-4000:]}"
        if expected != 0:
            results.append(None)
            continue
        results.append(torch.load(out_dir / f"rank{rank}.pt", weights_only=False))
    return results


@pytest.fixture
def run_dist(tmp_path):
    def _run(scenario, world_size=2, **params):
        return launch(scenario, world_size, tmp_path, **params)
    return _run
