"""The exact split: each batch's routes to an expert divided over its copies so that the busiest EP rank takes as
few as it can, on the device (torch ops only, no host read, no loop over experts, tokens or ranks).

Shape legend: G EP ranks (devices), E logical experts, R copies of one expert, F experts with two or more copies,
Y = F * R.

    copies = Copies(devices_ER, num_devices)           # once per placement
    n_ER = copies.split(counts_E)                      # this batch's routes per copy, summed over every rank [E, R]
    mine_ER = rank_share(counts_GE, n_ER, rank)        # the part of it this rank sends
    split_GER = steer(counts_GE, devices_ER)           # both at once, for every source rank

An expert with one copy sends its routes there; the F others are split to minimise the sum of squared device loads
(a flow problem's least-squares loads are also its min-max ones), by water filling from the even split (`Copies.split`,
steps 1-3). Every rank computes the same split from the same counts: dense reductions, no atomics. The rounds a
placement needs are found once, on the host, when its `Copies` are built (`_rounds_needed`): experts whose copies
share no device settle in one round (so do experts on both of two ranks), a wide coupled layer takes all 16.
"""
from __future__ import annotations

from typing import Optional

import torch

from .slots import integer_tensor

__all__ = ["Copies", "steer", "rank_share", "even_split"]

ROUNDS = 16       # water-filling rounds per batch at most (docs/benchmarks.md: the split against the LP's busiest rank)
SETTLED = 1e-3    # a placement's rounds: the fewest whose device loads are within this share of ROUNDS' (test loads)
_FAR = 1e30       # the base load of a padded copy: never below a water level


