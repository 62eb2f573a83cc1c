"""The route tally: what each MoE layer's gate counts during forward, by name.

Shape legend: L MoE layers (N of them folded at once), E experts per layer, W packed width (`TallyLayout(E).width`),
R routes of one forward (K * T; -1 = a route the capacity limit dropped), T tokens, K routes per token.

A gate owns a `LayerTally` and calls `add_routes(...)` on every counted forward (no host sync, no collective); the
balancer reads the reduced `[L, W]` rows back by `Tally`'s field names (a "record" is a log line: `core/record.py`).

The packed layout is private to this file: `TallyLayout` gives every field its slice. Each per-expert (and the
per-device) field is preceded by one scratch slot, so counting a route of expert id `e` is an `index_add_` at
`offset + e` with no mask: a dropped route (id -1) lands on the scratch slot."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import lru_cache
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

__all__ = ["Tally", "TallyLayout", "LayerTally"]

PER_EXPERT_FIELDS = ("routed", "kept")
PER_LAYER_FIELDS = ("tokens", "nonfinite", "aux", "forwards")


class TallyLayout:
    """Where each field lives in a packed row of width W = 2 (E + 1) + 4, plus G + 1 with devices."""

    def __init__(self, num_experts: int, num_devices: int = 0):
        self.num_experts = E = int(num_experts)
        self.num_devices = G = int(num_devices)
        self.start: dict[str, int] = {}
        self.scratch: list[int] = []
        at = 0
        for name, width in [(n, E) for n in PER_EXPERT_FIELDS] + ([("device", G)] if G else []):
            self.scratch.append(at)
            self.start[name] = at + 1
            at += width + 1
        for name in PER_LAYER_FIELDS:
            self.start[name] = at
            at += 1
        self.width = at

    def span(self, name: str) -> slice | int:
        """Slice of a per-expert or the per-device field, or index of a per-layer one, by name or `Tally` attribute."""
        name = name.rsplit("_", 1)[0]
        if name in PER_LAYER_FIELDS:
            return self.start[name]
        return slice(self.start[name], self.start[name] + (self.num_devices if name == "device" else self.num_experts))


@dataclass
class Tally:
    """One step's counts for L layers (float64). Build it by name; `pack` / `unpack` for the wire."""
    routed_LE: torch.Tensor                  # route requests per expert, before the capacity limit (demand)
    kept_LE: torch.Tensor                    # routes kept per expert (what the experts processed)
    tokens_L: torch.Tensor                   # tokens seen
    nonfinite_L: torch.Tensor                # tokens whose router logits held NaN/Inf
    aux_L: torch.Tensor                      # sum of the layer's unweighted l_aux over forwards (and ranks)
    forwards_L: torch.Tensor                 # forwards counted (aux / forwards is the mean l_aux)
    device_LG: Optional[torch.Tensor] = None   # kept routes per EP rank, from gates that know it (None: view's map)

    @classmethod
    def zeros(cls, num_layers: int, num_experts: int, num_devices: int = 0) -> "Tally":
        width = TallyLayout(num_experts, num_devices).width
        return cls.unpack(torch.zeros(num_layers, width, dtype=torch.float64), num_experts, num_devices)

    @classmethod
    def unpack(cls, packed_LW: torch.Tensor, num_experts: int, num_devices: int = 0) -> "Tally":
        """Read a packed [L, W] tensor by name (views into it, no copies)."""
        layout = TallyLayout(num_experts, num_devices)
        if packed_LW.dim() != 2 or packed_LW.shape[1] != layout.width:
            raise ValueError(f"a packed tally must be [layers, {layout.width}] for {num_experts} experts"
                             f"{f' and {num_devices} devices' if num_devices else ''}, got {tuple(packed_LW.shape)}")
        return cls(**{f.name: packed_LW[:, layout.span(f.name)] for f in fields(cls)
                      if f.name != "device_LG" or num_devices})

    def pack(self) -> torch.Tensor:
        """One [L, W] float64 tensor (the scratch slots are 0): what goes through the all-reduce."""
        L, E = self.routed_LE.shape
        layout = TallyLayout(E, 0 if self.device_LG is None else self.device_LG.shape[1])
        out_LW = torch.zeros(L, layout.width, dtype=torch.float64, device=self.routed_LE.device)
        for f in fields(self):
            if getattr(self, f.name) is not None:
                out_LW[:, layout.span(f.name)] = getattr(self, f.name)
        return out_LW

    def valid_L(self) -> torch.Tensor:
        """[L] bool: layers that saw tokens and no non-finite router logits."""
        return (self.tokens_L > 0) & (self.nonfinite_L == 0)

    def dropped_L(self) -> torch.Tensor:
        """[L] routes the capacity limit dropped (routed - kept)."""
        return (self.routed_LE.sum(1) - self.kept_LE.sum(1)).clamp_min(0)

    def mean_aux_L(self) -> torch.Tensor:
        """[L] mean unweighted l_aux per forward (0 for layers that counted no forward)."""
        return torch.where(self.forwards_L > 0, self.aux_L / self.forwards_L.clamp_min(1), 0.0)


