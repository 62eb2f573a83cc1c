"""The `eb` command.

    eb report RUN_DIR [--out DIR]     PNG balance curves + heatmap from RUN_DIR/balance.jsonl
    eb report --compare RUN_A RUN_B ... [--out FILE]   the runs' summary curves overlaid in one PNG
    eb bench gate [--json]            CrossLayerGate vs DeepSpeed's TopKGate overhead
    eb bench train [--json] [--framework megatron|autoep]   aux policies side by side on the example model (2 CPU ranks)
    eb bench train --sweep [--quick]  policies x coefficients x seeds, mean +- std, Pareto plot
    eb bench train --sweep --framework autoep|megatron   (or --scopes on the DeepSpeed example): the training
                                      controls incl. the balance loss's batch scopes, paired by seed, Pareto plot
    eb bench noise --run DIR          persistent skew vs step noise of a run's view: the cross_layer gain rule
    eb bench plan [--json]            planner time (61 x 256 x 64, both dispatch models) and steering vs an MoE layer
    eb bench optimum [--json]         planner vs a brute-force optimum on tiny inputs (30 loads x 7 shapes)
    eb bench infer [--json]           replicated serving vs plain DeepSpeed on 2 and 4 gloo ranks
    eb bench infer --framework autoep the EasyBalance article's serving table on AutoEP layers (2 and 4 ranks)
    eb simulate [--workload all] [--json]   the EasyBalance article's table + placement/steering rows, with targets
    eb plan LOAD --devices G [--slots S | --redundant R] [--nodes N] [--dispatch uniform|steered|padded]
            [--out plan.json] [--sglang sglang.json]    a placement from a load file, with a before/after table
"""
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


def _bench(args) -> int:
    """`eb bench WHAT`: the benchmark WHAT (and for `train`, its variant) prints its table or its JSON."""
    if args.what == "train":
        run = (_bench_sweep_saved if args.sweep and args.from_json else
               _bench_sweep_framework if args.sweep and (args.framework in ("autoep", "megatron") or args.scopes) else
               _bench_sweep if args.sweep else
               _bench_train_autoep if args.framework == "autoep" else _bench_train)
    elif args.what == "infer":
        run = _bench_infer_autoep if args.framework == "autoep" else _bench_infer
    else:
        run = {"gate": _bench_gate, "noise": _bench_noise, "plan": _bench_plan, "optimum": _bench_optimum}[args.what]
    return run(args)


def _show(args, result: dict, table: str) -> int:
    """The human table (on stderr when the JSON goes to stdout), then the JSON when asked."""
    print(table, file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


def _out(args, default: str | None) -> str | None:
    """--out, or the benchmark's own default when the user left the shared one."""
    return args.out if args.out != "runs/bench_train" else default


def _seeds(args):
    return tuple(range(1, args.sweep_seeds + 1)) if args.sweep_seeds else None


def _bench_gate(args) -> int:
    from .bench import bench_gate
    result = bench_gate(tokens=args.tokens, hidden=args.hidden, experts=tuple(args.experts), k=args.k,
                        repeats=args.repeats, progress=not args.json)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"CrossLayerGate / TopKGate (forward+backward): ratio {result['ratio']:.3f} "
              f"(target <= {result['target']}); with the device loss on: {result['device_loss_ratio']:.3f}")
    return 0


def _bench_sweep_saved(args) -> int:
    from ..core.files import load_json
    from .bench_sweep import format_sweep_table, summarize_sweep
    saved = load_json(args.from_json, "a saved sweep result (JSON)")
    if not isinstance(saved, dict) or not isinstance(saved.get("runs"), list) \
            or not all(isinstance(run, dict) for run in saved["runs"]):
        raise ValueError(f"{args.from_json}: not a saved sweep result (expected an object whose \"runs\" is a "
                         "list of objects: what `eb bench train --sweep --json` prints)")
    if saved.get("framework") in ("autoep", "megatron", "deepspeed"):
        from .bench_sweep_frameworks import format_sweep_table_framework, summarize_sweep_framework
        result = summarize_sweep_framework(saved, _out(args, f"runs/bench_sweep_{saved['framework']}"))
        return _show(args, result, format_sweep_table_framework(result))
    result = summarize_sweep(saved, _out(args, "runs/bench_sweep"))
    return _show(args, result, format_sweep_table(result))


