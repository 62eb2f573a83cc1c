"""Gloo ranks started here, no launcher: what `benchmarks.infer` and `benchmarks.infer_autoep` share.

    result = launch_ranks(args, world, port, module="benchmarks.infer")   # rank 0's result of run_rank(args)

`launch_ranks` starts `python -m MODULE --worker JSON` once per rank (RANK / WORLD_SIZE set as torch.distributed.run
would); the module ends in `rank_main(run_rank, ...)`, which runs one rank or, without --worker, hands its command
line to `python -m benchmarks` (which imports the benchmarks, never the other way round).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

__all__ = ["launch_ranks", "worker_main", "rank_main"]


def launch_ranks(args: dict, world: int, port: int, module: str = "benchmarks.infer",
                 out_dir: str | None = None) -> dict:
    """Run `module`'s `run_rank(args)` on `world` gloo ranks started here (RANK / WORLD_SIZE set, no launcher);
    rank 0's result, read back from a JSON file in out_dir (default runs/bench_infer under args["root"])."""
    out_dir = out_dir or os.path.join(args["root"], "runs", "bench_infer")
    out = os.path.join(out_dir, f"result_{os.getpid()}_{port}.json")
    os.makedirs(out_dir, exist_ok=True)
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([args["root"], os.environ.get("PYTHONPATH", "")]))
        procs.append(subprocess.Popen([sys.executable, "-m", module, "--worker", json.dumps({**args, "out": out})],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=3600)[0] for p in procs]
    for rank, p in enumerate(procs):
        if p.returncode != 0:
            raise RuntimeError(f"{module} rank {rank} failed ({p.returncode}):\n{logs[rank][-3000:]}")
    with open(out) as f:
        result = json.load(f)
    os.remove(out)
    return result


def worker_main(run_rank, argv=None) -> None:
    """A benchmark rank: `run_rank(args)` from --worker's JSON; rank 0 writes the result to args["out"]."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True)
    args = json.loads(parser.parse_args(argv).worker)
    result = run_rank(args)
    if torch.distributed.get_rank() == 0:
        with open(args["out"], "w") as f:
            json.dump(result, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def rank_main(run_rank, *command: str) -> None:
    """`python -m benchmarks.X`: with --worker, one rank of a run `launch_ranks` started; without, the same as
    `python -m benchmarks COMMAND... [options]` (that process replaces this one: same output, same exit code)."""
    if "--worker" in sys.argv:
        worker_main(run_rank)
    else:
        os.execv(sys.executable, [sys.executable, "-m", "benchmarks", *command, *sys.argv[1:]])
