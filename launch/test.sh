#!/usr/bin/env bash
# Set up, then run the whole test suite (unit + real multi-process DeepSpeed/gloo + the main job).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_cpu.sh"
cd "$EB_ROOT"
python -m pytest -q tests "$@"
