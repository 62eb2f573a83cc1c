"""One rank of a multi-process AutoEP test: `python autoep_worker.py SCENARIO OUT_DIR PARAMS_JSON`.

Started by `conftest.launch(..., worker="autoep_worker.py")`. Every scenario converts a tiny random Hugging Face
MoE model (examples/hf_moe.py) with DeepSpeed's real AutoEP on gloo ranks and saves what the test asserts on
to OUT_DIR/rank{R}.pt.
"""
from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

import deepspeed
from deepspeed.moe.utils import configure_moe_param_groups

import eb_deepspeed
from eb_deepspeed.adapters.autoep import find_autoep_layers
from eb_deepspeed.planning.placement import static_placement
from hf_moe import autoep_section, hf_moe_model, zipf_tokens

MICRO, SEQ = 2, 16


def config(family: str, zero: int = 0, accum: int = 1, block: dict | None = None, out: str = ".", ep: int = 2,
           bf16: bool = False) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": accum, "steps_per_print": 10**6,
           "zero_optimization": {"stage": zero}, "expert_parallel": autoep_section(family, ep)}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if block is not None:
        cfg["easybalance"] = {"log": {"dir": os.path.join(out, "balance")}, **block}
    return cfg


def engine_for(family: str, cfg: dict, use_eb: bool = True, seed: int = 0, checkpointing: str = "none",
               freeze: bool = False):
    torch.manual_seed(seed)                      # seeded once, as a user does; no reseeding between steps
    model = hf_moe_model(family, layers=2, hidden=32, experts=4, k=2, ffn=32, seq_len=SEQ)
    if freeze:                                   # the first MoE layer's experts frozen, as a partial fine-tune does
        next(m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate")).experts.requires_grad_(False)
    if checkpointing != "none":
        model.gradient_checkpointing_enable({"use_reentrant": checkpointing == "reentrant"})
    init = eb_deepspeed.initialize if use_eb else deepspeed.initialize
    engine, _, _, _ = init(model=model, config=cfg,
                           optimizer=lambda ps: torch.optim.AdamW(configure_moe_param_groups(list(ps)), lr=1e-2))
    return engine


def batch(step: int, micro: int, pad: bool = False):
    """Different ids on every rank; with `pad`, the last 5 positions of the first row are padding."""
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + dist.get_rank())
    ids = zipf_tokens(MICRO, SEQ, g)
    mask = torch.ones_like(ids)
    if pad:
        mask[0, -5:] = 0
    labels = torch.where(mask > 0, ids, -100)
    return ids, mask, labels


def named_grads(engine) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in engine.module.named_parameters() if p.grad is not None}


def train(engine, steps: int, grads: bool = False, pad: bool = False, between=None):
    losses, all_grads = [], []
    for step in range(steps):
        for micro in range(engine.gradient_accumulation_steps()):
            ids, mask, labels = batch(step, micro, pad)
            out = engine(input_ids=ids, attention_mask=mask, labels=labels)
            engine.backward(out.loss)
            losses.append(out.loss.detach().clone())
            if grads and engine.zero_optimization_stage() == 0:
                all_grads.append(named_grads(engine))
            engine.step()
        if between is not None:
            between(step)
    return losses, all_grads


def scenario_equivalence(p):
    """Plain AutoEP, the block absent, and `observe`: the same losses, gradients and weights."""
    family, zero, accum = p["family"], p["zero"], p["accum"]
    out = {}
    for name, block, use_eb in (("plain", None, False), ("no_block", None, True), ("observe", {"mode": "observe"}, True)):
        engine = engine_for(family, config(family, zero, accum, block, p["out"]), use_eb)
        losses, grads = train(engine, 3, grads=True)
        params = {n: t.detach().clone() for n, t in engine.module.state_dict().items()}
        out[name] = {"losses": losses, "grads": grads, "params": params,
                     "has_balancer": hasattr(engine, "easybalance")}
        if name == "observe":
            out[name]["routed"] = float(engine.easybalance.view.last.routed_LE.sum())
    return out


def scenario_tally(p):
    """`balance` on a family: the view's counts against an independent count of the router's choices (the
    test marks the phases itself: forwards counted, eval forwards and backward re-runs not)."""
    family, checkpointing, accum, pad = p["family"], p["checkpointing"], p["accum"], p["pad"]
    engine = engine_for(family, config(family, 0, accum, {"mode": "balance", "warmup_batches": 1}, p["out"]),
                        checkpointing=checkpointing)
    balancer = engine.easybalance
    layers = [m for _, m in find_autoep_layers(engine.module)]
    phase = {"now": None}
    own_LE = torch.zeros(len(layers), 4, dtype=torch.float64)
    valid = {"T": None}

    def counter(index):
        def hook(router, args, output):
            if phase["now"] == "forward":
                selected = output[1]
                if valid["T"] is not None:
                    selected = selected[valid["T"]]
                own_LE[index] += torch.bincount(selected.flatten(), minlength=4).double()
        return hook

    for index, layer in enumerate(layers):
        layer.router.register_forward_hook(counter(index))
    view_LE, own_steps, spreads, losses = [], [], [], []
    for step in range(4):
        own_LE.zero_()
        for micro in range(accum):
            ids, mask, labels = batch(step, micro, pad)
            valid["T"] = mask.reshape(-1) > 0
            phase["now"] = "forward"
            out = engine(input_ids=ids, attention_mask=mask, labels=labels)
            phase["now"] = "backward"
            engine.backward(out.loss)
            losses.append(float(out.loss))
            phase["now"] = "eval"
            engine.eval()
            with torch.no_grad():
                engine(input_ids=ids, attention_mask=mask)
            engine.train()
            engine.step()
        dist.all_reduce(own_LE)
        own_steps.append(own_LE.clone())
        view_LE.append(balancer.view.last.routed_LE.clone())
        spreads.append(balancer.bias_spreads())
    return {"view": view_LE, "own": own_steps, "spreads": spreads, "losses": losses,
            "tokens": float(balancer.view.last.tokens_L[0]), "family": family,
            "grad_norm": float(sum(layer.router.gate.weight.detach().norm() for layer in layers))}


