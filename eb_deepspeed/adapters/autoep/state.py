"""Every AutoEP layer's expert state as rows that a move carries (`moves.Rows`): weights, fp32 masters and optimizer
moments, under a torch optimizer or ZeRO 1/2.

Shape legend: H expert rows of a rank (its grouped weights' leading dimension).

Moving an expert row with its state is the same training only for an optimizer that updates every element from its
own state (`ELEMENTWISE_OPTIMIZERS`)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..common import torch_optimizer

__all__ = ["ExpertState"]

# Optimizers whose update of an element reads that element's own state alone (and per-tensor scalars such as the
# step count): moving a row with its state is then the same training. Adafactor, LAMB, LARS, Muon and others
# compute a step from a whole tensor (its norm, its factored moments): a row moved to another rank's tensor would
# change the steps of its neighbours. By class name (no import of DeepSpeed's ops).
ELEMENTWISE_OPTIMIZERS = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop",
                          "FusedAdam", "DeepSpeedCPUAdam", "FusedLion", "DeepSpeedCPULion", "DeepSpeedCPUAdagrad")


class ExpertState:
    """Every AutoEP layer's expert state as rows (`moves.Rows`): row j of each weight [H, ...], of its fp32 master
    and of each optimizer moment, widened to fp32, as one vector. Under ZeRO 1/2 (and bf16) the master and the
    moments are partitioned over the expert's data-parallel peers: a read gathers them with one all-reduce each
    into buffers allocated by `prepare` (as DeepSpeed's `safe_get_full_*` do, but with nothing to allocate after
    the ranks agreed), a write stores this rank's fragment only (local, as `safe_set_full_*`); at ZeRO 0 they are
    the torch optimizer's own state."""

    def __init__(self, engine, layers: list):
        self.layers, self.keys = layers, state_keys(engine)
        self.optimizer = torch_optimizer(getattr(engine, "optimizer", None))
        owner = getattr(engine, "optimizer", None)
        if self.keys and hasattr(owner, "_hp_optimizer_states_linked"):
            # DeepSpeed links each parameter to its optimizer state after the first step of its first parameter
            # group, before AutoEP's expert groups have state: link them all again (local, the same on every rank)
            owner._hp_optimizer_states_linked = False
            owner._lazy_init_hp_params_optimizer_state()
        self._full: dict = {}

    def unsupported(self) -> Optional[str]:
        """Why a state tensor of the experts cannot move row by row (None: every one can)."""
        for m in self.layers:
            for param in m.experts.parameters():
                mapping = getattr(param, "_hp_mapping", None)
                for key in self.keys:
                    if mapping is not None:
                        have = mapping.optim_fragment or {}
                        if key not in have or have[key].numel() != mapping.lp_fragment_address.numel:
                            return f"the optimizer state {key!r} does not follow its parameter's elements"
                    elif self.optimizer is not None and key in self.optimizer.state.get(param, {}) and \
                            self.optimizer.state[param][key].shape != param.shape:
                        return (f"the optimizer state {key!r} has shape {tuple(self.optimizer.state[param][key].shape)}"
                                f", its parameter {tuple(param.shape)}: it cannot move row by row")
        return None

    def _slots(self, layer: int) -> list[tuple[torch.nn.Parameter, Optional[str]]]:
        """(parameter, what of it) for each tensor of a row, in order: "data", then under ZeRO None (the fp32
        master) and the moment keys, else the moment keys of the torch optimizer's state."""
        out = []
        for param in self.layers[layer].experts.parameters():
            out.append((param, "data"))
            out += [(param, None)] * hasattr(param, "_hp_mapping") + [(param, key) for key in self.keys]
        return out

    def prepare(self, layer: int) -> None:
        self._full = {(id(p), k): torch.empty(p.numel(), dtype=torch.float32, device=p.device)
                      for p, k in self._slots(layer) if k != "data" and hasattr(p, "_hp_mapping")}
        self._width = sum(p[0].numel() for p, _ in self._slots(layer))

    def row_like(self, layer: int) -> torch.Tensor:
        return torch.empty(self._width, dtype=torch.float32, device=self.layers[layer].router.gate.weight.device)

    def read(self, layer: int, rows: list[int]) -> dict[int, torch.Tensor]:
        if not rows:             # the data-parallel peers of this rank have no rows in this layer either
            return {}
        tensors = [self._whole(p, k) for p, k in self._slots(layer)]
        return {j: torch.cat([t[j].reshape(-1).float() for t in tensors]) for j in rows}

    def _whole(self, param, key) -> torch.Tensor:
        """The whole tensor [H, ...] of `param`'s `key` (collective under ZeRO)."""
        if key == "data":
            return param.data
        if not hasattr(param, "_hp_mapping"):
            state = self.optimizer.state.get(param, {}) if self.optimizer is not None else {}
            return state[key] if key in state else torch.zeros_like(param.data, dtype=torch.float32)
        full = self._full[(id(param), key)].zero_()
        if param._hp_mapping is not None:
            at = param._hp_mapping.lp_fragment_address
            full[at.start:at.start + at.numel].copy_(param._hp_mapping.get_hp_fragment(key).reshape(-1))
        dist.all_reduce(full, group=param._dp_group)
        return full.view(param.shape)

    def write(self, layer: int, rows: dict[int, torch.Tensor]) -> None:
        at = 0
        with torch.no_grad():
            for param, key in self._slots(layer):
                n = param[0].numel()
                values = {j: flat[at:at + n] for j, flat in rows.items()}
                at += n
                if key == "data" or not hasattr(param, "_hp_mapping"):
                    target = param.data if key == "data" else self._whole(param, key)
                    for j, value in values.items():
                        target[j].copy_(value.view_as(target[j]))
                elif param._hp_mapping is not None:   # this rank's fragment of the flat tensor
                    fragment = param._hp_mapping.get_hp_fragment(key).reshape(-1)
                    start = param._hp_mapping.lp_fragment_address.start
                    for j, value in values.items():
                        lo, hi = max(j * n, start), min((j + 1) * n, start + fragment.numel())
                        if lo < hi:
                            fragment[lo - start:hi - start].copy_(value[lo - j * n:hi - j * n])


def state_keys(engine) -> list[str]:
    """The optimizer's per-element state (Adam: exp_avg, exp_avg_sq); none before its first step."""
    optimizer = torch_optimizer(getattr(engine, "optimizer", None))
    if optimizer is None:
        return []
    return sorted({k for state in optimizer.state.values() for k, v in state.items()
                   if torch.is_tensor(v) and v.dim() > 0 and v.numel() > 1})


def expert_params(layer) -> int:
    """Parameters of one expert of an AutoEP layer."""
    return sum(p[0].numel() for p in layer.experts.parameters())


def state_bytes(layer, keys: int) -> int:
    """Bytes of one expert's state: each weight, its fp32 master (ZeRO 1/2, bf16), its fp32 moments."""
    return sum(p[0].numel() * (p.element_size() + 4 * (keys + hasattr(p, "_hp_mapping")))
               for p in layer.experts.parameters())
