"""Expert-load traces from files, for `eb plan` and the simulator (`python -m benchmarks simulate --workload trace`).

Shape legend: N steps (of an .npz: samples), L layers, E logical experts, P physical slots.

    trace_NLE = load_trace("runs/main/balance")          # our own balance log
    trace_NLE = load_trace("expert_distribution.pt")      # SGLang dump, vLLM-style loads"""
from __future__ import annotations

import os
import zipfile
from typing import Optional

import torch

from ..core.files import open_regular
from ..core.record import EXPERT_COUNTS
from .report import read_log

__all__ = ["load_trace"]


def load_trace(path: str, last: Optional[int] = None, workload: Optional[str] = None) -> torch.Tensor:
    """Expert load trace [steps, layers, experts], float64, finite and non-negative (`_checked`), from a file (only
    its last `last` steps when given: a balance log is then read holding no more than those).

    * SGLang expert-distribution dump: `stat` mode (`torch.save` of a dict with `logical_count`
      [steps, layers, experts] or [layers, experts]), or one rank's `per_pass` file (`records`, each
      with `global_physical_count` [layers, physical], and `last_physical_to_logical_map`);
    * vLLM-style expert load (a dict with `expert_load_window` [window, layers, physical] or
      `expert_load_pass` [layers, physical], plus `physical_to_logical_map` [layers, physical]; or a
      logical `global_expert_load` [layers, experts]);
    * our own balance log (`balance.jsonl`, or its directory: the `expert_counts_LE` of each record);
    * the benchmarks' counts (`.npz`: an array [samples, layers, experts] per workload; all, or only `workload`).
    Read with `torch.load(..., weights_only=True)` or `np.load(..., allow_pickle=False)`, only from a regular file,
    within `_load_bounded`'s bounds and MAX_TRACE_COUNTS counts. Malformed files raise ValueError naming the problem."""
    if workload is not None and not path.endswith(".npz"):
        raise ValueError(f"{path}: workload {workload!r} names an array of an .npz of counts; this is no .npz")
    if path.endswith(".jsonl") or os.path.isdir(path):
        return _checked(torch.stack(_from_balance_log(path, last)), f"{path}: {EXPERT_COUNTS}")
    trace_NLE = _from_npz(path, workload) if path.endswith(".npz") else _from_torch_file(path)
    return trace_NLE if last is None else trace_NLE[-int(last):]


def _from_torch_file(path: str) -> torch.Tensor:
    data = _load_bounded(path)
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
            return _to_logical(tensor(key), data, "physical_to_logical_map", f"'{key}' counts", path)
    raise ValueError(f"{path}: no expert load found; expected one of logical_count (SGLang), global_expert_load, "
                     f"expert_load_window / expert_load_pass (vLLM); keys present: {sorted(data)}")


# What one trace may take: 2 GiB, both as the payload of a .pt file and as the float64 counts [N, L, E] (2^28:
# 10,000 SGLang passes x 61 layers x 288 slots is 1.8e8). A payload may expand to 8 x the file (torch.save
# stores tensors uncompressed, so a real dump expands to its own size), at least to 64 MiB.
MAX_TRACE_BYTES = 2 * 2 ** 30
MAX_TRACE_COUNTS = MAX_TRACE_BYTES // 8
MAX_EXPANSION, EXPANSION_FLOOR = 8, 64 * 2 ** 20
MAX_COUNT = 2.0 ** 53     # tokens an expert gets in one step: exact in float64, and far beyond any real batch


