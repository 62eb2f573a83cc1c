"""The exact split: each batch's routes to an expert divided over its copies so that the busiest EP rank takes as
few as it can, on the device (torch ops of fixed shapes, no host read, no loop over experts, tokens or ranks). One
split for serving's placements and training's replicas chosen each micro-batch.

Shape legend: L layers (independent splits side by side), G EP ranks, E logical experts, R copies of one expert.

    n_LGE = split(counts_LE, holds_LGE)                # routes of each expert each rank computes
    mine_ER = rank_share(counts_GE, n_ER)[rank]        # the part of a split this rank sends
    split_GER = steer(counts_GE, devices_ER)           # both at once, for every source rank

Water filling: an expert's routes go to its copies so that the sum of squared device loads is least (a flow
problem's least-squares loads are also its min-max ones). Each round every expert computes its water level over its
copies' ranks, the others' loads as they are, and all step towards theirs by one exact line search (the moves are
linear in the step); then whole routes. What a placement's split needs is found once, on the host (`fill_of`): the
experts with two or more copies (the only ones filled), the most copies one has (a level reads that many lowest
bases), the rounds (experts whose copies share no rank settle in one, a wide coupled layer takes all 16)."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .slots import integer_tensor

__all__ = ["split", "steer", "rank_share"]

ROUNDS = 16       # water-filling rounds per batch at most (docs/benchmarks.md: the split against the LP's busiest rank)
SETTLED = 1e-3    # a placement's rounds: the fewest whose device loads are within this share of ROUNDS' (test loads)


class Fill(NamedTuple):
    """What a split fills: `rounds` of water filling, only the experts flex_F [F] (None: all), whose copies are at
    most `copies` (None: every rank)."""
    rounds: int = ROUNDS
    flex_F: Optional[torch.Tensor] = None
    copies: Optional[int] = None


def water_fill(c_LE: torch.Tensor, holds_LGE: torch.Tensor, x_LGE: torch.Tensor, fill: Fill,
               fixed_LG: torch.Tensor | None = None) -> torch.Tensor:
    """`fill.rounds` rounds of water filling from x_LGE [L, G, E] (each expert's routes on each rank, float64, summing
    to c_LE [L, E] over G, zero where holds_LGE is False); fixed_LG: each rank's routes of experts not filled."""
    C = fill.copies or holds_LGE.shape[1]
    c, k = c_LE.unsqueeze(1), torch.arange(1, C + 1, dtype=torch.float64, device=c_LE.device).view(1, C, 1)
    off = torch.zeros_like(x_LGE).masked_fill_(~holds_LGE, torch.finfo(torch.float64).max / 4)  # no copy: far away
    neg_x = x_LGE.neg()
    load = x_LGE.sum(2, keepdim=True) if fixed_LG is None else x_LGE.sum(2, keepdim=True) + fixed_LG.unsqueeze(2)
    for _ in range(fill.rounds):
        # Step 1: each expert's level: the lowest (routes + its k lowest bases) / k (base: a load less its routes)
        base = (load + off).add_(neg_x)
        level = base.topk(C, 1, largest=False).values.cumsum_(1).add_(c).div_(k).amin(1, keepdim=True)
        # Step 2: all towards their levels (no copy: it moves nothing) by the step least in squared loads (negated)
        move = (level - base).clamp_min_(0.0).add_(neg_x)
        move_G = move.sum(2, keepdim=True)
        step = (load * move_G).sum(1, keepdim=True).div_((move_G * move_G).sum(1, keepdim=True).clamp_min_(1e-30))
        neg_x.add_(move.mul_(step.clamp_(-1.0, 0.0)))
        load.sub_(move_G.mul_(step))
    return neg_x.neg_()


def split(counts_LE: torch.Tensor, holds_LGE: torch.Tensor, fill: Fill = Fill()) -> torch.Tensor:
    """n_LGE [L, G, E] (long): the routes of each expert (counts_LE [L, E], integers, every rank's; each expert with
    routes has a copy) that each rank holding one (holds_LGE [L, G, E] bool) computes, so that the busiest rank takes
    as few as it can; sums over G to counts_LE, zero where there is no copy. fill: `fill_of` the holds, which the L
    layers must then share (the experts outside flex_F keep their routes on one copy; flex_F on counts' device)."""
    if fill.flex_F is None:
        return _split(counts_LE, holds_LGE, fill)
    one_copy, flex_F = holds_LGE * counts_LE.long().unsqueeze(1), fill.flex_F
    return one_copy.index_copy_(2, flex_F, _split(counts_LE[:, flex_F], holds_LGE[:, :, flex_F], fill,
                                                  one_copy.index_fill(2, flex_F, 0).sum(2)))


def _split(counts_LE: torch.Tensor, holds_LGE: torch.Tensor, fill: Fill, fixed_LG: torch.Tensor | None = None):
    """Water filling from the even split, then whole routes: each expert's split rounded cumulatively over the ranks
    (float drift to its largest copy)."""
    c = counts_LE.to(torch.float64)
    x = water_fill(c, holds_LGE, holds_LGE * (c / holds_LGE.sum(1).clamp_min(1)).unsqueeze(1), fill, fixed_LG)
    ends = torch.minimum(x.clamp_min(0.0).cumsum(1).round(), c.unsqueeze(1))
    n = torch.diff(ends, dim=1, prepend=torch.zeros_like(ends[:, :1])).long()
    largest = torch.where(holds_LGE, x, -1.0).argmax(1, keepdim=True)             # a copy, whatever the drift
    return n.scatter_add_(1, largest, (counts_LE.long() - n.sum(1)).unsqueeze(1))


