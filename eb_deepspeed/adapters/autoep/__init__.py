"""The AutoEP adapter: Hugging Face MoE models converted by DeepSpeed's AutoEP (`expert_parallel` section),
balanced by `eb_deepspeed.initialize` like DeepSpeed-MoE models, and served with replicas by
`eb_deepspeed.init_inference` (`serving.py`, imported on its own: the serving engine's slot store of AutoEP's
layers). Importing it imports deepspeed."""
from .engine import attach, check_versions, expert_to_device, find_autoep_layers
from .layer import AutoEPBalance, attach_loss

__all__ = ["attach", "find_autoep_layers", "AutoEPBalance"]
