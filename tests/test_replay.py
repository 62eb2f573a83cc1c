"""benchmarks/replay.py: per-token routing traces replayed batch by batch through placement rules."""
import gzip
import json

import pytest
import torch

from benchmarks.replay import default_rules, held_out, load_traces, make_stream, replay, targets

pytestmark = pytest.mark.unit


def write_trace(path, dataset: str, hot: int, tokens: int = 40, layers: int = 2, seed: int = 0):
    """A workload whose first choice is expert `hot` in 3 of 4 tokens, the second spread over the others."""
    g = torch.Generator().manual_seed(seed)
    with gzip.open(path, "wt") as f:
        for t in range(tokens):
            for layer in range(layers):
                first = hot if t % 4 else int(torch.randint(0, 8, (1, ), generator=g))
                second = (first + 1 + int(torch.randint(0, 7, (1, ), generator=g))) % 8
                f.write(json.dumps({"dataset": dataset, "problem_id": t // 20, "layer": layer, "token_idx": t % 20,
                                    "experts": [first, second], "gating_probs": [0.7, 0.3]}) + "\n")


def test_a_shifting_hot_expert_is_followed_by_re_plans_and_the_static_layout_never_moves(tmp_path):
    write_trace(tmp_path / "a.jsonl.gz", "a", hot=0)
    write_trace(tmp_path / "b.jsonl.gz", "b", hot=5, seed=1)
    traces = load_traces(str(tmp_path))
    assert set(traces) == {"a", "b"} and traces["a"].shape == (40, 2, 8) and torch.all(traces["a"].sum(2) == 2)
    counts, names = make_stream(traces, [("a", 24), ("b", 24)], batch=16)
    assert counts.shape == (48, 2, 8) and torch.all(counts.sum(2) == 32) and names[:24] == ["a"] * 24
    # copies priced low (a small expert on a fast link): moving pays; at a Mixtral expert's price it never does here
    result = replay(counts, names, G=4, S=3, rules=default_rules(4, 3, 8, 2, copy_routes=1.0), copy_routes=1.0)
    dear = replay(counts, names, G=4, S=3, rules=default_rules(4, 3, 8, 2))
    assert dear["eb_default"]["replans"] == 0 < dear["eb_unpriced"]["replans"]
    assert dear["eb_default"]["time_uniform"] < dear["eb_unpriced"]["time_uniform"]
    static = result["static"]
    assert static["weight_copies"] == 0 and static["replans"] == 0 and static["uniform"] == static["steered"]
    for name, r in result.items():
        assert 0 < r["uniform"] <= r["steered"] <= 1 + 1e-9, name     # steering never loses to an even split
        assert r["bytes_moved"] == r["weight_copies"] * 3 * 4096 * 14336 * 2
    fast = result["eb_fast"]
    assert fast["replans"] >= 2                           # the hot expert moved: so did the replicas
    assert fast["phases"]["b"][0] > static["phases"]["b"][0] and fast["uniform"] > static["uniform"]
    judged = targets({"rules": result})
    ours, eplb = result["eb_default"], result["eplb_60_20"]
    assert judged == {"eb_default_ge_eplb_60_20_plus_0.05_at_no_more_bytes":
                      ours["uniform"] >= eplb["uniform"] + 0.05 and ours["bytes_moved"] <= eplb["bytes_moved"],
                      "eb_default_time_le_eplb_60_20": ours["time_uniform"] <= eplb["time_uniform"]}
    for r in result.values():    # time: the busiest devices' routes and the stall, over the mean's (1: ideal)
        assert r["time_steered"] <= r["time_uniform"] and r["time_uniform"] >= 1 / r["uniform"] - 1e-3
    assert static["time_uniform"] == pytest.approx(1 / static["uniform"], rel=0.2)   # never moved: no stall


def test_held_out_plans_on_the_other_workloads_and_in_sample_on_the_workload_itself(tmp_path):
    write_trace(tmp_path / "a.jsonl.gz", "a", hot=0)
    write_trace(tmp_path / "b.jsonl.gz", "b", hot=5, seed=1)
    result = held_out(load_traces(str(tmp_path)), G=4, S=3, batch=8, draws=4)
    for workload, row in result["leave_one_out"].items():
        for who in ("ours", "eplb"):
            for dispatch in ("uniform", "steered"):
                aggregate, worst = row["held_out"][who][dispatch]
                assert 0 < worst <= aggregate <= 1 + 1e-9
                # the other workload's hot expert is not this one's: planned on itself it balances better
                assert row["in_sample"][who][dispatch][0] > aggregate, (workload, who, dispatch)
    shifts = result["shifts"]
    for d in ("uniform", "steered"):
        mean, se = shifts["ours_minus_eplb"][d]
        assert abs(mean - (shifts["ours"][d][0] - shifts["eplb"][d][0])) < 2e-4 and se >= 0
    judged = targets({"rules": {}, "held_out": result})
    assert set(judged) >= {"held_out_uniform_ge_eplb_leave_one_out_mean", "held_out_steered_ge_eplb_shifts_mean"}
    assert all(name.split()[0] in ("a", "b") for name in judged["held_out_workloads_where_eplb_wins"])


