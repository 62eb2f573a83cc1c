"""What watching costs a serving gate: our `ReplicaGate` in DeepSpeed's layout against DeepSpeed's own
`TopKGate`, side by side in one process (top-2, no drops, no collectives), interleaved.

    DS_ACCELERATOR=cpu python -m benchmarks.gate_overhead          # T=512 tokens, E=8 experts, M=64
    DS_ACCELERATOR=cpu python -m benchmarks.gate_overhead 4096 64 256

Prints one JSON object: the median forward time of each gate, their difference per forward, the cost of the
tally's `take()` (one view step every `--view-interval` forwards, amortised), the extra work as a share of
DeepSpeed's gate, and `targets`: that share at most 20 % (the recorder that counted forward by forward cost
45-50 % here; the issue's own target is end to end, `python -m benchmarks infer`: serving >= 0.98x plain's tokens/s).
"""
from __future__ import annotations

import argparse
import json

TARGET_SHARE = 0.20


def measure(T: int, E: int, M: int, view_interval: int, repeats: int) -> dict:
    import torch
    from deepspeed.moe.sharded_moe import TopKGate

    from eb_deepspeed.adapters.deepspeed.replicas import ReplicaGate
    from eb_deepspeed.adapters.routing import SlotTable
    from eb_deepspeed.planning.placement import static_placement
    from benchmarks.infer import gate_medians_ms
    torch.set_num_threads(1)
    torch.manual_seed(0)
    plain = TopKGate(M, E, 2, 1.0, 1.0, 4, None, False, True, None, True).eval()
    ours = ReplicaGate.from_gate(plain, 1, E, table=SlotTable.even(static_placement(1, E, 1).log2phy[0]))
    h = torch.randn(T, M)
    ms = gate_medians_ms(plain, ours, h, repeats, skip=20, take_every=view_interval)
    extra = ms["ours"] - ms["plain"] + ms["take"] / view_interval
    return {"tokens": T, "experts": E, "model_dim": M, "view_interval": view_interval,
            "plain_ms": round(ms["plain"], 4), "ours_ms": round(ms["ours"], 4), "take_ms": round(ms["take"], 4),
            "extra_ms_per_forward": round(extra, 4), "extra_share_of_deepspeeds_gate": round(extra / ms["plain"], 4),
            "targets": {f"extra_le_{TARGET_SHARE}_of_deepspeeds_gate": extra <= TARGET_SHARE * ms["plain"]}}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tokens", nargs="?", type=int, default=512)
    p.add_argument("experts", nargs="?", type=int, default=8)
    p.add_argument("model_dim", nargs="?", type=int, default=64)
    p.add_argument("--view-interval", type=int, default=8)
    p.add_argument("--repeats", type=int, default=400)
    a = p.parse_args(argv)
    print(json.dumps(measure(a.tokens, a.experts, a.model_dim, a.view_interval, a.repeats)))


if __name__ == "__main__":
    main()