def _bench_sweep_framework(args) -> int:
    from .bench_sweep_frameworks import bench_train_sweep_framework, format_sweep_table_framework
    result = bench_train_sweep_framework(args.framework, quick=args.quick, progress=True, out_dir=_out(args, None),
                                         coefficients=tuple(args.coeffs) if args.coeffs else None,
                                         rows=tuple(args.policies) if args.policies else None, seeds=_seeds(args),
                                         steps=args.steps if args.steps_given else None)
    return _show(args, result, format_sweep_table_framework(result))


def _bench_sweep(args) -> int:
    from .bench_sweep import bench_train_sweep, format_sweep_table
    result = bench_train_sweep(quick=args.quick, out_dir=_out(args, "runs/bench_sweep"),
                               bias_rate=args.bias_rate or 0.03, progress=True,
                               coefficients=tuple(args.coeffs) if args.coeffs else None,
                               policies=tuple(args.policies) if args.policies else None, seeds=_seeds(args),
                               steps=args.steps if args.steps_given else None,
                               layers=args.layers if args.layers_given else None)
    return _show(args, result, format_sweep_table(result))


def _bench_train_autoep(args) -> int:
    from .bench import bench_train_autoep, format_autoep_table
    result = bench_train_autoep(steps=args.steps if args.steps_given else 60,
                                out_dir=_out(args, "runs/bench_train_autoep"),
                                seeds=tuple(range(1, (args.sweep_seeds or 3) + 1)), data=args.data, ffn=args.ffn)
    return _show(args, result, format_autoep_table(result))


def _bench_train(args) -> int:
    from .bench import bench_train, format_train_table
    result = bench_train(steps=args.steps, coeff=args.coeff, capacity_factor=args.capacity_factor,
                         seed=args.seed, out_dir=args.out, bias_rate=args.bias_rate, layers=args.layers,
                         framework=args.framework)
    return _show(args, result, format_train_table(result))


def _bench_noise(args) -> int:
    from .bench_sweep import score_noise
    result = score_noise(args.run)
    print(json.dumps(result, indent=2) if args.json else
          f"gain rule: {result['gain_rule']} (median over layers), {result['gain_rule_stalling']} (layers "
          f"persistently worse than the others); steps to tell skew from noise: {result['steps_to_tell_apart']}")
    return 0


def _bench_plan(args) -> int:
    from .bench import bench_plan
    result = bench_plan()
    print(json.dumps(result, indent=2) if args.json else
          f"planner {result['planner']['median_ms']} ms steered, {result['planner']['uniform_median_ms']} ms uniform "
          f"(target <= 100); steering / MoE layer "
          f"{result['steering']['ratio']:.4f} (target <= 0.02)")
    return 0


def _bench_optimum(args) -> int:
    from .bench import bench_optimum
    result = bench_optimum(seeds=args.seeds)
    print(json.dumps(result, indent=2) if args.json else
          "\n".join(f"{r['experts']} experts on {r['devices']} x {r['slots']}: worst {r['refined_worst']} "
                    f"({r['refined_over_5pct']} of {r['seeds']} over 5 %); greedy only {r['greedy_only_worst']} "
                    f"({r['greedy_only_over_5pct']} over)" for r in result["rows"]))
    return 0


