#!/usr/bin/env bash
# The DeepSpeed-MoE job: set up, then train the byte-level MoE LM (deepspeed.moe.layer.MoE) on the stdlib sources with 2 CPU ranks under
# the deepspeed launcher (W&B offline), twice: a baseline (observe) and balanced, writing
# runs/{ds_baseline,ds}/balance/balance.jsonl, their PNG plots, and runs/ds/compare.png + the verdict.
# Extra arguments go to examples/train_moe_lm.py (e.g. --steps 200, --resume).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_cpu.sh"
cd "$EB_ROOT"
port="$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
# DeepSpeed's CPU shm comm op leaves a 64 MiB /dev/shm buffer per rank named by the port: remove ours on exit
trap 'rm -f /dev/shm/deepspeed_allreduce_buffer_*_"$port"_*' EXIT
# First the baseline: the same job with easybalance only watching (observe: DeepSpeed's own routing,
# bit-identical to plain DeepSpeed), then the balanced run, which compares itself with it.
deepspeed --num_gpus 2 --master_port "$port" examples/train_moe_lm.py \
  --deepspeed_config configs/train_cpu_2rank.json --run-dir runs/ds_baseline --mode observe "$@"
deepspeed --num_gpus 2 --master_port "$port" examples/train_moe_lm.py \
  --deepspeed_config configs/train_cpu_2rank.json --run-dir runs/ds --baseline runs/ds_baseline "$@"
echo "plots: $EB_ROOT/runs/ds/balance/plots and runs/ds/compare.png (baseline vs balanced)"
echo "       (re-render any time: eb report runs/ds/balance; eb report --compare runs/ds_baseline runs/ds)"
