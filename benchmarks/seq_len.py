"""`python -m benchmarks.seq_len`: does weighting each token by its sequence's length (the article's last advice;
`easybalance.seq_len_weighting` until this measured it worse) make the per-EP-rank load a better predictor of each
rank's expert time than plain route counts? Writes benchmarks/results/seq_len.json.

Shape legend: B rows, S row length, L MoE layers, E experts, G EP ranks, T tokens (B x S), K top-k, N records.

    python -m benchmarks.seq_len [--seeds 3] [--steps 40] [--json]

A tiny HF Mixtral (examples/hf_moe.py) under DeepSpeed's AutoEP, 2 gloo ranks, ep_size 2, trained on the stdlib
sources, `mode: observe`; the weights are `length_weights` of each row's real length. AutoEP is dropless:
a rank's experts run GEMMs over exactly the rows it receives. (DeepSpeed-MoE pads every expert to the capacity on
every rank, so its expert time does not depend on the routes and no view can predict it.) Real lengths are uniform
in [min_len, S]. `padded`: one sequence a row, padded to S with byte 0, no attention mask (padding goes through router
and experts like any token); lengths_B = the real lengths. `packed`: sequences back to back; the API takes one
length per row, so lengths_B = S and every weight is 1; `segment` is what per-token weights (own sequence's length
over the mean) would predict. Truth per step, layer and rank: CPU seconds of the main thread in `layer.experts`
forward + backward (`thread_time`: less disturbed by a shared host than `wall`, also given) and the GEMM rows
(`flops`: FLOPs are rows x 18 H F). Predictions: each rank's share of the reduced routes, unweighted
(`view.last.kept_LE`, also recomputed from the routes: `own_routes_match_view`) and weighted;
`constant` (1 / G) is the floor. Scores over steps (the first 2 left out), layers and seeds: mean |predicted -
measured| busiest-rank share, Pearson r of rank 0's share (pooled, and within each seed and layer).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from eb_deepspeed.tools.cli import bounded

from .bench import _repo_root, free_port, unlink_shm_buffers
from .ranks import launch_ranks, worker_main

__all__ = ["bench_seq_len", "make_batch", "run_rank", "summarize"]

KINDS = ("padded", "packed")
PAD, SKIP = 0, 2     # padding byte; first steps left out (first-call overheads)


def make_batch(corpus, kind: str, B: int, S: int, min_len: int, g: torch.Generator):
    """inputs [B, S], labels [B, S] (-100 on padding), lengths_B [B] for set_sequence_lengths, and per token the
    length of its own sequence [T] (each packed sequence's, cut at the row's end)."""
    n = B if kind == "padded" else B * (S // min_len + 1)
    x_NS, len_N = corpus.batch("train", n, S, g)[0], torch.randint(min_len, S + 1, (n, ), generator=g)
    if kind == "padded":
        real_BS = torch.arange(S)[None, :] < len_N[:, None]
        x_BS = torch.where(real_BS, x_NS, PAD)
        return x_BS, torch.where(real_BS, x_BS, -100), len_N, len_N.repeat_interleave(S)
    rows, seg_T, i = [], [], 0
    for _ in range(B):
        fill = len(seg_T)
        while len(seg_T) - fill < S:
            take = min(int(len_N[i]), S - (len(seg_T) - fill))
            rows.append(x_NS[i, :take])
            seg_T, i = seg_T + [take] * take, i + 1
    x_BS = torch.cat(rows).view(B, S)
    return x_BS, x_BS.clone(), torch.full((B, ), S), torch.tensor(seg_T)


class _ExpertClock:
    """Per layer since `reset`: CPU and wall seconds in `layer.experts` forward + backward, its GEMM rows
    (examples/train_hf_moe.py's ExpertClock sums every layer over a run; this needs each layer and step)."""

    def __init__(self, layers):
        self.reset(len(layers))
        for i, layer in enumerate(layers):
            layer.experts.register_forward_pre_hook(lambda m, a, i=i: self._start(i, a[0].shape[0]))
            layer.experts.register_forward_hook(lambda m, a, o, i=i: self._stop(i))
            layer.experts.register_full_backward_pre_hook(lambda m, g, i=i: self._start(i, 0))
            layer.experts.register_full_backward_hook(lambda m, gi, go, i=i: self._stop(i))

    def reset(self, L: int) -> None:
        self.cpu_L, self.wall_L, self.rows_L = [0.0] * L, [0.0] * L, [0] * L

    def _start(self, i: int, rows: int) -> None:
        self.rows_L[i] += rows
        self.started = (time.thread_time(), time.perf_counter())

    def _stop(self, i: int) -> None:
        self.cpu_L[i] += time.thread_time() - self.started[0]
        self.wall_L[i] += time.perf_counter() - self.started[1]


def length_weights(lengths_B: torch.Tensor, seq_len: int) -> torch.Tensor:
    """What `seq_len_weighting` gave each token (the option left the package on this measurement): its
    sequence's real length over the batch mean, [B] -> [B * seq_len]."""
    lengths_B = lengths_B.double()
    return (lengths_B / lengths_B.mean()).repeat_interleave(seq_len)


def _run(args: dict, corpus, seed: int, kind: str) -> list[dict]:
    """One training run of `kind` batches; per (step, layer) the per-rank truth and every prediction."""
    import eb_deepspeed
    from deepspeed.moe.utils import configure_moe_param_groups
    from eb_deepspeed.adapters.autoep import find_autoep_layers
    from hf_moe import autoep_section, hf_moe_model
    G, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    B, S, E = args["batch"], args["seq_len"], args["experts"]
    torch.manual_seed(seed)
    model = hf_moe_model("mixtral", layers=args["layers"], hidden=args["hidden"], experts=E, k=2, ffn=args["ffn"])
    cfg = {"train_micro_batch_size_per_gpu": B, "steps_per_print": 10**6,
           "expert_parallel": autoep_section("mixtral", G),
           "easybalance": {"mode": "observe",
                           "log": {"dir": os.path.join(args["out_dir"], "log"), "interval": 10**6, "wandb": False}}}
    engine, _, _, _ = eb_deepspeed.initialize(model=model, config=cfg, optimizer=lambda ps: torch.optim.AdamW(
        configure_moe_param_groups(list(ps)), lr=1e-3, weight_decay=0.0))
    eb = engine.easybalance
    layers = [m for _, m in find_autoep_layers(engine.module)]
    routes = [None] * len(layers)      # [T, K] experts chosen in this step's forward, per layer
    for i, layer in enumerate(layers):
        layer.router.register_forward_hook(lambda m, a, out, i=i: routes.__setitem__(i, out[1].detach()))
    clock, g, out = _ExpertClock(layers), torch.Generator().manual_seed(1000 * seed + rank), []
    for step in range(args["steps"]):
        x_BS, y_BS, len_B, seg_T = make_batch(corpus, kind, B, S, args["min_len"], g)
        clock.reset(len(layers))
        engine.backward(engine(input_ids=x_BS, labels=y_BS).loss)
        engine.step()
        seg_T = seg_T.double()      # own predictions [3, L, G]: unweighted, the API's row weights, per sequence
        own_WLG = torch.stack([torch.stack([torch.zeros(G, dtype=torch.float64).index_add_(
            0, (r_TK // (E // G)).reshape(-1), w_T.repeat_interleave(r_TK.shape[1])) for r_TK in routes]) for w_T in
            (torch.ones(B * S, dtype=torch.float64), length_weights(len_B, S), seg_T * (1 / seg_T).mean())])
        torch.distributed.all_reduce(own_WLG)
        truth, view = [None] * G, eb.view
        unweighted_LG = view.expert_to_device_load(view.last.kept_LE)
        torch.distributed.all_gather_object(truth, (clock.cpu_L, clock.wall_L, clock.rows_L))
        for layer in range(len(layers)):
            out.append({"seed": seed, "step": step, "layer": layer,
                        **{key: [t[j][layer] for t in truth] for j, key in enumerate(("cpu", "wall", "flops"))},
                        "unweighted": unweighted_LG[layer].tolist(), "weighted": own_WLG[1, layer].tolist(),
                        "own_unweighted": own_WLG[0, layer].tolist(), "own_weighted": own_WLG[1, layer].tolist(),
                        "segment": own_WLG[2, layer].tolist()})
    eb.close()
    return out


def run_rank(args: dict) -> dict:
    """Every (seed, kind) run on this rank; rank 0 returns the summary."""
    import deepspeed
    sys.path.insert(0, os.path.join(args["root"], "examples"))
    from moe_lm import StdlibCorpus
    deepspeed.init_distributed(dist_backend="gloo")
    corpus = StdlibCorpus(max_bytes=args["max_bytes"])
    t0 = time.perf_counter()
    records = {kind: [r for seed in args["seeds"] for r in _run(args, corpus, seed, kind)] for kind in KINDS}
    return {**summarize(records), "seconds": round(time.perf_counter() - t0, 1)}


def _share(v) -> torch.Tensor:
    v = torch.as_tensor(v, dtype=torch.float64)
    return v / v.sum() if float(v.sum()) > 0 else torch.full_like(v, 1.0 / v.numel())


def _score(rows: list[dict], predictor: str, truth: str) -> dict:
    """Over `rows`: mean |busiest-rank share predicted - measured|; Pearson r of rank 0's share, pooled and within
    (each (seed, layer)'s mean taken out of both: does the prediction follow the step-to-step changes?)."""
    p_NG = torch.stack([_share(r[predictor] if predictor != "constant" else [1.0] * len(r[truth])) for r in rows])
    m_NG = torch.stack([_share(r[truth]) for r in rows])
    group_N = torch.tensor([1000 * r["seed"] + r["layer"] for r in rows]).unique(return_inverse=True)[1]
    pm = [torch.stack([p_NG[:, 0], m_NG[:, 0]])]
    pm.append(pm[0] - (torch.zeros(2, int(group_N.max()) + 1, dtype=torch.float64).index_add_(1, group_N, pm[0])
                       / torch.bincount(group_N))[:, group_N])      # minus each (seed, layer)'s mean
    r = [round(float(torch.corrcoef(x)[0, 1]), 4) if bool(x.std(1).gt(1e-12).all()) else None for x in pm]
    return {"mae_busiest_share": round(float((p_NG.max(1).values - m_NG.max(1).values).abs().mean()), 5),
            "corr_rank0_share": r[0], "corr_within_layer": r[1]}


def summarize(records: dict[str, list[dict]]) -> dict:
    """Per kind, truth and predictor: pooled scores and the MAE per seed; the check against the view; the verdict."""
    kinds, matches = {}, True
    for kind, rows in records.items():
        rows = [r for r in rows if r["step"] >= SKIP]
        matches &= all(torch.allclose(torch.tensor(r["own_" + p]), torch.tensor(r[p]), rtol=1e-9, atol=1e-6)
                       for r in rows for p in ("unweighted", "weighted"))
        by_seed = [[r for r in rows if r["seed"] == s] for s in sorted({r["seed"] for r in rows})]
        busiest = sum(float(_share(r["cpu"]).max()) for r in rows) / len(rows)
        kinds[kind] = {"records": len(rows), "measured_busiest_share_cpu": round(busiest, 4)}
        for truth in ("cpu", "wall", "flops"):
            kinds[kind][truth] = {p: {**_score(rows, p, truth), "mae_per_seed": [
                _score(seed_rows, p, truth)["mae_busiest_share"] for seed_rows in by_seed]}
                for p in ("unweighted", "weighted", "segment", "constant") if p != "segment" or kind == "packed"}
    u, w = kinds["padded"]["cpu"]["unweighted"], kinds["padded"]["cpu"]["weighted"]
    wins = sum(a < b for a, b in zip(w["mae_per_seed"], u["mae_per_seed"]))
    mae_w, mae_u = w["mae_busiest_share"], u["mae_busiest_share"]
    verdict = (f"padded batches, expert CPU time: busiest-share MAE weighted {mae_w:.4f} vs unweighted {mae_u:.4f} "
               f"({100 * (mae_w / max(mae_u, 1e-12) - 1):+.0f} %; weighted better in {wins} of "
               f"{len(u['mae_per_seed'])} seeds), within-layer r {w['corr_within_layer']} vs {u['corr_within_layer']}; "
               "packed: the per-row API gives every token weight 1 (no change)")
    return {"kinds": kinds, "verdict": verdict, "targets": {
        "weighting_predicts_expert_time_better": bool(mae_w < mae_u),
        "own_routes_match_view": bool(matches),
        "packed_weighting_is_a_no_op": all(r["weighted"] == r["unweighted"] for r in records["packed"])}}


def bench_seq_len(seeds: int = 3, steps: int = 40, quick: bool = False, out: str | None = None,
                  work_dir: str | None = None) -> dict:
    """Start 2 gloo ranks (no launcher), run every seed x kind, return rank 0's summary; `out`: write it there;
    work_dir: the ranks' balance logs and result file (default runs/bench_seq_len)."""
    root = _repo_root()
    size = dict(layers=2, hidden=32, ffn=64, experts=4, batch=2, seq_len=32, min_len=4) if quick else \
        dict(layers=4, hidden=128, ffn=512, experts=8, batch=8, seq_len=128, min_len=8)
    args = {"root": root, "seeds": list(range(1, seeds + 1)), "steps": steps, "max_bytes": 400_000,
            "out_dir": os.path.abspath(work_dir or os.path.join(root, "runs", "bench_seq_len")), **size}
    port = free_port()
    try:
        result = launch_ranks(args, 2, port, module="benchmarks.seq_len", out_dir=args["out_dir"])
    finally:
        unlink_shm_buffers(port)
    result = {"command": "python -m benchmarks.seq_len" + (" --quick" if quick else "") +
              f" --seeds {seeds} --steps {steps}", "model": size, **result}
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.seq_len", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=bounded(1, 100), default=3, help="seeds 1..N (3)")
    p.add_argument("--steps", type=bounded(SKIP + 1, 10000), default=40,
                   help=f"steps per seed and batch kind (40; the first {SKIP} left out)")
    p.add_argument("--quick", action="store_true", help="the smallest model (the test)")
    p.add_argument("--out", default=None, help="result JSON (default benchmarks/results/seq_len.json; not --quick)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    out = a.out or (None if a.quick else os.path.join(_repo_root(), "benchmarks", "results", "seq_len.json"))
    result = bench_seq_len(a.seeds, a.steps, a.quick, out)
    print(json.dumps(result, indent=1) if a.json else f"{result['verdict']}\ntargets: {json.dumps(result['targets'])}")
    return 0


if __name__ == "__main__":
    worker_main(run_rank) if "--worker" in sys.argv else sys.exit(main())
