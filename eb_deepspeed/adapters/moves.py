"""Expert rows moved between EP ranks, for serving's re-plans and training's placement: which rows move, what moving
them costs, the move itself in phases that leave every rank on one placement, and the lifecycle both run.

Shape legend: L layers, G EP ranks, S slots (rows) per rank, P physical slots (G * S; slot p is row p % S of rank
p // S), N row transfers.

    moves = slot_moves(old, new)                         # (layer, dst rank, dst row, src rank, src row) per copy
    stall = transfer_stall(src_N, dst_N, bytes_per_param, flops_per_route, node_G, "nvlink", "cuda")   # in routes
    moved = RowMover(rank, ep_ranks, group, device).move(moves, key, rows)      # False: every rank kept its rows
    placer = Placer(mover, home); placer.move(plan, rows, flip)                 # check -> move -> flip -> count

A row (`Rows`) is serving's slot weights or training's expert state (weights, fp32 masters, optimizer moments). A
move, every rank together: 0. the callers' checks and plan hashes agree (`agree`); per layer 1. `prepare`
allocates, agreed before anything is posted or read; 2. read (collective under ZeRO), transfer (`transfer`: a
stand-in for every op a rank fails to post), check finite, keep on the host; 3. once every layer arrived everywhere,
`write`, agreed again; a failed write makes every rank write back what it overwrote. Any failure ends with every
rank on the old rows (False) or every rank raising; none is left waiting for a peer."""
from __future__ import annotations

import hashlib
import warnings
from typing import Optional, Protocol

import torch
import torch.distributed as dist

from ..core.topology import TOPOLOGIES
from .common import dist_rank, dist_ready

__all__ = ["RowMover", "Placer", "transfer_stall"]

Move = tuple[int, int, int, int, int]      # (layer, dst rank, dst row, src rank, src row)
# A route takes FLOPs per expert parameter (2 in a forward, 6 with its backward); moving a row takes its bytes at
# the link's bandwidth. Stated, not measured (every rank must price a move alike): sustained bf16 expert GEMMs of
# an H100-class GPU; a CPU core's few GFLOP/s on the CPU (where a copy costs a few routes).
DEVICE_FLOPS = {"cuda": 400e12, "cpu": 1e11}


