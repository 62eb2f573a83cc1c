"""Placements in and out of files, and the before/after balance table `eb plan` prints.

Shape legend: L layers, E logical experts, G devices, S slots per device, P physical slots (G * S;
slot p lives on device p // S).

    doc = placement_json(plan, dispatch="uniform", num_nodes=2, source="runs/main/balance")
    plan = read_placement_json("plan.json")
    sglang = sglang_mapping(plan)          # {"physical_to_logical_map": [L][P]}: --init-expert-location
    table = balance_table(load_LE, {"trivial": trivial_placement(L, E, G, S), "planned": plan})

SGLang reads `--init-expert-location FILE.json` with `json.loads` and passes the dict as keyword
arguments to `ExpertLocationMetadata.init_by_mapping(physical_to_logical_map=...)`, so the file must
hold that one key and nothing else; physical slot p serves EP rank p // (P / ep_size), as here; P is
num_logical + `--ep-num-redundant-experts`, and every slot must hold an expert (checked in
tests/test_plan_export.py against a re-implementation of SGLang's parsing).
"""
from __future__ import annotations

import json

import numpy as np
import torch

from ..core.metrics import aggregate_balancedness, balancedness
from .flows import steered_load
from .placement import Placement, index_maps
from .uniform import device_loads

__all__ = ["PLAN_FORMAT", "placement_json", "read_placement_json", "sglang_mapping", "trivial_placement",
           "balance_table", "format_balance_table"]

PLAN_FORMAT = "eb_deepspeed.placement/1"


def trivial_placement(num_layers: int, num_experts: int, num_devices: int, slots_per_device: int) -> Placement:
    """The layout without a planner: slot p holds expert p % E (DeepSpeed's contiguous layout when P == E;
    SGLang's `trivial` and vLLM's `linear` layouts with redundant slots)."""
    P = num_devices * slots_per_device
    if P < num_experts:
        raise ValueError(f"{num_devices} devices x {slots_per_device} slots ({P}) cannot hold {num_experts} experts")
    phy = (torch.arange(P) % num_experts).expand(num_layers, P).clone()
    return index_maps(phy, num_experts, num_devices, slots_per_device)


def placement_json(plan: Placement, **meta) -> dict:
    """Our plan file: the index maps as lists, the shape, and `meta` (dispatch, num_nodes, source, ...)."""
    return {"format": PLAN_FORMAT, "num_layers": int(plan.phy2log.shape[0]), "num_experts": plan.num_experts,
            "num_devices": plan.num_devices, "slots_per_device": plan.slots_per_device, **meta,
            "phy2log": plan.phy2log.tolist(), "log2phy": plan.log2phy.tolist(), "logcnt": plan.logcnt.tolist()}


def read_placement_json(path: str) -> Placement:
    """A Placement from our plan file; ValueError naming the file and the problem when it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read a plan ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
        raise ValueError(f"{path}: not an eb_deepspeed plan (expected \"format\": \"{PLAN_FORMAT}\")")
    try:
        G, S, E = int(doc["num_devices"]), int(doc["slots_per_device"]), int(doc["num_experts"])
        phy = torch.tensor(doc["phy2log"], dtype=torch.long)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: malformed plan ({type(e).__name__}: {e})") from None
    if phy.dim() != 2 or phy.shape[1] != G * S or bool((phy < -1).any()) or bool((phy >= E).any()):
        raise ValueError(f"{path}: phy2log must be [layers, {G} x {S}] of expert ids in [-1, {E})")
    plan = index_maps(phy, E, G, S)
    if not bool((plan.logcnt >= 1).all()) or not bool((plan.holds().sum(1) == plan.logcnt).all()):
        raise ValueError(f"{path}: phy2log leaves an expert without a replica or puts two on one device")
    if plan.logcnt.tolist() != doc.get("logcnt", plan.logcnt.tolist()):
        raise ValueError(f"{path}: logcnt does not match phy2log")
    return plan


def sglang_mapping(plan: Placement) -> dict:
    """SGLang's `--init-expert-location` JSON: {"physical_to_logical_map": [L][P]} and nothing else."""
    if bool((plan.phy2log < 0).any()):
        raise ValueError("SGLang needs an expert in every physical slot; this plan leaves some empty")
    return {"physical_to_logical_map": plan.phy2log.tolist()}


def _loads(load_LE: torch.Tensor, plan: Placement) -> dict[str, torch.Tensor]:
    """[L, G] device loads under both dispatch models."""
    uniform = device_loads(plan.phy2log.numpy(), load_LE.numpy(), plan.num_devices, plan.slots_per_device)
    return {"uniform": torch.from_numpy(uniform), "steered": steered_load(plan, load_LE, iters=100)}


def balance_table(load_LE, plans: dict[str, Placement]) -> dict[str, dict[str, dict[str, float]]]:
    """{layout: {dispatch: {"aggregate": ..., "worst_layer": ...}}}: balancedness (mean / max device load;
    aggregate = sum of means / sum of maxima, core/metrics.py) of each plan under an even split of each
    expert over its replicas ("uniform") and under free steering ("steered": `flows.steered_load`)."""
    load_LE = torch.as_tensor(np.asarray(load_LE), dtype=torch.float64)
    out = {}
    for name, plan in plans.items():
        out[name] = {}
        for dispatch, y_LG in _loads(load_LE, plan).items():
            out[name][dispatch] = {"aggregate": round(aggregate_balancedness(y_LG), 4),
                                   "worst_layer": round(float(balancedness(y_LG).min()), 4)}
    return out


def format_balance_table(table: dict) -> str:
    """The table as aligned text, one row per layout."""
    width = max(len(name) for name in table) + 2
    lines = [f"{'':{width}}{'uniform dispatch':>26}{'steered dispatch':>26}",
             f"{'layout':{width}}{'aggregate':>13}{'worst layer':>13}{'aggregate':>13}{'worst layer':>13}"]
    for name, row in table.items():
        u, s = row["uniform"], row["steered"]
        lines.append(f"{name:{width}}{u['aggregate']:>13.4f}{u['worst_layer']:>13.4f}"
                     f"{s['aggregate']:>13.4f}{s['worst_layer']:>13.4f}")
    return "\n".join(lines)
