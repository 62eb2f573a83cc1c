"""Scenarios for the Megatron-Core adapter, one process per rank (gloo, CPU, EP 2 on 2 ranks).

    python megatron_worker.py SCENARIO OUT_DIR PARAMS_JSON      (launched by conftest.launch)

The model is a stack of Megatron-Core `MoELayer`s (TopKRouter, SequentialMLP experts, the alltoall
dispatcher) between a torch embedding and head; data parallel over the 2 ranks for everything but the
experts (their gradients are averaged by hand, as Megatron's DDP would), each rank its own tokens.
"""
from __future__ import annotations

import atexit
import faulthandler
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megatron_shim  # noqa: E402

megatron_shim.apply()
import torch.distributed as dist  # noqa: E402

E, H, L, VOCAB, T = 4, 16, 2, 32, 12


class Net(torch.nn.Module):
    def __init__(self, layers=L, eb_spec=False, **cfg_kw):
        super().__init__()
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.spec_utils import build_module
        kw = dict(num_layers=layers, hidden_size=H, num_attention_heads=2, ffn_hidden_size=2 * H, num_moe_experts=E,
                  moe_router_topk=2, moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
                  moe_aux_loss_coeff=1e-2, moe_router_dtype="fp32", expert_model_parallel_size=2,
                  use_cpu_initialization=True, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0)
        kw.update(cfg_kw)
        self.config = TransformerConfig(**kw)
        spec = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)
        if eb_spec:                               # EBRouters from the spec (attach converts a plain model's)
            from eb_deepspeed.adapters.megatron import eb_router_spec
            spec = eb_router_spec(spec)
        self.embed = torch.nn.Embedding(VOCAB, H)
        self.moes = torch.nn.ModuleList(build_module(spec, config=self.config, layer_number=i + 1)
                                        for i in range(layers))
        self.head = torch.nn.Linear(H, VOCAB)

    recompute = False                             # Megatron's activation recompute around each MoE layer

    def forward(self, ids_ST):
        from megatron.core.tensor_parallel import checkpoint
        x = self.embed(ids_ST)                     # [S, B, H]: Megatron's sequence-first layout
        for moe in self.moes:
            out = checkpoint(lambda h, m=moe: m(h)[0], False, x) if self.recompute else moe(x)[0]
            x = x + out
        return self.head(x)


def make(seed=0, **kw):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed + 1, force_reset_rng=True)
    return Net(**kw)


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, VOCAB, (T, 2), generator=g)
    ids[:, 0] = ids[:, 0] % 3                          # a skewed half: routes pile on few experts
    return ids, torch.roll(ids, -1, 0)


def sync_grads(model):
    """Average the replicated (non-expert) gradients over the data-parallel ranks, as Megatron's DDP does."""
    for name, p in model.named_parameters():
        if p.grad is not None and "experts" not in name:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def train(model, steps, optimizer, rank, aux_only=False):
    losses, grads = [], []
    for step in range(steps):
        ids, target = batch(step, rank)
        optimizer.zero_grad()
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
        (loss * 0.0 if aux_only else loss).backward()
        sync_grads(model)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
        losses.append(float(loss))
    return losses, grads


def block(p, **kw):
    return {"easybalance": {"log": {"dir": os.path.join(p["out"], "log"), "interval": 1}, "warmup_batches": 1, **kw}}


def scenario_equivalence(p):
    """plain / enabled: false / observe (routers converted by attach, or built by eb_router_spec): the same
    losses, gradients and parameters after 3 steps."""
    from eb_deepspeed.adapters.megatron import attach
    rank = dist.get_rank()
    out = {}
    for variant in ("plain", "disabled", "observe", "observe_spec"):
        model = make(eb_spec=variant == "observe_spec")
        built_as = type(model.moes[0].router).__name__
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        eb = None
        if variant == "disabled":
            eb = attach(model, block(p, enabled=False), optimizer=opt)
        elif variant.startswith("observe"):
            eb = attach(model, block(p, mode="observe"), optimizer=opt)
        losses, grads = train(model, 3, opt, rank)
        out[variant] = {"losses": losses, "grads": grads, "params": {n: t.detach().clone() for n, t in
                                                                      model.state_dict().items() if torch.is_tensor(t)},
                        "balancer": eb is not None,
                        "view": None if eb is None else {"steps": eb.view.steps, "pressure_LG": eb.view.pressure_LG,
                                                         "heat_LE": eb.view.heat_LE,
                                                         "tokens_L": eb.view.last.tokens_L},
                        "router_class": type(model.moes[0].router).__name__, "built_as": built_as}
    return out


def scenario_recompute(p):
    """Under Megatron's activation recompute (CheckpointFunction) each route is counted once."""
    from eb_deepspeed.adapters.megatron import attach
    rank = dist.get_rank()
    out = {}
    for recompute in (False, True):
        model = make()
        model.recompute = recompute
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        eb = attach(model, block(p, mode="observe"), optimizer=opt)
        losses, _ = train(model, 2, opt, rank)
        out[recompute] = {"losses": losses, "tally": eb.view.state_dict()["last_tally"], "steps": eb.view.steps}
    return out