class Copies:
    """Where one layer's experts are copied, as the split reads it (built on the host once per placement).

    devices_ER: [E, R] EP rank of each copy, -1 padded after an expert's copies; num_devices: G; device: where
    the split runs (the counts' device).
    """

    def __init__(self, devices_ER: torch.Tensor, num_devices: int, device=None):
        devices_ER = integer_tensor("devices_ER", devices_ER, "[experts, copies]")
        G = int(num_devices)
        if devices_ER.dim() != 2 or devices_ER.shape[1] < 1 or bool((devices_ER[:, 0] < 0).any()):
            raise ValueError(f"devices_ER must be [experts, copies] with a first copy for every expert, got "
                             f"{tuple(devices_ER.shape)}")
        if bool((devices_ER < -1).any()) or bool((devices_ER >= G).any()) or \
                bool(((devices_ER[:, :-1] < 0) & (devices_ER[:, 1:] >= 0)).any()):
            raise ValueError(f"devices_ER holds device ids outside [0, {G}), or a -1 before a copy (-1 pads the end)")
        n_E = (devices_ER >= 0).sum(1)
        self.E, self.G, self.R = devices_ER.shape[0], G, devices_ER.shape[1]
        valid_ER = devices_ER >= 0
        # built on the host (the calibration of `rounds` reads its results there), then moved to `device`. The F
        # experts with two or more copies are split; a padded copy sits on a bucket past the ranks (G) whose load
        # is far above any water level, so it takes no route
        self.flex_F = torch.nonzero(n_E >= 2).flatten()
        dev_ER = torch.where(valid_ER, devices_ER, G)
        dev_FR = dev_ER[self.flex_F, :int(n_E.max())]
        self.dev_FR, self.k_R = dev_FR, torch.arange(1, dev_FR.shape[1] + 1, dtype=torch.float64)
        self.even_FR = (dev_FR < G) / n_E[self.flex_F, None].double()
        self.onehot_YG = torch.nn.functional.one_hot(dev_FR.reshape(-1), G + 1).double()    # F x R copies' devices
        # [E, G + 1] each expert's even share of each device (none of the bucket's; its far load is `far_G`)
        self.even_EG = torch.nn.functional.one_hot(dev_ER, G + 1).sum(1).double() / n_E[:, None]
        self.even_EG[:, G] = 0.0
        self.far_G = (torch.arange(G + 1) == G).double() * _FAR
        self.single_ER = (torch.arange(self.R) == 0) & (n_E == 1)[:, None]     # an expert with one copy: all there
        self._real_Y = torch.nonzero(valid_ER.reshape(-1)).flatten()        # every real copy, for `_loads`
        self._dev_Y = devices_ER.reshape(-1)[self._real_Y]
        self.rounds = self._rounds_needed(n_E) if self.flex_F.numel() else 0
        for name in ("flex_F", "dev_FR", "k_R", "even_FR", "onehot_YG", "even_EG", "far_G", "single_ER"):
            setattr(self, name, getattr(self, name).to(device))

    def _rounds_needed(self, n_E: torch.Tensor) -> int:
        """The fewest rounds (1, 2, 4, ... ROUNDS) whose every device load is within SETTLED of the mean load of
        ROUNDS' on eight test loads (each expert's copies x a log-normal factor, seeded: every rank finds the
        same). On the host, once."""
        g = torch.Generator().manual_seed(0)
        loads = [(n_E * 1000 * torch.randn(self.E, generator=g).mul(0.5).exp()).long() for _ in range(8)]
        best = {}       # ROUNDS' loads, for the test loads a check reaches (the first that fails ends it)

        def settled(i: int, rounds: int) -> bool:
            b = best[i] if i in best else best.setdefault(i, self._loads(loads[i], ROUNDS))
            return float((self._loads(loads[i], rounds) - b).abs().max()) <= SETTLED * float(b.mean())
        rounds = 1
        while rounds < ROUNDS and not all(settled(i, rounds) for i in range(len(loads))):
            rounds *= 2
        return rounds

    def _loads(self, counts_E: torch.Tensor, rounds: int) -> torch.Tensor:
        """[G] each device's routes under the split of `rounds` rounds."""
        n_ER = self.split(counts_E, rounds)
        return torch.zeros(self.G, dtype=torch.float64, device=n_ER.device).index_add_(
            0, self._dev_Y, n_ER.reshape(-1)[self._real_Y].double())

    def split(self, counts_E: torch.Tensor, rounds: Optional[int] = None) -> torch.Tensor:
        """Routes per copy [E, R] (long) of this batch's routes per expert counts_E [E] (every rank's): the rows
        sum to counts_E, padding gets none. rounds: the placement's (`self.rounds`) unless given."""
        rounds = self.rounds if rounds is None else rounds
        n_ER = self.single_ER * counts_E.long()[:, None]
        if not self.flex_F.numel():
            return n_ER
        c_E = counts_E.double()
        load_G = torch.addmv(self.far_G, self.even_EG.T, c_E)                   # [G + 1]: the even split's loads
        c_F1 = c_E[self.flex_F, None]
        x_FR = c_F1 * self.even_FR
        for _ in range(rounds):
            # Step 1: each expert's water level over its copies' devices, the others' loads as they are: the lowest
            # (routes + the k lowest bases) / k over k (no k copies hold routes beyond it)
            base_FR = load_G[self.dev_FR] - x_FR
            level_F1 = base_FR.sort(1).values.cumsum_(1).add_(c_F1).div_(self.k_R).amin(1, keepdim=True)
            move_FR = (level_F1 - base_FR).clamp_min_(0.0).sub_(x_FR)
            # Step 2: every expert towards its target by the one step that lowers the sum of squares most (an exact
            # line search: the moves are linear in the step; the bucket moves nothing)
            move_G = move_FR.reshape(-1) @ self.onehot_YG
            step = (load_G @ move_G).neg_().div_((move_G @ move_G).clamp_min_(1e-30)).clamp_(0.0, 1.0)
            x_FR.addcmul_(move_FR, step)
            load_G.addcmul_(move_G, step)
        # Step 3: whole routes, each expert's split rounded cumulatively (rows keep their sums)
        ends_FR = torch.minimum(x_FR.clamp_min_(0.0).cumsum_(1).round_(), c_F1)
        ends_FR[:, -1:] = c_F1
        n_ER[self.flex_F, :ends_FR.shape[1]] = torch.diff(ends_FR, dim=1, prepend=torch.zeros_like(c_F1)).long()
        return n_ER