def widen_row(row_W: torch.Tensor, num_experts: int, to_experts: int, num_devices: int = 0) -> torch.Tensor:
    """A layer's packed row for `num_experts` experts, laid out for `to_experts` >= num_experts (the padded experts
    count 0): how a layer with fewer experts joins the one [L, W] tensor of a model whose layers differ (PR-MoE)."""
    if num_experts == to_experts:
        return row_W
    if num_experts > to_experts:
        raise ValueError(f"a layer of {num_experts} experts does not fit a tally of {to_experts}")
    width = TallyLayout(num_experts, num_devices).width
    if row_W.shape != (width, ):
        raise ValueError(f"a packed row for {num_experts} experts must be [{width}], got {tuple(row_W.shape)}")
    tally, pad = Tally.unpack(row_W[None], num_experts, num_devices), (0, to_experts - num_experts)
    return replace(tally, routed_LE=F.pad(tally.routed_LE, pad), kept_LE=F.pad(tally.kept_LE, pad)).pack()[0]


class _Forward(NamedTuple):
    """One counted forward, waiting to be folded into the row (see `LayerTally`)."""
    routed_E: torch.Tensor                   # [E] route requests before the capacity limit
    expert_TK: torch.Tensor                  # [T, K] int expert of each route, -1 = dropped
    device_TK: Optional[torch.Tensor]        # [T, K] int EP rank of each route, -1 = dropped
    device_E: Optional[torch.Tensor]         # [E] int EP rank of every route of each expert (instead of device_TK)
    kept_E: Optional[torch.Tensor]           # [E] kept routes per expert, counted by the gate (None: from the routes)
    tokens: Optional[torch.Tensor]           # [] tokens seen, given as a tensor
    host_tokens: float                       # tokens seen, given as a number (else 0)
    logit_sums_T: Optional[torch.Tensor]     # [T] per-token sums of the router logits, counted at the fold
    l_aux: Optional[torch.Tensor]            # [] the unweighted aux loss


