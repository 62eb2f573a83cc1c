"""docs/quickstart.md's own script: a 3-layer MoE model of your own, balanced by eb_deepspeed.

    source launch/setup_cpu.sh
    deepspeed --num_gpus 2 examples/quickstart_moe.py                      # 2 CPU ranks (DS_ACCELERATOR=cpu)
    EB_MODE=observe deepspeed --num_gpus 2 examples/quickstart_moe.py      # the same, only watched
    eb report runs/quickstart/balance                                      # the PNGs of one run
    eb report --compare runs/quickstart/observe runs/quickstart/balance    # did it help?
"""
import os

import deepspeed
import torch
from deepspeed.moe.layer import MoE

import eb_deepspeed

config = {
    "train_micro_batch_size_per_gpu": 8,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "easybalance": {"enabled": True, "mode": os.environ.get("EB_MODE", "balance"),
                    "log": {"dir": f"runs/quickstart/{os.environ.get('EB_MODE', 'balance')}", "interval": 2}},
}


class Model(torch.nn.Module):
    """Three MoE layers (8 experts, top-2, expert parallel over the 2 ranks) on a toy regression."""

    def __init__(self, hidden=32, experts=8, ep_size=2):
        super().__init__()
        self.moes = torch.nn.ModuleList(
            MoE(hidden, torch.nn.Sequential(torch.nn.Linear(hidden, 64), torch.nn.GELU(), torch.nn.Linear(64, hidden)),
                num_experts=experts, ep_size=ep_size, k=2) for _ in range(3))

    def forward(self, x):
        aux = []
        for moe in self.moes:
            out, l_aux, _ = moe(x)
            x = x + out
            aux.append(l_aux)
        return x, aux


deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
torch.manual_seed(0)
model = Model()
engine, _, _, _ = eb_deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
rank = torch.distributed.get_rank()
target = torch.nn.Linear(32, 32)              # the function to learn (the same on every rank: seeded above)
skew = torch.randn(32) * 2                    # inputs leaning one way: routing starts skewed
for step in range(40):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = (torch.randn(8, 16, 32, generator=g) + skew).to(engine.device)
    y, aux = engine(x)
    loss = torch.nn.functional.mse_loss(y, target(x).detach())
    engine.backward(loss + 0.01 * sum(aux))
    engine.easybalance.note(lm_loss=loss.item())      # the loss beside the balance curves
    engine.step()
if rank == 0:
    m = engine.easybalance.metrics()
    print("device max/mean per layer:", [round(v, 3) for v in m["device_max_over_mean"]])
