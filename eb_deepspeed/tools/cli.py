"""The `eb` command: what a user of the installed package needs (the benchmarks and the simulator run from a
checkout: `python -m benchmarks --help`).

    eb report RUN_DIR [--out DIR]     PNG balance curves + heatmap from RUN_DIR/balance.jsonl
    eb report --compare RUN_A RUN_B ... [--out FILE]   the runs side by side in one PNG: per layer, summary, maps
    eb plan LOAD --devices G [--slots S | --redundant R] [--nodes N] [--dispatch uniform|steered|padded]
            [--workload NAME] [--out plan.json] [--sglang sglang.json]   a placement from a load file (a balance
            log, an SGLang or vLLM dump, or the benchmarks' counts .npz), with a before/after table"""
from __future__ import annotations

import argparse
import json
import os
import sys

__all__ = ["main"]


def _report(args) -> int:
    from ..observe.report import render_compare, render_report
    if args.compare:
        print(render_compare(args.run_dir, args.out or "eb_compare.png"))
        return 0
    for path in render_report(args.run_dir[0], args.out):
        print(path)
    return 0


def _refuse_overwriting_inputs(source: str, outputs: list) -> None:
    """An output file that is the input (a balance log, or a log inside the input run directory), a second
    output, or an existing non-regular file (a FIFO, a device): refused before anything is read or written
    (links resolved), so `--out LOG` never replaces a log and `--out FIFO` never blocks."""
    inputs = [source]
    if os.path.isdir(source):
        inputs += [os.path.join(source, name) for name in os.listdir(source)]
    seen = {os.path.realpath(p): f"the input {p}" for p in inputs}
    for path in (p for p in outputs if p):
        real = os.path.realpath(path)
        if real in seen:
            raise ValueError(f"{path}: would write over {seen[real]}; name another output file")
        seen[real] = f"the other output {path}"
        if os.path.exists(path) and not os.path.isfile(path):     # a FIFO would block the write, a device take it
            raise ValueError(f"{path} exists and is not a regular file: eb plan writes its outputs only as files")


def _plan(args) -> int:
    from ..planning.export import balance_table, format_balance_table, placement_json, sglang_mapping
    import torch
    from ..planning.placement import index_maps, plan_placement, trivial_placement
    from ..observe.traces import load_total

    _refuse_overwriting_inputs(args.load, [args.out, args.sglang])
    load_LE, steps = load_total(args.load, last=args.last, workload=args.workload)   # summed: no [N, L, E] stack
    L, E = load_LE.shape
    G = args.devices
    if args.slots is not None:
        S = args.slots
    elif (E + args.redundant) % G:
        raise ValueError(f"--redundant {args.redundant}: experts + redundant ({E} + {args.redundant}) must be divisible "
                         f"by --devices {G} (SGLang: num_physical_experts % ep_size == 0)")
    else:
        S = (E + args.redundant) // G
    plan = plan_placement(load_LE, G, S, num_nodes=args.nodes, dispatch=args.dispatch)
    layouts = {"before (slot p holds expert p % E)": trivial_placement(L, E, G, S),
               f"planned (dispatch={args.dispatch})": plan}
    sglang = sglang_mapping(plan, load_LE) if args.sglang else None      # checked before any file is written
    if sglang is not None and bool((plan.phy2log < 0).any()):           # SGLang's map fills our empty slots
        layouts["--sglang (empty slots filled)"] = index_maps(torch.tensor(sglang["physical_to_logical_map"]), E, G, S)
    table = balance_table(load_LE, layouts)
    meta = {"dispatch": args.dispatch, "num_nodes": args.nodes, "source": args.load, "steps": steps,
            **({"workload": args.workload} if args.workload else {}), "balance": table}
    documents = [(path, make()) for path, make in ((args.out, lambda: placement_json(plan, **meta)),
                                                    (args.sglang, lambda: sglang)) if path]
    written = []
    from ..adapters.common import write_atomically
    for path, doc in documents:           # every document built (and checked) before any file is written
        write_atomically(path, json.dumps(doc))       # whole or not at all; a link is replaced, never followed
        written.append(path)
    if args.json:
        print(json.dumps({"layers": L, "experts": E, "devices": G, "slots_per_device": S, **meta, "written": written}))
        return 0
    records = (f"{steps} samples ({args.workload or 'every workload'})" if args.load.endswith(".npz") else
               f"{steps} load records (one per logged step)")
    print(f"{args.load}: {records}, {L} layers x {E} experts -> "
          f"{G} devices x {S} slots ({G * S - E} redundant), {args.nodes} node(s)")
    print("balancedness = mean / max device load over the records' summed load (1 = every device equal; higher is "
          "better); aggregate over all layers, and the worst layer")
    print(format_balance_table(table))
    for path in written:
        print(f"wrote {path}")
    return 0