def _load_bounded(path: str, read=None, what: str = "a torch.save file readable with weights_only=True"):
    """torch.load(weights_only=True) (or `read(file)`) of a regular file of at most MAX_TRACE_BYTES whose zip
    payload expands to at most min(MAX_TRACE_BYTES, max(EXPANSION_FLOOR, MAX_EXPANSION x its size))."""
    with open_regular(path, MAX_TRACE_BYTES) as f:
        size = os.fstat(f.fileno()).st_size
        payload = _zip_payload(f, path)
        bound = min(MAX_TRACE_BYTES, max(EXPANSION_FLOOR, MAX_EXPANSION * size))
        if payload > bound:
            raise ValueError(f"{path}: its zip entries expand to {payload} bytes, more than the {bound} allowed "
                             f"for a {size}-byte file (at most {MAX_EXPANSION} x its size, at least "
                             f"{EXPANSION_FLOOR // 2 ** 20} MiB, never past {MAX_TRACE_BYTES // 2 ** 30} GiB; "
                             "torch.save stores tensors uncompressed, so a real dump expands to about its own size)")
        f.seek(0)
        try:
            return read(f) if read else torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # pickle/zip/header errors differ by cause; all mean "not what we read"
            raise ValueError(f"{path}: not {what} ({type(e).__name__}: {e})") from None


def _from_npz(path: str, workload: Optional[str]) -> torch.Tensor:
    """[samples, L, E]: the .npz's arrays [samples, L, E] (one per workload) one after another, or only `workload`."""
    import numpy as np

    def read(f):
        if not zipfile.is_zipfile(f):                           # np.load would try a lone .npy array, then a pickle
            raise ValueError("not a zip archive")
        f.seek(0)
        with np.load(f, allow_pickle=False) as npz:
            return npz.files, {n: torch.from_numpy(npz[n]) for n in npz.files if workload in (None, n)}
    names, arrays = _load_bounded(path, read, "an .npz of count arrays (numpy.savez)")
    if not arrays:
        raise ValueError(f"{path}: no workload {workload!r}; it holds {names}" if names else f"{path}: holds no arrays")
    shapes = {name: tuple(t.shape) for name, t in arrays.items()}
    if any(len(shape) != 3 for shape in shapes.values()) or len({shape[1:] for shape in shapes.values()}) > 1:
        raise ValueError(f"{path}: every array must be [samples, layers, experts] of the same layers and experts, "
                         f"got {shapes}")
    if sum(t.numel() for t in arrays.values()) > MAX_TRACE_COUNTS:      # before any array is copied to float64
        raise ValueError(f"{path}: its arrays {shapes} hold more than the {MAX_TRACE_COUNTS} counts a trace may take")
    return torch.cat([_checked(t, f"{path}: '{name}'") for name, t in arrays.items()])


def _zip_payload(f, path: str) -> int:
    """The bytes the zip archive f declares its entries expand to (its central directory: torch's reader allocates
    that much and inflates no further), or 0 for a file that is not a zip (an older torch.save, read as it lies)."""
    if not zipfile.is_zipfile(f):
        return 0
    f.seek(0)
    try:
        with zipfile.ZipFile(f) as z:
            return sum(info.file_size for info in z.infolist())
    except (zipfile.BadZipFile, ValueError, OSError) as e:
        raise ValueError(f"{path}: not a torch.save file (a damaged zip: {e})") from None


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
        counts.append(t)
    if len({tuple(c.shape) for c in counts}) != 1:
        raise ValueError(f"{path}: records differ in shape ({sorted({tuple(c.shape) for c in counts})})")
    if len(counts) * counts[0].numel() > MAX_TRACE_COUNTS:        # before any record is copied to float64
        raise ValueError(f"{path}: {len(counts)} records of {tuple(counts[0].shape)} hold more than the "
                         f"{MAX_TRACE_COUNTS} counts a trace may take")
    t_NLP = torch.stack([_checked(t, f"{path}: record {i}") for i, t in enumerate(counts)])
    return _to_logical(t_NLP, data, "last_physical_to_logical_map", "per_pass records count", path)


def _to_logical(t_NLP: torch.Tensor, data: dict, key: str, counted: str, path: str) -> torch.Tensor:
    """[N, L, E] logical counts from physical counts t_NLP [N, L, P] (`counted`) by the map data[key] [L, P]."""
    if key not in data:
        raise ValueError(f"{path}: {counted} physical experts; '{key}' is missing")
    p2l_LP = _expert_map(data[key], tuple(t_NLP.shape[1:]), f"{path}: {key}")
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


