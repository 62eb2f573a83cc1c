"""Placements in and out of files, and the before/after balance table `eb plan` prints.

Shape legend: L layers, E logical experts, G devices, S slots per device, P slots (G * S; slot p on device p // S).

    doc = placement_json(plan, dispatch="uniform", num_nodes=2, source="runs/main/balance")
    plan = read_placement_json("plan.json")
    sglang = sglang_mapping(plan)          # {"physical_to_logical_map": [L][P]}: --init-expert-location
    table = balance_table(load_LE, {"trivial": trivial_placement(L, E, G, S), "planned": plan})

SGLang reads `--init-expert-location FILE.json` with `json.loads` and passes the dict as keyword arguments to
`ExpertLocationMetadata.init_by_mapping(physical_to_logical_map=...)`, so the file must hold that one key and nothing
else; physical slot p serves EP rank p // (P / ep_size), as here; P is num_logical + `--ep-num-redundant-experts`,
and every slot must hold an expert (tests/test_plan_export.py checks it against SGLang's parsing, re-implemented)."""
from __future__ import annotations

import json

import numpy as np
import torch

from ..core.files import load_json
from ..core.metrics import aggregate_balancedness, balancedness
from .flows import steered_load
from .placement import Placement, index_maps, is_legal, trivial_placement  # noqa: F401 - eb plan's trivial_placement
from .uniform import even_split_loads

__all__ = ["placement_json", "read_placement_json", "sglang_mapping"]

PLAN_FORMAT = "eb_deepspeed.placement/1"


def placement_json(plan: Placement, **meta) -> dict:
    """Our plan file: the index maps as lists, the shape, and `meta` (dispatch, num_nodes, source, ...)."""
    return {"format": PLAN_FORMAT, "num_layers": int(plan.phy2log.shape[0]), "num_experts": plan.num_experts,
            "num_devices": plan.num_devices, "slots_per_device": plan.slots_per_device, **meta,
            "phy2log": plan.phy2log.tolist(), "log2phy": plan.log2phy.tolist(), "logcnt": plan.logcnt.tolist()}


def read_placement_json(path: str) -> Placement:
    """A Placement from our plan file (a regular file of at most MAX_JSON_BYTES); ValueError naming the file,
    the JSON path and what is valid when it is not one. Counts and ids are JSON integers: true, false and
    fractions are refused, never read as 1, 0 or a truncated number."""
    try:
        doc = load_json(path, "an eb_deepspeed plan (JSON)")
    except OSError as e:
        raise ValueError(f"{path}: cannot read a plan ({e.strerror or e})") from None
    if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
        raise ValueError(f"{path}: not an eb_deepspeed plan (expected \"format\": \"{PLAN_FORMAT}\")")
    G, S, E = (_count(doc, key, path) for key in ("num_devices", "slots_per_device", "num_experts"))
    if E > G * S:
        raise ValueError(f"{path}: num_experts ({E}) must be <= num_devices x slots_per_device ({G} x {S}): "
                         "every expert needs a slot")
    phy = _expert_ids(doc.get("phy2log"), path, G * S, E)
    if "num_layers" in doc and _count(doc, "num_layers", path) != phy.shape[0]:
        raise ValueError(f"{path}: num_layers ({doc['num_layers']}) must match the {phy.shape[0]} rows of phy2log")
    plan = index_maps(phy, E, G, S)
    if not is_legal(plan):
        raise ValueError(f"{path}: phy2log leaves an expert without a replica or puts two on one device")
    for key, derived in (("logcnt", plan.logcnt), ("log2phy", plan.log2phy)):   # compared as JSON: 1 is not true
        if key in doc and json.dumps(doc[key]) != json.dumps(derived.tolist()):
            raise ValueError(f"{path}: {key} does not match phy2log (it is derived from it: leave it out or "
                             "write what phy2log gives)")
    return plan


def _count(doc: dict, key: str, path: str) -> int:
    """doc[key] as a count: a JSON integer in [1, 2^31)."""
    value = doc.get(key)
    if type(value) is not int or not 1 <= value < 2 ** 31:     # type, not isinstance: True is an int
        raise ValueError(f"{path}: {key} ({_as_json(value)}) must be an integer in [1, 2^31) (not true/false, "
                         "a fraction or a string)")
    return value


def _expert_ids(rows, path: str, P: int, E: int) -> torch.Tensor:
    """phy2log [L, P] from the plan's lists: every entry a JSON integer in [-1, E) (-1 = empty slot)."""
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{path}: phy2log ({_as_json(rows)}) must be a non-empty list of [{P}] rows of expert ids")
    for layer, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != P:
            got = f"{len(row)} entries" if isinstance(row, list) else _as_json(row)
            raise ValueError(f"{path}: phy2log[{layer}] must be a list of {P} expert ids (num_devices x "
                             f"slots_per_device), got {got}")
        bad = next((i for i, x in enumerate(row) if type(x) is not int or not -1 <= x < E), None)
        if bad is not None:
            raise ValueError(f"{path}: phy2log[{layer}][{bad}] ({_as_json(row[bad])}) must be an integer expert id "
                             f"in [-1, {E}) (-1 = empty slot; not true/false or a fraction)")
    return torch.tensor(rows, dtype=torch.long)


def _as_json(value) -> str:
    """JSON text of a value for a message, cut to 60 characters (a hostile value can be huge)."""
    text = json.dumps(value) if isinstance(value, (bool, int, float, str, type(None))) else type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


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
