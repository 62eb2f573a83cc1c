"""Expert-load traces from files, for `eb simulate --workload trace` and the planner.

Shape legend: N steps, L layers, E logical experts, P physical slots.

    trace_NLE = load_trace("runs/main/balance")          # our own balance log
    trace_NLE = load_trace("expert_distribution.pt")      # SGLang dump, vLLM-style loads

Every importer ends in the same check (`_checked`): a float64 tensor [N, L, E] of finite,
non-negative counts, or a ValueError naming the file and the problem.
"""
from __future__ import annotations

import os

import torch

from ..core.record import EXPERT_COUNTS, PRESSURE

__all__ = ["load_trace", "ranks_in_log"]


def load_trace(path: str) -> torch.Tensor:
    """Expert load trace [steps, layers, experts] from a file.

    * SGLang expert-distribution dump: `stat` mode (`torch.save` of a dict with `logical_count`
      [steps, layers, experts] or [layers, experts]), or one rank's `per_pass` file (`records`, each
      with `global_physical_count` [layers, physical], and `last_physical_to_logical_map`);
    * vLLM-style expert load (a dict with `expert_load_window` [window, layers, physical] or
      `expert_load_pass` [layers, physical], plus `physical_to_logical_map` [layers, physical]; or a
      logical `global_expert_load` [layers, experts]);
    * our own balance log (`balance.jsonl`, or its directory: the `expert_counts_LE` of each record).
    Read with `torch.load(..., weights_only=True)`; malformed files raise ValueError naming the problem.
    """
    if path.endswith(".jsonl") or os.path.isdir(path):
        return _from_balance_log(path)
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle/zip errors differ by cause; all mean "not a torch.save'd dict"
        raise ValueError(f"{path}: not a torch.save file readable with weights_only=True ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a dict of tensors, got {type(data).__name__}")

    def tensor(key):
        t = data[key]
        if not isinstance(t, torch.Tensor) or t.dim() not in (2, 3):
            raise ValueError(f"{path}: '{key}' must be a tensor with 2 or 3 dimensions, "
                             f"got {type(t).__name__}{'' if not isinstance(t, torch.Tensor) else tuple(t.shape)}")
        t = _checked(t, f"{path}: '{key}'")
        return t[None] if t.dim() == 2 else t

    if "logical_count" in data:                                   # SGLang, stat mode
        return tensor("logical_count")
    if "records" in data:                                         # SGLang, per_pass mode (one rank's file)
        return _from_sglang_records(data, path)
    if "global_expert_load" in data:                              # vLLM, logical
        return tensor("global_expert_load")
    for key in ("expert_load_window", "expert_load_pass"):        # vLLM, physical
        if key in data:
            t_NLP = tensor(key)
            if "physical_to_logical_map" not in data:
                raise ValueError(f"{path}: '{key}' counts physical experts; 'physical_to_logical_map' is missing")
            return _to_logical(t_NLP, data["physical_to_logical_map"], f"{path}: physical_to_logical_map", path)
    raise ValueError(f"{path}: no expert load found; expected one of logical_count (SGLang), global_expert_load, "
                     f"expert_load_window / expert_load_pass (vLLM); keys present: {sorted(data)}")


def ranks_in_log(path: str) -> int | None:
    """The EP ranks our own balance log recorded (the width of its last `pressure_LG`), or None for other
    files (SGLang's and vLLM's loads name no ranks) and logs without it."""
    if not (path.endswith(".jsonl") or os.path.isdir(path)):
        return None
    from ..observe.report import read_log
    last = read_log(path, keys=())[-1]
    pressure = last.get(PRESSURE)
    if isinstance(pressure, list) and pressure and isinstance(pressure[0], list) and pressure[0]:
        return len(pressure[0])
    return None


def _from_sglang_records(data: dict, path: str) -> torch.Tensor:
    """[passes, layers, logical] from an SGLang per_pass dump: physical counts mapped to logical experts."""
    records = data["records"]
    if not isinstance(records, list) or not records:
        raise ValueError(f"{path}: 'records' must be a non-empty list of SGLang per_pass records")
    counts = []
    for i, r in enumerate(records):
        t = r.get("global_physical_count") if isinstance(r, dict) else None
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{path}: record {i} has no [layers, physical] 'global_physical_count'")
        counts.append(_checked(t, f"{path}: record {i}"))
    if len({tuple(c.shape) for c in counts}) != 1:
        raise ValueError(f"{path}: records differ in shape ({sorted({tuple(c.shape) for c in counts})})")
    t_NLP = torch.stack(counts)
    if "last_physical_to_logical_map" not in data:
        raise ValueError(f"{path}: per_pass records count physical experts; 'last_physical_to_logical_map' is missing")
    return _to_logical(t_NLP, data["last_physical_to_logical_map"], f"{path}: last_physical_to_logical_map", path)