def _from_balance_log(path: str, last: Optional[int] = None) -> list[torch.Tensor]:
    """The [layers, experts] counts of each record of a balance log (its last `last`), as they are read."""
    def counts(record: dict) -> dict:
        """A record's expert counts as a [layers, experts] float64 tensor (None when it holds none), checked."""
        if EXPERT_COUNTS not in record:
            return {"step": record["step"], EXPERT_COUNTS: None}
        rows = record[EXPERT_COUNTS]
        if isinstance(rows, list) and all(isinstance(row, list) for row in rows) and len({len(r) for r in rows}) > 1:
            raise ValueError(f"{path}: the layers have different expert counts ({[len(row) for row in rows]}, a "
                             "PR-MoE run); traces and placement plans take one expert count for every layer")
        try:
            t = torch.tensor(rows, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError, OverflowError) as e:   # ragged lists, strings, nulls
            raise ValueError(f"{path}: {EXPERT_COUNTS} of step {record['step']} must be a [layers, experts] list of "
                             f"numbers ({e})") from None
        if t.dim() != 2:
            raise ValueError(f"{path}: {EXPERT_COUNTS} must be [layers, experts], got {tuple(t.shape)} at step "
                             f"{record['step']}")
        return {"step": record["step"], EXPERT_COUNTS: t}

    rows = [r[EXPERT_COUNTS] for r in read_log(path, keys=(EXPERT_COUNTS, ), last=last, convert=counts)
            if r[EXPERT_COUNTS] is not None]
    if not rows:
        raise ValueError(f"{path}: no record holds {EXPERT_COUNTS}")
    odd = next((i for i, t in enumerate(rows) if t.shape != rows[0].shape), None)
    if odd is not None:
        raise ValueError(f"{path}: {EXPERT_COUNTS} must be [layers, experts] of one shape in every record, got "
                         f"{tuple(rows[odd].shape)} (first {tuple(rows[0].shape)})")
    return rows


def load_total(path: str, last: Optional[int] = None, workload: Optional[str] = None) -> tuple[torch.Tensor, int]:
    """The summed expert load [layers, experts] of a trace file's steps (an .npz's samples; its last `last`), and
    how many: what `eb plan` plans from. A balance log is summed record by record, never stacked."""
    if workload is not None or not (path.endswith(".jsonl") or os.path.isdir(path)):
        trace_NLE = load_trace(path, last, workload)
        return trace_NLE.sum(0), int(trace_NLE.shape[0])
    rows = _from_balance_log(path, last)
    total_LE = torch.zeros_like(rows[0])
    for i, row_LE in enumerate(rows):
        total_LE += _checked(row_LE, f"{path}: {EXPERT_COUNTS} of record {i}")
    return total_LE, len(rows)


def _checked(t: torch.Tensor, what: str) -> torch.Tensor:
    """The one validation path of every importer: real, float64, finite, non-negative, bounded, not empty, at
    most MAX_TRACE_COUNTS (a tensor from a file may be a view of a smaller storage: checked before any copy)."""
    if t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{what} must hold real token counts, got {t.dtype}")
    if t.numel() > MAX_TRACE_COUNTS:
        raise ValueError(f"{what} holds {t.numel()} counts {tuple(t.shape)}, more than the {MAX_TRACE_COUNTS} "
                         f"({MAX_TRACE_BYTES // 2 ** 30} GiB as float64) a trace may take")
    t = t.to(torch.float64)
    if t.numel() == 0:
        raise ValueError(f"{what} is empty")
    if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
        raise ValueError(f"{what} must be finite and non-negative")
    if bool((t > MAX_COUNT).any()):
        raise ValueError(f"{what} holds counts above {MAX_COUNT:.0f} tokens")
    return t
