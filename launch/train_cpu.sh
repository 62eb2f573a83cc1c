#!/usr/bin/env bash
# The main job: set up, then train a tiny Hugging Face Mixtral (random weights from a config; no downloads)
# converted by DeepSpeed's AutoEP on the stdlib sources, 2 CPU ranks under the deepspeed launcher (W&B offline),
# twice: plain AutoEP (easybalance only watching: `observe`, bit-identical to AutoEP alone) and the default
# balanced block. Writes runs/{main_baseline,main}/balance/balance.jsonl with their PNG plots, runs/main/compare.png
# and runs/main/summary.json (vs_baseline), and prints the verdict. Extra arguments go to examples/train_hf_moe.py,
# both runs (e.g. --steps 300, --family qwen3_moe). The DeepSpeed-MoE job: launch/train_ds_cpu.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_cpu.sh"
cd "$EB_ROOT"
port="$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
# DeepSpeed's CPU shm comm op leaves a 64 MiB /dev/shm buffer per rank named by the port: remove ours on exit
trap 'rm -f /dev/shm/deepspeed_allreduce_buffer_*_"$port"_*' EXIT
# 200 steps (the balanced routes settle by ~120), micro-batch 16 x 64 tokens per rank, 8 held-out batches at the
# end (one thread per rank: setup_cpu.sh)
job=(examples/train_hf_moe.py --deepspeed_config configs/train_hf_cpu_2rank.json --steps 200 --micro-batch 16
     --eval-batches 8)
deepspeed --num_gpus 2 --master_port "$port" "${job[@]}" --run-dir runs/main_baseline --mode observe "$@"
deepspeed --num_gpus 2 --master_port "$port" "${job[@]}" --run-dir runs/main --baseline runs/main_baseline "$@"
echo "plots: $EB_ROOT/runs/main/compare.png (plain AutoEP vs balanced) and runs/main/balance/plots"
echo "       (re-render any time: eb report runs/main/balance; eb report --compare runs/main_baseline runs/main)"
