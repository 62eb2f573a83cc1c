"""benchmarks/seq_len.py: sequence-length weighting against plain route counts as a predictor of expert time."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks.seq_len import bench_seq_len, make_batch, summarize


@pytest.mark.unit
def test_padded_rows_weigh_by_their_real_length_and_packed_rows_hold_whole_sequences_back_to_back():
    from moe_lm import StdlibCorpus
    corpus, g = StdlibCorpus(max_bytes=50_000), torch.Generator().manual_seed(0)
    x_BS, y_BS, len_B, seg_T = make_batch(corpus, "padded", 4, 32, 4, g)
    assert x_BS.shape == y_BS.shape == (4, 32) and bool(((len_B >= 4) & (len_B <= 32)).all())
    assert ((y_BS != -100).sum(1) == len_B).all() and (x_BS[y_BS == -100] == 0).all()
    x_BS, y_BS, len_B, seg_T = make_batch(corpus, "packed", 4, 32, 4, g)
    assert (len_B == 32).all() and (y_BS == x_BS).all() and seg_T.numel() == 4 * 32
    # per token its sequence's length: a run of n tokens saying n (the last of a row cut at the row's end)
    at = 0
    while at < seg_T.numel():
        n = int(seg_T[at])
        assert (seg_T[at:at + n] == n).all() and (at % 32) + n <= 32
        at += n


def _records(off: float) -> dict:
    # rank 0's expert time is exactly its unweighted route share; the weighted load is `off` more on rank 0
    rows = []
    for step in range(4):
        share, weighted = [0.55 + 0.05 * step, 0.45 - 0.05 * step], [0.55 + 0.05 * step + off, 0.45 - 0.05 * step - off]
        rows.append({"seed": 1, "step": step, "layer": 0, "cpu": share, "wall": share, "flops": share,
                     "unweighted": share, "weighted": weighted, "own_unweighted": share, "own_weighted": weighted,
                     "segment": share})
    return {"padded": rows, "packed": [{**r, "weighted": r["unweighted"], "own_weighted": r["unweighted"]}
                                       for r in rows]}


@pytest.mark.unit
def test_the_summary_calls_weighting_better_only_when_it_is_closer_to_the_measured_time():
    worse = summarize(_records(0.05))
    # steps 2 and 3 (the first 2 left out): busiest shares 0.65, 0.70 measured, 0.70, 0.75 weighted: MAE 0.05
    assert worse["kinds"]["padded"]["cpu"]["weighted"]["mae_busiest_share"] == pytest.approx(0.05)
    assert worse["kinds"]["padded"]["cpu"]["unweighted"]["mae_busiest_share"] == 0
    assert worse["targets"] == {"weighting_predicts_expert_time_better": False, "own_routes_match_view": True,
                                "packed_weighting_is_a_no_op": True}
    records = _records(0.05)
    for r in records["padded"]:       # now the weighted load is the measured time and the route counts are off
        r["unweighted"], r["weighted"] = r["weighted"], r["unweighted"]
        r["own_unweighted"], r["own_weighted"] = r["unweighted"], r["weighted"]
    assert summarize(records)["targets"]["weighting_predicts_expert_time_better"]
    records["padded"][3]["own_weighted"] = [0.0, 1.0]
    assert not summarize(records)["targets"]["own_routes_match_view"]


@pytest.mark.slow
def test_the_quick_run_scores_both_predictors_against_expert_time_on_padded_and_packed_batches(tmp_path):
    result = bench_seq_len(seeds=1, steps=4, quick=True, out=str(tmp_path / "seq_len.json"), work_dir=str(tmp_path))
    assert json.loads((tmp_path / "seq_len.json").read_text()) == result
    assert set(result["kinds"]) == {"padded", "packed"}
    for kind, k in result["kinds"].items():
        assert k["records"] == 2 * 2                   # 2 layers x (4 steps - the first 2)
        for truth in ("cpu", "wall", "flops"):
            scores = k[truth]
            assert set(scores) == {"unweighted", "weighted", "constant"} | ({"segment"} if kind == "packed" else set())
            assert all(0 <= s["mae_busiest_share"] <= 0.5 and len(s["mae_per_seed"]) == 1 for s in scores.values())
    padded = result["kinds"]["padded"]["flops"]
    assert padded["weighted"]["mae_busiest_share"] != padded["unweighted"]["mae_busiest_share"]   # weights applied
    assert result["targets"]["own_routes_match_view"] and result["targets"]["packed_weighting_is_a_no_op"]
    assert isinstance(result["targets"]["weighting_predicts_expert_time_better"], bool)
    assert result["verdict"].startswith("padded batches, expert CPU time: busiest-share MAE weighted")
