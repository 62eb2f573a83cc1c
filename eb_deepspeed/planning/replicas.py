"""Replica slots filled from one micro-batch's counts, beside fixed homes, and the exact split over the copies: what
each rank computes, chosen on the device (torch ops of fixed shapes, no host read, no loop over experts or ranks),
the same on every rank from the same counts.

Shape legend: L layers (or any batch of independent layers), E experts, G EP ranks, R replica slots a rank.

    replica_LGR = choose_replicas(counts_LE, home_LE, G, R)      # the expert in each rank's replica slots, -1 empty
    holds_LGE = copies(home_LE, replica_LGR, G)                  # which ranks hold a copy of which expert
    n_LGE = steering.split(counts_LE, holds_LGE)                 # routes of each expert each rank computes

`choose_replicas` fills the slots in waves. Each wave, under the split over the copies chosen so far:
  1. every rank above the mean load lays out the routes it holds above it, its largest experts first (pieces),
     the ranks by how far above they are; every rank below the mean with a free slot lays out its room below it,
     the largest room first;
  2. each such rank takes a copy of the piece at the middle of its room (one slot a wave): hot experts spread over
     as many rooms as they cover, which a pairing of ranks (one copy a wave) cannot;
  3. a copy is kept only where the routes it could take (its piece, up to the room) reach `min_routes`: what its
     weights and gradients cost on the link (`moves.transfer_stall`).
Then the exact split (`steering.split`) divides each expert's routes over its copies."""
from __future__ import annotations

import torch

from .steering import Fill, water_fill

__all__ = ["choose_replicas", "copies"]

WAVES = 8           # waves of the choice: 6-8 reached the best balancedness on the ESFT replay (docs/benchmarks.md)
WAVE_ROUNDS = 8     # water-filling rounds of each wave's split, from the even split (fewer, or from the last wave's
                    # split, chose worse: 0.967 / 0.954 at EP 32 against 0.974 on the replay, docs/benchmarks.md)


def copies(home_LE: torch.Tensor, replica_LGR: torch.Tensor, num_devices: int) -> torch.Tensor:
    """holds_LGE [L, G, E] bool: rank g holds a copy of expert e (its home, home_LE [L, E], or one of its replica
    slots, replica_LGR [L, G, R], -1 empty)."""
    L, E = home_LE.shape
    holds = torch.zeros(L, num_devices, E + 1, dtype=torch.bool, device=home_LE.device)
    holds.scatter_(1, home_LE[:, None, :], True)
    holds.scatter_(2, torch.where(replica_LGR >= 0, replica_LGR, E), True)         # column E: the empty slots
    return holds[:, :, :E]


def choose_replicas(counts_LE: torch.Tensor, home_LE: torch.Tensor, num_devices: int, slots: int,
                    min_routes: float = 0.0, waves: int = WAVES, rounds: int = WAVE_ROUNDS) -> torch.Tensor:
    """The experts to copy into each rank's replica slots: replica_LGR [L, G, R] (long, -1 empty), never an expert
    a rank already holds.

    counts_LE: [L, E] this micro-batch's routes per expert (every rank's); home_LE: [L, E] each expert's home rank;
    min_routes: the fewest routes a copy must be able to take to be made (its transfer's price)."""
    c = counts_LE.to(torch.float64)
    L, E = c.shape
    G, R, dev = int(num_devices), int(slots), c.device
    holds = copies(home_LE, torch.full((L, G, R), -1, dtype=torch.long, device=dev), G)
    replica = torch.full((L, G, R), -1, dtype=torch.long, device=dev)
    free = torch.full((L, G), R, dtype=torch.long, device=dev)
    mean = c.sum(1, keepdim=True) / G
    layer = torch.arange(L, device=dev)[:, None].expand(L, G)
    for _ in range(waves if R else 0):                  # no slots: nothing to fill
        # Step 1: the split over the copies so far (water filling from the even split); pieces above the mean,
        # rooms below it
        x_LGE = water_fill(c, holds, holds * (c / holds.sum(1)).unsqueeze(1), Fill(rounds))
        load_LG = x_LGE.sum(2)
        excess_LG = (load_LG - mean).clamp_min(0.0)
        room_LG = torch.where(free > 0, (mean - load_LG).clamp_min(0.0), 0.0)
        x_sorted, expert_sorted = torch.sort(x_LGE, dim=2, descending=True, stable=True)
        piece = (excess_LG.unsqueeze(2) - (x_sorted.cumsum(2) - x_sorted)).clamp_min(0.0).minimum(x_sorted)
        donors = torch.argsort(excess_LG, dim=1, descending=True, stable=True).unsqueeze(2).expand(L, G, E)
        piece_N = piece.gather(1, donors).reshape(L, G * E)                    # donors in turn, largest first
        expert_N = expert_sorted.gather(1, donors).reshape(L, G * E)
        ends_N = piece_N.cumsum(1)
        # Step 2: each taker (largest room first) takes the piece at the middle of its room
        taker = torch.argsort(room_LG, dim=1, descending=True, stable=True)
        room = room_LG.gather(1, taker)
        middle = room.cumsum(1) - room / 2
        at = torch.searchsorted(ends_N, middle, right=True).clamp_max(G * E - 1)
        expert = expert_N.gather(1, at)
        # Step 3: kept where the copy can take what its transfer costs, on a rank without a copy of it
        can_take = torch.minimum(room, piece_N.gather(1, at))
        keep = (room > 0) & (middle < ends_N[:, -1:]) & ~holds[layer, taker, expert] & \
            (can_take >= min_routes) & (can_take > 0)
        row = (R - free.gather(1, taker)).clamp_max(R - 1)
        replica[layer, taker, row] = torch.where(keep, expert, replica[layer, taker, row])
        holds[layer, taker, expert] |= keep
        free = free - torch.zeros_like(free).scatter(1, taker, keep.long())
    return replica
