"""A small byte-level MoE transformer language model and its data: the Python standard library's
own source files, found at run time (real text that ships with every Python; no downloads).

Used by `train_moe_lm.py` and by the tests. Shape legend: B batch, S sequence, D model dim.

    corpus = StdlibCorpus(max_bytes=4_000_000)
    model = MoELM(layers=4, hidden=64, experts=8, ep_size=2, k=2)
    x_BS, y_BS = corpus.batch("train", batch=8, seq_len=128, generator=g)
    logits_BSV, l_aux = model(x_BS)        # l_aux: one per MoE layer; model.last_counts_LE: routes [L, E]
"""
from __future__ import annotations

import atexit
import hashlib
import json
import math
import os
import sys
import sysconfig

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["StdlibCorpus", "MoELM", "stdlib_source_files", "pyramid", "versus", "deepspeed_capacity", "dropped_routes"]


def stdlib_source_files() -> list[str]:
    """Every .py file of this interpreter's standard library (not site-packages), sorted."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    if not files:
        raise FileNotFoundError(f"no .py files under the standard library at {root}")
    return files


class StdlibCorpus:
    """Byte-level train / validation text from the stdlib sources; the split is by file (1 in 20
    files, chosen by a hash of its relative path, is held out), so it is the same on every rank."""

    def __init__(self, max_bytes: int = 4_000_000, val_every: int = 20):
        root = sysconfig.get_paths()["stdlib"]
        parts = {"train": [], "val": []}
        sizes = {"train": 0, "val": 0}
        for path in stdlib_source_files():
            rel = os.path.relpath(path, root)
            split = "val" if int(hashlib.sha1(rel.encode()).hexdigest(), 16) % val_every == 0 else "train"
            budget = max_bytes if split == "train" else max_bytes // val_every
            if sizes[split] >= budget:
                continue
            with open(path, "rb") as f:
                data = f.read()
            parts[split].append(data)
            sizes[split] += len(data)
        self.data = {k: torch.frombuffer(bytearray(b"".join(v)), dtype=torch.uint8).long() for k, v in parts.items()}

    def batch(self, split: str, batch: int, seq_len: int, generator: torch.Generator):
        """Random windows: inputs [B, S] and next-byte targets [B, S]."""
        data = self.data[split]
        starts_B = torch.randint(0, data.numel() - seq_len - 1, (batch, ), generator=generator)
        offsets_S = torch.arange(seq_len + 1)
        windows = data[starts_B[:, None] + offsets_S[None, :]]
        return windows[:, :-1], windows[:, 1:]


def _per_layer(value, layers: int, name: str) -> tuple[int, ...]:
    values = (value, ) * layers if isinstance(value, int) else tuple(int(v) for v in value)
    if len(values) != layers:
        raise ValueError(f"{name} ({value}) must be one number or one per layer ({layers})")
    return values


def pyramid(layers: int, counts: tuple[int, ...]) -> tuple[int, ...]:
    """Expert counts per layer from a short increasing list: layer i of `layers` gets
    counts[i * len(counts) // layers] (`pyramid(4, (4, 8))` = (4, 4, 8, 8))."""
    if not counts or layers < 1:
        raise ValueError(f"pyramid needs layers >= 1 and at least one count, got {layers}, {counts}")
    return tuple(counts[i * len(counts) // layers] for i in range(layers))


class ExpertMLP(nn.Module):

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):

    def __init__(self, hidden: int, heads: int, experts: int, ep_size: int, k: int, capacity_factor: float,
                 min_capacity: int, drop_tokens: bool, use_rts: bool, use_residual: bool = False):
        from deepspeed.moe.layer import MoE
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.moe = MoE(hidden, ExpertMLP(hidden, 2 * hidden), num_experts=experts, ep_size=ep_size, k=k,
                       capacity_factor=capacity_factor, eval_capacity_factor=capacity_factor,
                       min_capacity=min_capacity, drop_tokens=drop_tokens, use_rts=use_rts,
                       use_residual=use_residual)   # residual MoE: a dense MLP beside the experts (DeepSpeed-MoE)

    def forward(self, x_BSD, mask_SS):
        h = self.ln1(x_BSD)
        x_BSD = x_BSD + self.attn(h, h, h, attn_mask=mask_SS, need_weights=False)[0]
        out, l_aux, exp_counts_E = self.moe(self.ln2(x_BSD))
        return x_BSD + out, l_aux, exp_counts_E


class MoELM(nn.Module):
    """Embeddings -> `layers` x (attention + DeepSpeed MoE FFN) -> byte logits.

    k: top-k of every layer, or a sequence repeated over the layers (`(1, 2)`: top-1 and top-2 layers
    alternate, so layers differ in how skewed they route: the `deep8` preset of train_moe_lm.py).
    experts, ep_size: one for every layer, or one per layer (PR-MoE, the DeepSpeed-MoE paper's pyramid:
    `experts=(4, 4, 8, 8)`; a layer's ep_size must divide its experts). `pyramid(layers, (4, 8))` spreads a
    short list over the layers, the deeper layers getting the later (larger) counts.
    """

    def __init__(self, layers: int = 4, hidden: int = 64, heads: int = 4, experts: int | tuple[int, ...] = 8,
                 ep_size: int | tuple[int, ...] = 1, k: int | tuple[int, ...] = 2, seq_len: int = 128,
                 capacity_factor: float = 1.0, min_capacity: int = 4, drop_tokens: bool = True, use_rts: bool = True,
                 use_residual: bool = False):
        super().__init__()
        ks = (k, ) if isinstance(k, int) else tuple(k)
        experts_L = _per_layer(experts, layers, "experts")
        ep_L = _per_layer(ep_size, layers, "ep_size")
        self.tok = nn.Embedding(256, hidden)
        self.pos = nn.Embedding(seq_len, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, experts_L[i], ep_L[i], ks[i % len(ks)], capacity_factor,
                                          min_capacity, drop_tokens, use_rts, use_residual) for i in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, 256, bias=False)

    def forward(self, idx_BS):
        S = idx_BS.shape[1]
        x = self.tok(idx_BS) + self.pos(torch.arange(S, device=idx_BS.device))
        mask_SS = torch.full((S, S), float("-inf"), device=idx_BS.device).triu(1)
        l_aux, counts = [], []
        for block in self.blocks:
            x, aux, exp_counts_E = block(x, mask_SS)
            l_aux.append(aux)
            counts.append(exp_counts_E)
        # route requests per layer and expert of this forward ([L, E], before the capacity limit; layers
        # with fewer experts than the largest padded with zeros)
        width = max(c.numel() for c in counts)
        self.last_counts_LE = torch.stack([F.pad(c, (0, width - c.numel())) for c in counts]).detach()
        return self.head(self.ln_f(x)), l_aux


def versus(summary: dict, baseline_dir: str, rows, opening: str) -> dict:
    """This run's summary against a finished baseline run's (its summary.json): for each (key, what) of
    `rows`, the second-half means of both (`train_second_half`; for a key not there, e.g. `val_loss`, the
    final evaluation's, `final`) and the change in %; `verdict`: `opening` and one clause per row. A baseline
    that cannot be read gives a verdict saying so (this run's own summary is still written)."""
    try:
        with open(os.path.join(baseline_dir, "summary.json"), encoding="utf-8") as f:
            base = json.load(f)
        return _versus(summary, base, baseline_dir, rows, opening)
    except (OSError, KeyError, TypeError, ValueError) as e:
        return {"verdict": f"no comparison with {baseline_dir}: its summary.json could not be read "
                           f"({type(e).__name__}: {e})"}


def _versus(summary: dict, base: dict, baseline_dir: str, rows, opening: str) -> dict:
    metrics, words = {}, []
    for key, what in rows:
        where = "train_second_half" if key in (summary.get("train_second_half") or {}) else "final"
        ours, theirs = (summary.get(where) or {}).get(key), (base.get(where) or {}).get(key)
        if ours is None or theirs is None:
            continue
        change = None if theirs == 0 else round(100.0 * (ours - theirs) / theirs, 1)
        metrics[key] = {"baseline": round(theirs, 4), "this_run": round(ours, 4), "change_pct": change}
        words.append(f"{what} {theirs:.3f} -> {ours:.3f}" + ("" if change is None else f" ({change:+.1f} %)"))
    return {"baseline": baseline_dir, "metrics": metrics, "verdict": f"{opening}: " + "; ".join(words)}


def run_and_exit(main) -> None:
    """Run a launcher job's `main` and leave as soon as it returns, once the at-exit hooks (W&B's finish, the
    balance log's last record) have run and the output is flushed: at the interpreter's own teardown a gloo
    worker thread can abort a rank that finished its work ("terminate called without an active exception",
    pytorch/pytorch#179291; seen in CI after a complete run, process group destroyed). A `SystemExit` keeps its
    code and message; any other exception ends the process the usual way."""
    try:
        code = main()
    except SystemExit as e:
        code = e.code
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def deepspeed_capacity(tokens: int, num_experts: int, k: int, capacity_factor: float, min_capacity: int) -> int:
    """DeepSpeed's per-expert capacity with drop_tokens: max(ceil(tokens / E * capacity_factor * k), min_capacity)."""
    return max(math.ceil(tokens / num_experts * capacity_factor * k), min_capacity)


def dropped_routes(counts_LE: torch.Tensor, capacity: int) -> torch.Tensor:
    """Routes over capacity per layer: sum_e max(0, c_le - C). [L, E] -> [L]

    Exact for DeepSpeed's gates: each expert keeps min(count, capacity) routes.
    """
    return (torch.as_tensor(counts_LE, dtype=torch.float64) - capacity).clamp_min(0).sum(1)