def _bench_infer_autoep(args) -> int:
    from .bench_infer_autoep import bench_infer_autoep, format_autoep_infer_table
    result = bench_infer_autoep(ranks=tuple(args.ranks), batches=args.batches if args.batches_given else 24,
                                replica_slots=args.replica_slots)
    return _show(args, result, format_autoep_infer_table(result))


def _bench_infer(args) -> int:
    from .bench_infer import bench_infer
    result = bench_infer(ranks=tuple(args.ranks), batches=args.batches, replica_slots=args.replica_slots,
                         ckpt=args.ckpt)
    print(json.dumps(result, indent=2) if args.json else "\n".join(
        f"{r['row']:14s} {r['ranks']} ranks {r['split']:5s}: capacity/ideal {r['capacity_over_ideal_plain']} -> "
        f"{r['capacity_over_ideal_ours']} (bound {r['capacity_over_ideal_bound']}), MoE speed-up {r['speedup']}, "
        f"tokens/s {r['tokens_per_s_ratio']}x plain, slots {r['slots_serving']}, "
        f"drops {r['drop_rate_plain']} -> {r['drop_rate_ours']}, overhead {r['overhead_ratio']}, "
        f"equal {r['outputs_equal']}" for r in result["rows"]) + "\ntargets: " + json.dumps(result["targets"]))
    return 0


def _simulate(args) -> int:
    from tqdm import tqdm

    from .. import sim
    from ..sim.traces import ranks_in_log
    names = list(sim.WORKLOADS) if args.workload == "all" else [args.workload]
    cfg = sim.SimConfig(model=sim.ClusterModel(topology=sim.TOPOLOGIES[args.topology], window=args.window),
                        extra_slots=args.extra_slots)
    workloads = []
    for name in names:
        if name == "trace":
            trace = sim.load_trace(args.trace)
            devices = args.devices or ranks_in_log(args.trace) or 8
            workloads.append(sim.trace_workload(trace, devices, name=f"trace:{args.trace}"))
        else:
            workloads.append(sim.synthetic_workload(name, layers=args.layers, experts=args.experts,
                                                    devices=args.devices or 8, steps=args.steps, seed=args.seed,
                                                    **sim.WORKLOADS[name]))
    total = sum(w.counts_NLGE.shape[0] for w in workloads) * len(sim.STRATEGIES)
    tables = {}
    with tqdm(total=total, desc="simulate", disable=args.json, dynamic_ncols=True) as bar:
        for w in workloads:
            tables[w.name] = sim.run_table(w, cfg, progress=bar)
    result = {"tables": tables, "targets": sim.evaluate_targets(tables)}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for t in tables.values():
            print(sim.format_table(t) + "\n")
        print(sim.format_targets(result["targets"]))
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
    from ..planning.export import (balance_table, format_balance_table, placement_json, sglang_mapping,
                                   trivial_placement)
    from ..planning.placement import plan_placement
    from ..sim.traces import load_trace

    _refuse_overwriting_inputs(args.load, [args.out, args.sglang])
    trace_NLE = load_trace(args.load)
    if args.last:
        trace_NLE = trace_NLE[-args.last:]
    load_LE = trace_NLE.sum(0)
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
    table = balance_table(load_LE, {"before (slot p holds expert p % E)": trivial_placement(L, E, G, S),
                                    f"planned (dispatch={args.dispatch})": plan})
    meta = {"dispatch": args.dispatch, "num_nodes": args.nodes, "source": args.load, "steps": int(trace_NLE.shape[0]),
            "balance": table}
    documents = [(path, make()) for path, make in ((args.out, lambda: placement_json(plan, **meta)),
                                                    (args.sglang, lambda: sglang_mapping(plan))) if path]
    written = []
    from ..adapters.common import write_atomically
    for path, doc in documents:           # every document built (and checked) before any file is written
        write_atomically(path, json.dumps(doc))       # whole or not at all; a link is replaced, never followed
        written.append(path)
    if args.json:
        print(json.dumps({"layers": L, "experts": E, "devices": G, "slots_per_device": S, **meta, "written": written}))
        return 0
    print(f"{args.load}: {trace_NLE.shape[0]} load records (one per logged step), {L} layers x {E} experts -> "
          f"{G} devices x {S} slots ({G * S - E} redundant), {args.nodes} node(s)")
    print("balancedness = mean / max device load over the records' summed load (1 = every device equal; higher is "
          "better); aggregate over all layers, and the worst layer")
    print(format_balance_table(table))
    for path in written:
        print(f"wrote {path}")
    return 0


