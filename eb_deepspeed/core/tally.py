"""The route tally: what each MoE layer's gate counts during forward, by name.

Shape legend: L MoE layers, E experts per layer, W packed width (`TallyLayout(E).width`),
R routes of one forward (K * T; -1 = a route the capacity limit dropped), T tokens, K routes per token.

A gate owns a `LayerTally` and calls `add_routes(...)` on every counted forward (no host sync, no collective);
the balancer reads the reduced `[L, W]` rows back by name with `Tally.unpack`. (A "record" is a log line, never
a count: `core/record.py`.) The fields are `Tally`'s.

The packed layout is private to this file: `TallyLayout` gives every field its slice. Each
per-expert (and the per-device) field is preceded by one scratch slot, so counting a route of
expert id `e` is an `index_add_` at `offset + e` with no mask: a dropped route (id -1) lands on the
scratch slot.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple, Optional

import torch

__all__ = ["Tally", "TallyLayout", "LayerTally"]

PER_EXPERT_FIELDS = ("routed", "kept")
PER_LAYER_FIELDS = ("tokens", "nonfinite", "aux", "forwards")


class TallyLayout:
    """Where each field lives in a packed row of width W = 3 (E + 1) + 4, plus G + 1 with devices."""

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
        """Slice of a per-expert or the per-device field, or the index of a per-layer one."""
        if name in PER_EXPERT_FIELDS:
            return slice(self.start[name], self.start[name] + self.num_experts)
        if name == "device":
            return slice(self.start[name], self.start[name] + self.num_devices)
        return self.start[name]


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
    def build(cls, routed_LE, kept_LE=None, tokens_L=None, nonfinite_L=None, aux_L=None, forwards_L=None,
              device_LG=None) -> "Tally":
        """A tally from readable parts: kept defaults to routed, tokens to routed / 2
        (top-2), forwards to 1, the rest to 0. For tests, simulators and adapters that count
        elsewhere."""
        routed_LE = torch.as_tensor(routed_LE, dtype=torch.float64)
        if routed_LE.dim() == 1:
            routed_LE = routed_LE[None]
        L = routed_LE.shape[0]

        def per_layer(v, default):
            return torch.as_tensor(default if v is None else v, dtype=torch.float64).expand(L).clone()

        kept_LE = routed_LE if kept_LE is None else torch.as_tensor(kept_LE, dtype=torch.float64).reshape(L, -1)
        device_LG = None if device_LG is None else torch.as_tensor(device_LG, dtype=torch.float64).reshape(L, -1).clone()
        return cls(routed_LE.clone(), kept_LE.clone(), per_layer(tokens_L, routed_LE.sum(1) / 2),
                   per_layer(nonfinite_L, 0.0), per_layer(aux_L, 0.0), per_layer(forwards_L, 1.0), device_LG)

    @classmethod
    def unpack(cls, packed_LW: torch.Tensor, num_experts: int, num_devices: int = 0) -> "Tally":
        """Read a packed [L, W] tensor by name (views into it, no copies)."""
        layout = TallyLayout(num_experts, num_devices)
        if packed_LW.dim() != 2 or packed_LW.shape[1] != layout.width:
            raise ValueError(f"a packed tally must be [layers, {layout.width}] for {num_experts} experts"
                             f"{f' and {num_devices} devices' if num_devices else ''}, got {tuple(packed_LW.shape)}")
        return cls(**{f.name: packed_LW[:, layout.span(_field(f.name))] for f in fields(cls)
                      if f.name != "device_LG" or num_devices})

    def pack(self) -> torch.Tensor:
        """One [L, W] float64 tensor (the scratch slots are 0): what goes through the all-reduce."""
        L, E = self.routed_LE.shape
        layout = TallyLayout(E, 0 if self.device_LG is None else self.device_LG.shape[1])
        out_LW = torch.zeros(L, layout.width, dtype=torch.float64, device=self.routed_LE.device)
        for f in fields(self):
            if getattr(self, f.name) is not None:
                out_LW[:, layout.span(_field(f.name))] = getattr(self, f.name)
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
    """A layer's packed row for `num_experts` experts, laid out for `to_experts` >= num_experts (the padded
    experts count 0): how a layer with fewer experts joins the one [L, W] tensor of a model whose layers
    differ (PR-MoE). [W] -> [W']"""
    if num_experts == to_experts:
        return row_W
    if num_experts > to_experts:
        raise ValueError(f"a layer of {num_experts} experts does not fit a tally of {to_experts}")
    src, dst = TallyLayout(num_experts, num_devices), TallyLayout(to_experts, num_devices)
    if row_W.shape != (src.width, ):
        raise ValueError(f"a packed row for {num_experts} experts must be [{src.width}], got {tuple(row_W.shape)}")
    out_W = row_W.new_zeros(dst.width)
    for name in PER_EXPERT_FIELDS + (("device", ) if num_devices else ()) + PER_LAYER_FIELDS:
        at = dst.span(name)
        if isinstance(at, slice) and name in PER_EXPERT_FIELDS:
            at = slice(at.start, at.start + num_experts)
        out_W[at] = row_W[src.span(name)]
    return out_W


def _field(attribute: str) -> str:
    """The layout's name of a Tally attribute: `routed_LE` -> `routed`."""
    return attribute.rsplit("_", 1)[0]


class _Forward(NamedTuple):
    """One counted forward, waiting to be folded into the row (see `LayerTally`)."""
    routed_E: torch.Tensor                   # [E] route requests before the capacity limit
    expert_TK: torch.Tensor                  # [T, K] int expert of each route, -1 = dropped
    device_TK: Optional[torch.Tensor]        # [T, K] int EP rank of each route, -1 = dropped
    device_E: Optional[torch.Tensor]         # [E] int EP rank of every route of each expert (instead of device_TK)
    kept_E: Optional[torch.Tensor]           # [E] kept routes per expert, counted by the gate (None: from the routes)
    tokens: Optional[torch.Tensor]           # [] tokens seen, given as a tensor
    host_tokens: float                       # tokens seen, given as a number (else 0)
    nonfinite: Optional[torch.Tensor]        # [] tokens with non-finite router logits, counted by the caller
    logit_sums_T: Optional[torch.Tensor]     # [T] per-token sums of the router logits, counted at the fold
    l_aux: Optional[torch.Tensor]            # [] the unweighted aux loss


class LayerTally:
    """One layer's running tally, filled during forward and drained at the step boundary.

    `add_routes` keeps a forward's tensors and does no arithmetic (a small tensor op costs mostly its fixed
    overhead); `take` folds every kept forward into the packed row at once, as does an `add_routes` that finds
    `fold_every` forwards waiting (memory stays bounded when nobody takes). The fold gives the row that
    adding one forward at a time gives (`_fold`). The hazard of keeping tensors: a caller must not change
    a counted tensor in place before the next `take` (the gates hand over tensors that their forward
    made and nothing writes again).

    The row is a plain float64 tensor allocated on the routes' device, not a module buffer:
    `model.half()` / `.bfloat16()` would cast a buffer and lose counts, and it is not model state.
    Tokens given as a number and the forward count stay on the host until the fold.
    """

    fold_every = 16     # forwards kept before `add_routes` folds them into the row

    def __init__(self, num_experts: int, num_devices: int = 0):
        self.layout = TallyLayout(num_experts, num_devices)
        self._row_W: Optional[torch.Tensor] = None
        self._pending: list[_Forward] = []
        self._last_pending = False      # the last forward is the last pending one (discard can drop it)
        self._scratch_dirty = False     # a fold route by route wrote to the scratch slots since the last take
        self._cache: dict[tuple, tuple] = {}     # the fold's fixed tensors per device: (the map they hold, tensor)
        self._constants: dict[tuple, torch.Tensor] = {}     # `_constant`
        self.generation = 0             # rows taken or discarded so far (a reader's "new step" signal)

    def add_routes(self, expert_TK: torch.Tensor, *, routed_E: Optional[torch.Tensor] = None,
                      nonfinite: Optional[torch.Tensor] = None, logits_TE: Optional[torch.Tensor] = None,
                      logit_sums_T: Optional[torch.Tensor] = None, l_aux: Optional[torch.Tensor] = None, tokens=None,
                      valid_T: Optional[torch.Tensor] = None,
                      device_TK: Optional[torch.Tensor] = None, device_E: Optional[torch.Tensor] = None,
                      kept_E: Optional[torch.Tensor] = None, layer: int = 0) -> None:
        """Add one forward's routes, given by token (no host sync): what every adapter's gate calls.

        Args:
            expert_TK: [T, K] int expert of each route, -1 where none (dropped by the capacity limit, or fewer
                than K).
            routed_E: [E] route requests before the capacity limit (None: the routes of expert_TK, dropless).
            nonfinite / logits_TE / logit_sums_T: how tokens with NaN/Inf router logits are counted: a 0-dim
                count, or the logits [T, E] to count here, or their per-token sums [T] (`logit_sums`, taken
                before gating changed the logits) to count at the fold.
            l_aux: the layer's unweighted aux loss (None: 0). tokens: tokens seen (None: T, or the valid ones).
            valid_T: [T] bool, False for padding: those routes are left out everywhere (the caller's routed_E
                and kept_E must leave them out too).
            device_TK / device_E: the view device of each route [T, K] (-1 where dropped), or of every route of
                each expert [E] (cheaper); only with a layout that has devices.
            kept_E: [E] kept routes per expert when the gate has them (None: counted from expert_TK).
            layer: the layer's index, for messages.
        """
        T = expert_TK.shape[0]
        if logits_TE is None and valid_T is None and routed_E is not None:     # nothing to compute
            self._add(routed_E, expert_TK, T if tokens is None else tokens, nonfinite, logit_sums_T, l_aux,
                      device_TK, device_E, kept_E)
            return
        with torch.no_grad():
            if logits_TE is not None and nonfinite is None and logit_sums_T is None:
                logit_sums_T = logit_sums(logits_TE)
            if valid_T is not None:
                valid_T1 = valid_T.reshape(T, 1).to(torch.bool)
                expert_TK = torch.where(valid_T1, expert_TK, -1)
                if device_TK is not None:
                    device_TK = torch.where(valid_T1, device_TK, -1)
                if logit_sums_T is not None:     # a padding token's logits count nowhere
                    logit_sums_T = torch.where(valid_T1[:, 0], logit_sums_T, 0.0)
            if routed_E is None:       # dropless: every route is kept
                routed_E = route_counts(expert_TK, self.layout.num_experts)
            if tokens is None:
                tokens = T if valid_T is None else valid_T1.sum()
            self._add(routed_E, expert_TK, tokens, nonfinite, logit_sums_T, l_aux, device_TK, device_E, kept_E)

    def _add(self, routed_E, expert_TK, tokens, nonfinite, logit_sums_T, l_aux, device_TK, device_E, kept_E) -> None:
        """Keep one forward for the fold, folding the waiting ones first when `fold_every` wait (so the last
        forward is always pending, for `discard`)."""
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
                                      _scalar(nonfinite), logit_sums_T, _scalar(l_aux)))
        self._last_pending = True

    def _fold(self) -> None:
        """Add every pending forward to the row, bit for bit as adding one forward at a time does.

        Counts (routed, kept, devices, tokens, nonfinite, forwards) are integers, which float64 sums exactly in any
        order: each is summed over the pending forwards at once. The fractional values (aux) go through one
        `index_add_` in the order they were added, the order in which adding one forward at a time adds them on
        the CPU. (On CUDA `index_add_` adds in no fixed order: those sums may differ in the last bit.)"""
        pending, self._pending = self._pending, []
        if not pending:
            return
        lay, E, f64 = self.layout, self.layout.num_experts, torch.float64
        if self._row_W is None:
            self._row_W = torch.zeros(lay.width, dtype=f64, device=pending[0].routed_E.device)
        row = self._row_W
        by = _Forward(*zip(*pending))     # each field over the pending forwards, in the order added
        # Step 1: routed and kept routes per expert (float counts summed in float64: exact past 2**24)
        routed_nE = torch.stack(by.routed_E)
        routed_E = routed_nE.sum(0, dtype=f64 if routed_nE.is_floating_point() else None)
        if all(kept is routed for kept, routed in zip(by.kept_E, by.routed_E)):    # dropless: one tensor for both
            kept_E = routed_E
        else:
            given = [kept for kept in by.kept_E if kept is not None]
            kept_E = torch.stack(given).sum(0, dtype=f64) if given else row.new_zeros(E)
            if len(given) < len(pending):     # routes of expert e count at e + 1; a dropped one (-1) at 0
                expert1_R = _cat_routes([f.expert_TK for f in pending if f.kept_E is None]).add_(1)
                counts_E1 = row.new_zeros(E + 1).index_add_(0, expert1_R, self._ones(row.device, expert1_R.numel()))
                kept_E = kept_E + counts_E1[1:]
        # Step 2: route by route, the devices, unless one map serves every forward
        device_E = by.device_E[0] if all(d is by.device_E[0] for d in by.device_E) else None
        if lay.num_devices and device_E is None:
            device1_R = _cat_routes([f.device_TK if f.device_E is None else
                                     torch.cat([f.device_E, f.device_E.new_full((1, ), -1)])[f.expert_TK]
                                     for f in pending]).add_(1)
            self._field(row, "device").index_add_(0, device1_R, self._ones(row.device, device1_R.numel()))
            self._scratch_dirty = True
        # Step 3: one index_add_ of the counts per expert (and per device, by the map) and the per-layer
        # values; a float64 0 first (to a scratch slot), so that their cat is float64
        values = [self._constant(row.device, 0), routed_E, kept_E] + \
            ([kept_E] if lay.num_devices and device_E is not None else [])
        values.append(self._constant(row.device, len(pending)))
        fields = ["forwards"]
        host_tokens = sum(by.host_tokens)
        if host_tokens:
            values.append(self._constant(row.device, host_tokens))
            fields.append("tokens")
        for name, given in (("tokens", by.tokens), ("nonfinite", by.nonfinite)):
            given = [t for t in given if t is not None]
            if given:
                values.append(torch.stack(given).sum(dtype=f64).reshape(1).to(row.device))
                fields.append(name)
        sums = [s for s in by.logit_sums_T if s is not None]
        if sums:     # x - x is 0 for a finite x, NaN for a NaN or an Inf
            sums_T = torch.cat(sums)
            values.append(torch.count_nonzero(sums_T - sums_T).reshape(1).to(row.device))
            fields.append("nonfinite")
        aux = [a for a in by.l_aux if a is not None]
        if aux:
            values.append(torch.stack(aux).to(row.device))
            fields += ["aux"] * len(aux)
        row.index_add_(0, self._slots(row.device, device_E, tuple(fields)), torch.cat(values))

    def _slots(self, device, device_E: Optional[torch.Tensor], fields: tuple[str, ...]) -> torch.Tensor:
        """Where `_fold`'s step 3 adds its values: a scratch slot, the routed and kept fields [E], the device of
        each expert by `device_E` [E] when given, then the per-layer slot of each of `fields`. Made once per
        pattern, map and device (no host-to-device copy per fold)."""
        key = (device, None if device_E is None else id(device_E), fields)
        if key not in self._cache or self._cache[key][0] is not device_E:
            if len(self._cache) > 64:     # patterns and maps come and go (a new placement): keep the few in use
                self._cache.clear()
            lay, E = self.layout, self.layout.num_experts
            # built on the device from aranges and fills: no host-to-device copy (a cache miss comes in a forward)
            experts = [torch.full((1, ), lay.scratch[0], dtype=torch.long, device=device)] + \
                [torch.arange(lay.start[name], lay.start[name] + E, device=device)
                 for name in ("routed", "kept")]
            devices = [] if device_E is None else [device_E.to(device, torch.long) + lay.start["device"]]
            per_layer = [torch.full((1, ), lay.start[name], dtype=torch.long, device=device) for name in fields]
            self._cache[key] = (device_E, torch.cat(experts + devices + per_layer))
        return self._cache[key][1]

    def _field(self, row_W: torch.Tensor, name: str) -> torch.Tensor:
        """A per-expert or the per-device field of `row_W`, its scratch slot first [E + 1] (or [G + 1])."""
        at = self.layout.start[name] - 1
        return row_W[at:at + (self.layout.num_devices if name == "device" else self.layout.num_experts) + 1]

    def _ones(self, device, n: int) -> torch.Tensor:
        """[n] float64 ones (a view of one cached element)."""
        key = (device, "one")
        if key not in self._cache:
            self._cache[key] = (None, torch.ones(1, dtype=torch.float64, device=device))
        return self._cache[key][1].expand(n)

    def _constant(self, device, value) -> torch.Tensor:
        """[1] float64 `value`, cached (made by a fill on `device`: no host-to-device copy)."""
        key = (device, value)
        if key not in self._constants:
            if len(self._constants) > 32:     # token counts vary with the batches: keep the recent ones
                self._constants.clear()
            self._constants[key] = torch.full((1, ), value, dtype=torch.float64, device=device)
        return self._constants[key]

    def discard(self, last_forward_only: bool = False) -> None:
        """Forget what was counted since the last `take` (or only the last forward's routes; a second
        call then forgets nothing more)."""
        if not last_forward_only:
            self._row_W, self._pending, self._scratch_dirty = None, [], False
            self.generation += 1
        elif self._last_pending:
            self._pending.pop()
        self._last_pending = False

    def take(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """This layer's packed row [W] (float64, on `device`), reset to zero."""
        self._fold()
        lay = self.layout
        if self._row_W is None:
            out = torch.zeros(lay.width, dtype=torch.float64, device=device)
        else:
            out, self._row_W = self._row_W.to(device), None
            if self._scratch_dirty:
                for at in lay.scratch:        # slots, not a list index: no host-to-device copy of the index
                    out[at] = 0.0
            # NaN logits give a NaN l_aux; the nonfinite count already says so
            out[lay.start["aux"]:lay.start["aux"] + 1].nan_to_num_(0.0, 0.0, 0.0)
        self._last_pending = self._scratch_dirty = False
        self.generation += 1
        return out


def take_all(tallies: list[LayerTally], device: torch.device | str) -> Optional[torch.Tensor]:
    """Every layer's packed row at once [N, W] (float64, on `device`), each tally reset as `take` resets it; None
    (nothing taken) unless every pending forward of every layer has one shape: as many forwards per layer, the same
    fields and routes shape, no devices, no row folded earlier; then one fold for all layers, with `take`'s sums."""
    def signature(f: _Forward) -> tuple:
        return (f.expert_TK.shape, f.kept_E is None, f.kept_E is f.routed_E, f.tokens is None, f.host_tokens,
                f.nonfinite is None, f.logit_sums_T is None, f.l_aux is None)
    if not tallies or not tallies[0]._pending:
        return None
    lay, n, first = tallies[0].layout, len(tallies[0]._pending), tallies[0]._pending[0]
    want = signature(first)
    if any(t._row_W is not None or t.layout.width != lay.width or t.layout.num_devices
                           or len(t._pending) != n or any(signature(f) != want for f in t._pending) for t in tallies):
        return None
    N, E, f64 = len(tallies), lay.num_experts, torch.float64
    forwards = [f for t in tallies for f in t._pending]                   # layer-major: [N * n]

    def per_layer(values: list, width: int = 1) -> torch.Tensor:        # [N * n] tensors -> [N] or [N, width] sums
        return torch.stack(values).to(f64).view(N, n, width).sum(1).squeeze(1)
    out_NW = torch.zeros(N, lay.width, dtype=f64, device=device)
    routed_NE = per_layer([f.routed_E for f in forwards], E)
    if first.kept_E is first.routed_E:
        kept_NE = routed_NE
    elif first.kept_E is not None:
        kept_NE = per_layer([f.kept_E for f in forwards], E)
    else:       # routes of layer i to expert e count at i * (E + 1) + e + 1; a dropped one (-1) at i * (E + 1)
        expert_NR = torch.stack([f.expert_TK for f in forwards]).view(N, -1).long()
        offset_N1 = torch.arange(N, device=expert_NR.device).mul_(E + 1).add_(1)[:, None]
        counts = torch.zeros(N * (E + 1), dtype=f64, device=expert_NR.device)
        counts.index_add_(0, (expert_NR + offset_N1).view(-1), tallies[0]._ones(expert_NR.device, expert_NR.numel()))
        kept_NE = counts.view(N, E + 1)[:, 1:]
    for name, value in (("routed", routed_NE), ("kept", kept_NE)):
        out_NW[:, lay.span(name)] = value
    out_NW[:, lay.start["forwards"]] = n
    if first.tokens is not None:
        out_NW[:, lay.start["tokens"]] = per_layer([f.tokens for f in forwards])
    elif first.host_tokens:
        out_NW[:, lay.start["tokens"]] = first.host_tokens * n
    if first.nonfinite is not None:
        out_NW[:, lay.start["nonfinite"]] += per_layer([f.nonfinite for f in forwards])
    if first.logit_sums_T is not None:     # x - x is 0 for a finite x, NaN for a NaN or an Inf
        sums_NX = torch.stack([f.logit_sums_T for f in forwards]).view(N, -1)
        out_NW[:, lay.start["nonfinite"]] += torch.count_nonzero(sums_NX - sums_NX, dim=1)
    if first.l_aux is not None:            # NaN logits give a NaN l_aux; the nonfinite count already says so
        out_NW[:, lay.start["aux"]] = per_layer([f.l_aux for f in forwards]).nan_to_num_(0.0, 0.0, 0.0)
    for t in tallies:
        t._pending, t._last_pending, t._scratch_dirty = [], False, False
        t.generation += 1
    return out_NW


def _scalar(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A one-element tensor as 0-dim (a view; the common 0-dim case with no op), None as None."""
    return t if t is None or t.dim() == 0 else t.reshape(())


def _cat_routes(parts_TK: list[torch.Tensor]) -> torch.Tensor:
    """[T_i, K] route tensors (views of any strides) -> [sum T_i * K], token-major: one copy when K agrees."""
    if len({p.shape[1] for p in parts_TK}) == 1:
        return torch.cat(parts_TK).reshape(-1)
    return torch.cat([p.reshape(-1) for p in parts_TK])


def logit_sums(logits_TE: torch.Tensor) -> torch.Tensor:
    """Per-token sums of the router logits [T, E] -> [T], no autograd node: a sum is non-finite iff its row
    holds a NaN or Inf, so the tally counts non-finite tokens from these at the fold (`add_routes`)."""
    return (logits_TE.detach() if logits_TE.requires_grad else logits_TE).sum(dim=1)


def nonfinite_tokens(logits_TE: torch.Tensor) -> torch.Tensor:
    """0-dim count of tokens whose router logits hold a NaN or Inf [T, E] -> [] (a row sum is non-finite iff
    the row holds one: one reduction, no [T, E] mask). No autograd node."""
    with torch.no_grad():
        return (~torch.isfinite(logits_TE.sum(dim=1))).sum()


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
    """True while autograd runs a backward pass: a router forward then is activation checkpointing
    re-running it (DeepSpeed's `checkpointing.checkpoint`, Megatron's `CheckpointFunction`,
    `torch.utils.checkpoint` reentrant or not), whose routes the first forward already counted.
    The hazard: without this, every route of a checkpointed layer is counted twice. (torch has no
    public name for "inside backward".)"""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1