def fill_of(holds_GE: torch.Tensor, rounds: Optional[int] = None) -> Fill:
    """One layer's placement's `Fill` (on the host, once per placement): its experts with two or more copies, the
    most copies, and `rounds`, or (None) the fewest rounds (1, 2, 4, ... ROUNDS) whose every device load is within
    SETTLED of the mean load of ROUNDS' on eight test loads (each expert's copies x a log-normal factor, seeded:
    every rank finds the same)."""
    n_E = holds_GE.sum(0).cpu()
    flex_F = torch.nonzero(n_E >= 2).flatten()
    fill = Fill(rounds if rounds is not None else ROUNDS if len(flex_F) else 0, flex_F, int(n_E.max()))
    if rounds is not None or not len(flex_F):
        return fill
    holds, g = holds_GE.cpu()[None].expand(8, -1, -1), torch.Generator().manual_seed(0)
    loads = torch.stack([(n_E * 1000 * torch.randn(len(n_E), generator=g).mul(0.5).exp()).long() for _ in range(8)])
    best = split(loads, holds, fill).sum(2).double()
    settled = (fill._replace(rounds=r) for r in (1, 2, 4, 8)
               if (split(loads, holds, fill._replace(rounds=r)).sum(2) - best).abs().max() <= SETTLED * best.mean())
    return next(settled, fill)


def rank_share(counts_GE: torch.Tensor, n_ER: torch.Tensor, devices_ER: torch.Tensor | None = None) -> torch.Tensor:
    """The part of the split n_ER [E, R] (routes per copy, summing to counts_GE.sum(0)) that `rank` sends, [E, R]
    (None: every rank's, [G, E, R]): each expert's routes are laid out rank after rank, its copies take them in
    order, and a rank's part of a copy is the overlap. counts_GE: [G, E] every rank's routes per expert. devices_ER
    (each copy's EP rank, -1 padded): each rank first fills its own copies, so fewer routes leave their rank."""
    counts_GE = counts_GE.long()
    if devices_ER is not None:
        own_GER = n_ER * (devices_ER == torch.arange(counts_GE.shape[0], device=n_ER.device)[:, None, None])
        ends_GER = own_GER.cumsum(2)
        kept_GER = torch.minimum(counts_GE[..., None], ends_GER) - torch.minimum(counts_GE[..., None], ends_GER - own_GER)
        out = kept_GER + rank_share(counts_GE - kept_GER.sum(2), n_ER - kept_GER.sum(0))
        return out
    lo_GE = counts_GE.cumsum(0) - counts_GE
    ends_ER = n_ER.cumsum(1)
    lo, hi = lo_GE[..., None], (lo_GE + counts_GE)[..., None]
    return (torch.minimum(hi, ends_ER) - torch.maximum(lo, ends_ER - n_ER)).clamp_min(0)


def steer(counts_GE: torch.Tensor, devices_ER: torch.Tensor) -> torch.Tensor:
    """The exact split for every source rank: split_GER [G, E, R] (long), rank g's routes to each copy.

    counts_GE: [G, E] routes each rank sends to each expert this batch; devices_ER: [E, R] EP rank of each copy,
    -1 padded after an expert's copies (e.g. `Placement.expert_devices()[layer]`). Conserves routes
    (split_GER.sum(2) == counts_GE) and uses only existing copies; each rank fills its own copies first, as the
    runtime does."""
    counts_GE = integer_tensor("counts_GE", counts_GE, "[ranks, experts]")
    if counts_GE.shape[0] < 1 or bool((counts_GE < 0).any()):
        raise ValueError(f"counts_GE must be non-negative routes from at least one rank, got {tuple(counts_GE.shape)}")
    devices_ER = integer_tensor("devices_ER", devices_ER, "[experts, copies]")
    G = counts_GE.shape[0]
    if devices_ER.dim() != 2 or devices_ER.shape[1] < 1 or bool((devices_ER[:, 0] < 0).any()):
        raise ValueError(f"devices_ER must be [experts, copies] with a first copy for every expert, got "
                         f"{tuple(devices_ER.shape)}")
    if bool((devices_ER < -1).any()) or bool((devices_ER >= G).any()) or \
            bool(((devices_ER[:, :-1] < 0) & (devices_ER[:, 1:] >= 0)).any()):
        raise ValueError(f"devices_ER holds device ids outside [0, {G}), or a -1 before a copy (-1 pads the end)")
    if counts_GE.shape[1] != devices_ER.shape[0]:
        raise ValueError(f"counts_GE has {counts_GE.shape[1]} experts, devices_ER {devices_ER.shape[0]}")
    E = devices_ER.shape[0]
    holds_GE = torch.zeros(G, E + 1, dtype=torch.bool).index_put_(
        (devices_ER.clamp_min(0).reshape(-1), torch.where(devices_ER >= 0, torch.arange(E)[:, None], E).reshape(-1)),
        torch.tensor(True))[:, :E]
    if not torch.equal(holds_GE.sum(0), (devices_ER >= 0).sum(1)):
        raise ValueError("devices_ER holds two copies of an expert on one device")
    n_GE = split(counts_GE.sum(0)[None], holds_GE[None], fill_of(holds_GE, ROUNDS))[0]
    n_ER = torch.where(devices_ER >= 0, n_GE.T.gather(1, devices_ER.clamp_min(0)), 0)     # by copy, the caller's order
    return rank_share(counts_GE, n_ER, devices_ER=devices_ER)
