"""SGLang's reading of `--init-expert-location`, re-implemented from its source for our tests (not SGLang's
code): sglang 0.5.23, python/sglang/srt/eplb/expert_location.py (`compute_initial_expert_location_metadata`,
`ExpertLocationMetadata.init_by_mapping`, `_init_raw`, `_compute_logical_to_all_physical_map`,
`compute_logical_to_rank_dispatch_physical_map`). The parts that decide whether a file loads:

* "trivial", a path ending .pt (torch.load, weights_only), a path ending .json, or inline JSON;
* a dict with "physical_to_logical_map" is splatted into init_by_mapping(physical_to_logical_map,
  moe_ep_rank=None): any other key is a TypeError; else "logical_count" goes to EPLB; else an error;
* num_physical = the map's width, divisible by ep_size; physical p lives on rank p // (num_physical / ep_size);
* logical_to_all_physical_map: each logical expert's physical ids, -1 padded (an id >= num_logical is an
  IndexError; a logical expert with no physical slot breaks static dispatch with a division by zero).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch


def read_init_expert_location(data: str, *, num_layers: int, num_logical: int, ep_size: int,
                              gpus_per_node: int) -> dict:
    if data == "trivial":
        p2l = (torch.arange(num_logical).repeat(num_layers, 1))
        return _metadata(p2l, num_layers, num_logical, ep_size, gpus_per_node)
    if data.endswith(".pt"):
        data_dict = torch.load(data, weights_only=True, map_location="cpu")
    elif data.endswith(".json"):
        data_dict = json.loads(Path(data).read_text())
    else:
        data_dict = json.loads(data)
    if "physical_to_logical_map" in data_dict:
        return _init_by_mapping(**data_dict, num_layers=num_layers, num_logical=num_logical, ep_size=ep_size,
                                gpus_per_node=gpus_per_node)
    if "logical_count" in data_dict:
        raise NotImplementedError("the logical_count path runs SGLang's own EPLB (not re-implemented here)")
    raise NotImplementedError(f"Unknown init_expert_location format ({list(data_dict.keys())=})")


def _init_by_mapping(physical_to_logical_map, moe_ep_rank=None, *, num_layers, num_logical, ep_size, gpus_per_node):
    if not isinstance(physical_to_logical_map, torch.Tensor):
        physical_to_logical_map = torch.tensor(physical_to_logical_map)
    return _metadata(physical_to_logical_map, num_layers, num_logical, ep_size, gpus_per_node)


def _metadata(p2l: torch.Tensor, num_layers: int, num_logical: int, ep_size: int, gpus_per_node: int) -> dict:
    layers, num_physical = p2l.shape
    assert layers == num_layers, f"map has {layers} layers, the model {num_layers}"
    assert num_physical % ep_size == 0
    num_local = num_physical // ep_size
    lists = [[[] for _ in range(num_logical)] for _ in range(layers)]
    for l in range(layers):
        for p in range(num_physical):
            lists[l][int(p2l[l, p])].append(p)          # IndexError for ids >= num_logical (negative ids wrap)
    max_len = max(len(inner) for outer in lists for inner in outer)
    padded = torch.tensor([[inner + [-1] * (max_len - len(inner)) for inner in outer] for outer in lists])
    l2all = torch.nn.functional.pad(padded, (0, num_physical - padded.shape[-1]), value=-1)
    num_valid = torch.count_nonzero(l2all != -1, dim=-1)
    # static dispatch: each rank takes a replica on its own GPU, else on its node, else a fair random choice
    rng = random.Random(42)
    gpu_of = lambda p: p // num_local
    dispatch = torch.full((ep_size, layers, num_logical), -1, dtype=torch.long)
    for l in range(layers):
        for e in range(num_logical):
            cands = lists[l][e]
            remaining = []
            for r in range(ep_size):
                same_gpu = [p for p in cands if gpu_of(p) == r]
                same_node = [p for p in cands if gpu_of(p) // gpus_per_node == r // gpus_per_node]
                if len(cands) == 1:
                    dispatch[r, l, e] = cands[0]
                elif same_gpu:
                    dispatch[r, l, e] = same_gpu[0]
                elif same_node and len(same_node) < len(cands):
                    dispatch[r, l, e] = same_node[0]
                else:
                    remaining.append(r)
            if remaining:
                q, extra = divmod(len(remaining), len(cands))        # ZeroDivisionError: an expert without a slot
                picks = cands * q + rng.sample(cands, extra)
                for r, p in zip(remaining, picks):
                    dispatch[r, l, e] = p
    return {"physical_to_logical_map": p2l, "logical_to_all_physical_map": l2all,
            "logical_to_all_physical_map_num_valid": num_valid, "num_local_physical_experts": num_local,
            "logical_to_rank_dispatch_physical_map": dispatch}
