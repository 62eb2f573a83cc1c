#!/usr/bin/env bash
# Multi-node GPU example (not run by the tests: this machine has no GPU). Needs a hostfile:
#   node1 slots=8
#   node2 slots=8
# and the CUDA torch of your cluster (pip install -e . on every node, same path).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
deepspeed --hostfile "${HOSTFILE:-hostfile}" examples/train_moe_lm.py \
  --deepspeed_config configs/train_8gpu.json --ep-size 8 --experts 16 --layers 8 --hidden 512 \
  --run-dir runs/multinode "$@"
