"""One accelerator check, one JSON: the numbers that need a GPU to mean anything.

    python -m benchmarks.gpu_check --device cuda --out gpu_check.json     # on a CUDA machine
    python -m benchmarks.gpu_check --device cpu --quick                   # the same code on CPU

Measured on `--device`, side by side in one run:
  * gate overhead: CrossLayerGate / DeepSpeed's TopKGate, forward + backward (target <= 1.05);
  * steering cost (on the host) / one DeepSpeed MoE layer forward (on the device) at 4096 tokens,
    ep_size 1 (target <= 0.02);
  * bf16 gate parity: in bfloat16 the swapped gate routes exactly as DeepSpeed's (same experts, same
    locations, same capacity) and its gate values and l_aux equal DeepSpeed's;
  * HF MoE under DeepSpeed's AutoEP (`autoep`): a random HF Mixtral converted by AutoEP (ep_size 1), its MoE
    layers stacked (h + moe(norm(h)); 2 layers, hidden 2048, 64 experts of FFN 1024, top-8, 8192 tokens, bf16
    on cuda), forward + backward without our hooks and with `AutoEPBalance` in balance mode (bias, expert- and
    device-level loss): `overhead_ratio` = median ours / median plain, interleaved (target <= 1.03);
    `host_syncs_ours`, our host syncs in forward + backward (target 0): on cuda the warnings of
    `torch.cuda.set_sync_debug_mode("warn")` hooked minus plain, on cpu `benchmarks.sync_audit` (run on cuda
    too: `host_syncs.audit_ours`); `observe_parity`: observe-mode hooks against none, routes, gate values and
    output bit for bit (torch.equal), every route counted.
  * training replicas' per-micro-batch work (`replicas`): `choose_replicas` + the exact split of one layer (64
    experts over 32 ranks, one slot; quick: 8 over 4), eager and, on cuda, compiled whole with CUDA graphs
    (`mode="reduce-overhead"`), over one AutoEP layer's forward + backward above (target <= 0.05).
`--quick`: small sizes (AutoEP: hidden 64, 8 experts, top-2, 256 tokens; fp32 on cpu), the suite's smoke run.
`launch/gpu_check.sh` sets up and runs it (`--cpu` for this machine).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import warnings

import torch

__all__ = ["gpu_check", "autoep_check"]


def bf16_parity(device: str, tokens: int = 4096, hidden: int = 1024, experts: int = 64, k: int = 2) -> dict:
    """Route the same bf16 tokens through DeepSpeed's TopKGate and the swapped CrossLayerGate."""
    from deepspeed.moe.sharded_moe import TopKGate

    from eb_deepspeed.adapters.deepspeed.gate import CrossLayerGate
    torch.manual_seed(0)
    ds = TopKGate(hidden, experts, k=k, min_capacity=4).to(device, torch.bfloat16).train()
    eb = CrossLayerGate.from_topk_gate(ds, layer_index=0).train()
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    out = {}
    for name, gate in (("deepspeed", ds), ("easybalance", eb)):
        torch.manual_seed(1)
        out[name] = gate(x, None, True, False)
    a, b = out["deepspeed"], out["easybalance"]
    same_routes = all(torch.equal(u, v) for u, v in zip(a[3:5], b[3:5])) and int(a[1]) == int(b[1])
    same_values = torch.equal(a[5], b[5]) and torch.equal(a[0], b[0]) and torch.equal(a[6], b[6])
    return {"tokens": tokens, "hidden": hidden, "experts": experts, "k": k, "same_routes": bool(same_routes),
            "same_gate_values": bool(same_values)}


# ---------------------------------------------------------------------------------------- HF MoE under AutoEP
# full: an OLMoE-1B-7B-sized Mixtral layer (hidden 2048, 64 experts of FFN 1024, top-8), 8192 tokens, 2 layers
AUTOEP_FULL = {"hidden": 2048, "ffn": 1024, "experts": 64, "k": 8, "batch": 4, "seq": 2048, "layers": 2}
AUTOEP_QUICK = {"hidden": 64, "ffn": 128, "experts": 8, "k": 2, "batch": 2, "seq": 128, "layers": 2}


