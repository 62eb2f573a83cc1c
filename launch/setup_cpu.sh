#!/usr/bin/env bash
# Set up everything eb_deepspeed needs on a CPU machine, into ./.venv (idempotent, safe to re-run).
# torch is pinned to the CPU build (torch==2.13.0) *before* the package, so no CUDA build is downloaded.
# DeepSpeed's JIT-compiled shm comm op is built here, once, into this checkout's venv, so no test and
# no training job pays for the compile inside its own time limit, and two checkouts never rebuild
# each other's copy (torch keys a build by its flags, which name the venv).
# Usage: source launch/setup_cpu.sh   (or bash it; the other launch scripts source it)
# Sourced, it only exports PATH, DS_ACCELERATOR, WANDB_MODE, OMP_NUM_THREADS, TORCH_EXTENSIONS_DIR and the EB_* names
# below: the work runs in a subshell under `set -euo pipefail`, and your shell's options stay as they were.
EB_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EB_VENV="${EB_VENV:-$EB_ROOT/.venv}"

export PATH="$EB_VENV/bin:$PATH"
export DS_ACCELERATOR=cpu                       # DeepSpeed's CPU accelerator (gloo backend)
export WANDB_MODE="${WANDB_MODE:-offline}"      # real W&B run files, no account; `wandb sync` uploads later
# one thread per rank: the CPU jobs run 2 ranks on 2 cores (torch's thread per core makes a step 1.7-2.6x slower)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$EB_VENV/torch_extensions}"

if ! (
  set -euo pipefail
  PY="${PYTHON:-python3}"
  stamp="$EB_VENV/.eb_setup_stamp"
  want="$(cat "$EB_ROOT/setup.py" "$EB_ROOT/launch/setup_cpu.sh" | sha1sum | cut -d' ' -f1)"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "[eb setup] creating $EB_VENV: 3 pip steps, ~2-4 min the first time (torch CPU, then deepspeed," \
         "megatron-core, transformers, wandb, pytest, matplotlib)"
    "$PY" -m venv "$EB_VENV"
    echo "[eb setup] pip 1/3: pip itself"
    "$EB_VENV/bin/python" -m pip install -q --upgrade pip
    echo "[eb setup] pip 2/3: torch==2.13.0 (the CPU wheel)"
    "$EB_VENV/bin/python" -m pip install -q "torch==2.13.0"
    echo "[eb setup] pip 3/3: eb_deepspeed and its extras (test, wandb, plots, megatron, hf)"
    "$EB_VENV/bin/python" -m pip install -q -e "$EB_ROOT[test,wandb,plots,megatron,hf]"
    echo "$want" > "$stamp"
  fi
  # Build (first time, ~40-110 s) or load (a few seconds) the shm op that deepspeed.init_distributed uses.
  if [ -z "$(ls -A "$TORCH_EXTENSIONS_DIR" 2> /dev/null)" ]; then
    echo "[eb setup] compiling DeepSpeed's shm comm op once into $TORCH_EXTENSIONS_DIR (can take minutes; later runs load it)"
  fi
  if ! ops_log="$("$EB_VENV/bin/python" - 2>&1 <<'PY'
import deepspeed.ops
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
    builder.load(verbose=False)
PY
  )"; then
    echo "$ops_log" >&2
    echo "[eb setup] building DeepSpeed's shm comm op failed (log above)" >&2
    exit 1
  fi
); then
  echo "[eb setup] failed (see above)" >&2
  # sourced: return to the caller's shell (which stays open); run: exit with an error
  return 1 2> /dev/null || exit 1
fi
