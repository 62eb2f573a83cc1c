"""ds_moe_suite: route every `deepspeed.initialize` through `eb_deepspeed.initialize` (one-off harness).

This directory goes on PYTHONPATH only for the runs of `tools/ds_moe_suite/run.py`; Python imports
`sitecustomize` at start-up in every interpreter, so the pytest process, the forkserver and every
worker process that DeepSpeed's `DistributedTest` starts get the same patch. Nothing happens unless
EB_DS_SUITE_MODE and EB_DS_SUITE_DIR are set (the runner sets them):

    EB_DS_SUITE_MODE    plain | observe | balance
    EB_DS_SUITE_POLICY  aux policy for balance mode (bias, cross_layer, fixed, bias_cross_layer)
    EB_DS_SUITE_DIR     the run's directory: evidence/<pid>.jsonl, eb_log/, current_test

When `deepspeed` is imported, its `initialize` is replaced by a wrapper:
* plain   -- calls the original with the very same arguments; only records how many
             `deepspeed.moe.layer.MoE` layers the model had (evidence that the test built an engine);
* observe / balance -- where the model has `deepspeed.moe.layer.MoE` layers or the config enables
             `expert_parallel` (AutoEP), adds an "easybalance" block to (a copy of) the config and calls
             `eb_deepspeed.initialize`; any other call goes to DeepSpeed as in plain. That function
             itself calls `deepspeed.initialize`, which is this wrapper again: a per-thread depth
             counter sends that inner call straight to DeepSpeed's original, so there is no recursion.
Each wrapped call writes one "init" line (test id, rank, MoE layers, CrossLayerGate count, or the
error and whether DeepSpeed or eb_deepspeed raised it) at once,
and one "exit" line per engine when the process ends (balancer steps, valid layer updates, routed
heat), so the runner can show that a passing test really ran our gate.
"""
import os
import sys

_MODE = os.environ.get("EB_DS_SUITE_MODE", "")
_DIR = os.environ.get("EB_DS_SUITE_DIR", "")


def _install() -> None:
    import importlib.abc
    import importlib.util

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname != "deepspeed":
                return None
            sys.meta_path.remove(self)         # one-shot: the real finders locate deepspeed
            spec = importlib.util.find_spec(fullname)
            loader = getattr(spec, "loader", None)
            if loader is not None and hasattr(loader, "exec_module"):
                inner = loader.exec_module

                def exec_module(module):       # on this loader instance only; its class is unchanged
                    inner(module)
                    _patch(module)
                loader.exec_module = exec_module
            return spec

    if "deepspeed" in sys.modules:
        _patch(sys.modules["deepspeed"])
    else:
        sys.meta_path.insert(0, _Finder())


