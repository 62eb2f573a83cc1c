"""The adapter kit: what every adapter (DeepSpeed-MoE, AutoEP, Megatron-Core, serving) shares.

    balancer = attach(cfg, gates, {"layers": len(gates)}, shape_of=lambda gathered: ModelShape.uniform(...),
                      reduce=reduce_over(group), device=..., hook=lambda b: ..., owners=[model])
    inner = torch_optimizer(engine.optimizer)    # the torch optimizer inside the framework's wrappers

`attach` is the one recipe every training adapter follows: one start-up all-gather (every rank's summary, rank 0
opening the log), agreement, the adapter's own checks on what was gathered, the `Balancer`, its step hook, and
`owner.easybalance`. World size 1 (no process group) works everywhere: no communication."""
from __future__ import annotations

import io
import os
import socket
import sys
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..core.balancer import Balancer, ModelShape, check_agreement
from ..core.config import EasyBalanceConfig
from ..core.record import BalanceLogger, NullLogger
from ..core.topology import node_map
from ..observe.monitor import DeepSpeedMonitorLogger, JsonlLogger, MultiLogger, WandbRunLogger

__all__ = ["attach"]


def attach(config: EasyBalanceConfig, gates: list, summary: dict[str, Any], *,
           shape_of: Callable[[list[dict[str, Any]]], ModelShape], reduce, device, hook: Callable[[Balancer], Any],
           owners: list, monitor=None, agree_on_all: bool = True) -> Balancer:
    """Build a training balancer over `gates` and hook it in: the recipe every training adapter follows.

    Args:
        summary: this rank's model summary for the start-up all-gather (the config is added).
        shape_of: every rank's summary (host names included) -> the model's `ModelShape`; raises the adapter's
            own errors (every rank evaluates the same list, so every rank raises the same).
        reduce / device: the per-step all-reduce (None: world size 1) and its tensors' device.
        hook: connects `balancer.step()` to the framework's optimizer step.
        owners: objects that get `.easybalance` (the engine, the model chunks).
        monitor: DeepSpeed's monitor, for W&B; agree_on_all: every rank's whole summary must agree (False: the
            config only; pipeline stages hold different layers)."""
    gathered, rank, logger = gather_startup({"config": config.to_dict(), **summary},
                                            prepare=lambda: make_logger(config, monitor=monitor))
    check_agreement([{k: v for k, v in g.items() if k != "host" and (agree_on_all or k == "config")}
                     for g in gathered], rank)
    shape = shape_of(gathered)
    shape.rank_to_node = node_map([g["host"] for g in gathered])
    balancer = Balancer(config, gates, shape, reduce=reduce, logger=logger, device=device)
    hook(balancer)
    for owner in owners:
        owner.easybalance = balancer
    return balancer


def dist_ready() -> bool:
    """A default process group exists (False at world size 1 without one)."""
    return dist.is_available() and dist.is_initialized()


def dist_rank() -> int:
    return dist.get_rank() if dist_ready() else 0


def gather_startup(mine: dict[str, Any], prepare: Optional[Callable[[], Any]] = None, *, enabled: bool = True
                   ) -> tuple[list[dict[str, Any]], int, Any]:
    """Every rank's start-up summary (one all-gather over every rank), this rank's index, and what `prepare` returned.

    enabled: whether this rank's block is on. A rank whose block is off joins the same all-gather
    (`join_startup_off`), so ranks that read different blocks get one error each instead of one waiting here
    and the other in the framework's first collective. `mine` gets this rank's host name under "host" (the node
    map; leave it out of agreement checks). prepare: this rank's start-up work that can fail on one rank alone (rank
    0 opening the balance log): run before the all-gather, its failure travels in it, and every rank raises the
    same error instead of one rank dying while the others wait in their first collective."""
    result, problem = None, None
    if prepare is not None:
        try:
            result = prepare()
        except (OSError, ValueError) as e:
            problem = str(e)
    mine = {**mine, "host": socket.gethostname(), "problem": problem, "enabled": enabled}
    if not dist_ready() or dist.get_world_size() == 1:
        gathered, rank = [mine], 0
    else:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        rank = dist.get_rank()
    on = [r for r, g in enumerate(gathered) if g.pop("enabled")]
    if 0 < len(on) < len(gathered):
        off = [r for r in range(len(gathered)) if r not in on]
        raise ValueError(f"easybalance is enabled on ranks {on} and off on ranks {off}: every rank must read the "
                         "same easybalance block (one ds_config for the whole job); stopped before the first step")
    if failed := [(r, text) for r, g in enumerate(gathered) if (text := g.pop("problem"))]:
        raise ValueError("easybalance: start-up failed on " + "; ".join(f"rank {r}: {text}" for r, text in failed))
    return gathered, rank, result


def shared_problem(problem: Optional[str]) -> Optional[str]:
    """The first rank's problem of all ranks' (one all-gather, which is also a barrier); this rank's alone
    without a process group."""
    if dist_ready() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, problem)
        return next((p for p in gathered if p), None)
    return problem


def join_startup_off() -> None:
    """A rank whose block is off (or absent) joins the start-up all-gather of the ranks whose block is on:
    when every rank agrees it is off this is the only communication easybalance adds; when they disagree
    every rank raises the same error (see `gather_startup`). No-op without a process group."""
    gather_startup({}, enabled=False)


def reduce_over(group=None) -> Optional[Callable[[torch.Tensor], None]]:
    """The per-step reduce: an in-place all-reduce (sum) over `group` (None: every rank); None when that
    group is one rank, or there is no process group (world size 1: no communication)."""
    if not dist_ready() or dist.get_world_size(group) == 1:
        return None
    return lambda packed_LW: dist.all_reduce(packed_LW, group=group)


def make_logger(cfg: EasyBalanceConfig, monitor=None) -> BalanceLogger:
    """Rank 0's balance logger: the JSONL log, plus W&B when `log.wandb` is on — through DeepSpeed's own
    monitor when the engine has one enabled (`monitor`), else the user's `wandb.run` if one is open.
    Other ranks get the no-op logger."""
    if dist_rank() != 0:
        return NullLogger()
    loggers: list[BalanceLogger] = [JsonlLogger(cfg.log.dir)]
    if cfg.log.wandb and monitor is not None:
        if getattr(monitor, "enabled", False):
            loggers.append(DeepSpeedMonitorLogger(monitor))
    elif cfg.log.wandb and getattr(sys.modules.get("wandb"), "run", None) is not None:   # a run needs wandb imported
        loggers.append(WandbRunLogger())
    return MultiLogger(loggers)


def torch_optimizer(optimizer) -> Optional[torch.optim.Optimizer]:
    """The torch optimizer inside a framework's wrappers (DeepSpeed's FP16/BF16/ZeRO `.optimizer`,
    Megatron's `.optimizer` or the first of a `ChainedOptimizer`), or None."""
    for _ in range(8):
        if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
            break
        chained = getattr(optimizer, "chained_optimizers", None)
        optimizer = chained[0] if chained else getattr(optimizer, "optimizer", None)
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


def write_atomically(path: str, data: str | bytes | Any) -> None:
    """Write `data` (text, bytes, or anything `torch.save` takes) to `path` so that after a kill at any moment
    `path` holds the old content or the new, never a torn file: a temporary file beside it, fsync, rename."""
    if not isinstance(data, (str, bytes)):
        buffer = io.BytesIO()
        torch.save(data, buffer)
        data = buffer.getvalue()
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
