"""Test-only: run megatron-core's MoE layer on CPU / gloo by stubbing its CUDA-only spots.

Checked with megatron-core 0.16.1 (the pin in setup.py's `megatron` extra); `apply()` refuses any
other version and fails loudly if a patched name moved, so a megatron-core upgrade cannot silently
run un-shimmed code. Never imported by the library: on GPUs megatron-core runs untouched.

The five spots (each replaced with its CPU meaning, nothing else):
  1. `torch.cuda.current_device()` (router gating moves its weight there; tensor-parallel mappings
     allocate there) -> the CPU device;
  2. the alltoall dispatcher's device-to-host side stream and event -> a plain synchronous copy;
  3. the CUDA RNG tracker (`model_parallel_cuda_manual_seed`, `fork`) -> CPU generator states;
  4. `moe_utils.te_general_gemm`, undefined without TransformerEngine -> None (torch.mm path);
  5. `maybe_move_tensor_to_cpu` (only converts CUDA tensors) -> converts CPU tensors too (numpy splits).
"""
from __future__ import annotations

import contextlib

import torch

PINNED = "0.16.1"
_applied = False


def _need(owner, name: str):
    if not hasattr(owner, name):
        raise RuntimeError(f"megatron shim: {getattr(owner, '__name__', owner)}.{name} is gone; the shim was written "
                           f"for megatron-core {PINNED} and must be re-checked")
    return getattr(owner, name)


def apply() -> None:
    global _applied
    if _applied:
        return
    import megatron.core
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils, token_dispatcher
    if megatron.core.__version__ != PINNED:
        raise RuntimeError(f"megatron shim checked with megatron-core {PINNED}, found {megatron.core.__version__}")

    # 1. the current device is the CPU
    torch.cuda.current_device = lambda: torch.device("cpu")

    # 2. no side stream: copy the splits to host synchronously where the dispatcher would
    dispatcher = _need(token_dispatcher, "MoEAlltoAllTokenDispatcher")
    _need(dispatcher, "_maybe_dtoh_and_synchronize")
    dispatcher.cuda_dtoh_stream = object()      # set, so __init__ never creates a torch.cuda.Stream

    def dtoh(self, point, tokens_per_expert=None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            tokens_per_expert = _to_cpu(tokens_per_expert)
            self.input_splits = _to_cpu(self.input_splits, as_numpy=True)
            self.output_splits = _to_cpu(self.output_splits, as_numpy=True)
            self.output_splits_tp = _to_cpu(self.output_splits_tp, as_numpy=True)
            self.num_out_tokens = _to_cpu(self.num_out_tokens)
            if self.num_local_experts > 1 and not self.config.moe_permute_fusion:
                self.num_global_tokens_per_local_expert = _to_cpu(self.num_global_tokens_per_local_expert)
        return tokens_per_expert
    dispatcher._maybe_dtoh_and_synchronize = dtoh

    # 3. RNG states of the model-parallel tracker live in CPU generators
    _need(mrandom, "_get_cuda_rng_state")
    _need(mrandom, "_set_cuda_rng_state")
    tracker = _need(mrandom, "CudaRNGStatesTracker")
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_ or name in self.states_:
            raise Exception(f"rng state {name} / seed {seed} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()
    tracker.add = add

    @contextlib.contextmanager
    def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)
    tracker.fork = fork

    # 4. TransformerEngine's gemm does not exist here
    _need(moe_utils, "RouterGatingLinearFunction")
    moe_utils.te_general_gemm = None

    # 5. host copies of CPU tensors (numpy splits)
    _need(token_dispatcher, "maybe_move_tensor_to_cpu")
    token_dispatcher.maybe_move_tensor_to_cpu = lambda t, as_numpy=False, record_stream=False: _to_cpu(t, as_numpy)
    _applied = True


def _to_cpu(tensor, as_numpy: bool = False):
    if torch.is_tensor(tensor):
        tensor = tensor.cpu()
        return tensor.numpy() if as_numpy else tensor
    return tensor
