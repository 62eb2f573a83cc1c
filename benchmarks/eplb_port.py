"""A port of DeepSeek's Expert Parallelism Load Balancer, for side-by-side comparison only.

Source: https://github.com/deepseek-ai/EPLB, `eplb.py` at commit d52c72d5b2f2fb4c41afbf8eb21366820239913d
(2025-03-24), MIT License, Copyright (c) 2025 DeepSeek. The algorithm is kept step for step (same
greedy orders, same tie-breaking, same Python loops) so that both its plans and its running time
are the published algorithm's; only names and layout differ. This file is not part of the package.

    phy2log, log2phy, logcnt = rebalance_experts(weight_LE, num_replicas, num_groups, num_nodes, num_gpus)

Policies: hierarchical when num_groups % num_nodes == 0 (groups packed to nodes, replication within
nodes, packing onto the node's GPUs), else global (the hierarchical steps with one group, one node).
`rebalance_global` forces the global policy. Note that EPLB's packing does not stop two replicas of one
expert from landing on one GPU.
"""
from __future__ import annotations

import torch

__all__ = ["balanced_packing", "replicate_experts", "rebalance_experts_hierarchical", "rebalance_experts",
           "rebalance_global"]


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Items [X, n] into num_packs packs of n / num_packs items each: heaviest first, each to the lightest
    pack that still has room. Returns (pack of each item, rank of the item in its pack), both [X, n]."""
    rows, n = weight.shape
    assert n % num_packs == 0
    per_pack = n // num_packs
    if per_pack == 1:
        return (torch.arange(n, dtype=torch.int64).expand(weight.shape),
                torch.zeros_like(weight, dtype=torch.int64))
    order = weight.float().sort(-1, descending=True).indices.cpu()
    pack_index = torch.full_like(weight, -1, dtype=torch.int64, device="cpu")
    rank_in_pack = torch.full_like(pack_index, -1)
    for i in range(rows):
        pack_weights = [0] * num_packs
        pack_items = [0] * num_packs
        for item in order[i]:
            pack = min((j for j in range(num_packs) if pack_items[j] < per_pack), key=pack_weights.__getitem__)
            pack_index[i, item] = pack
            rank_in_pack[i, item] = pack_items[pack]
            pack_weights[pack] += weight[i, item]
            pack_items[pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: torch.Tensor, num_phy: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """num_phy - num_log extra replicas, one at a time, each to the expert with the largest load per
    replica. Returns phy2log [X, num_phy], replica rank [X, num_phy], logcnt [X, num_log]."""
    n, num_log = weight.shape
    assert num_phy >= num_log
    phy2log = torch.arange(num_phy, dtype=torch.int64).repeat(n, 1)
    rank = torch.zeros(n, num_phy, dtype=torch.int64)
    logcnt = torch.ones(n, num_log, dtype=torch.int64)
    rows = torch.arange(n, dtype=torch.int64)
    for i in range(num_log, num_phy):
        pick = (weight / logcnt).max(dim=-1).indices
        phy2log[:, i] = pick
        rank[:, i] = logcnt[rows, pick]
        logcnt[rows, pick] += 1
    return phy2log, rank, logcnt


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.size(1), dtype=torch.int64).expand(perm.shape))
    return inv


def rebalance_experts_hierarchical(weight: torch.Tensor, num_physical_experts: int, num_groups: int,
                                   num_nodes: int, num_gpus: int):
    """EPLB's hierarchical policy. Returns phy2log [L, P], replica rank [L, P], logcnt [L, E]."""
    num_layers, num_logical = weight.shape
    assert num_logical % num_groups == 0 and num_groups % num_nodes == 0
    assert num_gpus % num_nodes == 0 and num_physical_experts % num_gpus == 0
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    phy_per_gpu = num_physical_experts // num_gpus

    # Step 1: pack expert groups onto nodes.
    tokens_per_group = weight.unflatten(-1, (num_groups, group_size)).sum(-1)
    group_pack, group_rank = balanced_packing(tokens_per_group, num_nodes)
    log2mlog = (((group_pack * groups_per_node + group_rank) * group_size).unsqueeze(-1)
                + torch.arange(group_size, dtype=torch.int64)).flatten(-2)
    mlog2log = _inverse(log2mlog)

    # Step 2: replicate experts within each node.
    tokens_per_mlog = weight.gather(-1, mlog2log).view(-1, num_logical // num_nodes)
    phy2mlog, phyrank, mlogcnt = replicate_experts(tokens_per_mlog, num_physical_experts // num_nodes)

    # Step 3: pack the physical experts onto each node's GPUs.
    tokens_per_phy = (tokens_per_mlog / mlogcnt).gather(-1, phy2mlog)
    pack, rank_in_pack = balanced_packing(tokens_per_phy, num_gpus // num_nodes)
    phy2pphy = pack * phy_per_gpu + rank_in_pack
    pphy2phy = _inverse(phy2pphy)

    pphy2mlog = phy2mlog.gather(-1, pphy2phy)
    pphy2mlog = (pphy2mlog.view(num_layers, num_nodes, -1)
                 + torch.arange(0, num_logical, num_logical // num_nodes).view(1, -1, 1)).flatten(-2)
    pphy2log = mlog2log.gather(-1, pphy2mlog)
    pphyrank = phyrank.gather(-1, pphy2phy).view(num_layers, -1)
    logcnt = mlogcnt.view(num_layers, -1).gather(-1, log2mlog)
    return pphy2log, pphyrank, logcnt


def _with_log2phy(weight, num_replicas, phy2log, phyrank, logcnt):
    num_layers, num_logical = weight.shape
    maxcnt = int(logcnt.max())
    log2phy = torch.full((num_layers, num_logical, maxcnt), -1, dtype=torch.int64)
    log2phy.view(num_layers, -1).scatter_(-1, phy2log * maxcnt + phyrank,
                                          torch.arange(num_replicas, dtype=torch.int64).expand(num_layers, -1))
    return phy2log, log2phy, logcnt


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int):
    """EPLB's entry point: hierarchical when num_nodes divides num_groups, else global.
    Returns phy2log [L, P], log2phy [L, E, R] (-1 padded), logcnt [L, E]."""
    weight = weight.float().cpu()
    if num_groups % num_nodes == 0:
        parts = rebalance_experts_hierarchical(weight, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        parts = rebalance_experts_hierarchical(weight, num_replicas, 1, 1, num_gpus)
    return _with_log2phy(weight, num_replicas, *parts)


def rebalance_global(weight: torch.Tensor, num_replicas: int, num_gpus: int):
    """EPLB's global policy (what `rebalance_experts` runs when the nodes do not divide the groups)."""
    weight = weight.float().cpu()
    return _with_log2phy(weight, num_replicas, *rebalance_experts_hierarchical(weight, num_replicas, 1, 1, num_gpus))
