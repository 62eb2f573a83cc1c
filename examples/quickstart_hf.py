"""docs/quickstart.md's Hugging Face script: an HF MoE model converted by DeepSpeed's AutoEP, balanced by
eb_deepspeed. Here a tiny random Mixtral from a config; put your own `AutoModelForCausalLM` in its place.

    source launch/setup_cpu.sh
    deepspeed --num_gpus 2 examples/quickstart_hf.py                       # 2 CPU ranks (DS_ACCELERATOR=cpu)
    EB_MODE=observe deepspeed --num_gpus 2 examples/quickstart_hf.py       # plain AutoEP routing, only watched
    eb report --compare runs/quickstart_hf/observe runs/quickstart_hf/balance
"""
import os

import deepspeed
import torch
import transformers
from deepspeed.moe.utils import configure_moe_param_groups

import eb_deepspeed

mode = os.environ.get("EB_MODE", "balance")
config = {
    "train_micro_batch_size_per_gpu": 8,
    "expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": "mixtral"},   # DeepSpeed's AutoEP
    "easybalance": {"enabled": True, "mode": mode, "log": {"dir": f"runs/quickstart_hf/{mode}", "interval": 2}},
}

deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
torch.manual_seed(0)
model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=128))
engine, _, _, _ = eb_deepspeed.initialize(
    model=model, config=config,          # AutoEP's expert parameter groups, a torch optimizer
    optimizer=lambda params: torch.optim.AdamW(configure_moe_param_groups(list(params)), lr=1e-3))
rank = torch.distributed.get_rank()
weights = torch.arange(1, 257, dtype=torch.float64).pow(-1.1)   # skewed token ids: the routers collapse unbalanced
for step in range(60):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.multinomial(weights, 8 * 64, replacement=True, generator=g).view(8, 64).to(engine.device)
    out = engine(input_ids=x, labels=x)           # the plain HF loop: the balance loss rides on the routes
    engine.backward(out.loss)
    engine.easybalance.note(lm_loss=out.loss.item())
    engine.step()
if rank == 0:
    m = engine.easybalance.metrics()
    print("expert max/mean per layer:", [round(v, 3) for v in m["expert_max_over_mean"]])
    print("busiest rank's load / mean per layer:", [round(v, 3) for v in m["device_max_over_mean"]])
engine.easybalance.close()
torch.distributed.barrier()
torch.distributed.destroy_process_group()
