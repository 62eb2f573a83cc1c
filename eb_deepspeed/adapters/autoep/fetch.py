"""Replicas in AutoEP's grouped GEMM: a layer's grouped weights [H, ...] -> [S, ...] for one forward, the home rows
then the rows of the replicas this rank holds, fetched from their homes; their gradients sent home in backward.

Shape legend: H home expert rows of a rank, S = H + replica slots, G EP ranks.

    with_replicas(layer.experts, lambda: plan)      # the layer's experts compute over [S, ...] weights when a plan
    Fetch.plan(served, layer, H, rank, group, device)   # is given: what this rank sends and receives

The swap is the one forward's: the experts' own forward runs inside it and the weights go back in a `finally`, so
an exception anywhere in it (an OOM in the grouped GEMM, an interrupt) leaves nothing of ours in the layer.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from ...planning.placement import Placement

__all__ = ["Fetch", "with_replicas"]


def with_replicas(experts: torch.nn.Module, plan_of: Callable[[], Optional[dict]]) -> None:
    """Run `experts` (AutoEP's `GroupedExperts`) with [S, ...] weights whenever `plan_of()` gives a fetch plan
    (`Fetch.plan`), its own [H, ...] otherwise."""
    forward = experts.forward

    def replicated_forward(*args, **kwargs):
        fetch = plan_of()
        if fetch is None:
            return forward(*args, **kwargs)
        kept = dict(experts.named_parameters(recurse=False))
        try:
            for name, full in zip(kept, Fetch.apply(fetch, *kept.values())):
                experts._parameters[name] = full
            return forward(*args, **kwargs)
        finally:
            experts._parameters.update(kept)
    experts.forward = replicated_forward


class Fetch(torch.autograd.Function):
    """A layer's grouped weights with replicas. Forward: each weight [H, ...] -> [S, ...], the home rows, then the
    rows of the replicas this rank holds, fetched from their homes (one all-to-all of all weights' rows). Backward:
    the replica rows' gradients go home the same way and are added into the home rows' gradients, so the
    optimizer, ZeRO and the expert-data-parallel reduction see the home parameters only."""

    @staticmethod
    def plan(served: Placement, layer: int, H: int, rank: int, group, device) -> dict:
        """What this rank sends (home rows, per destination rank) and receives (replica rows, per source rank)
        in `layer` of `served`: host-side splits, device-side indices."""
        S, G = served.slots_per_device, served.num_devices
        homes = served.phy2log[layer].view(G, S)[:, :H]
        home_of = {int(e): (g, j) for g in range(G) for j, e in enumerate(homes[g].tolist())}
        copies = [(g, j, home_of[int(e)]) for g in range(G) for j, e in enumerate(served.phy2log[layer].view(G, S)[g])
                  if j >= H and int(e) >= 0]
        send = [(g, r) for g, _, (o, r) in copies if o == rank]                      # by destination, then row
        receive = sorted((o, j) for g, j, (o, _) in copies if g == rank)              # by source, then row
        return {"send_rows": torch.tensor([r for _, r in send], dtype=torch.long, device=device),
                "send_splits": [sum(g == d for g, _ in send) for d in range(G)],
                "receive_rows": torch.tensor([j - H for _, j in receive], dtype=torch.long, device=device),
                "receive_splits": [sum(o == d for o, _ in receive) for d in range(G)],
                "H": H, "S": S, "group": group}

    @staticmethod
    def forward(ctx, fetch: dict, *weights):
        ctx.fetch, ctx.like = fetch, [(w.shape, w.dtype, w.device) for w in weights]
        rows = _guarded_rows(fetch, weights, fetch["send_rows"], "fetching replica weights")
        arrived = _exchange(rows, fetch["receive_splits"], fetch["send_splits"], fetch["group"])
        out, at = [], 0
        for w in weights:
            full = w.new_zeros((fetch["S"], ) + tuple(w.shape[1:]))
            full[:fetch["H"]] = w
            n = w[0].numel()
            full[fetch["H"] + fetch["receive_rows"]] = arrived[:, at:at + n].view(-1, *w.shape[1:])
            at += n
            out.append(full)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        fetch, H = ctx.fetch, ctx.fetch["H"]
        grads = [torch.zeros((fetch["S"], ) + tuple(shape[1:]), dtype=dtype, device=device) if g is None else g
                 for g, (shape, dtype, device) in zip(grads, ctx.like)]
        rows = _guarded_rows(fetch, grads, H + fetch["receive_rows"], "sending replica gradients home")
        back = _exchange(rows, fetch["send_splits"], fetch["receive_splits"], fetch["group"])
        out, at = [], 0
        for g in grads:
            n = g[0].numel()
            out.append(g[:H].clone().index_add_(0, fetch["send_rows"], back[:, at:at + n].view(-1, *g.shape[1:])))
            at += n
        return (None, *out)


def _rows(tensors: list, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` of every tensor [N, ...], side by side: [len(index), the tensors' row sizes summed]."""
    return torch.cat([t[index].reshape(len(index), t[0].numel()) for t in tensors], 1)


def _guarded_rows(fetch: dict, tensors: list, index: torch.Tensor, what: str) -> torch.Tensor:
    """`_rows`, or, when reading them fails on this rank, zeros of the planned shape, so that every rank still
    meets in the all-to-all (no hang); the failure is kept in `fetch` and every rank raises before the optimizer
    step (`TrainPlacement._agree_fetches`), so no rank steps on what a failed transfer computed."""
    try:
        return _rows(tensors, index)
    except Exception as e:   # noqa: BLE001 - any failure here, reported on every rank at the step
        fetch["failed"] = f"{what} failed on rank {dist.get_rank()}: {type(e).__name__}: {e}"
        width = sum(t[0].numel() for t in tensors)
        return torch.zeros((len(index), width), dtype=tensors[0].dtype, device=tensors[0].device)


def _exchange(rows: torch.Tensor, receive_splits: list, send_splits: list, group) -> torch.Tensor:
    """One all-to-all of rows (every rank of the EP group together, each with the splits it sends and receives)."""
    out = rows.new_empty((sum(receive_splits), rows.shape[1]))
    dist.all_to_all_single(out, rows.contiguous(), receive_splits, send_splits, group=group)
    return out