class LayerTally:
    """One layer's running tally, filled during forward and drained at the step boundary.

    `add_routes` keeps a forward's tensors and does no arithmetic (a small op costs mostly its fixed overhead); `take`
    folds every kept forward into the packed row at once (`_fold_rows`), as does an `add_routes` that finds
    `fold_every` waiting (memory stays bounded). The hazard of keeping tensors: a caller must not change a counted
    tensor in place before the next `take` (the gates hand over tensors their forward made and nothing writes again).

    The row is a plain float64 tensor on the routes' device, not a module buffer: `model.half()` / `.bfloat16()`
    would cast a buffer and lose counts, and it is not model state. Tokens given as a number and the forward count
    stay on the host until the fold."""

    fold_every = 16     # forwards kept before `add_routes` folds them into the row

    def __init__(self, num_experts: int, num_devices: int = 0):
        self.layout = TallyLayout(num_experts, num_devices)
        self._row_W: Optional[torch.Tensor] = None
        self._pending: list[_Forward] = []
        self._last_pending = False      # the last forward is the last pending one (discard can drop it)
        self._scratch_dirty = False     # a fold route by route wrote to the scratch slots since the last take
        self._cache: dict[tuple, tuple] = {}     # the fold's fixed tensors per device: (the map they hold, tensor)
        self.generation = 0             # rows taken or discarded so far (a reader's "new step" signal)

    def add_routes(self, expert_TK: torch.Tensor, *, routed_E: Optional[torch.Tensor] = None,
                   logit_sums_T: Optional[torch.Tensor] = None, l_aux: Optional[torch.Tensor] = None, tokens=None,
                   valid_T: Optional[torch.Tensor] = None, device_TK: Optional[torch.Tensor] = None,
                   device_E: Optional[torch.Tensor] = None, kept_E: Optional[torch.Tensor] = None) -> None:
        """Add one forward's routes, given by token (no host sync): what every adapter's gate calls.

        Args:
            expert_TK: [T, K] int expert of each route, -1 where none (dropped by the capacity limit, or fewer than K).
            routed_E: [E] route requests before the capacity limit (None: the routes of expert_TK, dropless).
            logit_sums_T: [T] per-token sums of the router logits (`logit_sums`, taken before gating changed the
                logits): tokens with NaN/Inf logits are counted from them at the fold.
            l_aux: the layer's unweighted aux loss (None: 0). tokens: tokens seen (None: T, or the valid ones).
            valid_T: [T] bool, False for padding: those routes are left out everywhere (the caller's routed_E
                and kept_E must leave them out too).
            device_TK / device_E: the view device of each route [T, K] (-1 where dropped), or of every route of
                each expert [E] (cheaper); only with a layout that has devices.
            kept_E: [E] kept routes per expert when the gate has them (None: counted from expert_TK)."""
        T = expert_TK.shape[0]
        if valid_T is not None or routed_E is None:     # else nothing to compute
            with torch.no_grad():
                if valid_T is not None:
                    valid_T1 = valid_T.reshape(T, 1).to(torch.bool)
                    expert_TK = torch.where(valid_T1, expert_TK, -1)
                    if device_TK is not None:
                        device_TK = torch.where(valid_T1, device_TK, -1)
                    if logit_sums_T is not None:     # a padding token's logits count nowhere
                        logit_sums_T = torch.where(valid_T1[:, 0], logit_sums_T, 0.0)
                    tokens = valid_T1.sum() if tokens is None else tokens
                if routed_E is None:       # dropless: every route is kept
                    routed_E = route_counts(expert_TK, self.layout.num_experts)
        tokens = T if tokens is None else tokens
        # kept for the fold, the waiting ones folded first when `fold_every` wait (the last one stays, for `discard`)
        if not self.layout.num_devices:
            device_TK = device_E = None
        elif device_TK is None and device_E is None:
            raise ValueError(f"a tally with {self.layout.num_devices} devices needs the device of every route")
        if len(self._pending) >= self.fold_every:
            self._fold()
        if l_aux is not None and l_aux.requires_grad:      # a kept autograd graph would outlive the forward
            l_aux = l_aux.detach()
        tensor_tokens = isinstance(tokens, torch.Tensor)
        self._pending.append(_Forward(routed_E, expert_TK, device_TK, device_E, kept_E,
                                      _scalar(tokens) if tensor_tokens else None, 0 if tensor_tokens else tokens,
                                      logit_sums_T, _scalar(l_aux)))
        self._last_pending = True

    def _fold(self) -> None:
        """Add every pending forward to the row (`_fold_rows`)."""
        pending, self._pending = self._pending, []
        if pending:
            if self._row_W is None:
                self._row_W = torch.zeros(self.layout.width, dtype=torch.float64, device=pending[0].routed_E.device)
            self._scratch_dirty |= self._fold_rows(self._row_W, [pending])

    def _fold_rows(self, row: torch.Tensor, layers: list[list[_Forward]]) -> bool:
        """Add the pending forwards of N layers to their rows, laid end to end in `row` [N * W], bit for bit as
        adding one forward at a time does; True if it wrote to the scratch slots. N = 1: `_fold`; more: `take_all`,
        whose layers' forwards agree in shape and fields.

        Counts (routed, kept, devices, tokens, nonfinite, forwards) are integers, which float64 sums exactly in any
        order: each is summed over the pending forwards at once. The fractional values (aux) go through one
        `index_add_` in the order they were added, the order in which adding one forward at a time adds them on
        the CPU. (On CUDA `index_add_` adds in no fixed order: those sums may differ in the last bit.)"""
        lay, E, f64, at, N = self.layout, self.layout.num_experts, torch.float64, row.device, len(layers)
        by = _Forward(*zip(*[f for layer in layers for f in layer]))     # each field, layer-major, in the order added

        def per_layer(values: list, width: int = 1) -> torch.Tensor:     # N * m [width] -> [N, width], summed in f64
            return torch.stack(values).view(N, -1, width).sum(1, dtype=f64)

        def count(routes_TK: list, into: torch.Tensor, start: int, stride: int) -> torch.Tensor:
            """Add 1 to `into` at start + id + layer * stride for each route (a dropped one, -1, at start - 1)."""
            if N == 1:      # token-major: one copy when K agrees
                slot_R = (torch.cat(routes_TK).reshape(-1) if len({r.shape[1] for r in routes_TK}) == 1
                          else torch.cat([r.reshape(-1) for r in routes_TK])).add_(start)
            else:       # every layer's routes alike in shape (`take_all`)
                slot_R = (torch.stack(routes_TK).view(N, -1) + torch.arange(N, device=at)[:, None] * stride).view(-1)
                slot_R.add_(start)
            return into.index_add_(0, slot_R, _constant(at, 1).expand(slot_R.numel()))
        # Step 1: routed and kept routes per expert
        routed_NE = per_layer(by.routed_E, E)
        if all(kept is routed for kept, routed in zip(by.kept_E, by.routed_E)):    # dropless: one tensor for both
            kept_NE = routed_NE
        else:
            given = [kept for kept in by.kept_E if kept is not None]
            kept_NE = per_layer(given, E) if given else None
            if len(given) < len(by.kept_E):     # the others' routes, counted here
                routes = [expert_TK for expert_TK, kept in zip(by.expert_TK, by.kept_E) if kept is None]
                counts_NE = count(routes, row.new_zeros(N * (E + 1)), 1, E + 1).view(N, E + 1)[:, 1:]
                kept_NE = counts_NE if kept_NE is None else kept_NE + counts_NE
        # Step 2: route by route, the devices, unless one map serves every forward
        device_E = by.device_E[0] if all(d is by.device_E[0] for d in by.device_E) else None
        if by_route := bool(lay.num_devices) and device_E is None:
            count([device_TK if map_E is None else torch.cat([map_E, map_E.new_full((1, ), -1)])[expert_TK]
                   for device_TK, map_E, expert_TK in zip(by.device_TK, by.device_E, by.expert_TK)],
                  row, lay.start["device"], lay.width)
        # Step 3: one index_add_ of the counts per expert (and per device, by the map) and the per-layer
        # values; a float64 0 first (to a scratch slot), so that their cat is float64
        values = [_constant(at, 0, (N, 1)), routed_NE, kept_NE] + \
            ([kept_NE] if lay.num_devices and device_E is not None else [])
        values.append(_constant(at, len(layers[0]), (N, 1)))
        fields = ["forwards"]
        if host_tokens := sum(by.host_tokens[:len(layers[0])]):     # the same in every layer (`take_all`)
            values.append(_constant(at, host_tokens, (N, 1)))
            fields.append("tokens")
        if given := [t for t in by.tokens if t is not None]:
            values.append(per_layer(given).to(at))
            fields.append("tokens")
        sums = [s for s in by.logit_sums_T if s is not None]
        if sums:     # x - x is 0 for a finite x, NaN for a NaN or an Inf
            sums_NX = torch.cat(sums).view(N, -1)
            values.append(torch.count_nonzero(sums_NX - sums_NX, dim=1).view(N, 1).to(at))
            fields.append("nonfinite")
        if aux := [a for a in by.l_aux if a is not None]:
            values.append(torch.stack(aux).view(N, -1).to(at))
            fields += ["aux"] * (len(aux) // N)
        row.index_add_(0, self._slots(at, device_E, tuple(fields), N), torch.cat(values, dim=1).view(-1))
        return by_route

    def _slots(self, device, device_E: Optional[torch.Tensor], fields: tuple[str, ...], N: int) -> torch.Tensor:
        """Where `_fold_rows`'s step 3 adds its values [N * S], made once per pattern, map and device (no
        host-to-device copy per fold)."""
        key = (device, None if device_E is None else id(device_E), fields, N)
        if key not in self._cache or self._cache[key][0] is not device_E:
            if len(self._cache) > 64:     # patterns and maps come and go (a new placement): keep the few in use
                self._cache.clear()
            lay, E = self.layout, self.layout.num_experts
            # built on the device from aranges and fills: no host-to-device copy (a cache miss comes in a forward)
            slots = [torch.full((1, ), lay.scratch[0], dtype=torch.long, device=device)]     # the leading 0
            slots += [torch.arange(lay.start[name], lay.start[name] + E, device=device) for name in ("routed", "kept")]
            slots += [] if device_E is None else [device_E.to(device, torch.long) + lay.start["device"]]   # by the map
            slots += [torch.full((1, ), lay.start[name], dtype=torch.long, device=device) for name in fields]
            slots_S = torch.cat(slots)
            if N > 1:
                slots_S = (slots_S + torch.arange(N, device=device)[:, None] * lay.width).view(-1)
            self._cache[key] = (device_E, slots_S)
        return self._cache[key][1]

    def _reset(self) -> None:
        """Forget the row and the pending forwards: a new step."""
        self._row_W, self._pending, self._last_pending, self._scratch_dirty = None, [], False, False
        self.generation += 1

    def discard(self, last_forward_only: bool = False) -> None:
        """Forget what was counted since the last `take` (or only the last forward's, once)."""
        if not last_forward_only:
            self._reset()
        elif self._last_pending:
            self._pending.pop()
            self._last_pending = False

    def take(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """This layer's packed row [W] (float64, on `device`), reset to zero."""
        self._fold()
        if self._row_W is None:     # nothing counted
            self._row_W = torch.zeros(self.layout.width, dtype=torch.float64, device=device)
        return _taken([self], self._row_W.to(device))


def _taken(tallies: list[LayerTally], rows_NW: torch.Tensor) -> torch.Tensor:
    """Folded rows [N, W] (or one [W]) as `take` gives them: scratch slots and a NaN aux 0; each tally reset."""
    lay = tallies[0].layout
    if any(t._scratch_dirty for t in tallies):
        for at in lay.scratch:        # slots, not a list index: no host-to-device copy of the index
            rows_NW[..., at] = 0.0
    # NaN logits give a NaN l_aux; the nonfinite count already says so
    rows_NW[..., lay.start["aux"]:lay.start["aux"] + 1].nan_to_num_(0.0, 0.0, 0.0)
    for t in tallies:
        t._reset()
    return rows_NW


def take_all(tallies: list[LayerTally], device: torch.device | str) -> Optional[torch.Tensor]:
    """Every layer's packed row at once [N, W] (float64, on `device`), each tally reset as `take` resets it; None
    (nothing taken) unless every pending forward of every layer has one shape: as many forwards per layer, the same
    fields and routes shape, no devices, no row folded earlier; then one fold for all layers, with `take`'s sums."""
    def signature(f: _Forward) -> tuple:
        return (f.expert_TK.shape, f.kept_E is None, f.kept_E is f.routed_E, f.tokens is None, f.host_tokens,
                f.logit_sums_T is None, f.l_aux is None)
    if not tallies or not tallies[0]._pending:
        return None
    lay, n, first = tallies[0].layout, len(tallies[0]._pending), tallies[0]._pending[0]
    want = signature(first)
    if any(t._row_W is not None or t.layout.width != lay.width or t.layout.num_devices or len(t._pending) != n
           or any(signature(f) != want for f in t._pending) for t in tallies):
        return None
    rows_NW = torch.zeros(len(tallies), lay.width, dtype=torch.float64, device=first.routed_E.device)
    tallies[0]._fold_rows(rows_NW.view(-1), [t._pending for t in tallies])
    return _taken(tallies, rows_NW.to(device))


@lru_cache(maxsize=64)      # token counts vary with the batches: the recent ones are kept
def _constant(device: torch.device, value: float, shape: tuple[int, ...] = (1, )) -> torch.Tensor:
    """float64 `value` of `shape`, cached and never written (made by a fill on `device`: no host-to-device copy)."""
    return torch.full(shape, value, dtype=torch.float64, device=device)


def _scalar(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A one-element tensor as 0-dim (a view; the common 0-dim case with no op), None as None."""
    return t if t is None or t.dim() == 0 else t.reshape(())


def logit_sums(logits_TE: torch.Tensor) -> torch.Tensor:
    """Per-token sums of the router logits [T, E] -> [T], no autograd node: a sum is non-finite iff its row
    holds a NaN or Inf, so the tally counts non-finite tokens from these at the fold (`add_routes`)."""
    return (logits_TE.detach() if logits_TE.requires_grad else logits_TE).sum(dim=1)


def route_counts(expert_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routes per expert [T, K] -> [E] float64; -1 (no route) counts nowhere (it lands on a dropped slot 0)."""
    counts = torch.zeros(num_experts + 1, dtype=torch.float64, device=expert_TK.device)
    flat_R = expert_TK.reshape(-1).long() + 1
    return counts.index_add_(0, flat_R, torch.ones(flat_R.numel(), dtype=torch.float64, device=flat_R.device))[1:]


def routes_from_mask(mask_TE: torch.Tensor, k: int) -> torch.Tensor:
    """Routes of a [T, E] bool routing map as [T, k] expert ids, -1 where a token has fewer than k (no host
    sync, unlike `nonzero`). A token with more than k routes keeps k of them: pass the largest k."""
    with torch.no_grad():
        k = min(int(k), mask_TE.shape[1])
        on_TK, expert_TK = mask_TE.to(torch.uint8).topk(k, dim=1)
        return torch.where(on_TK > 0, expert_TK, -1)


def in_backward() -> bool:
    """True while autograd runs a backward pass: a router forward then is activation checkpointing re-running it
    (DeepSpeed's `checkpointing.checkpoint`, Megatron's `CheckpointFunction`, `torch.utils.checkpoint` reentrant or
    not), whose routes the first forward already counted. The hazard: without this, every route of a checkpointed
    layer is counted twice. (torch has no public name for "inside backward".)"""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1