def scenario_checkpoint(p):
    """`balance` at a ZeRO stage: save, load into a fresh engine (same state), and into plain AutoEP."""
    family, zero = p["family"], p["zero"]
    ckpt = os.path.join(p["out"], "ckpt")
    cfg = config(family, zero, 1, {"mode": "balance", "warmup_batches": 1}, p["out"])
    engine = engine_for(family, cfg)
    train(engine, 4)
    engine.save_checkpoint(ckpt, client_state={"step": 4})
    saved = engine.easybalance.state_dict()
    next_loss, _ = train(engine, 1)
    fresh = engine_for(family, cfg, seed=5)
    path, client = fresh.load_checkpoint(ckpt)
    loaded = fresh.easybalance.state_dict()
    bias_of_gates = [c.bias_E.clone() for c in fresh.easybalance.controls]
    fresh_loss, _ = train(fresh, 1)
    plain = engine_for(family, config(family, zero, 1), use_eb=False, seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain_path, _ = plain.load_checkpoint(ckpt)
    return {"saved": saved, "loaded": loaded, "client_step": client["step"], "path": path,
            "next_loss": float(next_loss[0]), "fresh_loss": float(fresh_loss[0]), "plain_path": plain_path,
            "bias_of_gates": bias_of_gates}


def _rolled(L: int, E: int, G: int, shift: int):
    """A permutation of every layer's experts: layer l's rolled by shift + l (none of them AutoEP's layout)."""
    from eb_deepspeed.planning.placement import index_maps
    phy2log = torch.stack([torch.roll(torch.arange(E), shift + layer) for layer in range(L)])
    return index_maps(phy2log, E, G, E // G)


def _logical_expert_grads(engine, placement) -> dict[str, torch.Tensor]:
    """Every expert weight's gradient [E, ...] in logical order, gathered over the EP group (ZeRO 0)."""
    out = {}
    for index, (_, layer) in enumerate(find_autoep_layers(engine.module)):
        for name, param in layer.experts.named_parameters():
            if not param.requires_grad:          # frozen
                continue
            grad = param.grad.detach().contiguous()
            parts = [torch.zeros_like(grad) for _ in range(layer.ep_size)]
            dist.all_gather(parts, grad, group=layer.ep_group)
            out[f"{index}.{name}"] = torch.cat(parts)[placement.log2phy[index, :, 0]]
    return out


def _placement_block(interval: int = 10**6, **extra) -> dict:
    return {"mode": "observe", "warmup_batches": 1, "train_placement": {"enabled": True, "interval": interval},
            **extra}


def _fail_once(module, name: str) -> None:
    real = getattr(module, name)

    def fail(*args, **kwargs):
        setattr(module, name, real)
        raise ValueError("injected")
    setattr(module, name, fail)


def scenario_placement(p):
    """Plain AutoEP against `observe` with training placement, 5 optimizer steps, the experts re-placed before
    steps 1, 2 and 3 (three permutations) and home at the end: losses, logical gradients (ZeRO 0) and the final
    weights; with `p["fault"]`, the second move fails on rank 1 while checking what arrived ("verify") or while
    reading the state it sends ("read": its sends go as NaNs)."""
    import eb_deepspeed.adapters.autoep.state as state_module
    import eb_deepspeed.adapters.moves as moves_module
    family, zero, accum, ep = "mixtral", p["zero"], p["accum"], p["ep"]
    out = {}
    for name in ("plain", "placed"):
        block = _placement_block() if name == "placed" else None
        engine = engine_for(family, config(family, zero, accum, block, p["out"], ep=ep, bf16=p.get("bf16", False)),
                            use_eb=name == "placed", freeze=p.get("freeze", False))
        placer = getattr(getattr(engine, "easybalance", None), "placement", None)
        home = static_placement(2, 4, ep)
        losses, grads, applied = [], [], []
        for step in range(5):
            if placer is not None and 1 <= step <= 3:
                if p.get("fault") and step == 2 and dist.get_rank() == 1:     # checking what arrived, or reading
                    _fail_once(*((moves_module, "verify_finite") if p["fault"] == "verify"
                                 else (state_module.ExpertState, "read")))
                applied.append(placer.apply(_rolled(2, 4, ep, step)))
            for micro in range(accum):
                ids, mask, labels = batch(step, micro)
                loss = engine(input_ids=ids, attention_mask=mask, labels=labels).loss
                engine.backward(loss)
                losses.append(loss.detach().float().clone())
                if zero == 0:
                    grads.append(_logical_expert_grads(engine, placer.resident if placer else home))
                engine.step()
        if placer is not None:
            applied.append(placer.apply(home))
        out[name] = {"losses": losses, "grads": grads, "applied": applied,
                     "params": {n: t.detach().clone() for n, t in engine.module.state_dict().items()},
                     "moves": None if placer is None else (placer.replans, placer.weight_moves, placer.moved_bytes,
                                                           placer.failed_moves)}
    return out


def scenario_replicas(p):
    """Plain AutoEP against `observe` with one replica slot a rank (filled every micro-batch), 5 optimizer steps,
    other homes before steps 1, 2 and 3 and home at the end: losses, logical home gradients (ZeRO 0), final
    weights, and the rows each rank's grouped GEMM computed."""
    family, zero, accum, ep = "mixtral", p["zero"], p["accum"], p["ep"]
    out = {}
    for name in ("plain", "placed"):
        block = _placement_block() if name == "placed" else None
        if block is not None:
            block["train_placement"]["replica_slots"] = 1
        engine = engine_for(family, config(family, zero, accum, block, p["out"], ep=ep, bf16=p.get("bf16", False)),
                            use_eb=name == "placed", freeze=p.get("freeze", False))
        placer = getattr(getattr(engine, "easybalance", None), "placement", None)
        rows = []
        for _, layer in find_autoep_layers(engine.module):
            layer.experts.register_forward_hook(lambda m, args, o: rows.append(args[1].tolist()))
        home = static_placement(2, 4, ep)
        losses, grads, applied = [], [], []
        for step in range(5):
            if placer is not None and 1 <= step <= 3:
                applied.append(placer.apply(_rolled(2, 4, ep, step)))
            for micro in range(accum):
                ids, mask, labels = batch(step, micro)
                loss = engine(input_ids=ids, attention_mask=mask, labels=labels).loss
                engine.backward(loss)
                losses.append(loss.detach().float().clone())
                if zero == 0:
                    grads.append(_logical_expert_grads(engine, placer.resident if placer else home))
                engine.step()
        if placer is not None:
            applied.append(placer.apply(home))
        out[name] = {"losses": losses, "grads": grads, "applied": applied, "rows": rows,
                     "params": {n: t.detach().clone() for n, t in engine.module.state_dict().items()}}
    return out


def scenario_replica_fault(p):
    """Replicas served; on rank 1 reading the rows for the replica all-to-all fails once, in forward ("fetch") or
    backward ("grad") of the second step: every rank raises before that optimizer step, nobody hangs, no weight
    changed; caught, training goes on: the steps after are plain AutoEP's that never saw the failed batch."""
    from eb_deepspeed.adapters.autoep import fetch as fetch_module
    block = _placement_block()
    block["train_placement"]["replica_slots"] = 1
    cfg = config("mixtral", p["zero"], 1, block, p["out"], bf16=p.get("bf16", False))
    plain, placed = engine_for("mixtral", cfg, use_eb=False), engine_for("mixtral", cfg)

    def step(engine, b):
        ids, mask, labels = batch(b, 0)
        loss = engine(input_ids=ids, attention_mask=mask, labels=labels).loss
        engine.backward(loss)
        engine.step()
        return float(loss)
    losses = {"plain": [step(plain, 0)], "placed": [step(placed, 0)]}
    before = {n: t.detach().clone() for n, t in placed.module.named_parameters()}
    if dist.get_rank() == 1:
        rows = fetch_module._rows

        def failing(tensors, index):     # the weights' rows [H = 2, ...] forward, their gradients' [S = 3, ...] back
            if (tensors[0].shape[0] == 2) == (p["fault"] == "fetch"):
                fetch_module._rows = rows
                raise RuntimeError("injected")
            return rows(tensors, index)
        fetch_module._rows = failing
    error = None
    try:
        step(placed, 1)
    except RuntimeError as e:
        error = str(e)
    unchanged = all(torch.equal(before[n], t.detach()) for n, t in placed.module.named_parameters())
    for b in (2, 3):                     # the user goes on; plain never saw batch 1
        losses["plain"].append(step(plain, b))
        losses["placed"].append(step(placed, b))
    weights = max(float((a.float() - b.float()).abs().max()) for a, b in
                  zip(plain.module.state_dict().values(), placed.module.state_dict().values()))
    return {"error": error, "unchanged": unchanged, "losses": losses, "weights_max_diff": weights,
            "steps": (int(plain.global_steps), int(placed.global_steps))}


def scenario_replicas_beside(p):
    """Replica slots and what users do around training: eval forwards and `generate` between steps with every replica
    read failing on rank 1 compute on the homes (plain AutoEP's logits and tokens, nothing raised); serving the
    engine in the same process is refused, naming the way out; a permutation alone goes home and serves as AutoEP;
    replica slots past what the experts can fill are refused at initialize, naming the key."""
    from eb_deepspeed.adapters.autoep import fetch as fetch_module
    block = _placement_block()
    block["train_placement"]["replica_slots"] = 1
    placed, plain = engine_for("mixtral", config("mixtral", 0, 1, block, p["out"])), \
        engine_for("mixtral", config("mixtral", 0, 1, None, p["out"]), use_eb=False)
    train(placed, 1), train(plain, 1)
    if dist.get_rank() == 1:
        def failing(tensors, index):
            raise RuntimeError("injected")
        fetch_module._rows = failing
    ids = batch(5, 0)[0]
    out = {}
    with torch.no_grad():
        for engine in (placed, plain):
            engine.eval()
        out["eval_max_diff"] = float((placed(input_ids=ids).logits - plain(input_ids=ids).logits).abs().max())
        out["generated"] = [e.module.generate(ids[:, :4], max_new_tokens=3, do_sample=False, synced_gpus=True).tolist()
                            for e in (placed, plain)]
    try:
        eb_deepspeed.init_inference(placed, config={"easybalance": {"mode": "observe"}})
        out["serve_refused"] = None
    except ValueError as e:
        out["serve_refused"] = str(e)
    permuted = engine_for("mixtral", config("mixtral", 0, 1, _placement_block(), p["out"]))
    assert permuted.easybalance.placement.apply(_rolled(2, 4, 2, 1))
    train(permuted, 1)
    plain2 = engine_for("mixtral", config("mixtral", 0, 1, None, p["out"]), use_eb=False)
    train(plain2, 1)
    served = eb_deepspeed.init_inference(permuted, config={"easybalance": {"mode": "observe"}})
    with torch.no_grad():
        plain2.eval()
        out["served_max_diff"] = float((served(input_ids=ids).logits - plain2(input_ids=ids).logits).abs().max())
    for slots in (20000, 70000):
        block["train_placement"]["replica_slots"] = slots
        try:
            engine_for("mixtral", config("mixtral", 0, 1, block, p["out"]))
            out[f"slots_{slots}"] = None
        except ValueError as e:
            out[f"slots_{slots}"] = str(e)
    return out


def scenario_isolation(p):
    """A plain AutoEP model beside one easybalance trains with replicas (the exact split) in one process: the plain one
    trains as it does alone and DeepSpeed's module keeps its own count exchange; an exception inside the balanced
    layer's grouped GEMM leaves its [H, ...] weights in place, and the model trains on and saves."""
    from deepspeed.module_inject import auto_ep_layer
    original = auto_ep_layer.compute_split_plan
    alone = train(engine_for("mixtral", config("mixtral", 0, 1, None, p["out"]), use_eb=False), 2)[0]
    block = _placement_block()
    block["train_placement"]["replica_slots"] = 1
    placed = engine_for("mixtral", config("mixtral", 0, 1, block, p["out"]))
    assert placed.easybalance.placement.apply(_rolled(2, 4, 2, 1))
    train(placed, 1)                                              # the exact split's count exchange in use
    beside = engine_for("mixtral", config("mixtral", 0, 1, None, p["out"]), use_eb=False)
    layers = [m for _, m in find_autoep_layers(beside.module)]
    out = {"module_untouched": auto_ep_layer.compute_split_plan is original,
           "layers_untouched": all("_forward" not in vars(m) and "forward" not in vars(m.experts) for m in layers),
           "alone": alone, "beside": train(beside, 2)[0]}
    experts = find_autoep_layers(placed.module)[0][1].experts
    before = [tuple(t.shape) for t in experts.parameters()]
    try:                                     # a grouped GEMM that raises (here: rows of the wrong width)
        experts(torch.zeros(4, 7), torch.tensor([1, 1, 1, 1, 0, 0]))
    except RuntimeError as e:
        out["raised"] = str(e)[:80]
    out["shapes"] = (before, [tuple(t.shape) for t in experts.parameters()])
    out["after"] = train(placed, 1)[0]
    out["saved"] = placed.save_checkpoint(os.path.join(p["out"], "ckpt"), tag="t")
    return out


def _expert_state(engine) -> list[dict]:
    """Every layer's expert state, row by row, as a move reads it (collective under ZeRO: every rank calls it)."""
    from eb_deepspeed.adapters.autoep.state import ExpertState
    rows, layers = ExpertState(engine, [m for _, m in find_autoep_layers(engine.module)]), []
    for layer, m in enumerate(rows.layers):
        rows.prepare(layer)
        layers.append({j: t.clone() for j, t in rows.read(layer, list(range(int(m.num_local_experts)))).items()})
    return layers


def scenario_placement_faults(p):
    """Moves that fail on one rank (`p["victim"]`) at each point: allocating what a layer's move needs
    ("prepare"), the transfer as a whole before it posts anything ("transfer"), posting one ("post"), writing what
    arrived ("write"): every rank keeps the old placement and state, no rank waits; then a move that goes through,
    training equal to plain AutoEP's; then the exports:
    `state_dict()` refused while placed, the logical layout inside `at_home()` and from `save_16bit_model`."""
    import eb_deepspeed.adapters.autoep.state as state_module
    import eb_deepspeed.adapters.moves as moves_module
    zero, ep, rank = p["zero"], p["ep"], dist.get_rank()
    plain = engine_for("mixtral", config("mixtral", zero, 1, None, p["out"], ep=ep), use_eb=False)
    placed = engine_for("mixtral", config("mixtral", zero, 1, _placement_block(), p["out"], ep=ep))
    placer = placed.easybalance.placement
    losses = {"plain": train(plain, 1)[0], "placed": train(placed, 1)[0]}        # the optimizer has state now
    out = {"applied": [], "unchanged": []}
    for step, (where, name) in enumerate(((state_module.ExpertState, "prepare"), (moves_module, "transfer"),
                                          (moves_module, "_post"), (state_module.ExpertState, "write")), start=1):
        before = _expert_state(placed)
        if rank == p["victim"]:
            _fail_once(where, name)
        out["applied"].append(placer.apply(_rolled(2, 4, ep, step)))
        after = _expert_state(placed)
        out["unchanged"].append(all(torch.equal(a[j], b[j]) for a, b in zip(before, after) for j in a))
        out["placed_after_fault"] = placer.resident is placer.home
    out["applied"].append(placer.apply(_rolled(2, 4, ep, 1)))
    for name, engine in (("plain", plain), ("placed", placed)):
        losses[name] += train(engine, 3)[0]
    out["losses"] = {k: [float(v) for v in vs] for k, vs in losses.items()}
    try:
        placed.module.state_dict()
        out["refused"] = None
    except RuntimeError as e:
        out["refused"] = str(e)
    with placer.at_home():
        inside = {k: v.detach().clone() for k, v in placed.module.state_dict().items()}
    out["export_max_diff"] = max(float((inside[k].float() - v.float()).abs().max())
                                 for k, v in plain.module.state_dict().items())
    for name, engine in (("plain", plain), ("placed", placed)):
        engine.save_16bit_model(os.path.join(p["out"], name), "model.bin")
    out["still_placed"] = placer.resident is not placer.home
    out["failed_moves"] = placer.failed_moves
    out["exported"] = [os.path.join(p["out"], name, "model.bin") for name in ("plain", "placed")]
    return out


def scenario_placement_refuses(p):
    """An optimizer whose step reads a whole tensor (Adafactor) is refused at initialize, naming it."""
    model = hf_moe_model("mixtral", layers=2, hidden=32, experts=4, k=2, ffn=32, seq_len=SEQ)
    try:
        eb_deepspeed.initialize(model=model, config=config("mixtral", 0, 1, _placement_block(), p["out"]),
                                optimizer=lambda ps: torch.optim.Adafactor(configure_moe_param_groups(list(ps))))
        return {"error": None}
    except ValueError as e:
        return {"error": str(e)}


def scenario_placement_auto(p):
    """Skewed routers (experts 0 and 1 hot, both on EP rank 0), `observe` with placement every 2 steps: the view
    re-places them by itself, routing untouched (losses equal plain AutoEP's), the busiest rank's share drops; a
    checkpoint saved while placed loads into plain AutoEP and into a placed engine at another replica count
    (0 <-> 1), both continuing alike. With replica slots the routes are fixed (each position's logits a constant:
    expert 0 first for every token, the second spread over 1..3), which no permutation of 2 experts a rank
    balances and one replica of 0 does; the learning router (lr 1e-2) would otherwise re-route faster than a
    re-plan every 2 steps follows."""
    family, ckpt = "mixtral", os.path.join(p["out"], "ckpt")
    fixed_TE = torch.randn(MICRO * SEQ, 4, generator=torch.Generator().manual_seed(0))
    fixed_TE[:, 0] = 6.0

    def skewed(engine):
        offset_E = torch.tensor([3.0, 1.5, 0.0, 0.0])
        for _, layer in find_autoep_layers(engine.module):
            layer.router.gate.register_forward_hook(
                (lambda m, a, logits: logits * 0 + fixed_TE) if p.get("replicas") else
                (lambda m, a, logits: logits + offset_E))
        return engine

    zero = p.get("zero", 0)
    block = _placement_block(2, log={"dir": os.path.join(p["out"], "log"), "interval": 1})
    block["train_placement"]["replica_slots"] = p.get("replicas", 0)
    plain = skewed(engine_for(family, config(family, zero), use_eb=False))
    placed = skewed(engine_for(family, config(family, zero, block=block)))
    ratios = []
    plain_losses, _ = train(plain, 8)
    placed_losses, _ = train(placed, 8, between=lambda step: ratios.append(
        placed.easybalance.metrics()["device_max_over_mean"]))
    placer = placed.easybalance.placement
    slots_at_save = placer.placement.slots_per_device
    placed.save_checkpoint(ckpt, tag="t")
    moved_after_save = placer.placement.phy2log.clone()       # with replicas: [L, G * (H + R)]
    # two steps after the save: the second's loss shows the optimizer state (moments) followed its expert
    next_placed, _ = train(placed, 2)
    fresh_plain = engine_for(family, config(family, zero), use_eb=False, seed=3)
    other = dict(block, train_placement=dict(block["train_placement"], replica_slots=1 - p.get("replicas", 0)))
    fresh_placed = engine_for(family, config(family, zero, block=other), seed=3)      # at another replica count
    for engine in (fresh_plain, fresh_placed):
        skewed(engine)
        engine.load_checkpoint(ckpt, tag="t")
    next_plain, _ = train(fresh_plain, 2)
    next_fresh, _ = train(fresh_placed, 2)
    return {"plain": plain_losses, "placed": placed_losses, "ratios": ratios, "replans": placer.replans,
            "phy2log": moved_after_save, "slots": slots_at_save,
            "next": [[float(v) for v in x] for x in (next_placed, next_plain, next_fresh)],
            "records": os.path.join(p["out"], "log")}


def scenario_folded(p):
    """Mixtral under AutoEP (autoep_size 2) with tensor-parallel folding (`tensor_parallel.autotp_size` = p["tp"];
    1: unfolded; attention sharded) on every rank of the job: plain, `observe` and `balance`, 3 steps each on the same
    batches (the batch of data-parallel rank rank // tp: tensor-parallel peers see the same tokens). Per
    engine: losses, router gradients of the first step, weights after 3 steps; for the balancer, its view's counts
    and bias against an independent count of the router's choices."""
    tp = p["tp"]
    dp_rank = dist.get_rank() // tp
    out = {}
    for name, block in (("plain", None), ("observe", {"mode": "observe"}),
                        ("balance", {"mode": "balance", "warmup_batches": 1})):
        cfg = config("mixtral", 0, 1, block, p["out"])
        if tp > 1:
            cfg["tensor_parallel"] = {"autotp_size": tp, "partition_config": {"use_default_specs": False, "layer_specs": [
                {"patterns": [r".*\.self_attn\.o_proj\.weight$"], "partition_type": "row"},
                {"patterns": [r".*\.self_attn\.[qkv]_proj\.weight$"], "partition_type": "column"}]}}
        engine = engine_for("mixtral", cfg, use_eb=block is not None)
        layers = [m for _, m in find_autoep_layers(engine.module)]
        own_LE = torch.zeros(len(layers), 4, dtype=torch.float64)

        def counter(index):
            def hook(router, args, output):
                if router.training and torch.is_grad_enabled():
                    own_LE[index] += torch.bincount(output[1].flatten(), minlength=4).double()
            return hook
        for index, layer in enumerate(layers):
            layer.router.register_forward_hook(counter(index))
        losses, router_grads, own, view, bias = [], None, [], [], []
        for step in range(3):
            own_LE.zero_()
            g = torch.Generator().manual_seed(1000 * step + dp_rank)
            ids = zipf_tokens(MICRO, SEQ, g)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            losses.append(float(loss))
            if step == 0:
                router_grads = [layer.router.gate.weight.grad.detach().clone() for layer in layers]
            engine.step()
            own.append(own_LE.clone())
            if block is not None:
                view.append(engine.easybalance.view.last.routed_LE.clone())
                bias.append(torch.stack([c.bias_E.clone() if c.bias_E is not None else torch.zeros(4)
                                         for c in engine.easybalance.controls]))
        params = {n: t.detach().clone() for n, t in engine.module.state_dict().items()}
        out[name] = {"losses": losses, "router_grads": router_grads, "params": params, "own": own, "view": view,
                     "bias": bias}
    return {"tp": tp, "dp_rank": dp_rank, **out}


def scenario_resize(p):
    """A balance run at autoep_size 2 on 4 ranks resumed at autoep_size p["to"]: at ZeRO 3 through DeepSpeed's
    universal checkpoint, at ZeRO 0 by a plain resume of the module; the balancer state before and after, the warnings, the
    next step's loss (of the saved engine too). Then a model of other layers: refused before anything loads."""
    from types import SimpleNamespace
    from deepspeed.checkpoint.ds_to_universal import main as convert_to_universal
    block = {"mode": "balance", "warmup_batches": 1}
    ckpt = os.path.join(p["out"], "ckpt")

    def resized(ep, zero, universal=False, layers=2):
        cfg = config("mixtral", zero, 1, block, p["out"])
        cfg["expert_parallel"] = autoep_section("mixtral", ep)
        if universal:
            cfg["checkpoint"] = {"load_universal": True}
        torch.manual_seed(5)
        model = hf_moe_model("mixtral", layers=layers, hidden=32, experts=4, k=2, ffn=32, seq_len=SEQ)
        engine, _, _, _ = eb_deepspeed.initialize(
            model=model, config=cfg, optimizer=lambda ps: torch.optim.AdamW(configure_moe_param_groups(list(ps)), lr=1e-2))
        return engine

    out = {}
    for name, zero in (("universal", 3), ("plain", 0)):
        engine = engine_for("mixtral", config("mixtral", zero, 1, block, p["out"]))
        train(engine, 3)
        engine.save_checkpoint(ckpt, tag=name)
        saved = engine.easybalance.state_dict()
        next_loss, _ = train(engine, 1)
        tag = name
        if name == "universal":
            dist.barrier()
            if dist.get_rank() == 0:
                convert_to_universal(SimpleNamespace(
                    input_folder=os.path.join(ckpt, name), output_folder=os.path.join(ckpt, "universal_u"),
                    num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                    inject_missing_state=False))
            dist.barrier()
            tag = "universal_u"
        resumed = resized(p["to"], zero, universal=name == "universal")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # a plain resume into other EP groups: the module only (DeepSpeed keeps the optimizer's expert
            # states in the old groups' shapes); the universal checkpoint re-slices them too
            path, _ = resumed.load_checkpoint(ckpt, tag=tag, load_optimizer_states=name == "universal")
        state = resumed.easybalance.state_dict()
        bias_of_gates = [c.bias_E.clone() for c in resumed.easybalance.controls]
        losses, _ = train(resumed, 1)
        out[name] = {"path": path, "saved": saved, "state": state, "loss": float(losses[0]),
                     "saved_next_loss": float(next_loss[0]), "G": resumed.easybalance.view.G,
                     "warned": [str(w.message) for w in caught if "easybalance" in str(w.message)],
                     "bias_of_gates": bias_of_gates}
    deeper = resized(p["to"], 0, layers=3)
    before = {n: t.detach().clone() for n, t in deeper.module.state_dict().items()}
    try:
        deeper.load_checkpoint(ckpt, tag="plain")
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    out["untouched"] = all(torch.equal(t, before[n]) for n, t in deeper.module.state_dict().items())
    return out


# ---------------------------------------------------------------------------------------------- serving
def _served_model(family: str, ep: int, experts: int, skew: float, seed: int = 0):
    """A tiny model AutoEP converted (plain deepspeed.initialize, no optimizer), in eval mode, its routers
    skewed the same way in every layer (cross-layer correlated hot experts): expert 0's logit gets `skew`,
    expert 1's half of it (a forward hook on each router's linear layer, part of the model)."""
    torch.manual_seed(seed)
    model = hf_moe_model(family, layers=2, hidden=32, experts=experts, k=2, ffn=32, seq_len=SEQ)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**6,
           "expert_parallel": autoep_section(family, ep)}
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    offset_E = torch.zeros(experts)
    offset_E[0], offset_E[1] = skew, skew / 2
    for _, layer in find_autoep_layers(engine.module):
        layer.router.gate.register_forward_hook(lambda m, a, logits: logits + offset_E)
    engine.module.eval()
    return engine


def _serve_block(p, **inference):
    return {"mode": "balance", "warmup_batches": 1, "log": {"dir": os.path.join(p["out"], "serve_log"), "interval": 1},
            "inference": {"replica_slots": 1, "replan_interval": 1, "replan_threshold": 1.0, "view_interval": 1,
                          **inference}}


def _serve_batch(b: int, rows: int | None = None) -> torch.Tensor:
    """Unequal batches per rank (2 + rank sequences, or `rows`) of skewed token ids."""
    g = torch.Generator().manual_seed(100 * b + dist.get_rank())
    return zipf_tokens(2 + dist.get_rank() if rows is None else rows, SEQ, g)


def _compare(model, plain, batches: range) -> list[dict]:
    serving, rows = model.serving, []
    for b in batches:
        ids = _serve_batch(b)
        slots = serving.placement.slots_per_device          # the placement that serves this batch
        with torch.no_grad():
            expected = plain(input_ids=ids).logits
            got = model(input_ids=ids).logits
        rows.append({"equal": torch.equal(expected, got), "maxdiff": float((expected - got).abs().max()),
                     "slots": slots, "replans": serving.replans})
    return rows


def scenario_serve(p):
    """AutoEP layers served with replicas (re-plans from the view of a skewed router) against plain AutoEP eval
    of the same weights, batch by batch; then back to AutoEP's layout; then `generate` against plain's."""
    family, ep, experts = p.get("family", "mixtral"), p.get("ep", 2), p.get("experts", 4)
    plain = _served_model(family, ep, experts, p.get("skew", 3.0)).module
    engine = _served_model(family, ep, experts, p.get("skew", 3.0))
    model = eb_deepspeed.init_inference(engine, config={"easybalance": _serve_block(p, split=p.get("split", "view"))})
    serving = model.serving
    rows = _compare(model, plain, range(1))
    first = model.easybalance.log.record(model.easybalance)   # the view of AutoEP's own layout under the skew
    rows += _compare(model, plain, range(1, p.get("batches", 5)))
    replicated = serving.placement
    returned = serving.apply(serving.home)
    rows += _compare(model, plain, range(100, 102))
    ids = _serve_batch(200, rows=2)
    forwards, flips = [0], []

    def flip(module, args, output):            # weight moves between generate's forwards: home, then replicas
        forwards[0] += 1
        if forwards[0] in (2, 3):
            flips.append(serving.apply(serving.home if forwards[0] == 2 else replicated))
    with torch.no_grad():
        want = plain.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        serving.apply(replicated)                  # replicas again, through the generate's forwards
        handle = model.register_forward_hook(flip)
        got = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        handle.remove()
        # ranks that generate different numbers of tokens: the served model's generate keeps every rank in the
        # forwards (synced_gpus); before, the rank that finished first left the other waiting in AutoEP's all-to-all
        rank = dist.get_rank()
        uneven_got = model.generate(ids, max_new_tokens=2 + 2 * rank, min_new_tokens=2 + 2 * rank, do_sample=False)
        uneven_want = plain.generate(ids, max_new_tokens=2 + 2 * rank, min_new_tokens=2 + 2 * rank, do_sample=False,
                                     synced_gpus=True)
    layer = serving.store.moes[0]
    return {"rows": rows, "returned": returned, "generate_equal": torch.equal(want, got), "flips": flips,
            "uneven_equal": torch.equal(uneven_want, uneven_got), "uneven_tokens": uneven_got.shape[1] - ids.shape[1],
            "rank": rank,
            "S_max": serving.S_max,
            "H": serving.H, "moves": serving.weight_moves, "record": model.easybalance.log.record(model.easybalance),
            "first": first,
            "num_local_experts": layer.num_local_experts, "w1_rows": layer.experts.w1.shape[0],
            "replicated_slots": replicated.slots_per_device, "logged": os.path.join(p["out"], "serve_log")}


def scenario_serve_empty(p):
    """Rank 1's AutoEP layer gets no tokens while rank 0's gets some, replicas serving: no hang, rank 0's output
    equal to plain AutoEP's layer over the same tokens (whose peer sends it none either)."""
    from eb_deepspeed.planning import plan_placement
    plain = _served_model("mixtral", 2, 4, 3.0).module
    engine = _served_model("mixtral", 2, 4, 3.0)
    model = eb_deepspeed.init_inference(engine, config={"easybalance": _serve_block(p, split=p["split"],
                                                                                   replan_interval=1000)})
    serving = model.serving
    serving.apply(plan_placement(torch.tensor([[9.0, 4, 1, 1]] * 2), 2, serving.S_max, previous=serving.placement))
    layer, plain_layer = serving.store.moes[0], find_autoep_layers(plain)[0][1]
    out = []
    for b in range(3):
        g = torch.Generator().manual_seed(b)
        x = torch.randn(1, 12, 32, generator=g)
        x = x[:, :0] if dist.get_rank() == 1 else x
        with torch.no_grad():
            got, expected = layer(x), plain_layer(x)
        got, expected = (got[0], expected[0]) if isinstance(got, tuple) else (got, expected)
        out.append({"shape": tuple(got.shape), "maxdiff": float((got - expected).abs().max()) if x.numel() else 0.0})
    return {"rows": out, "replicated": not serving.gates[0].home_layout}


def scenario_serve_move_fault(p):
    """A weight move that fails on rank 1 at `p["phase"]` (preparing, posting or waiting for a transfer, checking
    what arrived): every rank keeps the old placement, outputs stay plain AutoEP's, the next re-plan goes through."""
    from dist_worker import _inject_move_fault
    plain = _served_model("mixtral", 2, 4, 3.0).module
    engine = _served_model("mixtral", 2, 4, 3.0)
    model = eb_deepspeed.init_inference(engine, config={"easybalance": _serve_block(p)})
    serving = model.serving
    if dist.get_rank() == 1:
        _inject_move_fault(serving, p["phase"])
    rows = _compare(model, plain, range(5))
    return {"rows": rows, "failed": serving.failed_moves, "replans": serving.replans}


def scenario_serve_checkpoint(p):
    """DeepSpeed checkpoints in and out of a served AutoEP model: a plain engine's checkpoint (other weights)
    loaded while replicas serve gives that engine's logits, replicas kept; what the served model saves loads
    into a fresh plain engine (load_module_only) and gives the same logits again."""
    from eb_deepspeed.planning import plan_placement
    source = _served_model("mixtral", 2, 4, 3.0, seed=3)
    source.save_checkpoint(os.path.join(p["out"], "trained"), tag="t")
    engine = _served_model("mixtral", 2, 4, 3.0, seed=0)
    model = eb_deepspeed.init_inference(engine, config={"easybalance": _serve_block(p, replan_interval=1000)})
    serving = model.serving
    serving.apply(plan_placement(torch.tensor([[9.0, 4, 1, 1]] * 2), 2, serving.S_max, previous=serving.placement))
    before_load = serving.placement
    path = serving.load_checkpoint(os.path.join(p["out"], "trained"), tag="t")
    rows = _compare(model, source.module, range(3))
    saved = serving.save_checkpoint(os.path.join(p["out"], "served"), tag="s")
    rows_after_save = _compare(model, source.module, range(3, 5))
    fresh = _served_model("mixtral", 2, 4, 3.0, seed=7)
    fresh_path, _ = fresh.load_checkpoint(os.path.join(p["out"], "served"), tag="s", load_module_only=True)
    fresh_rows = _compare(model, fresh.module, range(5, 7))
    # a checkpoint of another model (8 experts) into this served 4-expert model: refused, nothing half-applied
    _served_model("mixtral", 2, 8, 3.0, seed=5).save_checkpoint(os.path.join(p["out"], "other"), tag="o")
    refused = None
    try:
        serving.load_checkpoint(os.path.join(p["out"], "other"), tag="o")
    except Exception as e:   # noqa: BLE001 - whatever DeepSpeed raises: the test reads the message
        refused = f"{type(e).__name__}: {e}"[:500]
    after_refusal = _compare(model, fresh.module, range(7, 9))      # still the weights loaded before, every one
    # a load that fails on rank 1 only (no such tag there): rank 0 puts back what it had loaded too
    one_failed = None
    try:
        serving.load_checkpoint(os.path.join(p["out"], "trained"), tag="t" if dist.get_rank() == 0 else "missing")
    except Exception as e:   # noqa: BLE001
        one_failed = f"{type(e).__name__}: {e}"[:500]
    after_refusal += _compare(model, fresh.module, range(9, 11))
    return {"one_failed": one_failed, "rows": rows + rows_after_save, "fresh_rows": fresh_rows, "path": path, "saved": saved,
            "fresh_path": fresh_path, "kept": torch.equal(serving.placement.phy2log, before_load.phy2log),
            "S": serving.S, "H": serving.H, "refused": refused, "after_refusal": after_refusal}


def scenario_sync(p):
    """Host-device synchronisations per micro-batch and per step (`benchmarks.sync_audit`): AutoEP training, plain
    against the block in balance mode with every control on (bias, device loss, the global scope) and padding in
    the batch; then serving with replicas (view every batch) against AutoEP's eval forward."""
    from benchmarks.sync_audit import SyncAudit, audited_run
    from dist_worker import SYNC_BLOCK, in_region
    out = {}
    replicas = _placement_block()
    replicas["train_placement"]["replica_slots"] = 1
    for variant in ("plain", "balance", "replicas"):
        audit = SyncAudit()
        with audit, audit.region("init"):
            block = {"plain": None, "balance": SYNC_BLOCK, "replicas": replicas}[variant]
            engine = engine_for("mixtral", config("mixtral", 0, 1, block, p["out"]), use_eb=variant != "plain")
        audit.on_device(engine.module)

        def micro_batch(i):
            ids, mask, labels = batch(i, 0, pad=True)
            audit.on_device(ids, mask, labels)
            engine.backward(engine(input_ids=ids, attention_mask=mask, labels=labels).loss)
        out[f"train_{variant}"] = audited_run(audit, 3, 2, micro_batch, lambda i: engine.step())
    for variant in ("plain", "serve"):
        audit = SyncAudit()
        with audit, audit.region("init"):
            model = _served_model("mixtral", 2, 4, 3.0)
            if variant == "serve":
                model = eb_deepspeed.init_inference(model, config={"easybalance": _serve_block(p)})
                in_region(audit, model.serving)
            else:
                model = model.module
        audit.on_device(model)

        def forward(i):
            ids = _serve_batch(i)
            audit.on_device(ids)
            with torch.no_grad():
                model(input_ids=ids)
        out[f"serve_{variant}"] = audited_run(audit, 4, 2, forward, lambda i: None)
        if variant == "serve":
            out["serve_replans"] = model.serving.replans
    return out


if __name__ == "__main__":
    from dist_worker import main
    main(globals())
