"""Placements in and out of files, and the before/after balance table `eb plan` prints.

Shape legend: L layers, E logical experts, G devices, S slots per device, P slots (G * S; slot p on device p // S).

    doc = placement_json(plan, dispatch="uniform", num_nodes=2, source="runs/main/balance")
    sglang = sglang_mapping(plan)          # {"physical_to_logical_map": [L][P]}: --init-expert-location
    table = balance_table(load_LE, {"trivial": trivial_placement(L, E, G, S), "planned": plan})

SGLang reads `--init-expert-location FILE.json` with `json.loads` and passes the dict as keyword arguments to
`ExpertLocationMetadata.init_by_mapping(physical_to_logical_map=...)`, so the file must hold that one key and nothing
else; physical slot p serves EP rank p // (P / ep_size), as here; P is num_logical + `--ep-num-redundant-experts`,
and every slot must hold an expert (tests/test_plan_export.py checks it against SGLang's parsing, re-implemented)."""
from __future__ import annotations

import numpy as np
import torch

from ..core.metrics import aggregate_balancedness, balancedness
from .flows import steered_load
from .placement import Placement
from .uniform import even_split_loads

__all__ = ["placement_json", "sglang_mapping"]

PLAN_FORMAT = "eb_deepspeed.placement/1"


def placement_json(plan: Placement, **meta) -> dict:
    """Our plan file: the index maps as lists, the shape, and `meta` (dispatch, num_nodes, source, ...)."""
    return {"format": PLAN_FORMAT, "num_layers": int(plan.phy2log.shape[0]), "num_experts": plan.num_experts,
            "num_devices": plan.num_devices, "slots_per_device": plan.slots_per_device, **meta,
            "phy2log": plan.phy2log.tolist(), "log2phy": plan.log2phy.tolist(), "logcnt": plan.logcnt.tolist()}


def sglang_mapping(plan: Placement) -> dict:
    """SGLang's `--init-expert-location` JSON: {"physical_to_logical_map": [L][P]} and nothing else."""
    if bool((plan.phy2log < 0).any()):
        raise ValueError("SGLang needs an expert in every physical slot; this plan leaves some empty")
    return {"physical_to_logical_map": plan.phy2log.tolist()}


def balance_table(load_LE, plans: dict[str, Placement]) -> dict[str, dict[str, dict[str, float]]]:
    """{layout: {dispatch: {"aggregate": ..., "worst_layer": ...}}}: balancedness (mean / max device load;
    aggregate = sum of means / sum of maxima, core/metrics.py) of each plan under an even split of each
    expert over its replicas ("uniform") and under free steering ("steered": `flows.steered_load`)."""
    load_LE = torch.as_tensor(np.asarray(load_LE), dtype=torch.float64)
    out = {}
    for name, plan in plans.items():   # [L, G] device loads under both dispatch models
        uniform = even_split_loads(plan.phy2log.numpy(), load_LE.numpy(), plan.num_devices, plan.slots_per_device)
        loads = {"uniform": torch.from_numpy(uniform), "steered": steered_load(plan, load_LE, iters=100)}
        out[name] = {dispatch: {"aggregate": round(aggregate_balancedness(y_LG), 4),
                                "worst_layer": round(float(balancedness(y_LG).min()), 4)}
                     for dispatch, y_LG in loads.items()}
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