def bounded(minimum: int, maximum: int = 2 ** 20):
    """An argparse type: an integer in [minimum, maximum] (a count past 2^20 is a typo, not a wish)."""
    def parse(text: str) -> int:
        value = int(text)
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"{value} must be >= {minimum}" if value < minimum else
                                             f"{value} must be <= {maximum}")
        return value
    parse.__name__ = "integer"         # argparse names the type in its message
    return parse


counting, non_negative = bounded(1), bounded(0)


def main(argv: list[str] | None = None) -> int:
    """The `eb` command: parse, check the arguments that depend on each other, run the sub-command."""
    return run(_parser(), argv, _check_args, lambda args: f"eb {args.command}")


def run(parser: argparse.ArgumentParser, argv, check, name) -> int:
    """Parse `argv`, `check(parser, args)` the options that go together, run `args.func(args)`; a bad input file
    or value prints `name(args): error: ...` (no traceback) and returns 2."""
    args = parser.parse_args(argv)
    check(parser, args)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:
        print(f"{name(args)}: error: {e}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eb", description="eb_deepspeed tools")
    sub = parser.add_subparsers(dest="command", required=True)
    _report_parser(sub)
    _plan_parser(sub)
    return parser


def _report_parser(sub) -> None:
    p = sub.add_parser("report", help="render balance curves and the heatmap from a run's JSONL log")
    p.add_argument("run_dir", nargs="+",
                   help="directory holding balance.jsonl (easybalance.log.dir), or the .jsonl file; with --compare, "
                        "two or more (an example run directory holding balance/ works too)")
    p.add_argument("--compare", action="store_true", help="the runs side by side in one PNG: per layer, the summary curves, a layers x ranks map per run")
    p.add_argument("--out", default=None,
                   help="output directory (default RUN_DIR/plots); with --compare the PNG file (eb_compare.png)")
    p.set_defaults(func=_report)


def _plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="plan expert replicas and placement from a load file; write ours / SGLang's JSON")
    p.add_argument("load", help="balance.jsonl or its run directory, an SGLang expert-distribution dump (.pt), a "
                                "torch.save'd vLLM EPLB load (expert_load_window + physical_to_logical_map), or "
                                "the benchmarks' counts (.npz of [samples, layers, experts] arrays, benchmarks/data)")
    p.add_argument("--devices", type=counting, required=True, help="EP ranks (SGLang: ep_size)")
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--slots", type=counting, default=None, help="physical expert slots per device")
    size.add_argument("--redundant", type=non_negative, default=None,
                      help="redundant experts per layer (SGLang: --ep-num-redundant-experts); instead of --slots")
    p.add_argument("--nodes", type=counting, default=1, help="nodes the devices span (must divide --devices)")
    p.add_argument("--dispatch", choices=["uniform", "steered", "padded"], default="uniform",
                   help="how the serving runtime splits an expert's tokens over its replicas: evenly (SGLang, vLLM), "
                        "freely (our steering), or evenly with every slot padded to the largest (DeepSpeed's "
                        "MOELayer); default uniform")
    p.add_argument("--last", type=counting, default=None, help="use only the last N steps (of an .npz: samples)")
    p.add_argument("--workload", metavar="NAME", default=None,
                   help="an .npz: plan from its array NAME only (default: every array's samples, summed)")
    p.add_argument("--out", default=None, help="write our plan JSON here")
    p.add_argument("--sglang", default=None, help="write SGLang's --init-expert-location JSON here")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=_plan)


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.command == "report" and not args.compare and len(args.run_dir) != 1:
        parser.error("eb report takes one RUN_DIR (or --compare RUN_A RUN_B ...)")
    if args.command == "report" and args.compare and len(args.run_dir) < 2:
        parser.error("eb report --compare needs two or more RUN_DIRs")


if __name__ == "__main__":
    sys.exit(main())
