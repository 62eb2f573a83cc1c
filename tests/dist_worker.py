"""One rank of a multi-process test: `python dist_worker.py SCENARIO OUT_DIR PARAMS_JSON`.

Started by `conftest.launch` with RANK / WORLD_SIZE / MASTER_PORT set. Every scenario builds
real DeepSpeed engines (gloo, CPU) around the small MoE language model of examples/moe_lm.py
and saves what the test asserts on to OUT_DIR/rank{R}.pt.
"""
from __future__ import annotations

import copy
import atexit
import faulthandler
import json
import os
import shutil
import sys
import time
import warnings

import torch

import deepspeed
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

import eb_deepspeed
from moe_lm import MoELM

SMALL = dict(layers=2, hidden=32, heads=2, experts=4, k=2, seq_len=16, min_capacity=2)
MICRO_BATCH = 4


def base_config(**overrides) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
           "steps_per_print": 10**6}
    cfg.update(overrides)
    return cfg


def make_model(seed: int = 0, **kw) -> MoELM:
    torch.manual_seed(seed)
    return MoELM(**{**SMALL, **kw})


def make_engine(model, config, use_eb: bool = True):
    params = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "p"})
    optimizer = torch.optim.SGD(params, lr=0.05)
    init = eb_deepspeed.initialize if use_eb else deepspeed.initialize
    engine, _, _, _ = init(model=model, optimizer=optimizer, config=config)
    return engine