def _to_logical(t_NLP: torch.Tensor, p2l, what: str, path: str) -> torch.Tensor:
    """[N, L, E] logical counts from physical counts t_NLP [N, L, P] through the map p2l [L, P] (checked)."""
    p2l_LP = _expert_map(p2l, tuple(t_NLP.shape[1:]), what)
    E = int(p2l_LP.max()) + 1
    out = torch.zeros(t_NLP.shape[0], t_NLP.shape[1], E + 1, dtype=torch.float64)
    out.scatter_add_(2, (p2l_LP + 1).clamp_min(0).expand_as(t_NLP), t_NLP)
    return _checked(out[:, :, 1:], path)


def _expert_map(p2l, shape: tuple, what: str) -> torch.Tensor:
    """A physical -> logical expert map [L, P]: whole numbers in [-1, P) (-1 = empty slot), every layer
    with an expert (a logical expert needs a physical slot, so ids stay below P: no huge allocation)."""
    if not isinstance(p2l, torch.Tensor) or tuple(p2l.shape) != shape:
        raise ValueError(f"{what} must be a tensor of shape {shape}, got "
                         f"{type(p2l).__name__}{tuple(p2l.shape) if isinstance(p2l, torch.Tensor) else ''}")
    if p2l.is_complex() or p2l.dtype == torch.bool:
        raise ValueError(f"{what} must hold expert ids (integers), got {p2l.dtype}")
    if p2l.is_floating_point() and (not bool(torch.isfinite(p2l).all()) or bool((p2l != p2l.round()).any())):
        raise ValueError(f"{what} must hold whole expert ids (no NaN, inf or fractions)")
    P = shape[1]
    if bool((p2l < -1).any()) or bool((p2l >= P).any()):
        raise ValueError(f"{what} holds ids outside [-1, {P}) (-1 = empty slot; a model has at most as many "
                         f"logical experts as physical slots)")
    p2l_LP = p2l.long()
    if bool((p2l_LP.amax(1) < 0).any()):
        raise ValueError(f"{what} has a layer with no expert")
    return p2l_LP


def _from_balance_log(path: str) -> torch.Tensor:
    from ..observe.report import read_log
    rows = []
    for r in read_log(path, keys=(EXPERT_COUNTS, )):
        if EXPERT_COUNTS not in r:
            continue
        counts = r[EXPERT_COUNTS]
        if isinstance(counts, list) and all(isinstance(row, list) for row in counts) \
                and len({len(row) for row in counts}) > 1:
            raise ValueError(f"{path}: the layers have different expert counts ({[len(row) for row in counts]}, a "
                             "PR-MoE run); traces and placement plans take one expert count for every layer")
        try:
            rows.append(torch.tensor(r[EXPERT_COUNTS], dtype=torch.float64))
        except (TypeError, ValueError, RuntimeError, OverflowError) as e:   # ragged lists, strings, nulls
            raise ValueError(f"{path}: {EXPERT_COUNTS} of step {r['step']} must be a [layers, experts] list of "
                             f"numbers ({e})") from None
        if rows[-1].dim() != 2 or rows[-1].shape != rows[0].shape:
            raise ValueError(f"{path}: {EXPERT_COUNTS} must be [layers, experts] of one shape in every record, got "
                             f"{tuple(rows[-1].shape)} at step {r['step']} (first {tuple(rows[0].shape)})")
    if not rows:
        raise ValueError(f"{path}: no record holds {EXPERT_COUNTS}")
    return _checked(torch.stack(rows), f"{path}: {EXPERT_COUNTS}")


MAX_COUNT = 2.0 ** 53     # tokens an expert gets in one step: exact in float64, and far beyond any real batch


def _checked(t: torch.Tensor, what: str) -> torch.Tensor:
    """The one validation path of every importer: real, float64, finite, non-negative, bounded, not empty."""
    if t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{what} must hold real token counts, got {t.dtype}")
    t = t.to(torch.float64)
    if t.numel() == 0:
        raise ValueError(f"{what} is empty")
    if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
        raise ValueError(f"{what} must be finite and non-negative")
    if bool((t > MAX_COUNT).any()):
        raise ValueError(f"{what} holds counts above {MAX_COUNT:.0f} tokens")
    return t
