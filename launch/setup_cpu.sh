#!/usr/bin/env bash
# Set up everything eb_deepspeed needs on a CPU machine, into ./.venv (idempotent, safe to re-run).
# torch is pinned to the CPU build (torch==2.13.0) *before* the package, so no CUDA build is downloaded.
# Usage: source launch/setup_cpu.sh   (or bash it; the other launch scripts source it)
set -euo pipefail
EB_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EB_VENV="${EB_VENV:-$EB_ROOT/.venv}"
PY="${PYTHON:-python3}"
stamp="$EB_VENV/.eb_setup_stamp"
want="$(cat "$EB_ROOT/setup.py" "$EB_ROOT/launch/setup_cpu.sh" | sha1sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[eb setup] creating $EB_VENV (torch==2.13.0 CPU, deepspeed, wandb, pytest, matplotlib)"
  "$PY" -m venv "$EB_VENV"
  "$EB_VENV/bin/python" -m pip install -q --upgrade pip
  "$EB_VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$EB_VENV/bin/python" -m pip install -q -e "$EB_ROOT[test,wandb,plots]"
  echo "$want" > "$stamp"
fi
export PATH="$EB_VENV/bin:$PATH"
export DS_ACCELERATOR=cpu                       # DeepSpeed's CPU accelerator (gloo backend)
export WANDB_MODE="${WANDB_MODE:-offline}"      # real W&B run files, no account; `wandb sync` uploads later
# DeepSpeed JIT-compiles its shm comm op once (~40-100 s here); keep the build between runs.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$HOME/.cache/eb_deepspeed/torch_extensions}"
