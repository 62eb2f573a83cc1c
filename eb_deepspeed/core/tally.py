"""The route tally: what each MoE layer's gate counts during forward, by name.

Shape legend: L MoE layers, E experts per layer, W packed width (`TallyLayout(E).width`),
R routes of one forward (K * T; -1 = a route the capacity limit dropped), T tokens, K routes per token.

A gate owns a `TallyRecorder` and calls `record_routes(...)` on every training forward with its routes by
token (no host sync, no collective); every adapter's gate goes through that one door. At the step boundary the balancer stacks each layer's packed row into one `[L, W]`
tensor, all-reduces it once, and reads it back by name with `Tally.unpack`:

    routed_LE    route requests per expert, before the capacity limit (demand)
    kept_LE      routes kept per expert (what the experts processed)
    load_LE      kept routes weighted by sequence length (= kept when weighting is off)
    tokens_L     tokens seen
    nonfinite_L  tokens whose router logits held NaN/Inf
    aux_L        sum of the layer's unweighted l_aux over forwards (and ranks)
    forwards_L   forward calls that recorded (aux / forwards is the mean l_aux)
    device_LG    optional: kept routes (weighted) per EP rank, for gates that know where each route
                 went (replicated experts); None when experts sit where the view's map says

The packed layout is private to this file: `TallyLayout` gives every field its slice. Each
per-expert (and the per-device) field is preceded by one scratch slot, so recording a route of
expert id `e` is an `index_add_` at `offset + e` with no mask: a dropped route (id -1) lands on the
scratch slot.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

import torch

__all__ = ["Tally", "TallyLayout", "TallyRecorder", "PER_EXPERT_FIELDS", "PER_LAYER_FIELDS", "tensor_problem", "in_backward",
           "widen_row", "nonfinite_tokens", "routes_from_mask", "route_counts"]

PER_EXPERT_FIELDS = ("routed", "kept", "load")
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
    routed_LE: torch.Tensor
    kept_LE: torch.Tensor
    load_LE: torch.Tensor
    tokens_L: torch.Tensor
    nonfinite_L: torch.Tensor
    aux_L: torch.Tensor
    forwards_L: torch.Tensor
    device_LG: Optional[torch.Tensor] = None

    @classmethod
    def zeros(cls, num_layers: int, num_experts: int, num_devices: int = 0) -> "Tally":
        width = TallyLayout(num_experts, num_devices).width
        return cls.unpack(torch.zeros(num_layers, width, dtype=torch.float64), num_experts, num_devices)

    @classmethod
    def build(cls, routed_LE, kept_LE=None, load_LE=None, tokens_L=None, nonfinite_L=None, aux_L=None,
              forwards_L=None, device_LG=None) -> "Tally":
        """A tally from readable parts: kept defaults to routed, load to kept, tokens to routed / 2
        (top-2), forwards to 1, the rest to 0. For tests, simulators and adapters that count
        elsewhere."""
        routed_LE = torch.as_tensor(routed_LE, dtype=torch.float64)
        if routed_LE.dim() == 1:
            routed_LE = routed_LE[None]
        L = routed_LE.shape[0]

        def per_layer(v, default):
            return torch.as_tensor(default if v is None else v, dtype=torch.float64).expand(L).clone()

        kept_LE = routed_LE if kept_LE is None else torch.as_tensor(kept_LE, dtype=torch.float64).reshape(L, -1)
        load_LE = kept_LE if load_LE is None else torch.as_tensor(load_LE, dtype=torch.float64).reshape(L, -1)
        device_LG = None if device_LG is None else torch.as_tensor(device_LG, dtype=torch.float64).reshape(L, -1).clone()
        return cls(routed_LE.clone(), kept_LE.clone(), load_LE.clone(), per_layer(tokens_L, routed_LE.sum(1) / 2),
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

    @property
    def num_layers(self) -> int:
        return self.routed_LE.shape[0]

    @property
    def num_experts(self) -> int:
        return self.routed_LE.shape[1]

    def valid_L(self) -> torch.Tensor:
        """[L] bool: layers that saw tokens and no non-finite router logits."""
        return (self.tokens_L > 0) & (self.nonfinite_L == 0)

    def dropped_L(self) -> torch.Tensor:
        """[L] routes the capacity limit dropped (routed - kept)."""
        return (self.routed_LE.sum(1) - self.kept_LE.sum(1)).clamp_min(0)

    def mean_aux_L(self) -> torch.Tensor:
        """[L] mean unweighted l_aux per forward (0 for layers that did not record)."""
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


class TallyRecorder:
    """One layer's running tally, filled during forward and drained at the step boundary.

    The buffer is a plain float64 tensor allocated on the logits' device, not a module buffer:
    `model.half()` / `.bfloat16()` would cast a buffer and lose counts, and it is not model state.
    Token and forward counts stay on the host (plain ints: no tensor op per forward for them).
    """

    def __init__(self, num_experts: int, num_devices: int = 0):
        self.layout = TallyLayout(num_experts, num_devices)
        self._row_W: Optional[torch.Tensor] = None
        self._tokens = 0
        self._forwards = 0
        self._ones: Optional[torch.Tensor] = None   # reused source of index_add_ for unweighted routes
        self._undo: Optional[tuple] = None          # (row, tokens, forwards) before the last record

    def record(self, routed_E: torch.Tensor, route_expert_R: torch.Tensor, tokens, nonfinite: torch.Tensor,
               l_aux: torch.Tensor, token_w_R: Optional[torch.Tensor] = None,
               route_device_R: Optional[torch.Tensor] = None) -> None:
        """Add one forward's routes (no host sync).

        routed_E: [E] route requests before the capacity limit; route_expert_R: [R] int64 expert id of
        each route, -1 where it was dropped; tokens: int or 0-dim tensor; nonfinite: 0-dim count of
        tokens with non-finite logits; l_aux: the unweighted aux loss; token_w_R: [R] load weight of
        each route (sequence-length weighting), None = 1; route_device_R: [R] int64 EP rank that
        processes each route, -1 where dropped (only with a layout that has devices).
        """
        lay = self.layout
        self._undo = (None if self._row_W is None else self._row_W.clone(), self._tokens, self._forwards)
        if self._row_W is None:
            self._row_W = torch.zeros(lay.width, dtype=torch.float64, device=routed_E.device)
        row = self._row_W
        row[lay.span("routed")] += routed_E
        kept_R = route_expert_R + lay.start["kept"]      # -1 lands on the scratch slot before `kept`
        load_R = route_expert_R + lay.start["load"]
        if token_w_R is None:
            if self._ones is None or self._ones.numel() < kept_R.numel() or self._ones.device != row.device:
                self._ones = torch.ones(kept_R.numel(), dtype=torch.float64, device=row.device)
            ones_R = self._ones[:kept_R.numel()]
            row.index_add_(0, kept_R, ones_R)
            row.index_add_(0, load_R, ones_R)
        else:
            token_w_R = token_w_R.to(row.device, row.dtype)
            row.index_add_(0, kept_R, torch.ones_like(token_w_R))
            row.index_add_(0, load_R, token_w_R)
        if lay.num_devices:
            row.index_add_(0, route_device_R + lay.start["device"], ones_R if token_w_R is None else token_w_R)
        if isinstance(tokens, int):
            self._tokens += tokens
        else:
            row[lay.start["tokens"]] += tokens
        at = lay.start["nonfinite"]
        assert lay.start["aux"] == at + 1
        row[at:at + 2] += torch.stack((nonfinite.to(row.dtype), l_aux.detach().to(row.dtype)))
        self._forwards += 1

    def record_routes(self, expert_TK: torch.Tensor, *, routed_E: Optional[torch.Tensor] = None,
                      nonfinite: Optional[torch.Tensor] = None, logits_TE: Optional[torch.Tensor] = None,
                      l_aux: Optional[torch.Tensor] = None, tokens=None, token_weights_T: Optional[torch.Tensor] = None,
                      valid_T: Optional[torch.Tensor] = None, device_TK: Optional[torch.Tensor] = None,
                      layer: int = 0) -> None:
        """Add one forward's routes, given by token (no host sync): what every adapter's gate calls.

        expert_TK: [T, K] int expert of each route, -1 where none (dropped by the capacity limit, or fewer
        than K); routed_E: [E] route requests before the capacity limit (None: the routes of expert_TK, a
        dropless layer). nonfinite: 0-dim count of tokens with NaN/Inf router logits, or `logits_TE` [T, E]
        to count them here. l_aux: the layer's unweighted aux loss (None: 0). tokens: tokens seen (None:
        T, or the valid ones). token_weights_T: [T] load weight of each token (sequence-length weighting;
        None: 1). valid_T: [T] bool, False for padding tokens: their routes are left out everywhere (the
        caller's routed_E must leave them out too). device_TK: [T, K] int view device of each route (only
        with a layout that has devices). layer: the layer's index, for messages.
        """
        T = expert_TK.shape[0]
        if token_weights_T is not None and token_weights_T.numel() != T:
            raise ValueError(f"layer {layer}: sequence-length weights cover {token_weights_T.numel()} tokens, the batch "
                             f"has {T}; call set_sequence_lengths() with one length per sequence")
        with torch.no_grad():
            expert_TK = expert_TK.long()
            if valid_T is not None:
                valid_T = valid_T.reshape(T, 1).to(torch.bool)
                expert_TK = torch.where(valid_T, expert_TK, -1)
                if device_TK is not None:
                    device_TK = torch.where(valid_T, device_TK.long(), -1)
                if logits_TE is not None:
                    logits_TE = logits_TE[valid_T[:, 0]]
            if nonfinite is None:
                nonfinite = nonfinite_tokens(logits_TE) if logits_TE is not None else expert_TK.new_zeros(())
            if routed_E is None:       # dropless: every route is kept
                routed_E = route_counts(expert_TK, self.layout.num_experts)
            if tokens is None:
                tokens = T if valid_T is None else valid_T.sum()
            K = expert_TK.shape[1]
            token_w_R = None if token_weights_T is None else \
                token_weights_T.reshape(T, 1).to(torch.float64).expand(T, K).reshape(-1)
            self.record(routed_E, expert_TK.reshape(-1), tokens, nonfinite,
                        l_aux if l_aux is not None else expert_TK.new_zeros((), dtype=torch.float64), token_w_R,
                        None if device_TK is None else device_TK.long().reshape(-1))

    def discard(self, last_forward_only: bool = False) -> None:
        """Forget what was recorded since the last `take` (or only the last forward's routes; a second
        call then forgets nothing more)."""
        if not last_forward_only:
            self._row_W, self._tokens, self._forwards = None, 0, 0
        elif self._undo is not None:
            self._row_W, self._tokens, self._forwards = self._undo
        self._undo = None

    def take(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """This layer's packed row [W] (float64, on `device`), reset to zero."""
        self._undo = None
        lay = self.layout
        if self._row_W is None:
            out = torch.zeros(lay.width, dtype=torch.float64, device=device)
        else:
            out, self._row_W = self._row_W.to(device), None
            out[lay.scratch] = 0.0
            # NaN logits give a NaN l_aux; the nonfinite count already says so
            out[lay.start["aux"]] = out[lay.start["aux"]].nan_to_num(0.0, 0.0, 0.0)
        out[lay.start["tokens"]] += self._tokens
        out[lay.start["forwards"]] += self._forwards
        self._tokens, self._forwards = 0, 0
        return out


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


def tensor_problem(state: dict, what: str, shapes: dict[str, tuple[int, ...]],
                   ranges: Optional[dict[str, tuple[float, float]]] = None) -> str | None:
    """Why the tensors of a checkpointed `state` do not fit `shapes` (missing, wrong shape, non-finite), or lie
    outside their plausible `ranges` ({key: (lo, hi)}, both included): a finite but impossible value (a
    negative count, a bias that puts every token on one expert) is refused as a damaged state, naming it."""
    for key, shape in shapes.items():
        t = state.get(key)
        if not isinstance(t, torch.Tensor) or t.is_complex():
            return f"the {what} state's {key} is not a real tensor"
        if tuple(t.shape) != shape:
            return f"the checkpointed {what} {key} has shape {tuple(t.shape)}, this model {shape}"
        if not bool(torch.isfinite(t).all()):
            return f"the checkpointed {what} {key} holds NaN or inf"
        lo, hi = (ranges or {}).get(key, (-math.inf, math.inf))
        if t.numel() and (float(t.min()) < lo or float(t.max()) > hi):
            return (f"the checkpointed {what} {key} holds values in [{float(t.min()):.4g}, {float(t.max()):.4g}], "
                    f"outside the plausible [{lo:g}, {hi:g}]")
    return None
