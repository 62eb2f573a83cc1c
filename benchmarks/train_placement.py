"""Training-time expert placement on AutoEP, side by side in one run (issue 41): plain AutoEP, placement only
(`observe`: routing untouched), the balanced default, and both, each a real 2-rank launch of the main job's model
(examples/train_hf_moe.py: a tiny HF Mixtral, 4 layers x 8 experts, top-2, on the stdlib sources).

    python -m benchmarks.train_placement [--steps 200] [--interval 20] [--seed 1234] [--json FILE]
    python -m benchmarks.train_placement --bound runs/bench_train_placement/plain      # a permutation, replicas: held out

Per variant, over the second half of the run: the busiest EP rank's routed tokens over the mean (p90 over layers;
a dropless layer's time on a GPU), the busiest rank's time in the experts over the mean rank's (CPU, forward and
backward, `--time-experts`), LM loss and held-out loss, re-plans and bytes of expert state moved per step against
the step's all-to-all bytes per rank. `targets` holds issue 41's.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import socket
import subprocess
import sys

from eb_deepspeed.tools.cli import bounded

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {"plain": ["--mode", "observe"], "placement": ["--mode", "observe", "--train-placement", "{interval}"],
            "default": [], "both": ["--train-placement", "{interval}"]}
# the main job's model (launch/train_cpu.sh): its dimensions give a step's all-to-all bytes
LAYERS, HIDDEN, K, SEQ, MICRO = 4, 64, 2, 64, 16


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_variant(name: str, steps: int, interval: int, out: str, seed: int) -> dict:
    run_dir = os.path.join(out, name)
    shutil.rmtree(run_dir, ignore_errors=True)           # a fresh log: records of an earlier run would be appended
    args = [a.format(interval=interval) for a in VARIANTS[name]]
    port = _port()
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(port), "examples/train_hf_moe.py",
           "--deepspeed_config", "configs/train_hf_cpu_2rank.json", "--steps", str(steps), "--micro-batch", str(MICRO),
           "--eval-batches", "8", "--time-experts", "--no-report", "--seed", str(seed), "--run-dir", run_dir, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    finally:        # DeepSpeed's CPU shm comm op leaves a 64 MiB /dev/shm buffer per rank, named by the port
        for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
            os.remove(path)
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(run_dir, "balance", "balance.jsonl")) as f:
        last = [json.loads(line) for line in f if line.strip()][-1]
    seconds = summary["expert_seconds_per_rank"]
    half = summary["train_second_half"]
    step_bytes = LAYERS * MICRO * SEQ * K * HIDDEN * 4 * 2 * 2    # routes x hidden x fp32, dispatch + combine, fwd + bwd
    return {"busiest_rank_share_p90": round(half["device_max_over_mean_p90"], 4),
            "expert_time_busiest_over_mean": round(max(seconds) / (sum(seconds) / len(seconds)), 4),
            "expert_seconds_per_rank": [round(s, 3) for s in seconds],
            "lm_loss": round(half["lm_loss"], 4), "val_loss": round(summary["final"]["val_loss"], 4),
            "replans": last.get("replans", 0), "moved_bytes_per_step": round(last.get("moved_bytes", 0) / steps),
            "moved_over_step_bytes": round(last.get("moved_bytes", 0) / steps / step_bytes, 4)}


def placement_bound(run_dir: str, devices: int = 2, replica_slots=(0, 1, 2)) -> dict:
    """What a permutation (0) and R replica slots a rank reach on a run's own traffic, held out: homes planned on the
    first half's summed expert counts; judged on the second half, the busiest rank over the mean per layer: the
    permutation on the summed counts, replicas as training chooses them (each logged step's slots from its own
    counts, `choose_replicas`, the exact split over the copies), against the per-step share the run had.
    (On real counts, OLMoE at EP 8-64 and others: `python -m benchmarks.replay --permutation`.)"""
    import torch
    from eb_deepspeed.observe.report import read_log
    from eb_deepspeed.planning.placement import expected_device_load, plan_placement
    from eb_deepspeed.planning.replicas import choose_replicas, copies
    from eb_deepspeed.planning.steering import split
    records = [r for r in read_log(os.path.join(run_dir, "balance"), keys=("expert_counts_LE", "device_max_over_mean"))
               if r.get("expert_counts_LE") and r.get("device_max_over_mean")]
    if len(records) < 2:
        raise ValueError(f"{run_dir}: its balance log holds {len(records)} records with expert counts, 2 at least "
                         "(a run of examples/train_hf_moe.py logs them)")
    first, half = records[:len(records) // 2], records[len(records) // 2:]
    plan_LE = torch.tensor([r["expert_counts_LE"] for r in first], dtype=torch.float64).sum(0)
    judge_NLE = torch.tensor([r["expert_counts_LE"] for r in half], dtype=torch.float64)
    homes = plan_placement(plan_LE, devices, plan_LE.shape[1] // devices, dispatch="uniform")
    home_LE = homes.log2phy[:, :, 0] // homes.slots_per_device
    load_LG = expected_device_load(judge_NLE.sum(0), homes)
    out = {"permutation_share": [round(v, 3) for v in (load_LG.amax(1) / load_LG.mean(1)).tolist()]}
    for r in (r for r in replica_slots if r):
        load_NLG = torch.stack([split(c, copies(home_LE, choose_replicas(c, home_LE, devices, r), devices)).sum(2)
                                for c in judge_NLE]).double()
        out[f"replicas_{r}_share"] = [round(v, 3) for v in (load_NLG.amax(2) / load_NLG.mean(2)).mean(0).tolist()]
    judge_LE = judge_NLE.sum(0)
    return out | {"hottest_expert_over_rank_share": [round(v, 3) for v in
                                                    (judge_LE.amax(1) / (judge_LE.sum(1) / devices)).tolist()],
                  "run_share": [round(sum(r["device_max_over_mean"][layer] for r in half) / len(half), 3)
                                for layer in range(judge_LE.shape[0])]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=bounded(1), default=200)
    p.add_argument("--interval", type=bounded(1), default=20, help="optimizer steps between re-plans (>= 1)")
    p.add_argument("--seed", type=int, default=1234, help="the example's seed (model and data)")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_train_placement"))
    p.add_argument("--json", default=None, help="also write the result here")
    p.add_argument("--bound", default=None, metavar="RUN_DIR",
                   help="only print what a permutation and 1-2 replica slots reach on a finished run's traffic, "
                        "held out (placement_bound)")
    args = p.parse_args(argv)
    if args.bound:
        try:
            print(json.dumps(placement_bound(args.bound)))
        except (OSError, ValueError) as e:
            print(f"benchmarks.train_placement --bound: error: {e}", file=sys.stderr)
            return 2
        return 0
    rows = {name: run_variant(name, args.steps, args.interval, args.out, args.seed) for name in VARIANTS}
    plain, placed = rows["plain"], rows["placement"]
    result = {"steps": args.steps, "interval": args.interval, "seed": args.seed, "rows": rows, "targets": {
        "placement_cuts_busiest_share_ge_30pct": placed["busiest_rank_share_p90"] <= 0.7 * plain["busiest_rank_share_p90"],
        "moves_le_5pct_of_step_bytes": placed["moved_over_step_bytes"] <= 0.05,
        "lm_loss_equal_to_plain": abs(placed["lm_loss"] - plain["lm_loss"]) <= 1e-3},
        "bound": placement_bound(os.path.join(args.out, "plain"))}      # on plain AutoEP's traffic, held out
    print(f"{'variant':10} {'busiest/mean p90':>16} {'expert time max/mean':>20} {'LM loss':>8} {'held-out':>8} "
          f"{'re-plans':>8} {'moved/step bytes':>16}")
    for name, r in rows.items():
        print(f"{name:10} {r['busiest_rank_share_p90']:16.3f} {r['expert_time_busiest_over_mean']:20.3f} "
              f"{r['lm_loss']:8.4f} {r['val_loss']:8.4f} {r['replans']:8d} {r['moved_over_step_bytes']:16.4f}")
    print(json.dumps(result["targets"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