def scenario_device_loss(p):
    """The device loss adds its own gradient, linear in its weight; zero weight adds nothing."""
    from eb_deepspeed.adapters.megatron import attach
    rank = dist.get_rank()
    out = {}
    for w in (0.0, 1.0, 2.0):
        model = make(layers=1)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        eb = attach(model, block(p, mode="balance", aux={"policy": "cross_layer"}), optimizer=opt)
        model.moes[0].router.controls.device_loss_weight = w      # the map: the balancer's
        _, grads = train(model, 1, opt, rank, aux_only=True)
        out[w] = grads[0]["moes.0.router.weight"]
    return out


def scenario_bias(p):
    """The selection bias changes routes, never the combine probabilities' values or the aux loss."""
    from eb_deepspeed.adapters.megatron import attach
    rank = dist.get_rank()
    out = {}
    for biased in (False, True):
        model = make(layers=1)          # one layer: its router's aux gradient is its own aux loss's alone
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        attach(model, block(p, mode="observe"), optimizer=opt)
        router = model.moes[0].router
        seen = {}

        def grab(module, args, result):
            seen["probs"], seen["map"] = result[0].detach().clone(), result[1].clone()
            seen["logits"] = module.gating(args[0]).detach().reshape(-1, E)
        handle = router.register_forward_hook(grab)
        if biased:
            router.controls.set_bias(torch.tensor([0.0, 0.0, 0.0, 5.0]))   # pull every token to expert 3
        _, grads = train(model, 1, opt, rank, aux_only=True)
        handle.remove()
        out[biased] = {"probs": seen["probs"], "map": seen["map"], "logits": seen["logits"],
                       "aux_grad": grads[0]["moes.0.router.weight"]}
    return out


def scenario_checkpoint(p):
    """save_state / load_state round trip of the view and controls (bias policy)."""
    from eb_deepspeed.adapters.megatron import attach, load_state, save_state
    rank = dist.get_rank()
    cfg = block(p, mode="balance", aux={"policy": "bias", "bias_rate": 0.05})
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    eb = attach(model, cfg, optimizer=opt)
    train(model, 3, opt, rank)
    path = os.path.join(p["out"], "state", "easybalance.pt")
    save_state(eb, path)
    fresh_model = make()
    fresh = attach(fresh_model, cfg, optimizer=torch.optim.SGD(fresh_model.parameters(), lr=0.05))
    loaded = load_state(fresh, path)
    return {"loaded": loaded, "saved": eb.state_dict(), "restored": fresh.state_dict(),
            "gate_bias": fresh_model.moes[1].router.controls.bias_E.double(), "steps": eb.view.steps}


def scenario_disagree(p):
    from eb_deepspeed.adapters.megatron import attach
    rank = dist.get_rank()
    model = make()
    try:
        attach(model, block(p, mode="observe", ema_alpha=0.3 if rank == 0 else 0.2))
    except ValueError as e:
        return {"error": str(e), "router_class": type(model.moes[0].router).__name__}
    return {"error": None}


def scenario_sync(p):
    """Host-device synchronisations per micro-batch and per step (`benchmarks.sync_audit`): plain Megatron-Core
    against the block in balance mode (bias and device loss on)."""
    from benchmarks.sync_audit import SyncAudit, audited_run
    from eb_deepspeed.adapters.megatron import attach
    rank, out = dist.get_rank(), {}
    for variant in ("plain", "balance"):
        audit = SyncAudit()
        with audit, audit.region("init"):
            model = make()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            if variant == "balance":
                attach(model, block(p, mode="balance", aux={"policy": "bias_cross_layer"}), optimizer=opt)
        audit.on_device(model)

        def micro_batch(i):
            ids, target = batch(i, rank)
            audit.on_device(ids, target)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), target.flatten()).backward()
            sync_grads(model)
        out[f"train_{variant}"] = audited_run(audit, 3, 2, micro_batch, lambda i: opt.step())
    return out


def main():
    scenario, out_dir, params = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    params["out"] = out_dir
    faulthandler.dump_traceback_later(params.pop("stacks_after", 600))
    dist.init_process_group("gloo")
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    result = globals()[f"scenario_{scenario}"](params)
    torch.save(result, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
    dist.barrier()
    dist.destroy_process_group()   # torn down while Python runs, as DeepSpeed's own tests do
    # The result is written and every group destroyed: the interpreter's teardown is not what these tests check.
    # There a gloo worker thread releasing a tensor can take the GIL during finalization and abort the process
    # ('terminate called without an active exception'; pytorch/pytorch#179291), seen in CI runs. The
    # launcher jobs leave the same way (examples/moe_lm.py `run_and_exit`). The at-exit hooks run first, as at exit.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
