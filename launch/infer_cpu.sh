#!/usr/bin/env bash
# Serve the DeepSpeed-MoE job's model: set up, train it first if runs/ds/ckpt is missing, then serve held-out
# stdlib text with 2 CPU ranks under the deepspeed launcher, plain DeepSpeed and eb_deepspeed side by side,
# writing runs/infer/summary.json, runs/infer/balance/balance.jsonl and its PNG plots.
# Extra arguments go to examples/infer_moe_lm.py (e.g. --batches 100).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_cpu.sh"
cd "$EB_ROOT"
if [ ! -f runs/ds/ckpt/latest ]; then
  echo "[eb infer] no runs/ds/ckpt yet: running launch/train_ds_cpu.sh first"
  bash launch/train_ds_cpu.sh --no-report
fi
port="$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
# DeepSpeed's CPU shm comm op leaves a 64 MiB /dev/shm buffer per rank named by the port: remove ours on exit
trap 'rm -f /dev/shm/deepspeed_allreduce_buffer_*_"$port"_*' EXIT
deepspeed --num_gpus 2 --master_port "$port" examples/infer_moe_lm.py \
  --config configs/infer_cpu_2rank.json --ckpt runs/ds/ckpt --run-dir runs/infer "$@"
echo "plots: $EB_ROOT/runs/infer/balance/plots   (re-render any time: eb report runs/infer/balance)"