def _at_least(minimum: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be >= {minimum}")
        return value
    parse.__name__ = "integer"         # argparse names the type in its message
    return parse


counting, non_negative = _at_least(1), _at_least(0)


class _Choices:
    """argparse choices read on first use: `eb --help` never imports the modules (and torch) behind them."""

    def __init__(self, load):
        self._load, self._values = load, None

    def _get(self) -> list[str]:
        if self._values is None:
            self._values = list(self._load())
        return self._values

    def __contains__(self, value) -> bool:
        return value in self._get()

    def __iter__(self):
        return iter(self._get())


def _topologies():
    from ..core.topology import TOPOLOGIES
    return TOPOLOGIES


def _workloads():
    from ..sim.workloads import WORKLOADS
    return ["all", "trace", *WORKLOADS]


def _sweep_policies():
    from .bench_sweep import SWEEP_POLICIES
    from .bench_sweep_frameworks import AUTOEP_ROWS
    return list(dict.fromkeys([name for name, _, _ in SWEEP_POLICIES] + list(AUTOEP_ROWS)))   # --framework autoep: its rows


def _bench_parsers(bench: argparse.ArgumentParser) -> None:
    """`eb bench WHAT`: one subcommand per benchmark, each with only its own options (and --json)."""
    what = bench.add_subparsers(dest="what", required=True, metavar="WHAT")

    def add(name: str, help: str) -> argparse.ArgumentParser:
        p = what.add_parser(name, help=help, description=help)
        p.add_argument("--json", action="store_true", help="print one JSON object")
        p.set_defaults(func=_bench)
        return p

    p = add("gate", "our gate vs DeepSpeed's TopKGate, forward + backward")
    p.add_argument("--tokens", type=counting, default=4096, help="tokens per forward (4096)")
    p.add_argument("--hidden", type=counting, default=1024, help="model dimension (1024)")
    p.add_argument("--experts", type=counting, nargs="+", default=[16, 64], help="expert counts to time (16 64)")
    p.add_argument("--k", type=counting, default=2, help="top-k (2)")
    p.add_argument("--repeats", type=counting, default=30, help="timed repeats")

    p = add("train", "aux policies side by side on the example model (or a sweep of them)")
    p.add_argument("--steps", type=counting, default=None, help="optimizer steps per row (200; AutoEP 60)")
    p.add_argument("--coeff", type=float, default=0.01, help="aux-loss coefficient of the balanced rows")
    p.add_argument("--capacity-factor", type=float, default=1.0, help="capacity factor of every row")
    p.add_argument("--seed", type=int, default=1234, help="the example's seed (1234)")
    p.add_argument("--layers", type=counting, default=None,
                   help="MoE layers of the example model (4; the sweep: 8, top-1 and top-2 alternating)")
    p.add_argument("--framework", choices=["deepspeed", "megatron", "autoep"], default="deepspeed",
                   help="the DeepSpeed example, the Megatron-Core one (examples/megatron_train_moe.py), or an HF "
                        "Mixtral under DeepSpeed's AutoEP (examples/train_hf_moe.py: plain, HF's aux loss, easybalance)")
    p.add_argument("--data", choices=["stdlib", "zipf"], default="stdlib",
                   help="--framework autoep: the stdlib sources, or i.i.d. Zipf-distributed token ids")
    p.add_argument("--ffn", type=counting, default=128, help="--framework autoep: each expert's hidden size (128)")
    p.add_argument("--bias-rate", type=float, default=None, help="easybalance.aux.bias_rate of the bias row")
    p.add_argument("--out", default="runs/bench_train", help="run directories")
    p.add_argument("--sweep", action="store_true",
                   help="policies x coefficients x seeds with a Pareto plot (~45 min; docs/benchmarks.md)")
    p.add_argument("--quick", action="store_true", help="--sweep: the small version the tests run")
    p.add_argument("--scopes", action="store_true",
                   help="--sweep on the DeepSpeed example: the batch scopes of its l_aux (micro, global_exact, "
                        "global_lagged, sequence) with cross_layer and the default, as --framework autoep/megatron")
    p.add_argument("--coeffs", type=float, nargs="+", default=None, help="--sweep: aux coefficients")
    p.add_argument("--sweep-seeds", type=counting, default=None, help="--sweep (and --framework autoep, 3): seeds 1..N")
    p.add_argument("--from", dest="from_json", default=None,
                   help="--sweep: re-judge and re-draw a saved result's runs (no training)")
    p.add_argument("--policies", nargs="+", default=None, choices=_Choices(_sweep_policies), metavar="POLICY",
                   help="--sweep: rows (default all): %(choices)s")

    p = add("noise", "how many steps a run's view needs to tell skew from noise")
    p.add_argument("--run", required=True, help="a balance log written every step (log.interval 1)")

    add("plan", "planner and steering time")

    p = add("optimum", "the planner against brute force on small shapes")
    p.add_argument("--seeds", type=counting, default=30, help="random loads per shape")

    p = add("infer", "serving with replicas against plain DeepSpeed, side by side")
    p.add_argument("--ranks", type=counting, nargs="+", default=[2, 4], help="gloo ranks of each run")
    p.add_argument("--batches", type=counting, default=None,
                   help="measured batches per row (40, the example row twice as many; --framework autoep 24)")
    p.add_argument("--replica-slots", type=non_negative, default=1, help="easybalance.inference.replica_slots")
    p.add_argument("--ckpt", default="runs/main/ckpt", help="the main job's checkpoint (trained routers)")
    p.add_argument("--framework", choices=["deepspeed", "autoep"], default="deepspeed",
                   help="autoep: the EasyBalance article's table on a HF Mixtral's AutoEP layers (24 batches a row)")


def main(argv: list[str] | None = None) -> int:
    """The `eb` command: parse, check the arguments that depend on each other, run the sub-command."""
    parser = _parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:   # bad input files and values: the message, not a traceback
        print(f"eb {args.command}: error: {e}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eb", description="eb_deepspeed tools")
    sub = parser.add_subparsers(dest="command", required=True)
    _report_parser(sub)
    _bench_parsers(sub.add_parser("bench", help="side-by-side benchmarks (eb bench WHAT --help: its options)"))
    _simulate_parser(sub)
    _plan_parser(sub)
    return parser


def _report_parser(sub) -> None:
    p = sub.add_parser("report", help="render balance curves and the heatmap from a run's JSONL log")
    p.add_argument("run_dir", nargs="+",
                   help="directory holding balance.jsonl (easybalance.log.dir), or the .jsonl file; with --compare, "
                        "two or more (an example run directory holding balance/ works too)")
    p.add_argument("--compare", action="store_true", help="overlay the runs' summary curves in one PNG")
    p.add_argument("--out", default=None,
                   help="output directory (default RUN_DIR/plots); with --compare the PNG file (eb_compare.png)")
    p.set_defaults(func=_report)


def _simulate_parser(sub) -> None:
    p = sub.add_parser("simulate", help="cluster simulator: the EasyBalance article's table plus placement + steering")
    p.add_argument("--workload", default="skewed_correlated", choices=_Choices(_workloads), metavar="NAME",
                   help="a synthetic workload, all of them, or trace (--trace FILE): one of %(choices)s")
    p.add_argument("--trace", help="with --workload trace: SGLang / vLLM expert-load file or balance.jsonl")
    p.add_argument("--topology", default="pcie", choices=_Choices(_topologies), metavar="NAME",
                   help="interconnect preset: one of %(choices)s")
    p.add_argument("--layers", type=counting, default=32, help="MoE layers of the simulated model (32)")
    p.add_argument("--experts", type=counting, default=64, help="experts per layer (64)")
    p.add_argument("--devices", type=counting, default=None,
                   help="EP ranks (8; with --workload trace, the ranks our own balance log recorded)")
    p.add_argument("--steps", type=counting, default=40, help="steps simulated (40)")
    p.add_argument("--extra-slots", type=non_negative, default=2, help="replica slots per device beyond experts / devices")
    p.add_argument("--window", type=counting, default=1, help="1 = synchronised per layer; w > 1 = bounded run-ahead")
    p.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    p.set_defaults(func=_simulate)


def _plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="plan expert replicas and placement from a load file; write ours / SGLang's JSON")
    p.add_argument("load", help="balance.jsonl or its run directory, an SGLang expert-distribution dump (.pt), or a "
                                "torch.save'd vLLM EPLB load (expert_load_window + physical_to_logical_map)")
    p.add_argument("--devices", type=counting, required=True, help="EP ranks (SGLang: ep_size)")
    p.add_argument("--slots", type=counting, default=None, help="physical expert slots per device")
    p.add_argument("--redundant", type=non_negative, default=None,
                   help="redundant experts per layer (SGLang: --ep-num-redundant-experts); instead of --slots")
    p.add_argument("--nodes", type=counting, default=1, help="nodes the devices span (must divide --devices)")
    p.add_argument("--dispatch", choices=["uniform", "steered", "padded"], default="uniform",
                   help="how the serving runtime splits an expert's tokens over its replicas: evenly (SGLang, vLLM), "
                        "freely (our steering), or evenly with every slot padded to the largest (DeepSpeed's "
                        "MOELayer); default uniform")
    p.add_argument("--last", type=counting, default=None, help="use only the last N steps of the load file")
    p.add_argument("--out", default=None, help="write our plan JSON here")
    p.add_argument("--sglang", default=None, help="write SGLang's --init-expert-location JSON here")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=_plan)


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Defaults that depend on whether an option was given, and the options that only go together."""
    if args.command == "bench" and args.what == "infer":
        args.batches_given, args.batches = args.batches is not None, args.batches or 40
    if args.command == "bench" and args.what == "train":
        args.steps_given, args.layers_given = args.steps is not None, args.layers is not None
        args.steps, args.layers = args.steps or 200, args.layers or 4
        sweep_only = [flag for flag, value in (("--quick", args.quick), ("--coeffs", args.coeffs),
                                                ("--from", args.from_json), ("--policies", args.policies),
                                                ("--scopes", args.scopes),
                                                ("--sweep-seeds", args.sweep_seeds and args.framework != "autoep"))
                      if value]
        if sweep_only and not args.sweep:
            parser.error(f"{', '.join(sweep_only)}: only with bench train --sweep")
    if args.command == "report" and not args.compare and len(args.run_dir) != 1:
        parser.error("eb report takes one RUN_DIR (or --compare RUN_A RUN_B ...)")
    if args.command == "report" and args.compare and len(args.run_dir) < 2:
        parser.error("eb report --compare needs two or more RUN_DIRs")
    if args.command == "plan" and (args.slots is None) == (args.redundant is None):
        parser.error("eb plan needs exactly one of --slots S or --redundant R")
    if args.command == "simulate" and (args.workload == "trace") != (args.trace is not None):
        parser.error("--trace FILE goes with --workload trace (and only with it)")


if __name__ == "__main__":
    sys.exit(main())