class MoEStack(torch.nn.Module):
    """The MoE half of each decoder layer, stacked: h + moe(norm(h)) per layer, [B, S, H] -> [B, S, H].
    Attention is left out: our hooks never touch it, so the overhead ratio here bounds a whole model's from above."""

    def __init__(self, norms, moes):
        super().__init__()
        self.norms, self.moes = torch.nn.ModuleList(norms), torch.nn.ModuleList(moes)

    def forward(self, h_BSH: torch.Tensor) -> torch.Tensor:
        for norm, moe in zip(self.norms, self.moes):
            h_BSH = h_BSH + moe(norm(h_BSH))
        return h_BSH


def autoep_stack(device: str, dtype: torch.dtype, *, hidden: int, ffn: int, experts: int, k: int,
                 layers: int, **_) -> MoEStack:
    """A random HF Mixtral converted by DeepSpeed's AutoEP at EP size 1 (no process group: nothing to exchange),
    its `AutoEPMoELayer`s and post-attention RMSNorms kept as a `MoEStack` on `device` in `dtype`."""
    import transformers as tf
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config
    config = tf.MixtralConfig(vocab_size=256, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                              num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
                              num_experts_per_tok=k, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):       # built where it runs: no full-size copy through the host
        model = tf.MixtralForCausalLM(config)
        autoep = AutoEP(model, parse_autoep_config({"enabled": True, "autoep_size": 1, "preset_model": "mixtral"}))
        autoep.replace_moe_layers(autoep.ep_parser(), ep_size=1, ep_rank=0)
    blocks = model.model.layers
    if not all(getattr(b.mlp, "_is_autoep_layer", False) for b in blocks):
        raise RuntimeError("AutoEP converted no MoE layer of the Mixtral model")
    return MoEStack([b.post_attention_layernorm for b in blocks], [b.mlp for b in blocks]).to(device, dtype).train()


