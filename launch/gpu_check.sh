#!/usr/bin/env bash
# One CUDA GPU, one JSON (last line; also runs/gpu_check_<device>.json): DeepSpeed-MoE gate overhead ratio,
# steering cost / MoE-layer forward at 4096 tokens (ep 1), bf16 gate parity; and an HF Mixtral under DeepSpeed's
# AutoEP (2 layers, hidden 2048, 64 experts, top-8, 8192 tokens, bf16) with our hooks and without: overhead ratio,
# host syncs of ours in forward + backward, observe-mode bit-parity. "targets": each target, true when met.
# Sets itself up: a venv with the CUDA torch pip picks and transformers (GPU machines) or, with --cpu, this
# project's CPU set-up; then runs benchmarks/gpu_check.py (a few minutes).
#   bash launch/gpu_check.sh                  # on a machine with one CUDA GPU
#   bash launch/gpu_check.sh --cpu [--quick]  # the same code on CPU (tested in the suite with --quick)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
device=cuda; extra=()
for a in "$@"; do
  case "$a" in
    --cpu) device=cpu ;;
    *) extra+=("$a") ;;
  esac
done
if [ "$device" = cpu ]; then
  source "$ROOT/launch/setup_cpu.sh"
else
  VENV="${EB_GPU_VENV:-$ROOT/.venv-gpu}"
  if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q torch          # the CUDA build from PyPI
  fi
  if ! "$VENV/bin/python" -c "import deepspeed, transformers" 2> /dev/null; then
    "$VENV/bin/python" -m pip install -q -e "$ROOT[hf]"  # the package, DeepSpeed and the transformers AutoEP needs
  fi
  export PATH="$VENV/bin:$PATH"
fi
cd "$ROOT"
python -m benchmarks.gpu_check --device "$device" --out "runs/gpu_check_$device.json" "${extra[@]+"${extra[@]}"}"
