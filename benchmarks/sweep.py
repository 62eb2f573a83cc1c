"""`python -m benchmarks train --sweep`: aux policies x coefficients x seeds on the example model, a Pareto plot.

Every run is the example LM (`examples/train_moe_lm.py`) under the real `deepspeed` launcher with 2
CPU ranks, on the same data. A row is one (policy, coefficient); its numbers are the mean and the
sample standard deviation over seeds. The Pareto plot puts validation loss against the training
drop rate and against the p90 device max/mean, one curve per policy through its coefficients,
with seed error bars both ways.

    python -m benchmarks train --sweep --json > benchmarks/results/bench_train_sweep.json     # ~45 min on 2 cores
    python -m benchmarks train --sweep --quick                                  # the test suite's small version
    python -m benchmarks train --sweep --from benchmarks/results/bench_train_sweep.json --json   # re-judge and re-draw, no training
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from .bench import _repo_root, free_port, unlink_shm_buffers

__all__ = ["SWEEP_POLICIES", "bench_train_sweep", "summarize_sweep", "sweep_stats", "score_noise"]

# (row name, aux policy, extra example arguments). `device_uniform` is `cross_layer` with every weight
# held at 1: the device loss without the view's per-layer weighting (what the weighting adds on its own).
# (`cross_layer_target`, the absolute-target law, and `global_lagged` were measured and left: docs/benchmarks.md.)
SWEEP_POLICIES = (("fixed", "fixed", ()), ("cross_layer", "cross_layer", ()),
                  ("device_uniform", "cross_layer", ("--aux-weight-range", "1", "1")),
                  ("bias", "bias", ()), ("bias_cross_layer", "bias_cross_layer", ()),
                  # `aux.batch_scope`: DeepSpeed's l_aux over the global batch, or per sequence
                  ("global_exact", "fixed", ("--batch-scope", "global_exact")),
                  ("sequence", "fixed", ("--batch-scope", "sequence")))
# metric -> (where in summary.json, what it is)
SWEEP_METRICS = {
    "val_loss": ("final", "validation loss at the end (held-out stdlib files)"),
    "token_drop_rate": ("train_second_half", "training token drop rate, second half of the run"),
    "device_max_over_mean_p90": ("train_second_half", "p90 over layers of device max/mean, second half"),
    "device_util_std": ("train_second_half", "device utilisation std, second half"),
    "val_token_drop_rate": ("final", "validation token drop rate at the end"),
    "val_device_max_over_mean_p90": ("final", "validation p90 device max/mean at the end"),
}
QUICK = dict(policies=("fixed", "cross_layer"), coefficients=(0.01, ), seeds=(1, 2), steps=12, layers=2, k="1,2")
FULL = dict(policies=tuple(p[0] for p in SWEEP_POLICIES[:5]), coefficients=(0.003, 0.01, 0.03), seeds=(1, 2, 3),
            steps=150, layers=8, k="1,2")       # the scope rows: --policies fixed global_exact ... (docs/benchmarks.md)


def _code_hash(root: str, config: str = "train_cpu_2rank.json") -> str:
    """sha1 of what a run's numbers depend on: the package's, the example's and the config's sources."""
    import hashlib
    h = hashlib.sha1()
    files = [os.path.join(root, "configs", config)]
    for top in ("eb_deepspeed", "examples"):
        for dirpath, dirnames, names in os.walk(os.path.join(root, top)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            files += [os.path.join(dirpath, n) for n in sorted(names) if n.endswith(".py")]
    for path in files:
        with open(path, "rb") as f:
            h.update(os.path.relpath(path, root).encode() + b"\0" + f.read())
    return h.hexdigest()


def _run(root: str, run_dir: str, policy: str, extra: tuple[str, ...], coeff: float, seed: int, steps: int,
         layers: int, k: str, bias_rate: float, code: str) -> dict[str, float]:
    args = ["--steps", str(steps), "--seed", str(seed), "--coeff", str(coeff), "--aux-policy", policy, "--layers",
            str(layers), "--k", k, "--eval-every", str(steps), "--eval-batches", "8", "--bias-rate", str(bias_rate),
            "--no-report", *extra]
    summary = _launch(root, run_dir, os.path.join("examples", "train_moe_lm.py"),
                      os.path.join("configs", "train_cpu_2rank.json"), args, code)
    return {metric: summary[where][metric] for metric, (where, _) in SWEEP_METRICS.items()}


def _launch(root: str, run_dir: str, script: str, config: str, args: list[str], code: str,
            config_flag: str = "--deepspeed_config") -> dict:
    """One 2-rank run of `script` (relative to the repo) under the deepspeed launcher; its summary.json. A run
    directory that holds a finished run of the same arguments and code is read instead."""
    done = os.path.join(run_dir, "sweep_args.json")
    if os.path.exists(done) and os.path.exists(os.path.join(run_dir, "summary.json")):
        with open(done) as f:
            reuse = json.load(f) == {"args": args, "code": code}   # same arguments, same code: an interrupted sweep
    else:
        reuse = False
    if not reuse:
        port = free_port()
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
               str(port), os.path.join(root, script), config_flag, os.path.join(root, config),
               "--run-dir", run_dir, *args]
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              env=dict(os.environ, WANDB_MODE="offline", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1"))
        unlink_shm_buffers(port)
        if proc.returncode != 0:
            raise RuntimeError(f"{run_dir} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        with open(done, "w") as f:
            json.dump({"args": args, "code": code}, f)
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)


def sweep_stats(runs: list[dict], metrics: dict = SWEEP_METRICS) -> list[dict]:
    """One row per (policy, coefficient): mean and sample std over its seeds of every metric."""
    rows: dict[tuple, dict] = {}
    for run in runs:
        rows.setdefault((run["policy"], run["coeff"]), []).append(run)
    out = []
    for (policy, coeff), group in rows.items():
        row = {"policy": policy, "coeff": coeff, "seeds": len(group)}
        for metric in metrics:
            values = [r[metric] for r in group]
            row[metric] = {"mean": statistics.fmean(values),
                           "std": statistics.stdev(values) if len(values) > 1 else 0.0}
        out.append(row)
    return out


def _paired(runs: list[dict], policy: str, base: str, coeff: float, metric: str) -> tuple[float, float, int]:
    """Per-seed differences policy - base of `metric` at `coeff` (same seed = same data and initial
    weights): their mean, sample std and count."""
    values = {(r["policy"], r["seed"]): r[metric] for r in runs if r["coeff"] == coeff}
    diffs = [values[(policy, seed)] - values[(base, seed)] for (name, seed) in values if name == policy
             and (base, seed) in values]
    if not diffs:
        return 0.0, 0.0, 0
    return statistics.fmean(diffs), (statistics.stdev(diffs) if len(diffs) > 1 else 0.0), len(diffs)


def _beyond_spread(runs: list[dict], policy: str, base: str, coeff: float, metric: str) -> bool | None:
    """policy lower than base on `metric` by more than the seed spread: the mean of the per-seed
    differences is below minus their std (None: fewer than 2 shared seeds have no spread)."""
    mean, std, n = _paired(runs, policy, base, coeff, metric)
    return None if n < 2 else bool(mean < 0 and -mean > std)


def _excess_cut(row: dict, base: dict, metric: str) -> float:
    """1 - row / base, of (value - 1) for max/mean metrics (the excess over balance), else of the value."""
    shift = 1.0 if "max_over_mean" in metric else 0.0
    b = base[metric]["mean"] - shift
    return 1.0 - (row[metric]["mean"] - shift) / b if b > 0 else 0.0


def sweep_targets(stats: list[dict], runs: list[dict]) -> tuple[dict, dict]:
    """Per-coefficient verdicts and the target booleans (see docs/benchmarks.md).

    cross_layer dominates fixed at a coefficient: drop rate and p90 excess both cut by >= 20 % and
    beyond the seed spread, val loss no worse than +0.5 %; the target wants that at >= 2 of 3
    coefficients (two thirds of the coefficients compared). bias_cross_layer beats bias: lower p90
    device max/mean beyond the seed spread, likewise. "Beyond the seed spread" is paired: the same
    seed gives both rows the same data and initial weights, so the per-seed differences carry the
    comparison; their mean must be below minus their std (>= 2 seeds). A target whose rows were not
    run is None.
    """
    by = {(r["policy"], r["coeff"]): r for r in stats}
    coeffs = sorted({r["coeff"] for r in stats})
    verdicts: dict[str, dict] = {}
    wins = {"cross_layer_vs_fixed": 0, "bias_cross_layer_vs_fixed": 0, "bias_cross_layer": 0}
    measured = dict.fromkeys(wins, 0)       # coefficients with both rows of the comparison
    for c in coeffs:
        v: dict[str, object] = {}
        fixed = by.get(("fixed", c))
        # device_uniform, cross_layer_target: what each part of cross_layer adds; bias, bias_cross_layer: the others
        for name in ("cross_layer", "device_uniform", "cross_layer_target", "bias", "bias_cross_layer"):
            cross = by.get((name, c))
            if not (fixed and cross):
                continue
            d = {"drop_rate_cut": _excess_cut(cross, fixed, "token_drop_rate"),
                 "p90_excess_cut": _excess_cut(cross, fixed, "device_max_over_mean_p90"),
                 "val_loss_change": cross["val_loss"]["mean"] / fixed["val_loss"]["mean"] - 1.0,
                 "drop_beyond_spread": _beyond_spread(runs, name, "fixed", c, "token_drop_rate"),
                 "p90_beyond_spread": _beyond_spread(runs, name, "fixed", c, "device_max_over_mean_p90"),
                 "val_loss_paired_diff": _paired(runs, name, "fixed", c, "val_loss")[:2]}
            d["dominates"] = bool(d["drop_rate_cut"] >= 0.2 and d["p90_excess_cut"] >= 0.2
                                  and d["val_loss_change"] <= 0.005 and d["drop_beyond_spread"]
                                  and d["p90_beyond_spread"])
            if name in ("cross_layer", "bias_cross_layer"):
                wins[f"{name}_vs_fixed"] += d["dominates"]
                measured[f"{name}_vs_fixed"] += 1
            v[f"{name}_vs_fixed"] = d
        bias, both = by.get(("bias", c)), by.get(("bias_cross_layer", c))
        if bias and both:
            d = {"p90_excess_cut": _excess_cut(both, bias, "device_max_over_mean_p90"),
                 "val_loss_change": both["val_loss"]["mean"] / bias["val_loss"]["mean"] - 1.0,
                 "p90_beyond_spread": _beyond_spread(runs, "bias_cross_layer", "bias", c, "device_max_over_mean_p90"),
                 "val_loss_paired_diff": _paired(runs, "bias_cross_layer", "bias", c, "val_loss")[:2]}
            d["beats"] = bool(d["p90_excess_cut"] > 0 and d["p90_beyond_spread"])
            wins["bias_cross_layer"] += d["beats"]
            measured["bias_cross_layer"] += 1
            v["bias_cross_layer_vs_bias"] = d
        verdicts[str(c)] = {name: {k: _rounded(x) for k, x in d.items()} for name, d in v.items()}
    # at >= 2 of 3 coefficients, i.e. two thirds of those compared; None when a comparison was not run
    targets = {target: (None if measured[key] == 0 else wins[key] * 3 >= 2 * measured[key])
               for target, key in (("cross_layer_dominates_fixed", "cross_layer_vs_fixed"),
                                   ("bias_cross_layer_beats_bias_on_p90", "bias_cross_layer"),
                                   ("bias_cross_layer_dominates_fixed", "bias_cross_layer_vs_fixed"))}
    return verdicts, targets


def _rounded(x):
    if isinstance(x, float):
        return round(x, 4)
    if isinstance(x, tuple):
        return [round(v, 4) for v in x]
    return x


def pareto_figure(stats: list[dict], title: str = ""):
    """Val loss against drop rate and against p90 device max/mean; one curve per policy, seed error bars."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    policies = list(dict.fromkeys(r["policy"] for r in stats))
    for policy in policies:
        rows = sorted((r for r in stats if r["policy"] == policy), key=lambda r: r["coeff"])
        for ax, metric in zip(axes, ("token_drop_rate", "device_max_over_mean_p90")):
            xs = [r[metric]["mean"] for r in rows]
            ys = [r["val_loss"]["mean"] for r in rows]
            ax.errorbar(xs, ys, xerr=[r[metric]["std"] for r in rows], yerr=[r["val_loss"]["std"] for r in rows],
                        marker="o", capsize=3, label=policy)
            for r, x, y in zip(rows, xs, ys):
                ax.annotate(f"{r['coeff']:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize="x-small")
    axes[0].set_xlabel("training token drop rate (second half; lower is better)")
    axes[1].set_xlabel("p90 over layers of device max/mean (second half; 1 = balanced)")
    for ax in axes:
        ax.set_ylabel("validation loss (lower is better)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title or "aux policies: mean over seeds, bars = seed std; labels = aux coefficient")
    fig.tight_layout()
    return fig


def bench_train_sweep(quick: bool = False, out_dir: str = "runs/bench_sweep", bias_rate: float = 0.03,
                      progress: bool = True, **override) -> dict[str, object]:
    """Run the sweep (FULL, or QUICK for the tests; `override` replaces any of their keys) and summarise.

    A run directory that already holds a finished run of the same arguments and the same code
    (`_code_hash`) is reused, so an interrupted sweep continues where it stopped (and a new row costs
    only its own runs).
    """
    plan = dict(QUICK if quick else FULL)
    plan.update({k: v for k, v in override.items() if v is not None})
    root = _repo_root()
    extras = {name: (policy, extra) for name, policy, extra in SWEEP_POLICIES}
    unknown = [p for p in plan["policies"] if p not in extras]
    if unknown:
        raise ValueError(f"unknown sweep policies {unknown}; choose from {list(extras)}")
    runs, t0, code = [], time.time(), _code_hash(root)
    total = len(plan["policies"]) * len(plan["coefficients"]) * len(plan["seeds"])
    for coeff in plan["coefficients"]:
        for name in plan["policies"]:
            policy, extra = extras[name]
            for seed in plan["seeds"]:
                run_dir = os.path.join(out_dir, f"{name}_c{coeff:g}_s{seed}")
                metrics = _run(root, run_dir, policy, extra, coeff, seed, plan["steps"], plan["layers"], plan["k"],
                               bias_rate, code)
                runs.append({"policy": name, "coeff": coeff, "seed": seed, "run_dir": run_dir, **metrics})
                if progress:
                    print(f"[benchmarks train --sweep] {len(runs)}/{total} {name} coeff {coeff:g} seed {seed}: "
                          + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()), file=sys.stderr, flush=True)
    result = {"benchmark": "train_sweep", "quick": quick, "steps": plan["steps"], "layers": plan["layers"],
              "k": plan["k"], "ranks": 2, "bias_rate": bias_rate, "seeds": list(plan["seeds"]),
              "coefficients": list(plan["coefficients"]), "policies": list(plan["policies"]), "runs": runs,
              "wall_s": round(time.time() - t0, 1), "code_sha1": code}
    return summarize_sweep(result, out_dir)


def summarize_sweep(result: dict, out_dir: str) -> dict[str, object]:
    """Rows, verdicts, targets and the Pareto plot (PNG + W&B image) of a sweep's runs; `result` holds
    them under "runs" (a fresh sweep, or a saved result: `python -m benchmarks train --sweep --from RESULT.json`
    re-draws and re-judges it without training)."""
    runs = result["runs"]
    stats = sweep_stats(runs)
    verdicts, targets = sweep_targets(stats, runs)
    fig = pareto_figure(stats)
    os.makedirs(out_dir, exist_ok=True)
    pareto = os.path.join(out_dir, "pareto.png")
    fig.savefig(pareto, dpi=90)
    _log_to_wandb(out_dir, pareto, stats)
    import matplotlib.pyplot as plt
    plt.close(fig)
    out = {k: v for k, v in result.items() if k not in ("rows", "against", "targets", "pareto_png", "metrics")}
    out.update({"metrics": {k: d for k, (_, d) in SWEEP_METRICS.items()}, "rows": stats, "against": verdicts,
                "pareto_png": pareto, "targets": targets})
    return out


def _log_to_wandb(out_dir: str, pareto_png: str, stats: list[dict]) -> None:
    """The Pareto plot and the rows as one W&B run (offline unless WANDB_MODE says otherwise)."""
    try:
        import wandb
    except ImportError:
        return
    run = wandb.init(project="eb_deepspeed", job_type="bench_train_sweep", dir=out_dir,
                     mode=os.environ.get("WANDB_MODE", "offline"), reinit="finish_previous")
    columns = ["policy", "coeff", "seeds"] + [f"{m}_{s}" for m in SWEEP_METRICS for s in ("mean", "std")]
    table = wandb.Table(columns=columns, data=[[r["policy"], r["coeff"], r["seeds"]]
                                               + [r[m][s] for m in SWEEP_METRICS for s in ("mean", "std")]
                                               for r in stats])
    run.log({"pareto": wandb.Image(pareto_png), "sweep": table})
    run.finish()


def format_sweep_table(result: dict[str, object]) -> str:
    keys = ("val_loss", "token_drop_rate", "device_max_over_mean_p90", "device_util_std")
    head = ["policy", "coeff"] + list(keys)
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in result["rows"]:
        lines.append(" | ".join([r["policy"], f"{r['coeff']:g}"]
                                + [f"{r[k]['mean']:.4f} ± {r[k]['std']:.4f}" for k in keys]))
    lines.append("targets: " + json.dumps(result["targets"]))
    return "\n".join(lines)


def score_noise(run_dir: str, skip: float = 0.25, window: int | None = None) -> dict[str, object]:
    """What the cross_layer integrator sees in a run's log (logged every step: `log.interval` 1).

    Per layer, over the records after the first `skip` of the run: the relative device score error
    e_l = score_l / mean_layers(score) - 1 (clipped to [-1, 1] as the integrator clips it), its
    mean mu_l (persistent skew), std sigma_l and lag-1 autocorrelation rho_l (step noise, correlated
    by the view's EMA). Summing N steps of AR(1) noise has std sigma * sqrt(N (1 + rho) / (1 - rho)),
    so mu_l * N exceeds twice that after N_l = (2 sigma_l sqrt((1 + rho_l) / (1 - rho_l)) / |mu_l|)^2
    steps: before that the integrator cannot tell the layer's skew from noise. The gain that lets a
    layer's weight reach x2 (log 2) just when it is told apart is ln 2 / (|mu_l| N_l); `gain_rule`
    is its median over layers, `gain_rule_stalling` its median over the layers the law pushes up
    (mu_l > 0: persistently worse than the others). window: the run's `easybalance.window` (default
    null: by depth, `window_for`, as the sweep's runs use). Steps where every score is 0 are left out (the law holds there).
    """
    import math

    import torch

    from eb_deepspeed.core.config import EasyBalanceConfig
    from eb_deepspeed.core.policies import device_scores
    from eb_deepspeed.observe.report import read_log

    records = [r for r in read_log(run_dir) if r.get("pressure_LG")]   # a re-run's superseded records left out
    if len(records) < 8:
        raise ValueError(f"{run_dir}: {len(records)} records with pressure_LG; log every step (log.interval 1)")
    L = len(records[0]["pressure_LG"])
    w = EasyBalanceConfig.from_ds_config({"easybalance": {} if window is None else {"window": window}}).window_for(L)
    scores = []
    for r in records[int(len(records) * skip):]:
        P = torch.tensor(r["pressure_LG"], dtype=torch.float64)
        cum = torch.cat([torch.zeros(1, P.shape[1], dtype=torch.float64), P.cumsum(0)])
        idx = torch.arange(L)
        C = cum[(idx + w + 1).clamp(max=L)] - cum[(idx - w).clamp(min=0)]
        scores.append(device_scores(P, C))
    S = torch.stack(scores)
    S = S[S.sum(1) > 0]
    err = (S / S.mean(1, keepdim=True).clamp_min(1e-12) - 1.0).clamp(-1.0, 1.0)
    mu, sigma = err.mean(0), err.std(0)
    d = err - mu
    rho = ((d[1:] * d[:-1]).mean(0) / d.var(0).clamp_min(1e-12)).clamp(-0.99, 0.99)
    n = (2 * sigma * ((1 + rho) / (1 - rho)).sqrt() / mu.abs().clamp_min(1e-6)) ** 2
    gains = math.log(2) / (mu.abs().clamp_min(1e-6) * n)
    return {"run": run_dir, "records": int(S.shape[0]), "window": w,
            "mean_error": [round(x, 3) for x in mu.tolist()], "std_error": [round(x, 3) for x in sigma.tolist()],
            "lag1_autocorrelation": [round(x, 2) for x in rho.tolist()],
            "steps_to_tell_apart": [round(x) for x in n.tolist()],
            "gain_per_layer": [round(x, 4) for x in gains.tolist()], "gain_rule": round(float(gains.median()), 4),
            "gain_rule_stalling": round(float(gains[mu > 0].median()), 4) if bool((mu > 0).any()) else None}