def test_a_users_own_dump_replays_step_by_step_with_every_rule(tmp_path, capsys):
    from benchmarks.replay import main
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 5, (40, 2, 8), generator=g).float()
    counts[20:, :, 3] += 60                                   # expert 3 turns hot half way through
    torch.save({"logical_count": counts}, tmp_path / "expert_distribution.pt")    # SGLang's stat dump
    assert main(["--stream", str(tmp_path / "expert_distribution.pt"), "--copy-routes", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["phases"] == [["stream", 40]] and "held_out" not in result
    rules = result["rules"]
    assert rules["static"]["phases"]["stream"][0] == rules["static"]["uniform"] and rules["eb_default"]["replans"] >= 1
    assert rules["eb_default"]["time_uniform"] < rules["static"]["time_uniform"]     # cheap copies: moving pays


def test_a_permutation_planned_on_a_workloads_own_past_balances_its_future(tmp_path):
    from benchmarks.replay import permutation_gain
    write_trace(tmp_path / "a.jsonl.gz", "a", hot=0, tokens=80)      # experts 0 and 1 share rank 0 contiguously
    write_trace(tmp_path / "b.jsonl.gz", "b", hot=1, tokens=80, seed=1)
    gain = permutation_gain(load_traces(str(tmp_path)), [2, 8, 3])
    assert set(gain) == {2, 8, "targets"}                             # 3 ranks do not divide 8 experts
    assert gain["targets"] == {f"ep{G}_same_task_busiest_share_cut_ge_30pct":
                               1 - gain[G]["contiguous"] / gain[G]["same_task"] >= 0.3 for G in (2, 8)}
    assert gain[2]["same_task"] > gain[2]["contiguous"] + 0.03        # the hot expert with cold ones
    assert gain[8]["same_task"] == gain[8]["contiguous"] == gain[8]["other_tasks"]   # one expert a rank


def test_olmoe_counters_become_one_tokens_routes_and_a_pickle_of_anything_else_is_refused(tmp_path):
    import collections
    import pickle
    import subprocess
    import numpy as np
    from benchmarks.replay import olmoe_counts
    repo = tmp_path / "olmoe"
    folder = repo / "scripts" / "routing_output" / "olmoe" / "expert_counts"
    folder.mkdir(parents=True)
    layers = [collections.Counter({np.int64(e): 10 * (e + 1) for e in range(4)}) for _ in range(3)]   # 100 routes
    (folder / "law.pkl").write_bytes(pickle.dumps(layers))
    (folder / "evil.pkl").write_bytes(pickle.dumps(subprocess.Popen))   # a class, not a count
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "-C", str(repo), "add", "."], check=True)
    subprocess.run([*git, "-C", str(repo), "commit", "-qm", "counts"], check=True)
    law = olmoe_counts(str(repo / ".git"), domains=("law", ), top_k=2)["law"]
    assert law.shape == (1, 3, 64) and law[0, 0, :5].tolist() == [0.2, 0.4, 0.6, 0.8, 0.0]   # routes of a token
    with pytest.raises(pickle.UnpicklingError, match="subprocess.Popen is not a routing count"):
        olmoe_counts(str(repo / ".git"), domains=("evil", ))


def test_esft_logs_become_per_sample_counts_and_load_back_from_the_npz(tmp_path):
    import subprocess
    import numpy as np
    from benchmarks.replay import esft_counts, load_counts
    repo = tmp_path / "esft"
    folder = repo / "results" / "expert_scores" / "law"
    folder.mkdir(parents=True)
    lines = {1: ["0\t1\t1\t3\t\t0.4\t0.3\t0.2\t0.1", "2\t2\t\t0.5\t0.5"], 2: ["7\t7\t7\t0\t\t0.25\t0.25\t0.25\t0.25", "5\t6\t\t0.6\t0.4"]}
    for layer, rows in lines.items():
        (folder / f"expert_weights_{layer}.txt").write_text("\n".join(rows) + "\n")
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "-C", str(repo), "add", "."], check=True)
    subprocess.run([*git, "-C", str(repo), "commit", "-qm", "logs"], check=True)
    counts = esft_counts(str(repo / ".git"), tasks=("law", ), layers=2, experts=8)["law"]
    assert counts.shape == (2, 2, 8)                      # 2 samples x 2 layers x 8 experts
    assert counts[0, 0].tolist() == [1, 2, 0, 1, 0, 0, 0, 0] and counts[1, 1].tolist() == [0, 0, 0, 0, 0, 1, 1, 0]
    np.savez_compressed(tmp_path / "c.npz", law=counts)
    loaded = load_counts(str(tmp_path / "c.npz"))
    assert torch.equal(loaded["law"], torch.from_numpy(counts).float())
    stream, names = make_stream(loaded, [("law", 3)], batch=2)
    assert stream.shape == (3, 2, 8) and names == ["law"] * 3
    assert torch.all(stream.sum(2) % 2 == 0)              # sums of whole samples (2 or 4 routes each)


def test_the_training_replay_ranks_slots_from_each_micro_batchs_counts_above_the_interval_plan_and_the_permutation():
    from benchmarks.train_replicas import replay
    out = replay(devices=(16, ), slots=(1, ), stride=40)              # 5 ESFT micro-batches
    row = out["ep16_r1"]
    assert row["permutation"] < row["interval"] < row["per_micro_batch"] <= 1.0, row
    assert out["targets"]["beats_interval_everywhere"]
