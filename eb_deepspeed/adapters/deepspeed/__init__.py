"""The DeepSpeed adapter: `CrossLayerGate` (a drop-in `TopKGate`), `initialize` (a drop-in
`deepspeed.initialize`), and serving: `init_inference` (a drop-in `deepspeed.init_inference`) with
`ReplicaGate` on replicated layers (`MoEStore`, the serving engine's slot store). Importing it imports deepspeed."""
from .engine import attach, find_moe_layers, initialize, patch_deepspeed, swap_gates
from .gate import CrossLayerGate
from .replicas import ReplicaGate
from .serving import MoEStore, init_inference, load_moe_checkpoint

__all__ = ["initialize", "patch_deepspeed", "init_inference", "swap_gates", "CrossLayerGate", "load_moe_checkpoint"]
