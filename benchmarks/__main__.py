"""The benchmarks and the cluster simulator, run from a checkout (they use the repository's examples/).

    python -m benchmarks gate [--json]          our gate vs DeepSpeed's TopKGate overhead
    python -m benchmarks train [--json] [--framework megatron|autoep]   aux policies side by side (2 CPU ranks)
    python -m benchmarks train --sweep [--quick]   policies x coefficients x seeds, mean +- std, Pareto plot
    python -m benchmarks train --sweep --framework autoep|megatron   (or --scopes on the DeepSpeed example)
    python -m benchmarks noise --run DIR        persistent skew vs step noise of a run's view
    python -m benchmarks plan [--json]          planner time (61 x 256 x 64) and steering vs an MoE layer
    python -m benchmarks scale [--json]         the balancer's host time per step and per forward (61 x 256 x 64)
    python -m benchmarks optimum [--json]       planner vs a brute-force optimum on tiny inputs
    python -m benchmarks infer [--json] [--framework autoep]   serving with replicas vs plain, 2 and 4 gloo ranks
    python -m benchmarks simulate [--workload all] [--json]   the EasyBalance article's table + our rows

Every benchmark's --json carries a `targets` object. Results and the commands behind them: docs/benchmarks.md (their JSON: benchmarks/results/).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from eb_deepspeed.tools.cli import bounded, counting, non_negative, run

__all__ = ["main"]


class Choices:
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


def ranks_in_log(path: str) -> int | None:
    """The EP ranks our own balance log recorded (the width of its last `pressure_LG`), or None for other
    files (SGLang's and vLLM's loads name no ranks) and logs without it."""
    if not (path.endswith(".jsonl") or os.path.isdir(path)):
        return None
    from eb_deepspeed.observe.report import read_log
    last = read_log(path, keys=())[-1]
    pressure = last.get("pressure_LG")
    if isinstance(pressure, list) and pressure and isinstance(pressure[0], list) and pressure[0]:
        return len(pressure[0])
    return None


def _bench(args) -> int:
    """`python -m benchmarks WHAT`: the benchmark WHAT (and for `train`, its variant) prints its table or its JSON."""
    if args.what == "train":
        run = (_bench_sweep_saved if args.sweep and args.from_json else
               _bench_sweep_framework if args.sweep and (args.framework in ("autoep", "megatron") or args.scopes) else
               _bench_sweep if args.sweep else
               _bench_train_autoep if args.framework == "autoep" else _bench_train)
    elif args.what == "infer":
        run = _bench_infer_autoep if args.framework == "autoep" else _bench_infer
    else:
        run = {"gate": _bench_gate, "noise": _bench_noise, "plan": _bench_plan, "optimum": _bench_optimum,
               "scale": _bench_scale, "sync_audit": _bench_sync_audit}[args.what]
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
    from eb_deepspeed.core.files import load_json
    from .sweep import format_sweep_table, summarize_sweep
    saved = load_json(args.from_json, "a saved sweep result (JSON)")
    if not isinstance(saved, dict) or not isinstance(saved.get("runs"), list) \
            or not all(isinstance(run, dict) for run in saved["runs"]):
        raise ValueError(f"{args.from_json}: not a saved sweep result (expected an object whose \"runs\" is a "
                         "list of objects: what `python -m benchmarks train --sweep --json` prints)")
    if saved.get("framework") in ("autoep", "megatron", "deepspeed"):
        from .sweep_frameworks import format_sweep_table_framework, summarize_sweep_framework
        result = summarize_sweep_framework(saved, _out(args, f"runs/bench_sweep_{saved['framework']}"))
        return _show(args, result, format_sweep_table_framework(result))
    result = summarize_sweep(saved, _out(args, "runs/bench_sweep"))
    return _show(args, result, format_sweep_table(result))


def _bench_sweep_framework(args) -> int:
    from .sweep_frameworks import bench_train_sweep_framework, format_sweep_table_framework
    result = bench_train_sweep_framework(args.framework, quick=args.quick, progress=True, out_dir=_out(args, None),
                                         coefficients=tuple(args.coeffs) if args.coeffs else None,
                                         rows=tuple(args.policies) if args.policies else None, seeds=_seeds(args),
                                         steps=args.steps if args.steps_given else None)
    return _show(args, result, format_sweep_table_framework(result))


def _bench_sweep(args) -> int:
    from .sweep import bench_train_sweep, format_sweep_table
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
    from .sweep import score_noise
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


def _bench_scale(args) -> int:
    from .scale import bench_scale
    result = bench_scale(layers=args.layers, experts=args.experts, devices=args.devices, tokens=args.tokens, k=args.k,
                         policy=args.policy)
    print(json.dumps(result, indent=2) if args.json else
          f"{result['layers']} x {result['experts']} x {result['devices']}, {result['policy']}: step "
          f"{result['step_ms']} ms of host time (target <= 5), recording {result['record_ms_per_layer']} ms per layer "
          f"per forward (target <= 0.05; a plain AutoEP router forward here: "
          f"{result['plain_autoep_router_forward_ms']} ms), reduce {result['reduce_bytes']} bytes")
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
    from .infer_autoep import bench_infer_autoep, format_autoep_infer_table
    result = bench_infer_autoep(ranks=tuple(args.ranks), batches=args.batches if args.batches_given else 24,
                                replica_slots=args.replica_slots)
    return _show(args, result, format_autoep_infer_table(result))


def _bench_sync_audit(args) -> int:
    """One audited forward of each AutoEP serving row (`benchmarks.infer_autoep`, tiny): host syncs, ours and
    everyone else's, against plain AutoEP's."""
    import tempfile

    from .infer_autoep import bench_infer_autoep
    with tempfile.TemporaryDirectory() as logs:
        result = bench_infer_autoep(ranks=tuple(args.ranks), batches=1, layers=args.layers, ffn=64, seq_len=32,
                                    out_dir=logs, progress=False)
    rows = [{"ranks": run["ranks"], "row": r["row"], **r["host_syncs_per_forward"]}
            for run in result["runs"] for r in run["rows"]]
    out = {"benchmark": "sync_audit", "layers": args.layers, "rows": rows,
           "targets": {k: v for k, v in result["targets"].items() if k == "host_syncs_as_plain_per_forward"}}
    return _show(args, out, "\n".join(f"{r['ranks']} ranks {r['row']:16s} ours {r['ours']:3d} others {r['theirs']:3d}"
                                      for r in rows) + "\ntargets: " + json.dumps(out["targets"]))


def _bench_infer(args) -> int:
    from .infer import bench_infer
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

    from . import sim
    names = list(sim.WORKLOADS) if args.workload == "all" else [args.workload]
    cfg = sim.SimConfig(model=sim.ClusterModel(topology=sim.TOPOLOGIES[args.topology], run_ahead=args.run_ahead),
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


def _topologies():
    from eb_deepspeed.core.topology import TOPOLOGIES
    return TOPOLOGIES


def _workloads():
    from .sim.workloads import WORKLOADS
    return ["all", "trace", *WORKLOADS]


def _sweep_policies():
    from .sweep import SWEEP_POLICIES
    from .sweep_frameworks import AUTOEP_ROWS
    return list(dict.fromkeys([name for name, _, _ in SWEEP_POLICIES] + list(AUTOEP_ROWS)))   # --framework autoep: its rows


def _bench_parsers(parser: argparse.ArgumentParser):
    """One subcommand per benchmark, each with only its own options (and --json); returns the subparsers."""
    what = parser.add_subparsers(dest="what", required=True, metavar="WHAT")

    def add(name: str, help: str) -> argparse.ArgumentParser:
        p = what.add_parser(name, help=help, description=help)
        p.add_argument("--json", action="store_true", help="print one JSON object")
        p.set_defaults(func=_bench)
        return p

    p = add("gate", "our gate vs DeepSpeed's TopKGate, forward + backward")
    p.add_argument("--tokens", type=bounded(1, 65536), default=4096, help="tokens per forward (4096; at most 65536)")
    p.add_argument("--hidden", type=bounded(1, 16384), default=1024, help="model dimension (1024; at most 16384)")
    p.add_argument("--experts", type=bounded(1, 1024), nargs="+", default=[16, 64],
                   help="expert counts to time (16 64; each at most 1024)")
    p.add_argument("--k", type=bounded(1, 64), default=2, help="top-k (2)")
    p.add_argument("--repeats", type=bounded(1, 10000), default=30, help="timed repeats (at most 10000)")

    p = add("train", "aux policies side by side on the example model (or a sweep of them)")
    p.add_argument("--steps", type=bounded(1, 100000), default=None,
                   help="optimizer steps per row (200; AutoEP 60; at most 100000)")
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
    p.add_argument("--policies", nargs="+", default=None, choices=Choices(_sweep_policies), metavar="POLICY",
                   help="--sweep: rows (default all): %(choices)s")

    p = add("noise", "how many steps a run's view needs to tell skew from noise")
    p.add_argument("--run", required=True, help="a balance log written every step (log.interval 1)")

    add("plan", "planner and steering time")

    p = add("scale", "the balancer's host time per step and per forward at DeepSeek-V3's shape")
    p.add_argument("--layers", type=bounded(1, 1024), default=61)
    p.add_argument("--experts", type=bounded(2, 4096), default=256)
    p.add_argument("--devices", type=bounded(1, 4096), default=64)
    p.add_argument("--tokens", type=bounded(1, 65536), default=4096, help="tokens per forward on a rank")
    p.add_argument("--k", type=bounded(1, 64), default=8)
    p.add_argument("--policy", choices=["fixed", "bias", "cross_layer", "bias_cross_layer"], default=None,
                   help="easybalance.aux.policy (default: the block's default)")

    p = add("sync_audit", "host syncs a forward of AutoEP serving, ours and plain's (inferred on CPU)")
    p.add_argument("--ranks", type=bounded(1, 64), nargs="+", default=[2, 4], help="gloo ranks of each run (2 4)")
    p.add_argument("--layers", type=bounded(1, 64), default=8, help="MoE layers (8)")

    p = add("optimum", "the planner against brute force on small shapes")
    p.add_argument("--seeds", type=counting, default=30, help="random loads per shape")

    p = add("infer", "serving with replicas against plain DeepSpeed, side by side")
    p.add_argument("--ranks", type=bounded(1, 64), nargs="+", default=[2, 4], help="gloo ranks of each run (at most 64)")
    p.add_argument("--batches", type=bounded(1, 10000), default=None,
                   help="measured batches per row (40, the example row twice as many; --framework autoep 24; at most "
                        "10000)")
    p.add_argument("--replica-slots", type=non_negative, default=1, help="easybalance.inference.replica_slots")
    p.add_argument("--ckpt", default="runs/ds/ckpt", help="launch/train_ds_cpu.sh's checkpoint (trained routers)")
    p.add_argument("--framework", choices=["deepspeed", "autoep"], default="deepspeed",
                   help="autoep: the EasyBalance article's table on a HF Mixtral's AutoEP layers (24 batches a row)")
    return what


def _simulate_parser(sub) -> None:
    """`simulate`: the cluster simulator (`sim/`)."""
    p = sub.add_parser("simulate", help="cluster simulator: the EasyBalance article's table plus placement + steering")
    p.add_argument("--workload", default="skewed_correlated", choices=Choices(_workloads), metavar="NAME",
                   help="a synthetic workload, all of them, or trace (--trace FILE): one of %(choices)s")
    p.add_argument("--trace", help="with --workload trace: SGLang / vLLM expert-load file or balance.jsonl")
    p.add_argument("--topology", default="pcie", choices=Choices(_topologies), metavar="NAME",
                   help="interconnect preset: one of %(choices)s")
    p.add_argument("--layers", type=counting, default=32, help="MoE layers of the simulated model (32)")
    p.add_argument("--experts", type=counting, default=64, help="experts per layer (64)")
    p.add_argument("--devices", type=counting, default=None,
                   help="EP ranks (8; with --workload trace, the ranks our own balance log recorded)")
    p.add_argument("--steps", type=bounded(1, 100000), default=40, help="steps simulated (40; at most 100000)")
    p.add_argument("--extra-slots", type=non_negative, default=2, help="replica slots per device beyond experts / devices")
    p.add_argument("--run-ahead", type=counting, default=1, help="1 = synchronised per layer; w > 1 = bounded run-ahead")
    p.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    p.set_defaults(func=_simulate)


def main(argv: list[str] | None = None) -> int:
    """Parse, check the arguments that depend on each other, run the benchmark."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description="eb_deepspeed benchmarks")
    _simulate_parser(_bench_parsers(parser))
    return run(parser, argv, _check_args, lambda args: f"python -m benchmarks {args.what}")


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Defaults that depend on whether an option was given, and the options that only go together."""
    if args.what == "infer":
        args.batches_given, args.batches = args.batches is not None, args.batches or 40
    if args.what == "train":
        args.steps_given, args.layers_given = args.steps is not None, args.layers is not None
        args.steps, args.layers = args.steps or 200, args.layers or 4
        sweep_only = [flag for flag, value in (("--quick", args.quick), ("--coeffs", args.coeffs),
                                                ("--from", args.from_json), ("--policies", args.policies),
                                                ("--scopes", args.scopes),
                                                ("--sweep-seeds", args.sweep_seeds and args.framework != "autoep"))
                      if value]
        if sweep_only and not args.sweep:
            parser.error(f"{', '.join(sweep_only)}: only with bench train --sweep")
    if args.what == "simulate" and (args.workload == "trace") != (args.trace is not None):
        parser.error("--trace FILE goes with --workload trace (and only with it)")


if __name__ == "__main__":
    sys.exit(main())
