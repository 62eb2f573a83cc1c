"""Benchmarks that print ratios measured side by side in one run (absolute times here are noise).

    python -m benchmarks gate --json      # CrossLayerGate vs DeepSpeed's TopKGate, forward + backward
    python -m benchmarks train --json     # aux policies fixed / cross_layer / bias (+ no balancing), same seed and data
    python -m benchmarks train --framework autoep --json   # an HF Mixtral under AutoEP: plain, HF's aux loss, easybalance
    python -m benchmarks plan --json      # planner time at 61 x 256 x 64, steering time vs one MoE layer forward
    python -m benchmarks optimum --json   # planner vs a brute-force optimum on tiny inputs, with and without refinement

Shape legend: T tokens, M model dim, E experts, K top-k.
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time

import torch

from .exact import brute_force_optimum, steered_max, steered_max_load

__all__ = ["bench_gate", "bench_train", "bench_train_autoep", "bench_plan", "bench_optimum", "free_port",
           "AUTOEP_ROWS"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_gate(gate, x_TM: torch.Tensor, seed: int) -> float:
    torch.manual_seed(seed)  # same Gumbel / RTS draws for both gates
    x_TM.grad = None
    gate.wg.weight.grad = None
    _sync(x_TM.device)
    t0 = time.perf_counter()
    l_aux, _, _, _, _, gates_KT, _ = gate(x_TM, None, True, False)
    (l_aux + gates_KT.sum()).backward()
    _sync(x_TM.device)
    return time.perf_counter() - t0


def bench_gate(tokens: int = 4096, hidden: int = 1024, experts=(16, 64), k: int = 2, repeats: int = 30,
               warmup: int = 3, progress: bool = False, device: str = "cpu") -> dict[str, object]:
    """Time CrossLayerGate against TopKGate on the same weights and inputs, interleaved.

    Each repeat times both gates back to back (alternating which goes first); the ratio is
    median(ours) / median(DeepSpeed's), per expert count and overall (geometric mean). A third gate
    with the device-level balance loss on (what `cross_layer` adds) is timed in the same rounds:
    `device_loss_ratio`; and a fourth that also tallies its routes per device (what every gate does when
    the model's EP groups differ in size, PR-MoE with a smaller `ep_size`): `device_tally_ratio`.
    """
    from deepspeed.moe.sharded_moe import TopKGate

    from eb_deepspeed.adapters.deepspeed.gate import CrossLayerGate

    rows = []
    for num_experts in experts:
        torch.manual_seed(0)
        ds_gate = TopKGate(hidden, num_experts, k=k, capacity_factor=1.0, min_capacity=4).to(device).train()
        eb_gate = CrossLayerGate.from_topk_gate(ds_gate, layer_index=0).train()
        dev_gate = CrossLayerGate.from_topk_gate(ds_gate, layer_index=1).train()
        dev_gate.controls.set_device_map(torch.arange(num_experts) // max(1, num_experts // 8))   # 8 EP ranks
        dev_gate.controls.device_loss_weight = 1.0
        tally_gate = CrossLayerGate.from_topk_gate(ds_gate, layer_index=2).train()
        tally_gate.count_devices(8, torch.arange(num_experts) // max(1, num_experts // 8))
        x_TM = torch.randn(tokens, hidden, device=device, requires_grad=True)
        times = {"deepspeed": [], "easybalance": [], "device_loss": [], "device_tally": []}
        for rep in range(warmup + repeats):
            order = [("deepspeed", ds_gate), ("easybalance", eb_gate), ("device_loss", dev_gate),
                     ("device_tally", tally_gate)]
            if rep % 2:
                order.reverse()
            for name, gate in order:
                dt = _time_gate(gate, x_TM, seed=rep)
                if rep >= warmup:
                    times[name].append(dt)
            for gate in (eb_gate, dev_gate, tally_gate):
                gate.tally.take(device)  # the step boundary drains it
        ds_med, eb_med = statistics.median(times["deepspeed"]), statistics.median(times["easybalance"])
        dev_med, tally_med = statistics.median(times["device_loss"]), statistics.median(times["device_tally"])
        rows.append({"tokens": tokens, "hidden": hidden, "experts": num_experts, "k": k,
                     "deepspeed_ms": round(ds_med * 1e3, 3), "easybalance_ms": round(eb_med * 1e3, 3),
                     "ratio": round(eb_med / ds_med, 4), "device_loss_ms": round(dev_med * 1e3, 3),
                     "device_loss_ratio": round(dev_med / ds_med, 4), "device_tally_ms": round(tally_med * 1e3, 3),
                     "device_tally_ratio": round(tally_med / ds_med, 4)})
        if progress:
            print(f"  E={num_experts}: TopKGate {ds_med * 1e3:.2f} ms, CrossLayerGate {eb_med * 1e3:.2f} ms, "
                  f"ratio {eb_med / ds_med:.3f}", flush=True)
    ratio = statistics.geometric_mean([r["ratio"] for r in rows])
    device_ratio = statistics.geometric_mean([r["device_loss_ratio"] for r in rows])
    tally_ratio = statistics.geometric_mean([r["device_tally_ratio"] for r in rows])
    return {"benchmark": "gate", "mode": "forward+backward, sparse routes", "device": str(device),
            "threads": torch.get_num_threads(),
            "repeats": repeats, "rows": rows, "ratio": round(ratio, 4), "device_loss_ratio": round(device_ratio, 4),
            "device_tally_ratio": round(tally_ratio, 4), "target": 1.05,
            "targets": {"gate_ratio_le_1.05": bool(ratio <= 1.05),
                        "device_tally_ratio_le_1.05": bool(tally_ratio <= 1.05)}}


# (row name, aux policy, coefficient multiplier): the no-balancing row keeps the gates but coefficient 0.
TRAIN_ROWS = (("none", "fixed", 0.0), ("fixed", "fixed", 1.0), ("cross_layer", "cross_layer", 1.0),
              ("bias", "bias", 1.0), ("bias_cross_layer", "bias_cross_layer", 1.0))
TRAIN_KEYS = ("token_drop_rate", "val_token_drop_rate", "val_max_vio", "device_max_over_mean_p90",
              "val_device_max_over_mean_p90", "val_loss", "seconds_per_step")


def _repo_root() -> str:
    """The checkout this file lies in (the benchmarks run the repository's examples/)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def unlink_shm_buffers(port: int) -> None:
    """Remove the /dev/shm buffers DeepSpeed's CPU shm comm op leaves behind for a finished job's master
    port (64 MiB per rank per job, never unlinked by DeepSpeed 0.19.8)."""
    import glob
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
        try:
            os.unlink(path)
        except OSError:
            pass


def free_port() -> int:
    """A free TCP port on loopback (one per launch, so concurrent jobs never share a master port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# framework -> (example script, its config argument, the config file)
TRAIN_FRAMEWORKS = {"deepspeed": ("train_moe_lm.py", "--deepspeed_config", "train_cpu_2rank.json"),
                    "megatron": ("megatron_train_moe.py", "--config", "megatron_cpu.json")}


def bench_train(steps: int = 200, coeff: float = 0.01, capacity_factor: float = 1.0, seed: int = 1234,
                out_dir: str = "runs/bench_train", bias_rate: float | None = None, layers: int = 4,
                num_gpus: int = 2, progress: bool = True, extra: tuple[str, ...] = (),
                framework: str = "deepspeed") -> dict[str, object]:
    """Train the example model once per policy (real deepspeed launcher, `num_gpus` CPU ranks) and compare.

    Every row uses the same seed, data, capacity factor, step count and mean coefficient; `none`
    sets the coefficient to 0 to show how much imbalance there is to remove. framework "megatron":
    the Megatron-Core example (`examples/megatron_train_moe.py`, EP over the ranks) instead.
    """
    root = _repo_root()
    script, config_flag, config_file = TRAIN_FRAMEWORKS[framework]
    rows = {}
    for name, policy, mult in TRAIN_ROWS:
        run_dir = os.path.join(out_dir, name)
        port = free_port()
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(num_gpus), "--master_port",
               str(port), os.path.join(root, "examples", script), config_flag,
               os.path.join(root, "configs", config_file), "--run-dir", run_dir, "--steps", str(steps),
               "--seed", str(seed), "--coeff", str(coeff * mult), "--aux-policy", policy, "--capacity-factor",
               str(capacity_factor), "--layers", str(layers), "--eval-every", str(max(1, steps // 2)),
               "--eval-batches", "8", *extra]
        if bias_rate is not None:
            cmd += ["--bias-rate", str(bias_rate)]
        if progress:
            print(f"[benchmarks train] {name}: policy {policy}, coefficient {coeff * mult} ...", file=sys.stderr,
                  flush=True)
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              env=dict(os.environ, WANDB_MODE="offline", OMP_NUM_THREADS="1"))
        unlink_shm_buffers(port)
        if proc.returncode != 0:
            raise RuntimeError(f"row {name} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
        final, half = summary["final"], summary["train_second_half"]
        rows[name] = {"policy": policy, "coeff": coeff * mult,
                      "token_drop_rate": half["token_drop_rate"],
                      "val_token_drop_rate": final["val_token_drop_rate"], "val_max_vio": final["val_max_vio"],
                      "device_max_over_mean_p90": half["device_max_over_mean_p90"],
                      "val_device_max_over_mean_p90": final["val_device_max_over_mean_p90"],
                      "val_loss": final["val_loss"], "seconds_per_step": summary["seconds_per_step"],
                      "wall_s": round(time.time() - t0, 1)}
        if progress:
            print("  " + ", ".join(f"{k} {rows[name][k]:.4f}" for k in TRAIN_KEYS), file=sys.stderr, flush=True)
    base = rows["fixed"]

    def cut(row, key, minus_one=False):
        b, r = base[key] - (1.0 if minus_one else 0.0), row[key] - (1.0 if minus_one else 0.0)
        return 1.0 - r / b if b > 0 else 0.0

    verdicts = {}
    for name in ("cross_layer", "bias", "bias_cross_layer"):
        row = rows[name]
        v = {"drop_rate_cut": cut(row, "token_drop_rate"), "val_drop_rate_cut": cut(row, "val_token_drop_rate"),
             "p90_excess_cut": cut(row, "device_max_over_mean_p90", True),
             "val_p90_excess_cut": cut(row, "val_device_max_over_mean_p90", True),
             "val_loss_change": row["val_loss"] / base["val_loss"] - 1.0}
        v["meets_target"] = bool(v["drop_rate_cut"] >= 0.3 and v["p90_excess_cut"] >= 0.3
                                 and v["val_loss_change"] <= 0.01)
        verdicts[name] = {k: (round(x, 4) if isinstance(x, float) else x) for k, x in v.items()}
    return {"benchmark": "train", "framework": framework, "steps": steps, "coeff": coeff, "capacity_factor": capacity_factor, "seed": seed,
            "layers": layers, "ranks": num_gpus, "rows": rows, "against_fixed": verdicts,
            "target": "drop rate and p90 device max/mean excess cut >= 30% vs fixed, val loss <= +1%",
            "targets": {f"{name}_meets_target": v["meets_target"] for name, v in verdicts.items()}}


# (row name, arguments of examples/train_hf_moe.py): plain AutoEP is `observe` (bit-identical to it, and it measures),
# HF's pooled aux loss at Mixtral's default coefficient, and easybalance's default.
AUTOEP_ROWS = (("plain", ("--mode", "observe")), ("hf_aux", ("--mode", "observe", "--hf-aux-coef", "0.001")),
               ("easybalance", ("--mode", "balance")))


def bench_train_autoep(steps: int = 60, seeds=(1, 2, 3), lr: float = 1e-3, data: str = "stdlib", micro_batch: int = 8,
                       seq_len: int = 128, ffn: int = 128, out_dir: str = "runs/bench_train_autoep", num_gpus: int = 2,
                       rows=AUTOEP_ROWS, progress: bool = True, extra: tuple[str, ...] = ()) -> dict[str, object]:
    """Train the tiny HF Mixtral of examples/train_hf_moe.py under AutoEP once per row and seed (real deepspeed
    launcher, `num_gpus` CPU ranks), rows interleaved seed by seed, and compare.

    Per run: each layer's expert max/mean of every step averaged over the last 10 steps (and of the 10 steps'
    routes summed), the device max/mean (the dropless straggler), the training LM loss over the last 10 steps,
    tokens/s. Targets, on the means over seeds: (a) every layer's per-step expert max/mean <= 1.5 under
    easybalance; (b) its loss no worse than plain AutoEP's and within +1 % of HF's aux-loss row; (c) its
    tokens/s >= 1.2x plain's.
    """
    root = _repo_root()
    runs: dict[str, list[dict]] = {name: [] for name, _ in rows}
    for seed in seeds:
        for name, row_args in rows:
            run_dir = os.path.join(out_dir, f"{name}_seed{seed}")
            port = free_port()
            cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(num_gpus), "--master_port",
                   str(port), os.path.join(root, "examples", "train_hf_moe.py"), "--deepspeed_config",
                   os.path.join(root, "configs", "train_hf_cpu_2rank.json"), "--run-dir", run_dir, "--steps", str(steps),
                   "--seed", str(seed), "--lr", str(lr), "--data", data, "--micro-batch", str(micro_batch),
                   "--seq-len", str(seq_len), "--ffn", str(ffn), "--no-report", *row_args, *extra]
            if progress:
                print(f"[benchmarks train autoep] {name}, seed {seed} ...", file=sys.stderr, flush=True)
            proc = subprocess.run(cmd, capture_output=True, text=True,
                                  env=dict(os.environ, WANDB_MODE="offline", OMP_NUM_THREADS="1"))
            unlink_shm_buffers(port)
            if proc.returncode != 0:
                raise RuntimeError(f"row {name} seed {seed} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                                   f"{proc.stderr[-2000:]}")
            with open(os.path.join(run_dir, "summary.json")) as f:
                summary = json.load(f)
            runs[name].append({k: summary[k] for k in ("seed", "last10_lm_loss", "tokens_per_s",
                                                       "last10_expert_max_over_mean", "last10_sum_expert_max_over_mean",
                                                       "last10_device_max_over_mean")})
            if progress:
                r = runs[name][-1]
                print(f"  loss {r['last10_lm_loss']:.4f}, tokens/s {r['tokens_per_s']:.0f}, expert max/mean "
                      + " ".join(f"{v:.2f}" for v in r["last10_expert_max_over_mean"]), file=sys.stderr, flush=True)

    def mean(values):
        return sum(values) / len(values)

    table = {}
    for name, per_seed in runs.items():
        layers = len(per_seed[0]["last10_expert_max_over_mean"])
        table[name] = {
            "lm_loss": round(mean([r["last10_lm_loss"] for r in per_seed]), 4),
            "tokens_per_s": round(mean([r["tokens_per_s"] for r in per_seed]), 1),
            **{key: [round(mean([r[key][layer] for r in per_seed]), 3) for layer in range(layers)]
               for key in ("last10_expert_max_over_mean", "last10_sum_expert_max_over_mean",
                           "last10_device_max_over_mean")},
            "seeds": per_seed}
    ours, plain, hf = table["easybalance"], table["plain"], table.get("hf_aux")
    worst = max(ours["last10_expert_max_over_mean"])
    loss_vs_plain = ours["lm_loss"] / plain["lm_loss"] - 1.0
    loss_vs_hf = None if hf is None else ours["lm_loss"] / hf["lm_loss"] - 1.0
    speed = ours["tokens_per_s"] / plain["tokens_per_s"]
    return {"benchmark": "train", "framework": "autoep", "steps": steps, "seeds": list(seeds), "lr": lr, "data": data,
            "micro_batch": micro_batch, "seq_len": seq_len, "ffn": ffn, "ranks": num_gpus, "rows": table,
            "easybalance_worst_layer_expert_max_over_mean": worst,
            "loss_change_vs_plain": round(loss_vs_plain, 4),
            "loss_change_vs_hf_aux": None if loss_vs_hf is None else round(loss_vs_hf, 4),
            "tokens_per_s_ratio_vs_plain": round(speed, 4),
            "target": "every layer's expert max/mean (last 10 steps) <= 1.5; loss <= plain and <= +1% of HF aux; "
                      "tokens/s >= 1.2x plain",
            "targets": {"expert_max_over_mean_le_1.5": bool(worst <= 1.5),
                        "loss_no_worse_than_plain": bool(loss_vs_plain <= 0.0),
                        "loss_within_1pct_of_hf_aux": bool(loss_vs_hf is not None and loss_vs_hf <= 0.01),
                        "tokens_per_s_ge_1.2x_plain": bool(speed >= 1.2)}}


def format_autoep_table(result: dict[str, object]) -> str:
    lines = ["row | lm_loss | tokens/s | expert max/mean per layer (per step) | (10 steps summed) | device max/mean",
             "--- | --- | --- | --- | --- | ---"]
    for name, row in result["rows"].items():
        lines.append(" | ".join([name, f"{row['lm_loss']:.4f}", f"{row['tokens_per_s']:.0f}",
                                 " ".join(f"{v:.2f}" for v in row["last10_expert_max_over_mean"]),
                                 " ".join(f"{v:.2f}" for v in row["last10_sum_expert_max_over_mean"]),
                                 " ".join(f"{v:.2f}" for v in row["last10_device_max_over_mean"])]))
    lines.append("targets: " + ", ".join(f"{k} {v}" for k, v in result["targets"].items()))
    return "\n".join(lines)


def format_train_table(result: dict[str, object]) -> str:
    head = ["row", "coeff"] + list(TRAIN_KEYS)
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for name, row in result["rows"].items():
        lines.append(" | ".join([name, f"{row['coeff']:g}"] + [f"{row[k]:.4f}" for k in TRAIN_KEYS]))
    for name, v in result["against_fixed"].items():
        lines.append(f"{name} vs fixed: " + ", ".join(f"{k} {val}" for k, val in v.items()))
    return "\n".join(lines)


def _balancedness(load_LG: torch.Tensor) -> float:
    """Mean over layers of mean / max device load (1 = perfectly even)."""
    return float((load_LG.mean(1) / load_LG.amax(1)).mean())


def bench_plan(layers: int = 61, experts: int = 256, devices: int = 64, slots: int = 5, nodes: int = 8,
               repeats: int = 5, tokens: int = 4096, hidden: int = 1024, steer_devices: int = 8,
               steer_experts: int = 64, k: int = 2) -> dict[str, object]:
    """Planner time at DeepSeek-V3 scale, and steering time against one MoE layer's forward.

    Planner: median wall time of plan_placement on a skewed [layers, experts] load (target <= 100 ms),
    for steered dispatch (the default; balancedness after steering), uniform dispatch (balancedness of
    the even split) and without the local searches (greedy only). EPLB side by side:
    `python -m benchmarks.plan_vs_eplb` (a repository checkout; docs/benchmarks.md).
    Steering: steer() for one layer (steer_devices source ranks x steer_experts experts, `tokens`
    per rank, top-k, 2 slots per expert on average) against the forward of a DeepSpeed MoE layer
    (`steer_experts` experts of hidden -> 4 * hidden -> hidden, ep_size 1) on the same `tokens`
    in this process, side by side (target: steering <= 2 % of the layer).
    """
    from eb_deepspeed.planning.flows import steered_load
    from eb_deepspeed.planning.placement import expected_device_load, plan_placement

    g = torch.Generator().manual_seed(0)
    load_LE = torch.rand(layers, experts, generator=g).pow(-1 / 1.2)

    def timed(**kwargs):
        ms = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            plan = plan_placement(load_LE, devices, slots, num_nodes=nodes, **kwargs)
            ms.append((time.perf_counter() - t0) * 1e3)
        return plan, statistics.median(ms)

    plan, plan_med = timed()
    uniform, uniform_med = timed(dispatch="uniform")
    greedy, greedy_med = timed(refine_rounds=0)   # no local search (steps 3 and 3u), side by side
    steered_LG, greedy_steered_LG = steered_load(plan, load_LE), steered_load(greedy, load_LE)    # one judge

    steering = bench_steering(tokens=tokens, hidden=hidden, experts=steer_experts, devices=steer_devices, k=k,
                              repeats=repeats)
    split = {f"{experts}x{devices}x{s}": bench_split(experts, devices, s, repeats=repeats) for s in (slots, 8)}
    return {"benchmark": "plan", "threads": torch.get_num_threads(),
            "planner": {"layers": layers, "experts": experts, "devices": devices, "slots_per_device": slots,
                        "nodes": nodes, "median_ms": round(plan_med, 2), "target_ms": 100,
                        "balancedness_steered": round(_balancedness(steered_LG), 4),
                        "uniform_median_ms": round(uniform_med, 2),
                        "uniform_balancedness_even_split": round(_balancedness(expected_device_load(load_LE, uniform)), 4),
                        "greedy_only_median_ms": round(greedy_med, 2),
                        "greedy_only_balancedness_steered": round(_balancedness(greedy_steered_LG), 4)},
            "steering": steering,
            "targets": {"planner_ms_le_100": bool(plan_med <= 100), "uniform_ms_le_100": bool(uniform_med <= 100),
                        "steering_ratio_le_0.02": bool(steering["ratio"] <= 0.02),
                        f"split_ms_le_1_at_{experts}x{devices}x{slots}":
                            bool(split[f"{experts}x{devices}x{slots}"]["median_ms"] <= 1.0),
                        "split_within_2pct_of_lp": all(r["worst_over_lp"] <= 1.02 for r in split.values())},
            "split": split}


def bench_split(experts: int = 256, devices: int = 64, slots: int = 5, layers: int = 4, batches: int = 4,
                tokens: int = 4096 * 8, repeats: int = 5) -> dict[str, object]:
    """The exact split (`steering.split`, one layer, every rank's counts) on a placement planned on a skewed heat,
    for batches drawn from that heat shifted (traffic the plan has not seen): its time (per batch the fastest of
    `repeats`, then the median) and the worst batch's busiest rank over the LP's (`exact.steered_max`)."""
    from eb_deepspeed.planning.placement import plan_placement
    from eb_deepspeed.planning.steering import fill_of, split

    g = torch.Generator().manual_seed(0)
    heat_LE = torch.rand(layers, experts, generator=g).double().pow(-1 / 1.2)
    plan = plan_placement(heat_LE, devices, slots, dispatch="uniform")
    ms, worst = [], 0.0
    for layer in range(layers):
        holds_GE = plan.holds_mask()[layer]
        fill = fill_of(holds_GE)                                              # per placement
        for _ in range(batches):
            shifted_E = heat_LE[layer] * torch.rand(experts, generator=g).double().pow(-0.3)
            counts_E = torch.multinomial(shifted_E, tokens, replacement=True, generator=g).bincount(minlength=experts)
            split(counts_E[None], holds_GE[None], fill)                  # warm-up
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                n_GE = split(counts_E[None], holds_GE[None], fill)[0]
                times.append((time.perf_counter() - t0) * 1e3)
            ms.append(min(times))
            load_G = n_GE.sum(1)
            lp = float(steered_max(plan.phy2log[layer:layer + 1], counts_E[None].double(), slots)[0])
            worst = max(worst, float(load_G.max()) / lp)
    return {"experts": experts, "devices": devices, "slots_per_device": slots, "copies_max": int(plan.logcnt.max()),
            "median_ms": round(statistics.median(ms), 3), "worst_over_lp": round(worst, 4), "batches": len(ms)}


def bench_steering(tokens: int = 4096, hidden: int = 1024, experts: int = 64, devices: int = 8, k: int = 2,
                   repeats: int = 5, device: str = "cpu") -> dict[str, object]:
    """steer() for one layer (`devices` source ranks x `experts` experts, `tokens` per rank, top-k, two slots
    per expert on average) against the forward of a DeepSpeed MoE layer (`experts` experts of
    hidden -> 4 * hidden -> hidden, ep_size 1, on `device`) on the same tokens, side by side."""
    from deepspeed.moe.experts import Experts
    from deepspeed.moe.sharded_moe import MOELayer, TopKGate

    from eb_deepspeed.planning.placement import plan_placement
    from eb_deepspeed.planning.steering import steer

    g = torch.Generator().manual_seed(1)
    E, G = experts, devices
    heat_E = torch.rand(1, E, generator=g).pow(-1 / 1.2)
    small = plan_placement(heat_E, G, 2 * E // G, num_nodes=1)
    counts_GE = torch.distributions.Multinomial(tokens * k, heat_E[0] / heat_E.sum()).sample((G, )).long()
    steer_ms = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        steer(counts_GE, small.expert_devices()[0])
        steer_ms.append((time.perf_counter() - t0) * 1e3)
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden))
    layer = MOELayer(TopKGate(hidden, E, k=k, min_capacity=4), Experts(mlp, E, "ep_size_1"), "ep_size_1", 1, E)
    layer = layer.to(device).eval()
    x = torch.randn(1, tokens, hidden, device=device)
    layer_ms = []
    with torch.no_grad():
        for rep in range(max(2, repeats // 2) + 1):
            _sync(x.device)
            t0 = time.perf_counter()
            layer(x, None)
            _sync(x.device)
            if rep:                                        # the first call warms up (kernels, allocator)
                layer_ms.append((time.perf_counter() - t0) * 1e3)
    steer_med, layer_med = statistics.median(steer_ms), statistics.median(layer_ms)
    return {"ranks": G, "experts": E, "tokens_per_rank": tokens, "k": k, "device": str(device),
            "median_ms": round(steer_med, 3), "moe_layer_forward_ms": round(layer_med, 2),
            "ratio": round(steer_med / layer_med, 5), "target_ratio": 0.02}


def pareto_loads(L: int, E: int, seed: int = 0) -> torch.Tensor:
    """Skewed expert loads [L, E]: Pareto(1, 1.3) by inverse transform, times U(1, 2) noise."""
    g = torch.Generator().manual_seed(seed)
    pareto = torch.rand(L, E, generator=g).pow(-1 / 1.3)
    return pareto.mul(1 + torch.rand(L, E, generator=g))


OPTIMUM_SHAPES = ((4, 3, 2), (5, 3, 2), (3, 2, 3), (4, 2, 3), (5, 2, 3), (6, 3, 2), (4, 2, 2))


def bench_optimum(seeds: int = 30, shapes=OPTIMUM_SHAPES) -> dict[str, object]:
    """plan_placement against the brute-force optimum on tiny inputs (experts, devices, slots), one
    Pareto load per seed; the steered slowest device of the plan over the optimum's, with the
    refinement (default) and without it (refine_rounds=0), side by side (target: within 5 %)."""
    from eb_deepspeed.planning.placement import plan_placement

    rows = []
    for E, G, S in shapes:
        ratios = {"refined": [], "greedy_only": []}
        for seed in range(seeds):
            load = pareto_loads(1, E, seed)
            best = brute_force_optimum(load[0].tolist(), G, S)
            for name, rounds in (("refined", None), ("greedy_only", 0)):
                plan = plan_placement(load, G, S, refine_rounds=rounds)
                ratios[name].append(steered_max_load(plan.holds_mask()[0].tolist(), load[0].tolist()) / best)
        rows.append({"experts": E, "devices": G, "slots": S, "seeds": seeds,
                     **{f"{name}_worst": round(max(r), 4) for name, r in ratios.items()},
                     **{f"{name}_over_5pct": sum(x > 1.05 + 1e-9 for x in r) for name, r in ratios.items()}})
    return {"benchmark": "optimum", "rows": rows,
            "refined_worst": max(r["refined_worst"] for r in rows),
            "refined_over_5pct": sum(r["refined_over_5pct"] for r in rows),
            "greedy_only_worst": max(r["greedy_only_worst"] for r in rows),
            "greedy_only_over_5pct": sum(r["greedy_only_over_5pct"] for r in rows),
            "cases": seeds * len(shapes),
            "targets": {"refined_within_5pct": all(r["refined_over_5pct"] == 0 for r in rows)}}
