"""One rank of a test launch, forked from a server that imported torch, DeepSpeed and transformers once.

A rank started as a fresh `python worker.py ...` spends about 5 s of this 2-core machine importing them, more than
most scenarios take to run; conftest's launches fork every rank from multiprocessing's fork server instead, which
imports this module (and so the heavy ones) once per test session. The rank then runs its worker as a script
would: argv, environment, working directory and output are the ones a fresh process gets.
"""
from __future__ import annotations

import os
import runpy
import sys

import torch
import deepspeed                                  # noqa: F401  (imported once, here, for every forked rank)
import transformers.models.mixtral.modeling_mixtral   # noqa: F401
import eb_deepspeed                               # noqa: F401

PRELOADED_IN = os.getpid()


def run(worker: str, argv: list[str], env: dict[str, str], cwd: str, log: str) -> None:
    if os.getpid() == PRELOADED_IN:     # the fork server ignores a preload's ImportError: say so, or every rank pays
        raise RuntimeError("tests/forked_rank.py was not imported by the fork server (is tests/ on its PYTHONPATH?)")
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    sys.path.insert(0, os.path.dirname(os.path.abspath(worker)))
    sys.argv = [worker, *argv]
    runpy.run_path(worker, run_name="__main__")
