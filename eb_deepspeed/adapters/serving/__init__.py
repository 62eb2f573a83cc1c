"""Serving: one framework-neutral engine (`engine.ServingEngine`) over a runtime's slot store (`engine.SlotStore`),
and `init_inference`, the one door (AutoEP's layers: `adapters.autoep.serving`; DeepSpeed's MOELayer:
`adapters.deepspeed.serving`)."""
from __future__ import annotations

import torch

__all__ = ["init_inference"]


def init_inference(model: torch.nn.Module, config=None, **kwargs):
    """Serve `model` with the `easybalance` block of `config` (a dict or JSON path; the training ds_config works).

    A Hugging Face model that AutoEP converted: pass the engine `deepspeed.initialize` returned (or its module);
    returns the module in eval mode with `serving` (the `ServingEngine`) and, with an enabled block, `easybalance`
    (kwargs are refused: `deepspeed.init_inference` has no AutoEP path). A DeepSpeed-MoE model:
    `deepspeed.init_inference` made correct for expert parallelism (`adapters.deepspeed.serving.init_inference`,
    which takes its kwargs); returns DeepSpeed's InferenceEngine with the same attributes."""
    from ..autoep.serving import has_autoep_layers, init_autoep_inference
    if has_autoep_layers(model):
        if kwargs:
            raise TypeError(f"init_inference: an AutoEP model is served as deepspeed.initialize converted it; "
                            f"{', '.join(sorted(kwargs))} would go to deepspeed.init_inference, which has no AutoEP path")
        return init_autoep_inference(model, config)
    from ..deepspeed.serving import init_inference as init_deepspeed_inference
    return init_deepspeed_inference(model, config, **kwargs)
