#!/usr/bin/env bash
# The Megatron-Core job: set up (megatron-core 0.16.1 is in the CPU venv), then train a small Megatron-Core
# GPT with MoE layers (EP 2) on the stdlib sources with 2 CPU ranks under the deepspeed launcher (W&B
# offline), writing runs/megatron/balance/balance.jsonl and its PNG plots.
# Extra arguments go to examples/megatron_train_moe.py (e.g. --steps 200, --aux-policy bias).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_cpu.sh"
cd "$EB_ROOT"
port="$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
# DeepSpeed's CPU shm comm op leaves a 64 MiB /dev/shm buffer per rank named by the port: remove ours on exit
trap 'rm -f /dev/shm/deepspeed_allreduce_buffer_*_"$port"_*' EXIT
deepspeed --num_gpus 2 --master_port "$port" examples/megatron_train_moe.py \
  --config configs/megatron_cpu.json --run-dir runs/megatron "$@"
echo "plots: $EB_ROOT/runs/megatron/balance/plots   (re-render any time: eb report runs/megatron/balance)"