def slot_moves(old, new) -> list[Move]:
    """The copies a placement change makes: every slot of `new` (a `Placement`) whose row holds another expert in
    `old`, fetched from a slot of `old` that holds the expert (on the destination's rank when there is one)."""
    S_old, S_new = old.slots_per_device, new.slots_per_device
    moves = []
    for layer in range(new.phy2log.shape[0]):
        for p in torch.nonzero(new.phy2log[layer] >= 0).flatten().tolist():
            e, rank, j = int(new.phy2log[layer, p]), p // S_new, p % S_new
            if j < S_old and int(old.phy2log[layer, rank * S_old + j]) == e:
                continue
            holders = [(q // S_old, q % S_old) for q in torch.nonzero(old.phy2log[layer] == e).flatten().tolist()]
            src_rank, src_j = ([h for h in holders if h[0] == rank] or holders)[0]
            moves.append((layer, rank, j, src_rank, src_j))
    return moves


def transfer_stall(src_N, dst_N, bytes_per_param: float, flops_per_route: float, node_G, topology: str,
                   device_type: str) -> float:
    """The time the busiest rank spends on row transfers (rows from src_N [N] to dst_N [N], EP ranks), in routes it
    could have computed meanwhile: each row's parameters at `bytes_per_param` over the link between its ranks (the
    topology's bandwidth inside a node, between nodes across: node_G [G] node of each rank), a rank's sends and
    receives each at full duplex, against `flops_per_route` per parameter at `DEVICE_FLOPS`. A row that stays on its
    rank costs nothing. The one price of a weight move (serving, training placement) and of a replica's fetch."""
    topo, flops = TOPOLOGIES[topology], DEVICE_FLOPS["cuda" if device_type == "cuda" else "cpu"]
    src, dst, node = (torch.as_tensor(x, dtype=torch.long).reshape(-1) for x in (src_N, dst_N, node_G))
    bw = torch.where(node[src] == node[dst], *torch.tensor([topo.intra_bw, topo.inter_bw], dtype=torch.float64))
    routes_N = (src != dst).double() * (flops * bytes_per_param / flops_per_route) / bw
    zeros = torch.zeros(len(node), dtype=torch.float64)
    busy = torch.maximum(zeros.index_add(0, src, routes_N), zeros.index_add(0, dst, routes_N))
    return float(busy.max()) if len(node) else 0.0


class Rows(Protocol):
    """What a move moves: a layer's rows, each as one flat vector."""

    def prepare(self, layer: int) -> None:
        """Allocate what `row_like`, `read` and `write` of this layer need (local; may fail: agreed before use)."""

    def row_like(self, layer: int) -> torch.Tensor:
        """An uninitialised row of this layer (a receive buffer)."""

    def read(self, layer: int, rows: list[int]) -> dict[int, torch.Tensor]:
        """These local rows of the layer, each as one vector (collective over expert-data-parallel peers where the
        state is partitioned: every such peer reads the same layer)."""

    def write(self, layer: int, rows: dict[int, torch.Tensor]) -> None:
        """Store each vector into its local row (local; no collective)."""


class RowMover:
    """Moves rows between the ranks of one EP group (`rank` in it, `ep_ranks` their global ranks, `group` the
    process group of the transfers); agreements are over every rank of the job, on `device`."""

    def __init__(self, rank: int, ep_ranks: list[int], group, device):
        self.rank, self.ep_ranks, self.group, self.device = rank, ep_ranks, group, device

    def move(self, moves: list[Move], key: int, rows: Rows, ok: bool = True) -> bool:
        """Move every row of `moves` (module doc), or leave every rank's rows as they were (False). `key`: the
        plan's hash (`placement_key`); `ok`: this rank's own checks passed."""
        if not agree(ok, key, self.device):
            return False
        staged: dict[tuple[int, int], torch.Tensor] = {}     # (layer, row) -> what arrives there (host)
        kept: dict[tuple[int, int], torch.Tensor] = {}       # (layer, row) -> what it held (host)
        for layer in sorted({m[0] for m in moves}):
            mine = [m for m in moves if m[0] == layer and self.rank in (m[1], m[3])]
            prepared, buffers = self._prepare(layer, mine, rows)
            if not agree(ok and prepared, key, self.device):   # nobody has posted or read anything of this layer
                return False
            ok = self._transfer(layer, mine, rows, *buffers, staged, kept)
        if not agree(ok, key, self.device):
            return False
        if agree(self._write(rows, staged), key, self.device):
            return True
        if not agree(self._write(rows, kept), key, self.device):      # every rank: back to what it held
            raise RuntimeError("easybalance: moving expert rows failed while writing them and writing back the old "
                               "rows failed too (see the warnings): the experts' state is inconsistent; load the "
                               "last checkpoint")
        return False

    def _prepare(self, layer: int, mine: list[Move], rows: Rows) -> tuple[bool, tuple]:
        """Step 1 of one layer: every allocation of the layer (receive buffers, a row of NaNs to send in place of
        one this rank fails to read), before anything is posted."""
        try:
            rows.prepare(layer)
            recv = {m[2]: rows.row_like(layer) for m in mine if m[1] == self.rank and m[3] != self.rank}
            return True, (recv, rows.row_like(layer).fill_(float("nan")))
        except Exception as e:   # noqa: BLE001 - any failure must reach the agreement, not hang the peers
            return warn_failed(f"preparing the moves of layer {layer}", e), ({}, None)

    def _transfer(self, layer: int, mine: list[Move], rows: Rows, recv: dict, nan_row, staged: dict,
                  kept: dict) -> bool:
        """Step 2 of one layer: read, transfer, check, keep on the host. A rank that fails goes on matching its
        peers' transfers (NaNs for what it could not read, which the receiver refuses)."""
        ok, got = True, {}
        wanted = sorted({m[4] for m in mine if m[3] == self.rank} | {m[2] for m in mine if m[1] == self.rank})
        try:
            got = rows.read(layer, wanted)
        except Exception as e:   # noqa: BLE001
            ok = warn_failed(f"reading the rows of layer {layer}", e)
        ops = [dist.P2POp(dist.isend, got.get(src_j, nan_row), self.ep_ranks[dst], self.group) if src == self.rank
               else dist.P2POp(dist.irecv, recv[dst_j], self.ep_ranks[src], self.group)
               for _, dst, dst_j, src, src_j in mine if src != dst]      # a row that stays: after the transfers
        posted = []
        try:
            transfer(ops, posted)
            recv.update({dst_j: got[src_j].clone() for _, dst, dst_j, src, src_j in mine if src == dst})
            verify_finite({(layer, j): t for j, t in recv.items()})
            for j, t in recv.items():
                staged[(layer, j)] = t.cpu()
                kept[(layer, j)] = got[j].cpu()
        except Exception as e:   # noqa: BLE001
            ok = warn_failed(f"moving the rows of layer {layer}", e)
            finish(ops, posted)          # whatever this rank did not post stands in: no peer waits
        return ok

    def _write(self, rows: Rows, values: dict) -> bool:
        try:
            for layer in sorted({layer for layer, _ in values}):
                rows.write(layer, {j: t.to(self.device) for (l, j), t in values.items() if l == layer})
            return True
        except Exception as e:   # noqa: BLE001
            return warn_failed("writing the moved rows", e)


class Placer:
    """One model's placement lifecycle, every rank together: check -> move -> flip -> count. `resident`: what the
    rows hold (serving's slots; training's home experts), `home`: the runtime's own layout. Serving's engine and
    training's placement each hold one and choose with `planning.placement.choose_placement`."""

    def __init__(self, mover: RowMover, home):
        self.mover, self.home, self.resident = mover, home, home
        self.replans = self.weight_moves = self.failed_moves = self.moved_bytes = 0

    def move(self, plan, rows, flip, replan: bool = True, row_bytes: int = 0) -> bool:
        """Copy the rows `plan` holds where `resident` does not (`slot_moves`), then `flip()` (the owner serves `plan`
        from the next forward) and count; or, when any rank fails, keep every rank's rows and tables (False).
        rows(): this rank's `Rows` and whether preparing them went well (asked only when something moves);
        replan: count a re-plan; row_bytes: a moved row's bytes (`moved_bytes`)."""
        moves = slot_moves(self.resident, plan)
        state, ok = rows() if moves else (None, True)
        if not self.mover.move(moves, placement_key(plan.phy2log), state, ok):     # agreed even with nothing to move
            self.failed_moves += 1
            return False
        self.resident = plan
        flip()
        self.replans += int(replan)
        self.weight_moves += len(moves)
        self.moved_bytes += row_bytes * sum(src != dst for _, dst, _, src, _ in moves)
        return True


def agree(ok: bool, key: int, device) -> bool:
    """Every rank succeeded (`ok`), and every rank planned the same placement (`key`, a hash of it: the view is
    identical everywhere). One all-reduce over every rank."""
    flags = torch.tensor([int(ok), key, -key], dtype=torch.long, device=device)
    if dist_ready() and dist.get_world_size() > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    if int(flags[1]) != -int(flags[2]):
        raise RuntimeError("easybalance: ranks planned different placements from what should be the same view")
    return bool(flags[0])


def placement_key(slots: torch.Tensor) -> int:
    """A 60-bit hash of a placement's slot map, for `agree`."""
    return int(hashlib.sha1(slots.cpu().numpy().tobytes()).hexdigest()[:15], 16)


def warn_failed(what: str, error: Exception) -> bool:
    warnings.warn(f"easybalance: {what} failed on rank {dist_rank()} ({type(error).__name__}: {error}); "
                  "every rank keeps the old placement")
    return False


def verify_finite(staging: dict) -> None:
    """What arrived must be finite (a move never loads garbage into a row)."""
    for (layer, j), flat in staging.items():
        if not bool(torch.isfinite(flat).all()):
            raise ValueError(f"layer {layer} row {j}: received non-finite values")


def _post(op: "dist.P2POp"):
    """Post one transfer (non-blocking); its work object."""
    return op.op(op.tensor, op.peer, op.group, op.tag)


def transfer(ops: list, posted: Optional[list] = None) -> None:
    """Post every transfer of a move and wait for each, so that no peer is left in a `wait()` that nothing will
    answer; `posted` collects the work of each op as it is posted. On NCCL the ops go as one group (posted one by
    one, a swap deadlocks) and a failure there is the communicator's. On gloo (which posts them one at a time
    anyway) each is posted on its own: one this rank fails to post is replaced by a stand-in of the same shape (a
    send of NaNs, which the receiver's check refuses; a receive into scratch), so the peer's matching operation
    completes; a wait that fails does not stop the others. Then the first error is raised."""
    posted = [] if posted is None else posted
    if not ops:
        return
    errors = []
    if dist.get_backend(ops[0].group) != "gloo":
        posted += dist.batch_isend_irecv(ops)
    else:
        for op in ops:
            try:
                posted.append(_post(op))
            except Exception as e:   # noqa: BLE001 - whatever failed, the peer's operation must still be matched
                errors.append(e)
                posted.append(_post(_stand_in(op)))
    _wait(list(posted), errors)


def finish(ops: list, posted: list) -> None:
    """After a move's transfer failed on this rank: post a stand-in for every op it did not post and wait for those,
    errors dropped, so that no peer is left waiting (the ops it posted were waited for in `transfer`). On gloo; on
    NCCL a failure is the communicator's."""
    rest = ops[len(posted):]
    if rest and dist.get_backend(rest[0].group) == "gloo":
        try:
            _wait([_post(_stand_in(op)) for op in rest], [])
        except RuntimeError:
            pass


def _stand_in(op: "dist.P2POp") -> "dist.P2POp":
    """The same transfer with its own buffer standing in (no allocation): NaNs sent, a receive into it."""
    return dist.P2POp(op.op, op.tensor.fill_(float("nan")) if op.op is dist.isend else op.tensor, op.peer, op.group,
                      op.tag)


def _wait(requests: list, errors: list) -> None:
    for request in requests:
        try:
            request.wait()
        except Exception as e:   # noqa: BLE001
            errors.append(e)
    if errors:
        # a fresh error, no traceback into the transfers: no work object outlives the move in a frame that an
        # exception keeps alive (a gloo work freed after its process group is gone at exit aborts the process)
        message = f"{type(errors[0]).__name__}: {errors[0]}"
        requests.clear(), errors.clear()
        raise RuntimeError(message)
