#!/usr/bin/env bash
# Set up, then run the tests.
#   bash launch/test.sh            everything: unit, real multi-process DeepSpeed/gloo jobs, the main job
#   bash launch/test.sh --fast     the unit subset only (pure logic, one process; about 1.5 min on 2 cores)
# Other arguments go to pytest (e.g. -k checkpoint, -x).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_cpu.sh"
cd "$EB_ROOT"
# The full run names each test as it starts (-v): a multi-process test can take minutes on 2 cores.
mode=(-v --durations=30); extra=()
for a in "$@"; do
  if [ "$a" = "--fast" ]; then mode=(-q -m unit); else extra+=("$a"); fi
done
python -m pytest tests "${mode[@]}" "${extra[@]+"${extra[@]}"}"