def hook_stack(stack: MoEStack, balance: bool, device: torch.device) -> list:
    """Our `AutoEPBalance` on every layer. Balance mode runs the default policy's whole forward path: a selection
    bias, the expert-level loss (coefficient 0.01, the default) and the device-level loss over 8 EP ranks' worth
    of experts (as at EP size 8; here the loss's cost is what counts)."""
    from eb_deepspeed.adapters.autoep import AutoEPBalance
    gates = [AutoEPBalance(moe, index, loss_coeff=0.01, grad_scale=lambda: 1.0, balance=balance)
             for index, moe in enumerate(stack.moes)]
    if balance:
        g = torch.Generator().manual_seed(1)
        for gate in gates:
            E = gate.num_experts
            gate.controls.set_bias(((torch.rand(E, generator=g) - 0.5) * 0.2).to(device))
            gate.controls.set_device_map(torch.arange(E) // max(1, E // 8), device)
            gate.controls.device_loss_weight = 1.0
    return gates


def _forward_backward(stack: MoEStack, x_BSH: torch.Tensor) -> torch.Tensor:
    out_BSH = stack(x_BSH)
    out_BSH.float().square().mean().backward()
    return out_BSH


def _step_boundary(stack: MoEStack, x_BSH: torch.Tensor, gates: list) -> None:
    """What a training step does between micro-batches here: drain the tallies, drop the gradients."""
    for gate in gates:
        gate.tally.take(x_BSH.device)
    for p in stack.parameters():
        p.grad = None
    x_BSH.grad = None


def _timed(stack: MoEStack, x_BSH: torch.Tensor, gates: list) -> float:
    from .bench import _sync
    _sync(x_BSH.device)
    t0 = time.perf_counter()
    _forward_backward(stack, x_BSH)
    _sync(x_BSH.device)
    dt = time.perf_counter() - t0
    _step_boundary(stack, x_BSH, gates)
    return dt


def _audit_syncs(stack: MoEStack, x_BSH: torch.Tensor, gates: list) -> dict:
    """`SyncAudit` of one forward + backward after a warm one (its first copies), on a stack not run before:
    {"ours": n, "calls": {call: n}} of eb_deepspeed's code."""
    from .sync_audit import SyncAudit
    audit = SyncAudit()
    controls = [(g.controls.bias_E, g.controls.expert_to_device_E, g.controls.experts_per_device_G) for g in gates]
    audit.on_device(stack, x_BSH, controls)
    with audit:
        with audit.region("warm"):
            _forward_backward(stack, x_BSH)
            _step_boundary(stack, x_BSH, gates)
        with audit.region("forward+backward"):
            _forward_backward(stack, x_BSH)
        _step_boundary(stack, x_BSH, gates)
    return {"ours": audit.total("forward+backward"), "calls": dict(audit.ours["forward+backward"])}


def _cuda_sync_warnings(stack: MoEStack, x_BSH: torch.Tensor, gates: list) -> int:
    """Host syncs of one forward + backward that `torch.cuda.set_sync_debug_mode("warn")` reports."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _forward_backward(stack, x_BSH)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    _step_boundary(stack, x_BSH, gates)
    return sum("synchroniz" in str(w.message) for w in caught)


def _observe_parity(plain: MoEStack, observe: MoEStack, x_BSH: torch.Tensor, gates: list) -> dict:
    """One training forward + backward of the same tokens through the stack without hooks and with observe-mode
    hooks: the routers' routes and gate values, and the stack's output, bit for bit (torch.equal)."""
    from eb_deepspeed.core.tally import Tally
    seen: dict[str, list] = {"plain": [], "observe": []}
    handles = []
    for name, stack in (("plain", plain), ("observe", observe)):
        for moe in stack.moes:      # after AutoEPBalance's own hooks: sees what AutoEP's layer goes on with
            handles.append(moe.router.register_forward_hook(
                lambda module, args, out, into=seen[name]: into.append((out[0].detach(), out[1].detach()))))
    try:
        outs = {name: _forward_backward(stack, x_BSH).detach() for name, stack in (("plain", plain),
                                                                                   ("observe", observe))}
    finally:
        for handle in handles:
            handle.remove()
    counted = sum(float(Tally.unpack(g.tally.take(x_BSH.device)[None].cpu(), g.num_experts).routed_LE.sum())
                  for g in gates)
    _step_boundary(plain, x_BSH, [])
    _step_boundary(observe, x_BSH, [])
    pairs = list(zip(seen["plain"], seen["observe"]))
    return {"same_routes": len(pairs) == len(plain.moes) and all(torch.equal(a[1], b[1]) for a, b in pairs),
            "same_gate_values": len(pairs) == len(plain.moes) and all(torch.equal(a[0], b[0]) for a, b in pairs),
            "same_output": torch.equal(outs["plain"], outs["observe"]),
            "routes_counted": int(counted)}


def autoep_check(device: str = "cuda", quick: bool = False) -> dict:
    """A Mixtral-shaped layer stack under DeepSpeed's AutoEP, through our hooks and without them (module doc)."""
    sizes = dict(AUTOEP_QUICK if quick else AUTOEP_FULL)
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cuda = dev.type == "cuda"
    warm, repeats = (3, 30) if cuda else (1, 15 if quick else 5)
    plain = autoep_stack(device, dtype, **sizes)
    observe, balance = copy.deepcopy(plain), copy.deepcopy(plain)
    observe_gates = hook_stack(observe, balance=False, device=dev)
    balance_gates = hook_stack(balance, balance=True, device=dev)
    torch.manual_seed(2)
    B, S, H = sizes["batch"], sizes["seq"], sizes["hidden"]
    x_BSH = torch.randn(B, S, H, device=dev, dtype=dtype, requires_grad=True)

    audit = _audit_syncs(balance, x_BSH, balance_gates)      # first: every tensor it sees is made under it
    times = {"plain": [], "ours": []}
    for rep in range(warm + repeats):
        order = [("plain", plain, []), ("ours", balance, balance_gates)]
        for name, stack, gates in (order if rep % 2 == 0 else order[::-1]):
            dt = _timed(stack, x_BSH, gates)
            if rep >= warm:
                times[name].append(dt)
    plain_s, ours_s = statistics.median(times["plain"]), statistics.median(times["ours"])
    syncs = {"audit_ours": audit["ours"], "audit_calls": audit["calls"]}
    if cuda:
        hooked, unhooked = _cuda_sync_warnings(balance, x_BSH, balance_gates), _cuda_sync_warnings(plain, x_BSH, [])
        syncs.update(method="torch.cuda.set_sync_debug_mode('warn'): warnings hooked - plain, and the audit",
                     cuda_warnings_hooked=hooked, cuda_warnings_plain=unhooked)
        ours_syncs = hooked - unhooked
    else:
        syncs["method"] = "benchmarks.sync_audit.SyncAudit: calls from eb_deepspeed"
        ours_syncs = audit["ours"]
    parity = _observe_parity(plain, observe, x_BSH, observe_gates)
    ratio = ours_s / plain_s
    same = parity["same_routes"] and parity["same_gate_values"] and parity["same_output"]
    routes = sizes["layers"] * B * S * sizes["k"]       # every route counted: the observe hooks did run
    return {"model": "mixtral (HF, converted by DeepSpeed AutoEP, ep_size 1)", **sizes, "tokens": B * S,
            "dtype": str(dtype).replace("torch.", ""), "mode": "forward+backward; ours: balance mode (bias, "
            "expert- and device-level loss)", "repeats": repeats,
            "plain_ms": round(plain_s * 1e3, 3), "ours_ms": round(ours_s * 1e3, 3), "overhead_ratio": round(ratio, 4),
            "host_syncs_ours": int(ours_syncs), "host_syncs": syncs, "observe_parity": parity,
            "targets": {"autoep_overhead_le_1.03": bool(ratio <= 1.03),
                        "autoep_syncs_0": bool(ours_syncs == 0 and audit["ours"] == 0),
                        "autoep_observe_parity": bool(same and parity["routes_counted"] == routes)}}


def replica_choice(device: str, layer_ms: float, quick: bool = False) -> dict:
    """One layer's replica choice and exact split per micro-batch, timed against one AutoEP layer (module doc)."""
    from eb_deepspeed.planning.replicas import choose_replicas, copies
    from eb_deepspeed.planning.steering import split
    E, G = (8, 4) if quick else (64, 32)
    dev = torch.device(device)
    g = torch.Generator().manual_seed(0)
    counts_LE = ((torch.rand(1, E, generator=g) ** 3) * 250 * E).long().to(dev)     # a skewed micro-batch
    home_LE = (torch.arange(E) // (E // G))[None].to(dev)

    def choose_and_split(c, h):
        return split(c, copies(h, choose_replicas(c, h, G, 1), G))
    variants = {"eager": choose_and_split}
    if dev.type == "cuda":
        variants["compiled"] = torch.compile(choose_and_split, fullgraph=True, mode="reduce-overhead")
    ms = {}
    for name, fn in variants.items():
        for _ in range(3):
            fn(counts_LE, home_LE)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            fn(counts_LE, home_LE)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        ms[name] = round((time.perf_counter() - t0) / 20 * 1e3, 3)
    ratio = min(ms.values()) / layer_ms
    return {"experts": E, "ranks": G, "slots": 1, "ms": ms, "layer_forward_backward_ms": round(layer_ms, 3),
            "ratio": round(ratio, 4), "targets": {"replica_choice_le_0.05_of_layer": bool(ratio <= 0.05)}}


def gpu_check(device: str = "cuda", quick: bool = False) -> dict:
    from .bench import bench_gate, bench_steering
    t0 = time.time()
    tokens = 512 if quick else 4096
    hidden = 128 if quick else 1024
    info = {"device": device, "torch": torch.__version__}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    gate = bench_gate(tokens=tokens, hidden=hidden, experts=(16, 64), repeats=5 if quick else 30, device=device)
    steering = bench_steering(tokens=tokens, hidden=hidden, repeats=3 if quick else 7, device=device)
    parity = bf16_parity(device, tokens=tokens, hidden=hidden)
    autoep = autoep_check(device, quick)
    replicas = replica_choice(device, autoep["plain_ms"] / autoep["layers"], quick)
    return {"benchmark": "gpu_check", **info, "quick": quick, "gate": gate, "steering": steering, "bf16": parity,
            "autoep": autoep, "replicas": replicas, "seconds": round(time.time() - t0, 1),
            "targets": {"gate_ratio_le_1.05": gate["targets"]["gate_ratio_le_1.05"],
                        "steering_ratio_le_0.02": bool(steering["ratio"] <= 0.02),
                        "bf16_parity": parity["same_routes"] and parity["same_gate_values"],
                        **autoep["targets"], **replicas["targets"]}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run of the same code)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run with --device cpu (or launch/gpu_check.sh --cpu)", file=sys.stderr)
        return 2
    result = gpu_check(args.device, args.quick)
    text = json.dumps(result)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
