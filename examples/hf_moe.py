"""Tiny Hugging Face MoE language models from configs (random weights, no downloads), for DeepSpeed's AutoEP.

Used by `train_hf_moe.py`, the tests and `python -m benchmarks train --framework autoep`. Shape legend: B batch, S sequence.

    model = hf_moe_model("mixtral", layers=4, hidden=64, experts=8, k=2)      # or "qwen3_moe", "deepseek_v3"
    ds_config["expert_parallel"] = autoep_section("mixtral", ep_size=2)
    x_BS = zipf_tokens(batch=4, seq_len=64, generator=g)                     # skewed token ids (or StdlibCorpus)
"""
from __future__ import annotations

import torch

__all__ = ["FAMILIES", "hf_moe_model", "autoep_section", "zipf_tokens", "VOCAB"]

VOCAB = 256          # byte-level: the stdlib corpus's bytes, or Zipf-distributed ids over as many tokens
FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")


def hf_moe_model(family: str = "mixtral", *, layers: int = 4, hidden: int = 64, experts: int = 8, k: int = 2,
                 ffn: int = 128, seq_len: int = 128, router_aux_loss_coef: float | None = None):
    """A randomly initialised HF causal LM of `family` (seed torch first). router_aux_loss_coef: None keeps
    HF's own load-balancing loss off (output_router_logits false); a number turns it on with that
    coefficient (Mixtral / Qwen3-MoE; DeepSeek-V3 has none)."""
    import transformers as tf
    common = dict(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=max(128, seq_len), num_experts_per_tok=k,
                  tie_word_embeddings=False)
    aux = {} if router_aux_loss_coef is None else {"output_router_logits": True,
                                                   "router_aux_loss_coef": router_aux_loss_coef}
    if family == "mixtral":
        config = tf.MixtralConfig(intermediate_size=ffn, num_local_experts=experts, **aux, **common)
        return tf.MixtralForCausalLM(config)
    if family == "qwen3_moe":
        config = tf.Qwen3MoeConfig(intermediate_size=ffn, moe_intermediate_size=ffn, num_experts=experts,
                                   decoder_sparse_step=1, mlp_only_layers=[], head_dim=hidden // 4, **aux, **common)
        return tf.Qwen3MoeForCausalLM(config)
    if family == "deepseek_v3":
        if aux:
            raise ValueError("DeepSeek-V3 has no HF load-balancing loss (router_aux_loss_coef must be None)")
        config = tf.DeepseekV3Config(intermediate_size=ffn, moe_intermediate_size=ffn, n_routed_experts=experts,
                                     n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=0,
                                     kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                     v_head_dim=16, routed_scaling_factor=1.0,
                                     **{**common, "num_key_value_heads": 4})    # MLA: no grouped KV heads
        return tf.DeepseekV3ForCausalLM(config)
    raise ValueError(f"family ({family!r}) must be one of: {', '.join(FAMILIES)}")


def autoep_section(family: str = "mixtral", ep_size: int = 2) -> dict:
    """The ds_config's `expert_parallel` section that converts `family` with AutoEP over `ep_size` ranks."""
    return {"enabled": True, "autoep_size": ep_size, "preset_model": family}


def zipf_tokens(batch: int, seq_len: int, generator: torch.Generator, exponent: float = 1.1) -> torch.Tensor:
    """[B, S] token ids drawn i.i.d. from a Zipf law over VOCAB ids (id r has weight 1 / (r + 1)^exponent):
    skewed input that drives the routers to collapse without balancing."""
    weights_V = torch.arange(1, VOCAB + 1, dtype=torch.float64).pow(-exponent)
    return torch.multinomial(weights_V, batch * seq_len, replacement=True, generator=generator).view(batch, seq_len)
