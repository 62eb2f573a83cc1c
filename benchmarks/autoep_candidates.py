"""The AutoEP benchmark's three rows beside three candidate settings of the balance, in one run (how the
default `aux.loss_coeff` was chosen; docs/benchmarks.md, "AutoEP").

    DS_ACCELERATOR=cpu python -m benchmarks.autoep_candidates > benchmarks/results/bench_train_autoep.json    # ~20 min, 2 cores
"""
from __future__ import annotations

import json

from benchmarks.bench import AUTOEP_ROWS, bench_train_autoep

CANDIDATES = (("eb_coeff0.1", ("--mode", "balance", "--loss-coeff", "0.1")),
              ("eb_coeff0.1_rate0.01", ("--mode", "balance", "--loss-coeff", "0.1", "--bias-rate", "0.01")),
              ("fixed0.1", ("--mode", "balance", "--aux-policy", "fixed", "--loss-coeff", "0.1")))

if __name__ == "__main__":
    print(json.dumps(bench_train_autoep(rows=AUTOEP_ROWS + CANDIDATES), indent=1))