def batch(step: int, micro: int = 0, rank: int | None = None):
    """Different data on every rank, the same for the same (step, micro, rank)."""
    rank = torch.distributed.get_rank() if rank is None else rank
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    x = torch.randint(0, 256, (MICRO_BATCH, SMALL["seq_len"] + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def train_step(engine, step: int, grads: dict | None = None, coeff: float = 0.1) -> torch.Tensor:
    """One optimizer step (all micro-batches); returns the last micro-batch's loss."""
    rank = torch.distributed.get_rank()
    for micro in range(engine.gradient_accumulation_steps()):
        torch.manual_seed(7919 * step + 31 * micro + rank)  # same gate noise (RTS, Gumbel) in every variant
        x, y = batch(step, micro)
        logits, l_aux = engine(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()) + coeff * sum(l_aux)
        engine.backward(loss)
        if grads is not None and engine.is_gradient_accumulation_boundary():
            grads.update({n: p.grad.detach().clone() for n, p in engine.module.named_parameters()
                          if p.grad is not None})
        engine.step()
    return loss.detach()


def gates_of(engine) -> list:
    """The engine's MoE gates (CrossLayerGates once swapped), in layer order."""
    from eb_deepspeed.adapters.deepspeed import find_moe_layers
    return [m.deepspeed_moe.gate for _, m in find_moe_layers(engine.module)]


def view_state(engine) -> dict:
    eb = engine.easybalance
    gates = gates_of(engine)
    return {"pressure_LG": eb.view.pressure_LG.clone(), "heat_LE": eb.view.heat_LE.clone(),
            "updates_L": eb.view.updates_L.clone(), "steps": eb.view.steps,
            "last_tally": eb.view.state_dict()["last_tally"], "bias_LE": eb.controller.bias_LE.clone(),
            "log_w_L": eb.controller.log_w_L.clone(), "device_loss_weight": eb.device_loss_weights(),
            "gate_device_loss": [g.controls.device_loss_weight for g in gates],
            "gate_bias": [None if g.controls.bias_E is None else g.controls.bias_E.clone() for g in gates]}


# ---------------------------------------------------------------------- scenarios
def scenario_equivalence(p):
    """Plain DeepSpeed vs eb_deepspeed disabled / observe / balance: losses and gradients."""
    out = {}
    blocks = {"plain": None, "no_block": None, "disabled": {"enabled": False}, "observe": {"mode": "observe"},
              "balance": {"mode": "balance", "aux": {"policy": "fixed"}}}
    for name, block in blocks.items():
        cfg = base_config(gradient_accumulation_steps=p.get("accum", 1))
        if block is not None:
            cfg["easybalance"] = {**block, "log": {"dir": os.path.join(p["out"], f"log_{name}")}}
        engine = make_engine(make_model(ep_size=2, use_residual=p.get("residual", False), **p.get("model", {})), cfg,
                             use_eb=name != "plain")
        losses, grads = [], []
        for step in range(3):
            g = {}
            losses.append(train_step(engine, step, g))
            grads.append(g)
        gate = engine.module.blocks[0].moe.deepspeed_moe.gate
        out[name] = {"losses": losses, "grads": grads, "gate": type(gate).__name__,
                     "has_balancer": hasattr(engine, "easybalance"),
                     "params": {n: t.detach().clone() for n, t in engine.module.named_parameters()}}
    return out


def scenario_user_equivalence(p):
    """As a user runs it: seed once, build, train; no reseeding between steps (so any random number
    that eb_deepspeed drew, or failed to draw, would change every later RTS draw and the losses)."""
    out = {}
    blocks = {"plain": None, "observe": {"mode": "observe"}, "balance": {"mode": "balance", "aux": {"policy": "fixed"}}}
    for name, block in blocks.items():
        cfg = base_config()
        if block is not None:
            cfg["easybalance"] = {**block, "log": {"dir": os.path.join(p["out"], f"log_{name}")}}
        torch.manual_seed(0)
        model = MoELM(**{**SMALL, "ep_size": 2, "use_residual": p.get("residual", False), **p.get("model", {})})
        engine = make_engine(model, cfg, use_eb=name != "plain")
        losses = []
        for step in range(4):
            x, y = batch(step)
            logits, l_aux = engine(x)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()) + 0.1 * sum(l_aux)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        out[name] = {"losses": losses, "params": {n: t.detach().clone() for n, t in engine.module.named_parameters()}}
    return out


class _PipeEmbed(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.emb = torch.nn.Embedding(256, hidden)

    def forward(self, x):
        h = self.emb(x)
        return h, torch.zeros(1) + 0 * h.sum()     # hidden, running sum of l_aux


class _PipeMoE(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        from deepspeed.moe.layer import MoE
        self.moe = MoE(hidden, torch.nn.Linear(hidden, hidden), num_experts=4, ep_size=1, k=2, min_capacity=2,
                       use_rts=False)

    def forward(self, inputs):
        h, aux = inputs
        out, l_aux, _ = self.moe(h)
        return h + out, aux + l_aux


class _PipeDense(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.lin = torch.nn.Linear(hidden, hidden)

    def forward(self, inputs):
        h, aux = inputs
        return h + self.lin(h), aux


class _PipeHead(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.head = torch.nn.Linear(hidden, 256)

    def forward(self, inputs):
        h, aux = inputs
        return self.head(h), aux


def scenario_pipeline(p):
    """MoE layers in a PipelineModule over 2 stages: the hook fires under PipelineEngine.train_batch and
    every rank holds the whole model's view (both stages' layers)."""
    from deepspeed.pipe import LayerSpec, PipelineModule

    def loss_fn(outputs, y):
        logits, aux = outputs
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()) + 0.1 * aux.sum()

    torch.manual_seed(0)
    hidden = 16
    moe_layers = 4 if p["layout"] == "both_stages" else 2
    # "both_stages": 2 MoE layers per stage; "second_stage": embedding and two dense layers on stage 0
    dense = [] if p["layout"] == "both_stages" else [LayerSpec(_PipeDense, hidden) for _ in range(2)]
    specs = ([LayerSpec(_PipeEmbed, hidden)] + dense + [LayerSpec(_PipeMoE, hidden) for _ in range(moe_layers)]
             + [LayerSpec(_PipeHead, hidden)])
    net = PipelineModule(specs, num_stages=2, loss_fn=loss_fn, partition_method="uniform")
    # the bias policy: it acts on expert counts, which these ep_size-1 layers have (no device imbalance to weigh)
    block = {"mode": "balance", "warmup_batches": 1, "aux": {"policy": "bias", "bias_rate": 0.1},
             "log": {"dir": os.path.join(p["out"], "log"), "interval": 1}}
    engine = make_engine(net, base_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2,
                                          easybalance=block))

    def data():
        g = torch.Generator().manual_seed(0)
        while True:
            x = torch.randint(0, 256, (2, 9), generator=g)
            yield x[:, :-1], x[:, 1:]

    it = data()
    for _ in range(3):
        engine.train_batch(it)
    eb = engine.easybalance
    return {"engine": type(engine).__name__, "stage": engine.stage_id, "global_steps": engine.global_steps,
            "view": view_state(engine), "layers": eb.layers, "num_layers": eb.num_layers,
            "gate_bias": [g.controls.bias_E.double() for g in gates_of(engine)],
            "gate_layers": [g.layer_index for g in gates_of(engine)]}


def _load_global_experts(model_ep, state_full, rank: int):
    """Copy a full (ep_size=1) state dict into an ep_size>1 model: local expert i = global rank*nle + i
    (nle: each layer's own local expert count)."""
    from eb_deepspeed.adapters.deepspeed.engine import find_moe_layers
    local_of = {name: m.num_local_experts for name, m in find_moe_layers(model_ep)}
    mapped = {}
    for name in model_ep.state_dict():
        src = name
        if ".deepspeed_experts." in name:
            head, tail = name.split(".deepspeed_experts.")
            local, rest = tail.split(".", 1)
            nle = local_of[head.rsplit(".deepspeed_moe.experts", 1)[0]]
            src = f"{head}.deepspeed_experts.{rank * nle + int(local)}.{rest}"
        mapped[name] = state_full[src]
    model_ep.load_state_dict(mapped)


def scenario_ep_equivalence(p):
    """ep_size 1 (every rank holds all experts) vs ep_size 2 (All-to-All): same losses and gradients."""
    rank = torch.distributed.get_rank()
    cfg = base_config(easybalance={"mode": "observe", "log": {"dir": os.path.join(p["out"], "log")}})
    model = p.get("model", {})
    full = make_model(ep_size=1, drop_tokens=p["drop_tokens"], use_rts=False, **model)
    sharded = make_model(ep_size=2, drop_tokens=p["drop_tokens"], use_rts=False, **model)
    _load_global_experts(sharded, full.state_dict(), rank)
    out = {}
    for name, model in (("ep1", full), ("ep2", sharded)):
        engine = make_engine(model, copy.deepcopy(cfg))
        g = {}
        loss = train_step(engine, 0, g)
        out[name] = {"loss": loss, "grads": g}
    return out


def scenario_view(p):
    """Different data per rank, gradient accumulation: identical views, one update per boundary."""
    accum = p["accum"]
    block = {"mode": p.get("mode", "observe"), "log": {"dir": os.path.join(p["out"], "log"), "interval": 1}}
    if "policy" in p:
        block.update(warmup_batches=1, aux={"policy": p["policy"], "bias_rate": 0.05})
    cfg = base_config(gradient_accumulation_steps=accum, easybalance=block, **p.get("ds", {}))
    engine = make_engine(make_model(ep_size=2, **p.get("model", {})), cfg)
    eb = engine.easybalance
    counts, calls = [], [0]
    original = eb.step

    def counting(*args, **kwargs):           # the step hook passes the sample count: step(samples=...)
        calls[0] += 1
        return original(*args, **kwargs)

    eb.step = counting
    controls = []
    rank = torch.distributed.get_rank()
    for step in range(p["steps"]):
        for micro in range(accum):
            torch.manual_seed(step * 10 + micro + rank)
            x, y = batch(step, micro)
            logits, l_aux = engine(x)
            engine.backward(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()) + 0.1 * sum(l_aux))
            engine.step()
            counts.append(calls[0])
            controls.append((eb.controller.log_w_L.clone(), eb.controller.bias_LE.clone()))
    return {"view": view_state(engine), "counts": counts, "controls": controls, "rank_to_node": eb.shape.rank_to_node,
            "metrics": eb.metrics(), "optimizer": type(engine.optimizer).__name__}


def scenario_checkpoint(p):
    """Save after 3 steps, restore into a fresh engine: view, weights and bias come back exactly,
    and the next step gives what the uninterrupted run gives."""
    ckpt = os.path.join(p["out"], "ckpt")
    aux = {"policy": p["policy"]}
    if "bias" in p["policy"]:
        aux["bias_rate"] = 0.05
    cfg = base_config(easybalance={"mode": "balance", "warmup_batches": 1, "aux": aux,
                                   "log": {"dir": os.path.join(p["out"], "log")}})
    model = p.get("model", {})
    a = make_engine(make_model(seed=0, ep_size=2, **model), copy.deepcopy(cfg))
    for step in range(3):
        train_step(a, step)
    a.save_checkpoint(ckpt, tag="step3", client_state={"user_key": 42})
    saved = view_state(a)
    train_step(a, 3)
    after_a = view_state(a)

    b = make_engine(make_model(seed=123, ep_size=2, **model), copy.deepcopy(cfg))
    train_step(b, 99)  # a different history that the load must replace
    load_path, client = b.load_checkpoint(ckpt, tag="step3")
    restored = view_state(b)
    train_step(b, 3)
    after_b = view_state(b)

    # reloading into the same engine: global_steps goes back to 3, a value its step hook already saw
    a.load_checkpoint(ckpt, tag="step3")
    train_step(a, 3)
    after_reload = view_state(a)

    plain = make_engine(make_model(seed=5, ep_size=2, **model), base_config(), use_eb=False)
    plain_path, plain_client = plain.load_checkpoint(ckpt, tag="step3")  # a plain engine reads it too
    return {"saved": saved, "restored": restored, "after_a": after_a, "after_b": after_b,
            "after_reload": after_reload, "client": client, "loaded": load_path is not None,
            "plain_loaded": plain_path is not None, "plain_client_keys": sorted(plain_client)}


def scenario_checkpoint_mismatch(p):
    """A checkpoint of an EP-2 run loaded into an EP-1 model: the expert-level balancer state carries over, the
    device-level state is rebuilt, one warning. A checkpoint of a 3-layer model into a 2-layer one: "strict"
    stops before DeepSpeed loads anything; "ignore_mismatch" loads the model, warns and keeps the balancer's own
    state."""
    ckpt = os.path.join(p["out"], "ckpt")
    block = {"mode": "balance", "warmup_batches": 1, "log": {"dir": os.path.join(p["out"], "log")}}
    a = make_engine(make_model(seed=0, ep_size=2), base_config(easybalance=dict(block)))
    for step in range(3):
        train_step(a, step)
    a.save_checkpoint(ckpt, tag="ep2")
    saved_view = view_state(a)

    other = make_engine(make_model(seed=0, ep_size=1), base_config(easybalance=dict(block)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other_path, _ = other.load_checkpoint(ckpt, tag="ep2", load_optimizer_states=False)   # other EP groups
    resumed = view_state(other)
    train_step(other, 3)
    relayout = {"loaded": other_path is not None, "saved": saved_view, "resumed": resumed,
                "warned": [str(w.message) for w in caught if "easybalance" in str(w.message)],
                "steps_after_train": other.easybalance.view.steps}

    deeper = make_engine(make_model(seed=0, ep_size=2, layers=3), base_config(easybalance=dict(block)))
    train_step(deeper, 0)
    deeper.save_checkpoint(ckpt, tag="deeper")
    saved = {n: q.detach().clone() for n, q in deeper.module.named_parameters() if "expert" not in n}
    b = make_engine(make_model(seed=9, ep_size=2), base_config(easybalance=dict(block)))
    train_step(b, 7)
    before = {n: q.detach().clone() for n, q in b.module.named_parameters()}
    view_before = view_state(b)
    try:
        b.load_checkpoint(ckpt, tag="deeper", load_module_strict=False)
        error = None
    except ValueError as e:
        error = str(e)
    untouched = all(torch.equal(q, before[n]) for n, q in b.module.named_parameters())
    view_after = view_state(b)

    c = make_engine(make_model(seed=9, ep_size=2), base_config(easybalance={**block, "checkpoint": "ignore_mismatch"}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_path, _ = c.load_checkpoint(ckpt, tag="deeper", load_module_strict=False, load_optimizer_states=False)
    loaded = all(torch.equal(q, saved[n]) for n, q in c.module.named_parameters() if n in saved)
    steps_after_load = c.easybalance.view.steps
    train_step(c, 3)
    return {"error": error, "untouched": untouched, "loaded": load_path is not None and loaded,
            "view_kept": all(torch.equal(view_after[k], view_before[k]) for k in ("pressure_LG", "heat_LE")),
            "warned": [str(w.message) for w in caught if "ignore_mismatch" in str(w.message)],
            "steps_after_load": steps_after_load, "steps_after_train": c.easybalance.view.steps,
            "shared_compared": len(saved), "relayout": relayout}


def scenario_skipped_steps(p):
    """Steps DeepSpeed skips (an inf gradient under torch_autocast's fp16 scaler) and a batch the user
    skips (`discard_tally`) leave the view exactly as a run that never saw those batches."""
    block = {"mode": "observe", "warmup_batches": 0, "log": {"dir": os.path.join(p["out"], "log")}}
    cfg = base_config(torch_autocast={"enabled": True, "dtype": "torch.float16"}, easybalance=block)
    engine = make_engine(make_model(seed=0, ep_size=2), copy.deepcopy(cfg))
    reference = make_engine(make_model(seed=0, ep_size=2), copy.deepcopy(cfg))
    train_step(engine, 0)                                    # the scaler's first steps may skip too: both alike
    train_step(reference, 0)
    before = (engine.global_steps, engine.easybalance.view.steps)
    x, y = batch(1)                                          # overflows: the scaler skips the optimizer step
    logits, l_aux = engine(x)
    engine.backward(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()) * 1e38)
    engine.step()
    after = (engine.global_steps, engine.easybalance.view.steps)
    engine.torch_autocast_z0_gradscaler.update(reference.torch_autocast_z0_gradscaler.get_scale())
    engine(batch(5)[0])                                      # the user skips this batch (a NaN loss, say)
    engine.easybalance.discard_tally(last_forward_only=True)
    for step in (2, 3, 4):
        train_step(engine, step)
        train_step(reference, step)
    return {"before": before, "after": after, "view": view_state(engine), "reference": view_state(reference),
            "params_equal": all(torch.equal(a, b) for a, b in zip(engine.module.parameters(),
                                                                  reference.module.parameters()))}


def scenario_disagree(p):
    """Rank 1 has another config: every rank raises the same clear error at start-up."""
    rank = torch.distributed.get_rank()
    block = {"mode": "observe", "ema_alpha": 0.3 if rank == 0 else 0.2, "log": {"dir": os.path.join(p["out"], "log")}}
    try:
        make_engine(make_model(ep_size=2), base_config(easybalance=block))
    except ValueError as e:
        return {"error": str(e)}
    return {"error": None}


def scenario_block_on_off(p):
    """Rank 0 has the block on, rank 1 off (training), then rank 0 serves with a block and rank 1 without one, then
    under `patch_deepspeed` rank 0 calls `deepspeed.initialize` with the block and rank 1 with none (a Trainer's
    path): each time every rank raises the same error at start-up instead of one waiting for the other."""
    rank = torch.distributed.get_rank()
    log = {"log": {"dir": os.path.join(p["out"], "log")}}
    errors = {}
    try:
        block = {"mode": "observe", **log} if rank == 0 else {"enabled": False}
        make_engine(make_model(ep_size=2), base_config(easybalance=block))
    except ValueError as e:
        errors["train"] = str(e)
    try:
        eb_deepspeed.init_inference(make_model(drop_tokens=False, ep_size=2),
                                    config={"easybalance": _serve_block(p)} if rank == 0 else None)
    except ValueError as e:
        errors["serve"] = str(e)
    eb_deepspeed.patch_deepspeed()
    try:
        make_engine(make_model(ep_size=2), base_config(**({"easybalance": {"mode": "observe", **log}} if rank == 0
                                                          else {})), use_eb=False)
    except ValueError as e:
        errors["patched"] = str(e)
    return {"errors": errors}


def scenario_nonfinite(p):
    """NaN hidden states reach one rank's gate: the view stays finite, unchanged, identical."""
    rank = torch.distributed.get_rank()
    cfg = base_config(easybalance={"mode": "observe", "log": {"dir": os.path.join(p["out"], "log")}})
    engine = make_engine(make_model(ep_size=2), cfg)
    for step in range(2):
        train_step(engine, step)
    before = view_state(engine)
    gate = engine.module.blocks[0].moe.deepspeed_moe.gate

    def poison(module, args):
        x = args[0].clone()
        x[:3] = float("nan")
        return (x, ) + tuple(args[1:])

    handle = gate.register_forward_pre_hook(poison) if rank == 1 else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_step(engine, 2)
    if handle is not None:
        handle.remove()
    return {"before": before, "after": view_state(engine),
            "warned": any("non-finite router logits" in str(w.message) for w in caught),
            "nonfinite": engine.easybalance.metrics()["nonfinite_tokens"]}


def scenario_nan_note(p):
    """The documented `note(lm_loss=loss.item())` with a NaN loss on rank 1 only: both ranks train on."""
    rank = torch.distributed.get_rank()
    cfg = base_config(easybalance={"mode": "observe", "log": {"dir": os.path.join(p["out"], "log"), "interval": 1}})
    engine = make_engine(make_model(ep_size=2), cfg)
    noted = []
    for step in range(3):
        loss = train_step(engine, step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine.easybalance.note(lm_loss=float("nan") if rank == 1 and step == 1 else float(loss))
        noted.append(engine.easybalance.log.record(engine.easybalance)["lm_loss"])
    return {"steps": int(engine.easybalance.view.steps), "noted": noted}


def scenario_log_dir_is_a_file(p):
    """easybalance.log.dir names an existing file: rank 0 alone opens the log, and every rank gets one error."""
    path = os.path.join(p["out"], "not_a_dir")
    if torch.distributed.get_rank() == 0:
        with open(path, "w") as f:
            f.write("x")
    torch.distributed.barrier()
    try:
        make_engine(make_model(ep_size=2), base_config(easybalance={"log": {"dir": path}}))
    except ValueError as e:
        return {"error": str(e)}
    return {"error": None}


def scenario_killed_rank(p):
    """Rank 1 dies mid-training (os._exit, as a kill would): rank 0 gets an error from its next collective
    within seconds instead of waiting out a timeout, and says how long it took."""
    rank = torch.distributed.get_rank()
    engine = make_engine(make_model(ep_size=2), base_config(easybalance={"log": {"dir": os.path.join(p["out"], "log")}}))
    for step in range(2):
        train_step(engine, step)
    torch.distributed.barrier()
    if rank == 1:
        os._exit(3)
    start, error = time.perf_counter(), None
    try:
        for step in range(2, 6):
            train_step(engine, step)
    except Exception as e:          # noqa: BLE001 -- any error is the point; what matters is that it came
        error = f"{type(e).__name__}: {e}"
    result = {"error": error, "seconds": time.perf_counter() - start, "steps": engine.easybalance.view.steps}
    torch.save(result, os.path.join(p["out"], "rank0.pt"))
    os._exit(0)                     # no barrier: the peer is gone


# ---------------------------------------------------------------------- serving
def _kill_rank0_while_writing(where: str) -> None:
    """From now on rank 0 dies by SIGKILL half-way through writing its next checkpoint file: `latest`
    ("latest": opened, truncated, nothing written yet) or the model-states file ("model": half its bytes)."""
    import builtins
    import io
    import signal
    if torch.distributed.get_rank() != 0:
        return
    real_open, real_save = builtins.open, torch.save

    def killing_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if where == "latest" and "w" in mode and os.path.basename(str(file)).startswith("latest"):
            os.kill(os.getpid(), signal.SIGKILL)
        return f

    def killing_save(obj, f, *args, **kwargs):
        if where == "model" and str(f).endswith("mp_rank_00_model_states.pt"):
            buffer = io.BytesIO()
            real_save(obj, buffer, *args, **kwargs)
            with real_open(f, "wb") as out:
                out.write(buffer.getvalue()[:len(buffer.getvalue()) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save(obj, f, *args, **kwargs)
    builtins.open, torch.save = killing_open, killing_save


def _torn_config(p):
    return base_config(easybalance={"mode": "balance", "warmup_batches": 1, "aux": {"policy": "bias", "bias_rate": 0.05},
                                    "log": {"dir": os.path.join(p["out"], "log")}})


def scenario_torn_save(p):
    """Save at step 2, then die (rank 0, SIGKILL) in the middle of the save at step 3 (`p["where"]`, tag
    `p["tag"]`: None for DeepSpeed's global_step tags). Rank 0 leaves the state a resume must bring back."""
    rank = torch.distributed.get_rank()
    engine = make_engine(make_model(ep_size=2), _torn_config(p))
    for step in range(2):
        train_step(engine, step)
    engine.save_checkpoint(p["ckpt"], tag=p["tag"])
    torch.save(view_state(engine), os.path.join(p["ckpt"], f"..{os.sep}good_state_{p['where']}_rank{rank}.pt"))
    train_step(engine, 2)
    _kill_rank0_while_writing(p["where"])
    try:
        engine.save_checkpoint(p["ckpt"], tag=p["tag"])
    except Exception:       # noqa: BLE001 - rank 1: its peer died inside the save
        pass
    os._exit(4)


def scenario_torn_resume(p):
    """Resume (tag None: `latest`) from each checkpoint directory a killed save left behind."""
    rank = torch.distributed.get_rank()
    out = {}
    for where, ckpt in p["ckpts"].items():
        engine = make_engine(make_model(seed=9, ep_size=2), _torn_config(p))
        try:
            path, _ = engine.load_checkpoint(ckpt)
            good = torch.load(os.path.join(ckpt, f"..{os.sep}good_state_{where}_rank{rank}.pt"), weights_only=False)
            out[where] = {"path": path, "error": None, "state": view_state(engine), "good": good,
                          "global_steps": int(engine.global_steps)}
        except ValueError as e:
            out[where] = {"error": str(e)}
    return out


def _plain_eval_model(seed=0, **kw):
    """DeepSpeed's exact expert-parallel eval forward: groups handed to every layer, eval mode."""
    from eb_deepspeed.adapters.deepspeed import find_moe_layers
    model = make_model(seed=seed, **kw)
    for _, moe in find_moe_layers(model):
        moe.set_deepspeed_parallelism()
    return model.eval()


def _skewed(model):
    """Make every router send most first choices to expert 0 (hot-expert traffic): the MoE input gets a
    constant offset (the layer norm's bias) that only expert 0's router row sees."""
    with torch.no_grad():
        for block in model.blocks:
            block.ln2.bias.fill_(0.3)
            block.moe.deepspeed_moe.gate.wg.weight[0] += 0.6
    return model


def _serve_block(p, **inference):
    return {"mode": "balance", "warmup_batches": 1, "log": {"dir": os.path.join(p["out"], "serve_log"), "interval": 1},
            "inference": {"replica_slots": 1, "replan_interval": 1, "replan_threshold": 1.0, "view_interval": 1,
                          **inference}}


def _skewed_batch(b: int, rank: int, vocab: int = 24, equal: bool = False):
    """Unequal batches per rank (2 + rank sequences; 2 each with `equal`) from a small vocabulary."""
    g = torch.Generator().manual_seed(100 * b + rank)
    return torch.randint(0, vocab, (2 if equal else 2 + rank, SMALL["seq_len"]), generator=g)


def _serve_and_compare(engine, plain, batches: int, rank: int, vocab: int = 24, start: int = 0, equal: bool = False,
                       read_view: bool = False):
    """read_view: rank 0 reads the view after each batch (as a rank-0 logger does), the other ranks do not."""
    rows = []
    for b in range(start, start + batches):
        x = _skewed_batch(b, rank, vocab, equal)
        serving = engine.serving
        served_by = serving.placement.phy2log.clone()            # the placement that serves this batch
        replicated = not serving.gates[0].home_layout
        with torch.no_grad():
            torch.manual_seed(b)
            expected = plain(x)[0]
            torch.manual_seed(b)
            got = engine(x)[0]
        if read_view and rank == 0:
            engine.easybalance.metrics()
        rows.append({"equal": torch.equal(expected, got), "maxdiff": float((expected - got).abs().max()),
                     "replans": serving.replans, "phy2log": served_by, "replicated": replicated,
                     "capacity": [g.last_capacity for g in serving.gates]})
    return rows


class _LateWork:
    """NCCL's completion seen from the host: the all-reduce's result reaches the tensor only at `wait()`;
    before that the tensor holds NaN (a read of it, or a reuse of the buffer, would show)."""
    real = staticmethod(torch.distributed.all_reduce)
    posted = 0

    def __init__(self, tensor, args, kwargs):
        self.tensor, self.result = tensor, tensor.clone()
        self.work = self.real(self.result, *args, async_op=True, **kwargs)
        tensor.fill_(float("nan"))
        _LateWork.posted += 1

    def wait(self):
        self.work.wait()
        self.tensor.copy_(self.result)
        return True


def _late_all_reduce(*args, async_op=False, **kwargs):
    if not async_op:
        return _LateWork.real(*args, **kwargs)
    tensor = args[0] if args else kwargs.pop("tensor")
    return _LateWork(tensor, args[1:], kwargs)


def scenario_serve_late_reduce(p):
    """The serving view's per-step reduce posted async, completing only at wait() (as on NCCL): the same view,
    re-plans and outputs as with gloo's completion, batch by batch."""
    rank = torch.distributed.get_rank()
    out = {}
    for late in (False, True):
        torch.manual_seed(0)
        engine = eb_deepspeed.init_inference(_skewed(make_model(drop_tokens=False, ep_size=2, k=2)), config={
            "easybalance": _serve_block(p, replica_slots=1)})
        _LateWork.posted = 0
        if late:
            torch.distributed.all_reduce = _late_all_reduce
        try:
            outputs = []
            with torch.no_grad():
                for b in range(6):
                    outputs.append(engine(_skewed_batch(b, rank))[0])
            engine.serving.settle()
        finally:
            torch.distributed.all_reduce = _LateWork.real
        view = engine.easybalance.view
        out["late" if late else "gloo"] = {"view": {"pressure_LG": view.pressure_LG.clone(), "heat_LE": view.heat_LE.clone(),
                                                    "steps": view.steps}, "replans": engine.serving.replans,
                                           "outputs": outputs, "posted": _LateWork.posted}
    return out


def scenario_serve_equivalence(p):
    """Replicated serving (P = E or P > E, re-plans forced) against DeepSpeed's exact eval forward, then back
    to DeepSpeed's layout (fewer slots per rank) and on."""
    rank = torch.distributed.get_rank()
    block = _serve_block(p, replica_slots=p["replica_slots"], split=p.get("split", "view"),
                         view_interval=p.get("view_interval", 1))
    kw = dict(drop_tokens=False, ep_size=p.get("ep", 2), k=p.get("k", 2))
    engine = eb_deepspeed.init_inference(_skewed(make_model(**kw)), config={"easybalance": block})
    plain = _skewed(_plain_eval_model(**kw))
    equal = p.get("equal_batches", False)
    rows = _serve_and_compare(engine, plain, p["batches"], rank, equal=equal)
    serving = engine.serving
    from eb_deepspeed.adapters.moves import slot_moves
    received = [sum(1 for m in slot_moves(serving.resident, serving.home) if m[1] == dst and m[3] != dst)
                for dst in range(serving.G)]
    price = serving.move_cost(serving.home)                        # what going home would stall, in routes
    returned = engine.serving.apply(engine.serving.home)          # back to DeepSpeed's layout
    rows += _serve_and_compare(engine, plain, 2, rank, start=p["batches"], equal=equal)
    return {"rows": rows, "S_max": engine.serving.S_max, "moves": engine.serving.weight_moves, "returned": returned,
            "metrics": engine.easybalance.metrics(), "log": os.path.join(p["out"], "serve_log"),
            "received": received, "price": price}


def scenario_serve_drops(p):
    """drop_tokens=True with replicas, unequal batches: one capacity everywhere, no slot past it, every
    token's kept gates summing to 1."""
    from eb_deepspeed.planning import plan_placement
    rank = torch.distributed.get_rank()
    engine = eb_deepspeed.init_inference(_skewed(make_model(drop_tokens=True, ep_size=2, capacity_factor=0.5)),
                                         config={"easybalance": _serve_block(p)})
    serving = engine.serving
    serving.apply(plan_placement(torch.tensor([[9.0, 1, 1, 1]] * 2), 2, serving.S_max, previous=serving.placement))
    seen = []
    gate = serving.gates[0]
    gate.register_forward_hook(lambda m, a, o: seen.append(o))
    for b in range(3):
        with torch.no_grad():
            engine(_skewed_batch(b, rank))
    out = []
    for l_aux, capacity, P, slot_KT, location_KT, gates_KT, counts_E in seen:
        kept = slot_KT >= 0
        pairs = slot_KT[kept].long() * 10_000 + location_KT[kept].long()
        token_kept = kept.any(0)
        out.append({"capacity": int(capacity), "P": P, "dropped": int((~kept).sum()), "routes": kept.numel(),
                    "max_location": int(location_KT[kept].max()) if bool(kept.any()) else -1,
                    "unique": pairs.numel() == pairs.unique().numel(),
                    "gate_sums": gates_KT.sum(0)[token_kept].tolist(), "replicated": not gate.home_layout})
    return {"rows": out}


def scenario_serve_no_block(p):
    """No block: DeepSpeed's forward made correct (groups, eval, one capacity); drop_tokens on and off."""
    rank = torch.distributed.get_rank()
    out = {}
    for drop in (False, True):
        engine = eb_deepspeed.init_inference(make_model(drop_tokens=drop, ep_size=2))
        plain = _plain_eval_model(drop_tokens=drop, ep_size=2)
        x = _skewed_batch(0, rank)
        with torch.no_grad():
            torch.manual_seed(0)
            got = engine(x)[0]
            if not drop:   # DeepSpeed itself aborts on unequal batches with drop_tokens=True
                torch.manual_seed(0)
                out["equal"] = torch.equal(plain(x)[0], got)
        out[f"finite_drop_{drop}"] = bool(torch.isfinite(got).all())
        out[f"has_balancer_drop_{drop}"] = hasattr(engine, "easybalance")
        out[f"training_drop_{drop}"] = engine.module.training
    return out


def _inject_move_fault(serving, phase: str) -> None:
    """The first weight move fails on this rank: while it is prepared ("prepare"), when its first transfer is
    posted ("post": posting it raises), while one is waited for ("wait": the first transfer's wait raises once
    it completed), or when what arrived is checked ("verify")."""
    calls = [0]

    def first_call() -> bool:
        calls[0] += 1
        return calls[0] == 1

    def fail():
        raise RuntimeError(f"injected: the link went down ({phase})")
    import eb_deepspeed.adapters.moves as moves_module
    import eb_deepspeed.adapters.serving.engine as engine_module
    if phase == "prepare":          # the store's rows, as this process's moves see them
        original = engine_module._SlotRows.prepare
        engine_module._SlotRows.prepare = lambda *a: fail() if first_call() else original(*a)
        return
    if phase == "verify":           # a module function of the moves: patched for this process's weight moves
        original_verify = moves_module.verify_finite
        moves_module.verify_finite = lambda *a: fail() if first_call() else original_verify(*a)
        return
    original_post = moves_module._post

    class FailingWait:
        def __init__(self, work):
            self.work = work

        def wait(self):
            self.work.wait()
            fail()

    def post(op):
        if not first_call():
            return original_post(op)
        if phase == "post":
            fail()
        return FailingWait(original_post(op))
    moves_module._post = post


def scenario_serve_move_fault(p):
    """A weight move that fails on one rank (at `p["phase"]`): every rank keeps the old placement, outputs
    stay right, and the next re-plan goes through."""
    rank = torch.distributed.get_rank()
    engine = eb_deepspeed.init_inference(_skewed(make_model(drop_tokens=False, ep_size=2)),
                                         config={"easybalance": _serve_block(p)})
    plain = _skewed(_plain_eval_model(drop_tokens=False, ep_size=2))
    serving = engine.serving
    if rank == 1:
        _inject_move_fault(serving, p.get("phase", "verify"))
    rows = _serve_and_compare(engine, plain, 4, rank)
    return {"rows": rows, "failed": serving.failed_moves, "replans": serving.replans}


def scenario_serve_checkpoint(p):
    """A plain DeepSpeed training checkpoint loaded into a replicated model, served through a re-plan (rank 0
    reading the view after each batch), saved back: the saved files hold the original tensors. Then a copy with
    an expert file only rank 1 reads broken: every rank raises and serves the weights it had."""
    rank = torch.distributed.get_rank()
    ckpt, back = os.path.join(p["out"], "ckpt"), os.path.join(p["out"], "back")
    trainer = make_engine(_skewed(make_model(seed=3, ep_size=2, drop_tokens=False)), base_config(), use_eb=False)
    for step in range(2):
        train_step(trainer, step)
    trainer.save_checkpoint(ckpt, tag="t2")
    engine = eb_deepspeed.init_inference(make_model(seed=99, drop_tokens=False, ep_size=2),
                                         config={"easybalance": _serve_block(p)})
    engine.serving.load_checkpoint(ckpt)
    plain = _plain_eval_model(seed=99, drop_tokens=False, ep_size=2)
    plain.load_state_dict({k: v for k, v in trainer.module.state_dict().items()})
    rows = _serve_and_compare(engine, plain, 3, rank, read_view=True)
    engine.serving.load_checkpoint(ckpt)       # now the replicas read their experts' files
    rows += _serve_and_compare(engine, plain, 1, rank, start=3)
    loaded_plain = _plain_eval_model(seed=123, drop_tokens=False, ep_size=2)
    eb_deepspeed.load_moe_checkpoint(loaded_plain, ckpt)
    plain_matches = all(torch.equal(a, b) for a, b in zip(loaded_plain.state_dict().values(),
                                                          trainer.module.state_dict().values()))
    engine.serving.save_checkpoint(back, tag="served")
    torch.distributed.barrier()
    original, saved = {}, {}
    for folder, into in ((os.path.join(ckpt, "t2"), original), (os.path.join(back, "served"), saved)):
        for name in sorted(os.listdir(folder)):
            if name.startswith("layer_") or name.startswith("mp_rank"):
                data = torch.load(os.path.join(folder, name), map_location="cpu", weights_only=True)
                into[name] = data["module"] if name.startswith("mp_rank") else data
    plain_loads = {}         # plain DeepSpeed engines load what serving saved, both ways that need no optimizer
    for how, kwargs in (("module_only", {"load_module_only": True}),
                        ("no_optimizer", {"load_optimizer_states": False, "load_lr_scheduler_states": False})):
        fresh = make_engine(make_model(seed=7, ep_size=2, drop_tokens=False), base_config(), use_eb=False)
        fresh.load_checkpoint(back, **kwargs)
        plain_loads[how] = all(torch.equal(a, b) for a, b in zip(fresh.module.state_dict().values(),
                                                                 trainer.module.state_dict().values()))
    broken = os.path.join(p["out"], "broken")
    if rank == 0:
        shutil.copytree(ckpt, broken)
        with open(os.path.join(broken, "t2", "layer_0_expert_3_mp_rank_00_model_states.pt"), "wb") as f:
            f.write(b"not a checkpoint")         # expert 3's home is EP rank 1: only rank 1 reads it
    torch.distributed.barrier()
    try:
        engine.serving.load_checkpoint(broken)
        broken_load = None
    except Exception as e:   # noqa: BLE001
        broken_load = f"{type(e).__name__}: {e}"
    rows += _serve_and_compare(engine, plain, 1, rank, start=4)      # still the trained weights
    return {"rows": rows, "broken_load": broken_load, "original": original, "saved": saved, "replans": engine.serving.replans,
            "latest": open(os.path.join(back, "latest")).read(), "plain_matches": plain_matches,
            "marker_left": os.path.exists(os.path.join(back, "served", "eb_save_incomplete")),
            "plain_loads": plain_loads}


class _OneMoE(torch.nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        from deepspeed.moe.layer import MoE
        torch.manual_seed(0)
        self.moe = MoE(hidden, torch.nn.Linear(hidden, hidden), num_experts=4, ep_size=2, k=2, min_capacity=1,
                       drop_tokens=False, use_rts=False)

    def forward(self, x):
        return self.moe(x)


def scenario_serve_empty(p):
    """Rank 1 serves an empty batch while rank 0 serves tokens: no hang, rank 0's output is right."""
    from eb_deepspeed.adapters.deepspeed import find_moe_layers
    from eb_deepspeed.planning import plan_placement
    rank = torch.distributed.get_rank()
    engine = eb_deepspeed.init_inference(_OneMoE(), config={"easybalance": _serve_block(
        p, split=p["split"], replan_interval=1000)})
    serving = engine.serving    # replicas serving from the start: the gate's general path, not DeepSpeed's own
    serving.apply(plan_placement(torch.tensor([[9.0, 1, 1, 1]]), 2, serving.S_max, previous=serving.placement))
    plain = _OneMoE()
    for _, moe in find_moe_layers(plain):
        moe.set_deepspeed_parallelism()
    plain.eval()
    out = []
    for b in range(3):
        g = torch.Generator().manual_seed(b)
        x = torch.randn(1, 12, 16, generator=g)
        with torch.no_grad():
            torch.manual_seed(b)        # the same 2nd-expert sampling draws in both
            got = engine(x[:, :0] if rank == 1 else x)[0]
            # plain DeepSpeed cannot serve an empty batch: its reference gives rank 1 tokens of its own,
            # which leave rank 0's outputs as they are (no drops)
            torch.manual_seed(b)
            expected = plain(x)[0]
        # the reference pads its slots to another capacity (rank 1 has tokens there): equal up to rounding
        out.append({"shape": tuple(got.shape),
                    "equal": bool(torch.allclose(expected, got, atol=1e-6, rtol=1e-5)) if rank == 0 else True})
    return {"rows": out, "steps": engine.easybalance.view.steps, "replicated": not serving.gates[0].home_layout}


def scenario_shipped_configs(p):
    """Every training config in configs/ as the README shows it (no client optimizer: the config's own), and
    the serving config through init_inference: a tiny MoE model initializes, steps and serves on CPU."""
    import json
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = {}
    for name in p["train"]:
        with open(os.path.join(root, "configs", name)) as f:
            config = json.load(f)
        config["easybalance"]["log"] = {"dir": os.path.join(p["out"], name), "interval": 1}
        config["wandb"] = {"enabled": False}
        config.update(train_micro_batch_size_per_gpu=MICRO_BATCH, gradient_accumulation_steps=1)
        model = make_model()
        engine, optimizer, _, _ = eb_deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                          config=config)
        losses = []
        for step in range(2):
            x, y = batch(step)
            logits, l_aux = engine(x)
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten()) + 0.01 * sum(l_aux)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        out[name] = {"losses": losses, "optimizer": type(optimizer).__name__, "view_steps": int(engine.easybalance.view.steps)}
    for name in p["serve"]:
        with open(os.path.join(root, "configs", name)) as f:
            config = json.load(f)
        config["easybalance"]["log"] = {"dir": os.path.join(p["out"], name), "interval": 1}
        engine = eb_deepspeed.init_inference(make_model(), config=config)
        with torch.no_grad():
            logits, _ = engine(batch(0)[0])
        out[name] = {"finite": bool(torch.isfinite(logits).all()), "shape": list(logits.shape)}
    for name in p.get("serve_training", []):      # the ds_config one trains with, as it is
        with open(os.path.join(root, "configs", name)) as f:
            config = json.load(f)
        config["easybalance"]["log"] = {"dir": os.path.join(p["out"], f"serve_{name}"), "interval": 1}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine = eb_deepspeed.init_inference(make_model(), config=config)
        with torch.no_grad():
            logits, _ = engine(batch(0)[0])
        out[f"serve_{name}"] = {"finite": bool(torch.isfinite(logits).all()),
                                "notes": [str(w.message) for w in caught if "init_inference" in str(w.message)]}
    return out


def scenario_mixed_ep(p):
    """PR-MoE with EP groups of two sizes (2 experts on ep_size 1, then 4 on ep_size 2) and unequal batches per
    rank: plain DeepSpeed vs observe vs balance (bias). Each rank returns its own routes per step, so the test
    can recount the view's device load exactly (a copied layer's load is where this rank's tokens went)."""
    rank = torch.distributed.get_rank()
    shape = dict(experts=(2, 4), ep_size=(1, 2), k=1, drop_tokens=False, use_rts=False)   # top-1: 2 experts can skew
    blocks = {"plain": None, "observe": {"mode": "observe"},
              "balance": {"mode": "balance", "warmup_batches": 1, "aux": {"policy": "bias", "bias_rate": 0.05}}}
    out = {}
    for name, block in blocks.items():
        cfg = base_config()
        if block is not None:
            cfg["easybalance"] = {**block, "log": {"dir": os.path.join(p["out"], f"log_{name}"), "interval": 1}}
        torch.manual_seed(0)
        model = MoELM(**{**SMALL, **shape})
        engine = make_engine(model, cfg, use_eb=name != "plain")
        losses, counts, views = [], [], []
        for step in range(3):
            x, y = batch(step)
            x, y = x[:4 if rank == 0 else 2], y[:4 if rank == 0 else 2]     # 64 tokens on rank 0, 32 on rank 1
            logits, l_aux = engine(x)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()) + 0.1 * sum(l_aux)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
            counts.append(engine.module.last_counts_LE.clone())
            if name != "plain":
                views.append(view_state(engine))
        out[name] = {"losses": losses, "counts": counts, "views": views,
                     "params": {n: t.detach().clone() for n, t in engine.module.named_parameters()}}
        if name != "plain":
            eb = engine.easybalance
            out[name].update(experts_L=eb.view.experts_L.tolist(), devices_L=eb.view.devices_L.tolist(),
                             last_load_LG=eb.view.last_load_LG.clone(), metrics=eb.metrics())
    return out


def in_region(audit, serving) -> None:
    """Count the serving engine's batch-boundary work as "step" (the view step) and "replan" (a new placement
    applied: plan agreed, weights moved), apart from the forward that calls it."""
    for method, region in (("after_batch", "step"), ("apply", "replan")):
        def in_it(*args, _call=getattr(serving, method), _region=region):
            with audit.region("warm" if audit.in_region("warm") else _region):
                return _call(*args)
        setattr(serving, method, in_it)


SYNC_BLOCK = {"mode": "balance", "warmup_batches": 1,
              "aux": {"policy": "bias_cross_layer"}}


def scenario_sync(p):
    """Host-device synchronisations per micro-batch and per step (`benchmarks.sync_audit`, 2 layers): DeepSpeed-MoE
    training, plain against the block in balance mode with every control on (bias, device loss), and serving with replicas (view every batch) against DeepSpeed's eval forward."""
    from benchmarks.sync_audit import SyncAudit, audited_run
    rank, out = torch.distributed.get_rank(), {}
    for variant in ("plain", "balance"):
        audit = SyncAudit()
        model = make_model(ep_size=2, drop_tokens=p.get("drop_tokens", True))
        with audit, audit.region("init"):
            engine = make_engine(model, base_config(**({} if variant == "plain" else {"easybalance": {
                **SYNC_BLOCK, "log": {"dir": os.path.join(p["out"], "log")}}})), use_eb=variant != "plain")
        audit.on_device(engine.module)

        def micro_batch(i):
            x, y = batch(i)
            audit.on_device(x, y)
            logits, l_aux = engine(x)
            engine.backward(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()) + 0.1 * sum(l_aux))
        out[f"train_{variant}"] = audited_run(audit, 3, 2, micro_batch, lambda i: engine.step())
    for variant in ("plain", "serve", "plain_drops", "serve_drops"):
        audit = SyncAudit()
        kw = dict(drop_tokens=variant.endswith("drops"), ep_size=2, k=2)
        with audit, audit.region("init"):
            if variant.startswith("plain"):
                model = _skewed(_plain_eval_model(**kw))
            else:
                block = _serve_block(p, replica_slots=1, view_interval=1)
                model = eb_deepspeed.init_inference(_skewed(make_model(**kw)), config={"easybalance": block})
                in_region(audit, model.serving)
        audit.on_device(model)

        def forward(i):
            x = _skewed_batch(i, rank, equal=variant.endswith("drops"))   # DeepSpeed's eval capacity is per rank
            audit.on_device(x)
            with torch.no_grad():
                model(x)
        out[f"serve_{variant}"] = audited_run(audit, 4, 2, forward, lambda i: None)
        if variant.startswith("serve"):
            out[f"{variant}_replans"] = model.serving.replans
    return out


def main(scenarios: dict | None = None):
    """Run argv's scenario from `scenarios` (a worker module's globals; default this module's)."""
    scenario, out_dir, params = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    params["out"] = out_dir
    faulthandler.enable()                                                # an aborted rank says where
    faulthandler.dump_traceback_later(params.pop("stacks_after", 600))   # a hung rank says where
    deepspeed.init_distributed(dist_backend="gloo")
    result = (scenarios or globals())[f"scenario_{scenario}"](params)
    torch.save(result, os.path.join(out_dir, f"rank{torch.distributed.get_rank()}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()   # torn down while Python runs, as DeepSpeed's own tests do
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