def _patch(ds) -> None:
    import copy
    import functools
    import inspect
    import json
    import threading
    import time

    if getattr(ds.initialize, "_eb_ds_suite", False):
        return
    original = ds.initialize
    signature = inspect.signature(original)
    state = threading.local()
    engines = []            # [(record, balancer)] of this process, written at exit
    lock = threading.Lock()
    flushed = set()
    registered = {}         # pid that registered the exit writers

    def evidence_path():
        d = os.path.join(_DIR, "evidence")
        os.makedirs(d, exist_ok=True)
        return os.path.join(d, f"{os.getpid()}.jsonl")

    def write(record):
        with lock, open(evidence_path(), "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def current_test():
        try:
            with open(os.path.join(_DIR, "current_test"), encoding="utf-8") as f:
                return f.read().strip()
        except OSError:
            return ""

    def rank():
        try:
            import torch.distributed as dist
            if dist.is_available() and dist.is_initialized():
                return dist.get_rank()
        except Exception:                       # evidence only: never break the test
            pass
        return int(os.environ.get("RANK", "-1"))

    def count_moe(model):
        try:
            from deepspeed.moe.layer import MoE
            return sum(isinstance(m, MoE) for m in model.modules()) if model is not None else 0
        except Exception:
            return -1

    def flush():
        for index, (record, balancer) in enumerate(engines):
            if index in flushed or record["pid"] != os.getpid():   # not twice, not a forked parent's
                continue
            flushed.add(index)
            out = dict(record, phase="exit", t=round(time.time(), 3))
            try:
                view = balancer.view
                out.update(steps=int(view.steps), layer_updates=int(view.updates_L.sum()),
                           heat_sum=float(view.heat_LE.sum()))
            except Exception as e:
                out.update(steps=None, exit_error=f"{type(e).__name__}: {e}")
            write(out)

    def register_exit():
        if registered.get("pid") == os.getpid():
            return
        registered["pid"] = os.getpid()
        import atexit
        import multiprocessing.util
        atexit.register(flush)
        # pool workers leave through os._exit, which skips atexit; multiprocessing's own exit
        # function still runs its finalizers.
        multiprocessing.util.Finalize(None, flush, exitpriority=100)

    def with_block(arguments):
        """arguments (bound, explicit only) -> the same, with the easybalance block in `config`."""
        a = dict(arguments)
        config = a.pop("config", None)
        config_params = a.pop("config_params", None)
        if config is None:
            config = config_params
        args = a.get("args")
        if config is None and args is not None and getattr(args, "deepspeed_config", None) is not None:
            config = args.deepspeed_config
            args = copy.copy(args)
            args.deepspeed_config = None
            a["args"] = args
        if isinstance(config, (str, os.PathLike)):
            with open(config, encoding="utf-8") as f:
                config = json.load(f)
        if not isinstance(config, dict):
            a["config"] = config
            return a, False
        config = dict(config)                   # the test's dict is not mutated
        section = config.get("expert_parallel")
        autoep = isinstance(section, dict) and section.get("enabled") is True
        if not autoep and count_moe(a.get("model")) <= 0:     # nothing to balance: DeepSpeed as it is
            a["config"] = config
            return a, False
        if "easybalance" not in config:
            block = {"enabled": True, "mode": _MODE, "log": {"dir": os.path.join(_DIR, "eb_log")}}
            if _MODE == "balance":     # the bias from the second step on: DeepSpeed's tests train 1-4 steps
                block["aux"] = {"policy": os.environ.get("EB_DS_SUITE_POLICY", "bias")}
                block["warmup_batches"] = 1
            config["easybalance"] = block
        a["config"] = config
        return a, True

    def error_of(e):
        message = (str(e).strip().splitlines() or [""])[0]
        return f"{type(e).__name__}: {message}"[:500]

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        if getattr(state, "depth", 0):          # eb_deepspeed.initialize -> deepspeed.initialize
            try:
                return original(*args, **kwargs)
            except BaseException:
                state.inner_raised = True       # DeepSpeed raised, not eb_deepspeed
                raise
        bound = signature.bind(*args, **kwargs)
        record = {"phase": "init", "mode": _MODE, "test": current_test(), "pid": os.getpid(), "rank": rank(),
                  "t_call": round(time.time(), 3),
                  "moe_layers": count_moe(bound.arguments.get("model"))}
        if _MODE == "balance":
            record["policy"] = os.environ.get("EB_DS_SUITE_POLICY", "bias")
        def plain(**arguments):                 # straight to DeepSpeed, recorded as such
            try:
                out = original(**arguments)
            except BaseException as e:
                write(dict(record, rank=rank(), routed_through_eb=False, t=round(time.time(), 3),
                           error=error_of(e), raised_by="deepspeed"))
                raise
            write(dict(record, rank=rank(), cross_layer_gates=0, routed_through_eb=False, t=round(time.time(), 3)))
            return out
        if _MODE not in ("observe", "balance"):
            return plain(**bound.arguments)
        arguments, injected = with_block(bound.arguments)
        if not injected:                        # no MoE, no AutoEP: as plain
            return plain(**arguments)
        state.depth = getattr(state, "depth", 0) + 1
        state.inner_raised = False
        try:
            import eb_deepspeed
            out = eb_deepspeed.initialize(**arguments)
        except BaseException as e:
            write(dict(record, rank=rank(), routed_through_eb=True, injected=injected, t=round(time.time(), 3),
                       error=error_of(e), raised_by="deepspeed" if state.inner_raised else "eb_deepspeed"))
            raise
        finally:
            state.depth -= 1
        engine = out[0]
        from eb_deepspeed.adapters.deepspeed.gate import CrossLayerGate
        module = getattr(engine, "module", engine)
        balancer = getattr(engine, "easybalance", None)
        gates = sum(isinstance(m, CrossLayerGate) for m in module.modules()) or \
            (len(balancer.tallies) if balancer is not None else 0)      # AutoEP: one hooked router per layer
        record.update(rank=rank(), routed_through_eb=True, injected=injected, cross_layer_gates=gates,
                      t=round(time.time(), 3),
                      has_balancer=balancer is not None)
        write(record)
        if balancer is not None:
            engines.append((record, balancer))
            register_exit()
        return out

    initialize._eb_ds_suite = True
    ds.initialize = initialize


if _MODE and _DIR:
    _install()
