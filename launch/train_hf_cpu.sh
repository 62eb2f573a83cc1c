#!/usr/bin/env bash
# A Hugging Face MoE model under DeepSpeed's AutoEP, balanced: set up, then train a tiny random Mixtral (from a
# config; no downloads) on the stdlib sources with 2 CPU ranks under the deepspeed launcher (W&B offline),
# writing runs/hf/balance/balance.jsonl and its PNG plots. Extra arguments go to examples/train_hf_moe.py
# (e.g. --family qwen3_moe or deepseek_v3, --mode observe, --zero 3, --steps 120, --resume).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_cpu.sh"
cd "$EB_ROOT"
port="$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
# DeepSpeed's CPU shm comm op leaves a 64 MiB /dev/shm buffer per rank named by the port: remove ours on exit
trap 'rm -f /dev/shm/deepspeed_allreduce_buffer_*_"$port"_*' EXIT
deepspeed --num_gpus 2 --master_port "$port" examples/train_hf_moe.py \
  --deepspeed_config configs/train_hf_cpu_2rank.json --run-dir runs/hf "$@"
echo "plots: $EB_ROOT/runs/hf/balance/plots   (re-render any time: eb report runs/hf/balance)"
