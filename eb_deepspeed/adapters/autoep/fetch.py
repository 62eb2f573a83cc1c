"""Replicas in AutoEP's grouped GEMM, chosen per micro-batch: each rank's R replica slots filled from the micro-batch's
own counts (`planning.replicas`), their weights fetched from their homes for the forward, their gradients sent home
in backward.

Shape legend: E experts, G EP ranks, H home expert rows of a rank, R replica slots, S = H + R, P = G * S slots.

    replicas = LayerReplicas(layer, G, H, R, rank, min_routes)      # one per AutoEP layer, its homes set on a move
    slot_EG, n_GE, rows_2G = replicas.route(counts_GE)   # in the route hook, after the count exchange
    replicas.start(send_rows, receive_rows)        # in AutoEP's one host read of its all-to-all sizes: the transfer
    with_replicas(layer.experts, replicas)         # the experts compute over [S, ...] weights

Per training micro-batch and layer: the choice and the exact split run on the device from the exchanged counts;
the sizes of the weights' transfer ride on the host read AutoEP's dispatch already makes (none of ours); the
transfer (one all-to-all of every weight's rows) is posted right there, before AutoEP's token all-to-all, and
waited for in the experts' forward (`Fetch`), whose backward sends the replica rows' gradients home, added to the
home rows' before anything of DeepSpeed's reduces them. The weights' swap is the one forward's: the experts' own
forward runs inside it and the weights go back in a `finally`, so an exception anywhere in it (an OOM in the grouped
GEMM, an interrupt) leaves nothing of ours in the layer. An eval forward computes on the homes (replica rows zero,
no route to them)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ...planning.replicas import choose_replicas, copies
from ...planning.steering import split

__all__ = ["LayerReplicas", "with_replicas"]


def with_replicas(experts: torch.nn.Module, replicas: "LayerReplicas") -> None:
    """Run `experts` (AutoEP's `GroupedExperts`) with [S, ...] weights: its [H, ...] home rows, then the replica
    rows of this forward's fetch (`LayerReplicas.take`; zeros where there is none)."""
    forward = experts.forward

    def replicated_forward(*args, **kwargs):
        fetch, kept = replicas.take(), dict(experts.named_parameters(recurse=False))
        try:
            fulls = Fetch.apply(fetch, *kept.values()) if fetch is not None else \
                [torch.cat([w, w.new_zeros((replicas.R, ) + w.shape[1:])]) for w in kept.values()]
            for name, full in zip(kept, fulls):
                experts._parameters[name] = full
            return forward(*args, **kwargs)
        finally:
            experts._parameters.update(kept)
    experts.forward = replicated_forward


class LayerReplicas:
    """One AutoEP layer's R replica slots a rank in training, filled every micro-batch (see the module doc).

    G EP ranks, H home rows and R replica slots a rank, `rank` this one's place in the EP group (`group`);
    min_routes: the fewest routes a copy must take to pay for its transfer (`moves.transfer_stall`)."""

    def __init__(self, layer: torch.nn.Module, G: int, H: int, R: int, rank: int, min_routes: float):
        self.layer, self.G, self.H, self.R, self.S, self.rank = layer, G, H, R, H + R, rank
        self.min_routes, self.group = float(min_routes), layer.ep_group
        self.home_E = self.row_E = None
        self._routed = self._fetch = None
        self.failed: list[str] = []                 # transfers that failed on this rank since the last step

    def set_homes(self, home_E: torch.Tensor, row_E: torch.Tensor) -> None:
        """Each expert's home rank and its row there [E], on the router's device."""
        self.home_E, self.row_E = home_E, row_E

    def route(self, counts_GE: torch.Tensor):
        """From every rank's routes per expert counts_GE [G, E]: the slot of each expert's copy on each rank
        slot_EG [E, G] (-1: none), the routes of each expert each rank computes n_GE [G, E], and the replica rows
        this rank sends to and receives from each rank rows_2G [2, G]."""
        G, H, R, S, rank = self.G, self.H, self.R, self.S, self.rank
        home_E, E, dev = self.home_E, counts_GE.shape[1], counts_GE.device
        self._fetch = None
        c_E = counts_GE.sum(0)
        replica_GR = choose_replicas(c_E[None], home_E[None], G, R, self.min_routes)[0]
        n_GE = split(c_E[None], copies(home_E[None], replica_GR[None], G))[0]
        rank_G = torch.arange(G, device=dev)
        slot_GE = torch.full((G, E + 1), -1, dtype=torch.long, device=dev)
        slot_GE[home_E, torch.arange(E, device=dev)] = home_E * S + self.row_E
        slot_GE.scatter_(1, torch.where(replica_GR >= 0, replica_GR, E), rank_G[:, None] * S + H +
                         torch.arange(R, device=dev))
        # the transfer: home rows of this rank's experts in others' replica slots (by destination, then slot), and
        # this rank's replica slots (by source, then slot)
        home_GR = torch.where(replica_GR >= 0, home_E[replica_GR.clamp_min(0)], -1)
        send_N = (home_GR == rank).reshape(-1)
        order = torch.argsort((~send_N).long(), stable=True)
        receive_key = torch.where(home_GR[rank] >= 0, home_GR[rank], G) * R + torch.arange(R, device=dev)
        self._routed = {"send_index": self.row_E[replica_GR.reshape(-1).clamp_min(0)[order]],
                        "receive_slot": torch.argsort(receive_key)}
        rows_2G = torch.stack((send_N.view(G, R).sum(1), (home_GR[rank][:, None] == rank_G).sum(0)))
        return slot_GE[:, :E].T, n_GE, rows_2G

    def start(self, send_rows: list[int], receive_rows: list[int]) -> None:
        """Post the transfer of this micro-batch's replica weights (host sizes from AutoEP's read)."""
        routed, self._routed = self._routed, None
        weights = [w.detach() for w in self.layer.experts.parameters(recurse=False)]
        index = routed["send_index"][:sum(send_rows)]
        rows = _guarded_rows(self, weights, index, "fetching replica weights")
        arrived = rows.new_empty((sum(receive_rows), rows.shape[1]))
        work = dist.all_to_all_single(arrived, rows, receive_rows, send_rows, group=self.group, async_op=True)
        self._fetch = {"work": work, "arrived": arrived, "send_index": index, "send_rows": send_rows,
                       "receive_rows": receive_rows, "receive_slot": routed["receive_slot"][:sum(receive_rows)],
                       "owner": self}

    def take(self) -> Optional[dict]:
        """The fetch of this forward (the transfer `start` posted), or None (an eval forward: no replica)."""
        fetch, self._fetch = self._fetch, None
        if self.layer.training and self._routed is not None:
            raise RuntimeError("easybalance: this AutoEP layer routed to replicas whose transfer never started (its "
                               "all-to-all sizes were not read through compute_split_plan)")
        return fetch if self.layer.training else None


class Fetch(torch.autograd.Function):
    """A layer's grouped weights with replicas. Forward: each weight [H, ...] -> [S, ...], the home rows, then the
    replica rows the transfer brought (zeros in empty slots). Backward: the replica rows' gradients go home the same
    way and are added into the home rows' gradients, so the optimizer, ZeRO and the expert-data-parallel reduction
    see the home parameters only."""

    @staticmethod
    def forward(ctx, fetch: dict, *weights):
        ctx.fetch, ctx.like = fetch, [(w.dtype, w.device, tuple(w.shape[1:])) for w in weights]
        owner = fetch["owner"]
        fetch["work"].wait()
        out, at = [], 0
        for w in weights:
            full = w.new_zeros((owner.S, ) + tuple(w.shape[1:]))
            full[:owner.H] = w
            n = w[0].numel()
            full[owner.H + fetch["receive_slot"]] = fetch["arrived"][:, at:at + n].view(-1, *w.shape[1:]).to(w.dtype)
            at += n
            out.append(full)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        fetch = ctx.fetch
        owner, H = fetch["owner"], fetch["owner"].H
        grads = [torch.zeros((owner.S, ) + shape, dtype=dtype, device=device) if g is None else g
                 for g, (dtype, device, shape) in zip(grads, ctx.like)]
        rows = _guarded_rows(owner, grads, H + fetch["receive_slot"], "sending replica gradients home")
        back = rows.new_empty((sum(fetch["send_rows"]), rows.shape[1]))
        dist.all_to_all_single(back, rows, fetch["send_rows"], fetch["receive_rows"], group=owner.group)
        out, at = [], 0
        for g in grads:         # added in fp32: a bf16 home row is rounded once, as plain's one GEMM sum is
            n = g[0].numel()
            home = g[:H].float().index_add_(0, fetch["send_index"], back[:, at:at + n].view(-1, *g.shape[1:]).float())
            out.append(home.to(g.dtype))
            at += n
        return (None, *out)


def _rows(tensors: list, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` of every tensor [N, ...], side by side: [len(index), the tensors' row sizes summed]."""
    return torch.cat([t[index].reshape(len(index), t[0].numel()) for t in tensors], 1)


def _guarded_rows(owner: LayerReplicas, tensors: list, index: torch.Tensor, what: str) -> torch.Tensor:
    """`_rows`, or, when reading them fails on this rank, zeros of the planned shape, so that every rank still
    meets in the all-to-all (no hang); the failure is kept (`owner.failed`) and every rank raises before the
    optimizer step, so no rank steps on what a failed transfer computed."""
    try:
        return _rows(tensors, index)
    except Exception as e:   # noqa: BLE001 - any failure here, reported on every rank at the step
        owner.failed.append(f"{what} failed on rank {dist.get_rank()}: {type(e).__name__}: {e}")
        width = sum(t[0].numel() for t in tensors)
        return torch.zeros((len(index), width), dtype=tensors[0].dtype, device=tensors[0].device)
