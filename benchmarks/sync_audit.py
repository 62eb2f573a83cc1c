"""Host-device synchronisations counted on CPU, by who calls them: what `torch.cuda.set_sync_debug_mode`
reports on a GPU, for a machine without one.

    audit = SyncAudit()
    audit.on_device(engine.module, batch)          # what would live on the accelerator
    with audit, audit.region("micro-batch"):
        loss = engine(batch); engine.backward(loss)
    audit.ours["micro-batch"]        # Counter {"eb_deepspeed/core/x.py:12 function item": n}: from eb_deepspeed
    audit.theirs["micro-batch"]      # the same from everyone else (DeepSpeed, transformers, the test)

A call counts when it would stall the host on a GPU: a device tensor's `item`, `tolist`, `numpy`, `bool`,
`int`, `float`, `index`; `cpu()` / `to("cpu")` of one (device to host); `to(device)` / `copy_` of a host tensor
onto the device, `torch.tensor(data, device=...)` of Python data (a blocking host-to-device copy); indexing a device
tensor with a bool mask or a Python list; `nonzero`, `argwhere`, `masked_select`, `unique`, `bincount`,
one-argument `torch.where`, `repeat_interleave` without `output_size`, `equal`, `allclose`, `is_nonzero`.

On CPU every tensor is on the same device, so the audit infers where each would live (a `TorchFunctionMode`
follows every op): the parameters, buffers and tensors given to `on_device` are on the accelerator; so is what a
factory makes with `device=` a `torch.device` (`torch.zeros(E, device=x.device)`), what `to(torch.device)` moves,
and every op's output with an input on the accelerator. Tensors made with no device or with the string "cpu",
and tensors the audit has not seen (made before it started), are on the host. The hazard: code that names its
accelerator with a string ("cuda:0") reads as host here; the package passes devices as `torch.device`.
A call's owner is the first caller outside torch and this file.
"""
from __future__ import annotations

import collections
import contextlib
import os
import sys
from typing import Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["SyncAudit", "audited_run"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.abspath(__file__)
_PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(_HERE)), "eb_deepspeed")

_READS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "__complex__"}
_UNSIZED = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount", "equal",
            "allclose", "is_nonzero"}
_FACTORIES = {"zeros", "ones", "full", "empty", "arange", "linspace", "rand", "randn", "randint", "eye", "tensor",
              "as_tensor", "zeros_like", "ones_like", "full_like", "empty_like", "new_zeros", "new_ones",
              "new_full", "new_empty", "new_tensor", "scalar_tensor", "randperm"}


def _tensors(obj) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def _device_arg(args, kwargs):
    """The target device of a `to(...)` call, or None: a torch.device (accelerator) or a string (host)."""
    for a in list(args[1:]) + [kwargs.get("device")]:
        if isinstance(a, (torch.device, str)):
            return a
    return None