def rank_share(counts_GE: torch.Tensor, n_ER: torch.Tensor, rank: int | None = None,
               devices_ER: torch.Tensor | None = None) -> torch.Tensor:
    """The part of the split n_ER [E, R] (`Copies.split` of counts_GE.sum(0)) that `rank` sends, [E, R] (None:
    every rank's, [G, E, R]): each expert's routes are laid out rank after rank, its copies take them in order,
    and a rank's part of a copy is the overlap. counts_GE: [G, E] every rank's routes per expert. devices_ER (each
    copy's EP rank, -1 padded): each rank first fills its own copies, so fewer routes leave their rank."""
    counts_GE = counts_GE.long()
    if devices_ER is not None:
        own_GER = n_ER * (devices_ER == torch.arange(counts_GE.shape[0], device=n_ER.device)[:, None, None])
        ends_GER = own_GER.cumsum(2)
        kept_GER = torch.minimum(counts_GE[..., None], ends_GER) - torch.minimum(counts_GE[..., None], ends_GER - own_GER)
        out = kept_GER + rank_share(counts_GE - kept_GER.sum(2), n_ER - kept_GER.sum(0))
        return out if rank is None else out[rank]
    lo_GE = counts_GE.cumsum(0) - counts_GE
    if rank is not None:
        lo_GE, counts_GE = lo_GE[rank], counts_GE[rank]
    ends_ER = n_ER.cumsum(1)
    lo, hi = lo_GE[..., None], (lo_GE + counts_GE)[..., None]
    return (torch.minimum(hi, ends_ER) - torch.maximum(lo, ends_ER - n_ER)).clamp_min(0)


def steer(counts_GE: torch.Tensor, devices_ER: torch.Tensor, rounds: int = ROUNDS) -> torch.Tensor:
    """The exact split for every source rank: split_GER [G, E, R] (long), rank g's routes to each copy.

    counts_GE: [G, E] routes each rank sends to each expert this batch; devices_ER: [E, R] EP rank of each copy,
    -1 padded (e.g. `Placement.expert_devices()[layer]`). Conserves routes (split_GER.sum(2) == counts_GE) and
    uses only existing copies; each rank fills its own copies first, as the runtime does.
    """
    counts_GE = integer_tensor("counts_GE", counts_GE, "[ranks, experts]")
    if counts_GE.shape[0] < 1 or bool((counts_GE < 0).any()):
        raise ValueError(f"counts_GE must be non-negative routes from at least one rank, got {tuple(counts_GE.shape)}")
    devices_ER = integer_tensor("devices_ER", devices_ER, "[experts, copies]")
    copies = Copies(devices_ER, counts_GE.shape[0])
    if counts_GE.shape[1] != copies.E:
        raise ValueError(f"counts_GE has {counts_GE.shape[1]} experts, devices_ER {copies.E}")
    return rank_share(counts_GE, copies.split(counts_GE.sum(0), rounds), devices_ER=devices_ER)


def even_split(counts_GE: torch.Tensor, devices_ER: torch.Tensor) -> torch.Tensor:
    """Each source's routes for an expert divided evenly over its copies -> [G, E, R] (long)."""
    valid_ER = devices_ER >= 0
    n_E = valid_ER.sum(1).clamp_min(1)
    base, rem = counts_GE // n_E, counts_GE % n_E
    r_idx = torch.arange(devices_ER.shape[1])
    return (base[:, :, None] + (r_idx[None, None, :] < rem[:, :, None]).long()) * valid_ER[None]
