"""Placements in and out of files, and the before/after balance table `eb plan` prints.

Shape legend: L layers, E logical experts, G devices, S slots per device, P slots (G * S; slot p on device p // S).

    doc = placement_json(plan, dispatch="uniform", num_nodes=2, source="runs/main/balance")
    sglang = sglang_mapping(plan, load_LE) # {"physical_to_logical_map": [L][P]}: --init-expert-location
    table = balance_table(load_LE, {"trivial": trivial_placement(L, E, G, S), "planned": plan})

SGLang reads `--init-expert-location FILE.json` with `json.loads` and passes the dict as keyword arguments to
`ExpertLocationMetadata.init_by_mapping(physical_to_logical_map=...)`, so the file must hold that one key and nothing
else; physical slot p serves EP rank p // (P / ep_size), as here; P is num_logical + `--ep-num-redundant-experts`,
and every slot must hold an expert (tests/test_plan_export.py checks it against SGLang's parsing, re-implemented):
a slot our plan leaves empty gets the copy that raises its layer's busiest device least under SGLang's even split."""
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


def sglang_mapping(plan: Placement, load_LE=None) -> dict:
    """SGLang's `--init-expert-location` JSON: {"physical_to_logical_map": [L][P]} and nothing else. Empty slots
    are filled (module doc) from load_LE [L, E], the load the plan was made for; without it they are refused."""
    phy_LP = plan.phy2log.clone()
    empty = torch.nonzero(phy_LP < 0).tolist()
    if empty and load_LE is None:
        raise ValueError("SGLang needs an expert in every physical slot; this plan leaves some empty")
    load_LE = torch.as_tensor(np.asarray(load_LE if empty else []), dtype=torch.float64)
    G, S, E = plan.num_devices, plan.slots_per_device, plan.num_experts
    for layer, p in empty:            # a few slots: one at a time, each seeing the ones filled before it
        holds_GE = torch.zeros(G, E + 1, dtype=torch.bool)
        holds_GE[torch.arange(G * S) // S, torch.where(phy_LP[layer] >= 0, phy_LP[layer], E)] = True
        holds_GE = holds_GE[:, :E]
        if bool(holds_GE[p // S].all()):
            raise ValueError(f"SGLang needs an expert in every physical slot, and device {p // S} already holds "
                             f"every one of the {E} experts: use fewer slots per device")
        load_E, count_E = load_LE[layer], holds_GE.sum(0).clamp_min(1)
        y_G = (holds_GE * (load_E / count_E)).sum(1)
        # a copy of e on device d: e's holders shed load/count - load/(count + 1), d takes load/(count + 1)
        y_GE = y_G[:, None] - holds_GE * (load_E / count_E - load_E / (count_E + 1))
        y_GE[p // S] += load_E / (count_E + 1)
        busiest_E = torch.where(holds_GE[p // S], torch.inf, y_GE.amax(0))
        phy_LP[layer, p] = int(busiest_E.argmin())
    return {"physical_to_logical_map": phy_LP.tolist()}


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