class SyncAudit(TorchFunctionMode):
    """Counts host-device synchronisations per region and owner (see the module doc)."""

    def __init__(self):
        super().__init__()
        self._where: WeakIdKeyDictionary = WeakIdKeyDictionary()     # tensor -> True: on the accelerator
        self.ours: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.theirs: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._region = "outside"

    # ------------------------------------------------------------------ set-up
    def on_device(self, *things) -> "SyncAudit":
        """Modules (their parameters and buffers) and tensors that live on the accelerator."""
        for thing in things:
            if isinstance(thing, torch.nn.Module):
                for t in list(thing.parameters()) + list(thing.buffers()):
                    self._where[t] = True
            else:
                for t in _tensors(thing):
                    self._where[t] = True
        return self

    @contextlib.contextmanager
    def region(self, name: str):
        """Calls inside count under `name`."""
        before, self._region = self._region, name
        try:
            yield self
        finally:
            self._region = before

    def in_region(self, name: str) -> bool:
        return self._region == name

    def total(self, region: str, ours: bool = True) -> int:
        return sum((self.ours if ours else self.theirs)[region].values())

    def on_accelerator(self, t: torch.Tensor) -> bool:
        return bool(self._where.get(t, False))

    # ------------------------------------------------------------------ the mode
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        what = self._sync(name, func, args, kwargs)
        out = func(*args, **kwargs)
        if name in ("to", "cpu") and out is args[0] and what and "copy" in what:
            out = out.clone()         # on a GPU a copy is a new tensor: the original keeps its place
        if what:
            self._count(what)
        self._place(name, args, kwargs, out)
        return out

    def _sync(self, name: str, func, args, kwargs):
        """What makes this call a synchronisation, or None."""
        inputs = list(_tensors(args)) + list(_tensors(kwargs))
        on = any(self._where.get(t, False) for t in inputs)
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        first_on = first is not None and self._where.get(first, False)
        if name in _READS and first_on:
            return name
        if name == "cpu" and first_on:
            return "device-to-host copy"
        if name == "to" and first is not None:
            target = _device_arg(args, kwargs)
            if isinstance(target, str) and first_on and torch.device(target).type == "cpu":
                return "device-to-host copy"
            if isinstance(target, torch.device) and not first_on and first.numel():
                return "host-to-device copy"
        if name == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor):
            if first_on != bool(self._where.get(args[1], False)) and args[1].numel():
                return "host-to-device copy" if first_on else "device-to-host copy"
        if name in ("tensor", "as_tensor") and isinstance(kwargs.get("device"), torch.device) \
                and not isinstance(args[0] if args else None, torch.Tensor):
            return "host-to-device copy (torch.tensor of Python data)"
        if name in _UNSIZED and on:
            return name
        if name == "where" and len(args) + len(kwargs) == 1 and on:
            return "where (one argument)"
        if name == "repeat_interleave" and "output_size" not in kwargs and on \
                and any(isinstance(a, torch.Tensor) for a in list(args[1:]) + [kwargs.get("repeats")]):
            return "repeat_interleave without output_size"
        if name in ("__getitem__", "__setitem__", "index_put_", "index_put") and first_on and len(args) > 1:
            index = args[1] if isinstance(args[1], tuple) else (args[1], )
            for ix in index:
                if isinstance(ix, torch.Tensor) and ix.dtype == torch.bool:
                    return "bool-mask indexing"
                if isinstance(ix, list):
                    return "list indexing (host-to-device copy)"
        return None

    def _place(self, name: str, args, kwargs, out) -> None:
        """Where `out` would live."""
        outs = list(_tensors(out))
        if not outs:
            return
        if name in _FACTORIES and not name.endswith("_like") and not name.startswith("new_"):
            on = isinstance(kwargs.get("device"), torch.device)
        elif name == "to" or name == "cuda":
            target = _device_arg(args, kwargs)
            first = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if isinstance(target, torch.device):
                on = True
            elif isinstance(target, str):
                on = torch.device(target).type != "cpu"
            else:
                on = first is not None and self._where.get(first, False)
        elif name == "cpu":
            on = False
        else:
            on = any(self._where.get(t, False) for t in list(_tensors(args)) + list(_tensors(kwargs)))
        if on:
            for t in outs:
                self._where[t] = True

    def _count(self, what: str) -> None:
        frame = sys._getframe(1)
        while frame is not None:
            path = os.path.abspath(frame.f_code.co_filename)
            if not path.startswith(_TORCH_DIR) and path != _HERE and "contextlib" not in path:
                break
            frame = frame.f_back
        if frame is None:
            return
        path = os.path.abspath(frame.f_code.co_filename)
        ours = path.startswith(_PACKAGE_DIR)
        where = os.path.relpath(path, os.path.dirname(_PACKAGE_DIR)) if ours else path
        (self.ours if ours else self.theirs)[self._region][f"{where}:{frame.f_lineno} {frame.f_code.co_name} {what}"] += 1

    def summary(self) -> dict[str, dict]:
        """{region: {"ours": {call: n}, "theirs": total}}: what a worker hands back to its test."""
        regions = set(self.ours) | set(self.theirs)
        return {r: {"ours": dict(self.ours[r]), "theirs": self.total(r, ours=False)} for r in sorted(regions)}


def audited_run(audit: SyncAudit, steps: int, warm: int, micro_batch: Callable[[int], None],
                step: Callable[[int], None]) -> dict[str, dict]:
    """`warm` unaudited-region steps (cold start: first copies, JIT, caches), then `steps` steps whose micro-batch
    (forward and backward, or a serving forward) and step boundary count as "micro-batch" and "step"."""
    with audit:
        for i in range(warm + steps):
            with audit.region("micro-batch" if i >= warm else "warm"):
                micro_batch(i)
            with audit.region("step" if i >= warm else "warm"):
                step(i)
    return audit.summary()
