#!/usr/bin/env bash
# Set up, then run the tests.
#   bash launch/test.sh            everything: unit, real multi-process DeepSpeed/gloo jobs, the main job
#   bash launch/test.sh --fast     the unit subset only (pure logic, one process; under a minute)
# Other arguments go to pytest (e.g. -k checkpoint, -x).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_cpu.sh"
cd "$EB_ROOT"
args=()
for a in "$@"; do
  if [ "$a" = "--fast" ]; then args+=(-m unit); else args+=("$a"); fi
done
python -m pytest -q tests "${args[@]+"${args[@]}"}"
