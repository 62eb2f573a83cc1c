"""A small Megatron-Core GPT with MoE layers, balanced by eb_deepspeed, on the stdlib sources.

    bash launch/train_megatron_cpu.sh                 # 2 CPU ranks, EP 2, under the deepspeed launcher
    deepspeed --num_gpus 2 examples/megatron_train_moe.py --config configs/megatron_cpu.json
    torchrun --nproc_per_node 2 examples/megatron_train_moe.py --config configs/megatron_cpu.json

Megatron-Core's `GPTModel` (local spec with `eb_router_spec`: `EBRouter`, `SequentialMLP` experts, the
alltoall dispatcher), expert-parallel over the ranks; `eb_deepspeed.adapters.megatron.attach` builds the
balancer over its routers and hooks the optimizer. The same `easybalance` block as on DeepSpeed, read from
`--config` (a JSON file holding an "easybalance" block). Writes RUN_DIR/balance/balance.jsonl, its
PNGs, RUN_DIR/summary.json and RUN_DIR/ckpt/easybalance.pt.

Without CUDA (this repository's CPU machines) megatron-core needs five CUDA-only spots stubbed: the
example then applies the test-only shim `tests/megatron_shim.py` (pinned to megatron-core 0.16.1);
the library itself never patches megatron-core. Data parallelism for the non-expert weights is a
plain gradient all-reduce here (Megatron's DDP wrapper does the same on GPUs).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from moe_lm import StdlibCorpus, run_and_exit  # noqa: E402


def parse_args(argv=None):
    from eb_deepspeed.core.policies import POLICIES
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    p.add_argument("--config", default=os.path.join(HERE, "..", "configs", "megatron_cpu.json"),
                   help="JSON file with the easybalance block")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--capacity-factor", type=float, default=1.0, help="Megatron's moe_expert_capacity_factor")
    p.add_argument("--coeff", type=float, default=0.01, help="moe_aux_loss_coeff")
    p.add_argument("--load-balancing", choices=["aux_loss", "global_aux_loss", "seq_aux_loss", "none"],
                   default="aux_loss", help="Megatron's moe_router_load_balancing_type: the micro-batch loss, the "
                   "global-batch one (exact: an all-reduce per layer per micro-batch), DeepSeek-V3's sequence-wise "
                   "one, or none")
    p.add_argument("--mode", choices=["observe", "balance"], default=None, help="override easybalance.mode")
    p.add_argument("--aux-policy", choices=list(POLICIES), default=None, help="override easybalance.aux.policy")
    p.add_argument("--bias-rate", type=float, default=None, help="override easybalance.aux.bias_rate")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--max-bytes", type=int, default=4_000_000)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--run-dir", default="runs/megatron")
    p.add_argument("--no-report", action="store_true")
    return p.parse_args(argv)


def build_model(args):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=4, ffn_hidden_size=2 * args.hidden,
        num_moe_experts=args.experts, moe_router_topk=args.k, moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type=args.load_balancing, moe_aux_loss_coeff=args.coeff, moe_router_dtype="fp32",
        moe_expert_capacity_factor=args.capacity_factor, moe_token_drop_policy="probs",
        expert_model_parallel_size=torch.distributed.get_world_size(), use_cpu_initialization=True,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32)
    from eb_deepspeed.adapters.megatron import eb_router_spec
    spec = eb_router_spec(get_gpt_layer_local_spec(num_experts=args.experts, moe_grouped_gemm=False))
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=256, max_sequence_length=args.seq_len,
                    share_embeddings_and_output_weights=False)


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "offline")
    os.makedirs(args.run_dir, exist_ok=True)
    if not torch.cuda.is_available():                  # CPU: the test-only shim for megatron-core's CUDA spots
        sys.path.insert(0, os.path.join(HERE, "..", "tests"))
        import megatron_shim
        megatron_shim.apply()
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from eb_deepspeed.adapters.megatron import attach, find_routers, save_state
    from eb_deepspeed.core import metrics as M
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)

    with open(args.config, encoding="utf-8") as f:
        ds_config = json.load(f)
    block = ds_config.setdefault("easybalance", {})
    block.setdefault("log", {})["dir"] = os.path.join(args.run_dir, "balance")
    if args.aux_policy is not None:
        block.setdefault("aux", {})["policy"] = args.aux_policy
    if args.mode is not None:
        block["mode"] = args.mode
    if args.bias_rate is not None:
        block.setdefault("aux", {})["bias_rate"] = args.bias_rate

    if rank == 0 and ds_config.get("wandb", {}).get("enabled"):      # a W&B run for the balancer's curves
        import wandb
        wandb.init(project=ds_config["wandb"].get("project", "eb_deepspeed"), dir=args.run_dir, job_type="megatron",
                   config={"steps": args.steps, "layers": args.layers, "policy": block.get("aux", {}).get("policy")})
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    model = build_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    balancer = attach(model, ds_config, optimizer=optimizer)
    replicated = [p for n, p in model.named_parameters() if ".experts." not in n]

    corpus = StdlibCorpus(max_bytes=args.max_bytes)
    S, B, L, E, G = args.seq_len, args.micro_batch, args.layers, args.experts, world
    positions = torch.arange(S)[None].expand(B, S)
    causal = torch.triu(torch.ones(1, 1, S, S, dtype=torch.bool), 1)      # True = masked

    def loss_of(x, y):
        return model(x, positions, causal, labels=y).mean()

    def evaluate() -> dict:
        """Validation loss and balance on held-out files (rank r its own windows; sums all-reduced)."""
        demand, kept = torch.zeros(L, E, dtype=torch.float64), torch.zeros(L, E, dtype=torch.float64)

        def hook_for(layer):
            def hook(router, inputs, result):
                with torch.no_grad():
                    logits = router.gating(inputs[0]).reshape(-1, E)
                    top = logits.topk(args.k, dim=1).indices          # demand before capacity dropping
                    demand[layer] += torch.bincount(top.flatten(), minlength=E).double()
                    kept[layer] += result[1].sum(0).double()
            return hook
        handles = [r.register_forward_hook(hook_for(i)) for i, (_, r) in enumerate(find_routers(model))]
        model.eval()
        g = torch.Generator().manual_seed(args.seed + 7 + 1000 * rank)
        loss = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad():
            for _ in range(args.eval_batches):
                x, y = corpus.batch("val", B, S, g)
                loss += torch.tensor([float(loss_of(x, y)), 1.0], dtype=torch.float64)
        model.train()
        for h in handles:
            h.remove()
        for t in (loss, demand, kept):
            dist.all_reduce(t)
        device_LG = kept.view(L, G, -1).sum(2)
        return {"val_loss": float(loss[0] / loss[1]), "val_max_vio": float(M.max_vio(demand).mean()),
                "val_device_max_over_mean_p90": float(torch.quantile(M.max_over_mean(device_LG), 0.9)),
                "val_token_drop_rate": float((demand - kept).sum() / demand.sum())}

    history, step_times, t0 = [], [], time.time()
    for step in range(args.steps):
        t_step = time.perf_counter()
        g = torch.Generator().manual_seed(hash((args.seed, rank, step)) % (2 ** 62))
        x, y = corpus.batch("train", B, S, g)
        optimizer.zero_grad()
        lm_loss = loss_of(x, y)
        lm_loss.backward()
        for p in replicated:                            # data parallel for the non-expert weights
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world
        if balancer is not None:
            balancer.note(lm_loss=float(lm_loss))       # logged beside the balance numbers (JSONL, W&B, eb report)
        optimizer.step()                                # the easybalance hook runs balancer.step()
        for _, router in find_routers(model):           # what Megatron's finalize_model_grads does each step
            router.reset_global_aux_loss_tracker()
        step_times.append(time.perf_counter() - t_step)
        row = {"step": step + 1, "lm_loss": float(lm_loss)}
        if balancer is not None:
            m = balancer.metrics()
            row.update(token_drop_rate=m["token_drop_rate"], device_util_std=m["device_util_std"],
                       device_max_over_mean_p90=m["device_max_over_mean_p90"])
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            row.update(evaluate())
        history.append(row)
        if rank == 0 and ((step + 1) % 10 == 0 or step + 1 == args.steps):
            print(json.dumps(row), flush=True)

    if balancer is not None:
        save_state(balancer, os.path.join(args.run_dir, "ckpt", "easybalance.pt"))
    if rank == 0:
        tail = history[len(history) // 2:]

        def mean_of(key):
            values = [r[key] for r in tail if r.get(key) is not None]
            return sum(values) / len(values) if values else None
        summary = {"framework": "megatron-core", "steps": args.steps, "world_size": world,
                   "seconds": round(time.time() - t0, 2),
                   "seconds_per_step": sum(step_times[2:]) / max(1, len(step_times[2:])), "final": history[-1],
                   "tokens_per_s": B * S * world * max(1, len(step_times[2:])) / max(1e-9, sum(step_times[2:])),
                   "train_second_half": {k: mean_of(k) for k in ("lm_loss", "token_drop_rate",
                                                                 "device_max_over_mean_p90", "device_util_std")
                                         if k in tail[0]}}
        if balancer is not None:
            balancer.close()
            if not args.no_report:
                from eb_deepspeed.observe.report import render_report
                summary["plots"] = render_report(os.path.join(args.run_dir, "balance"))
        with open(os.path.join(args.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(json.dumps(summary, indent=2))
        if ds_config.get("wandb", {}).get("enabled"):
            import wandb
            wandb.finish()
    # torn down while Python runs: left to the interpreter's exit, gloo has aborted a rank there
    # ("terminate called without an active exception") after a run that had finished
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run_and_exit(main)
