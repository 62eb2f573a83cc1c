"""The DeepSpeed adapter: `CrossLayerGate` (a drop-in `TopKGate`) and `initialize` (a drop-in
`deepspeed.initialize`). Importing it imports deepspeed."""
from .engine import STATE_KEY, attach, find_moe_layers, initialize, swap_gates
from .gate import CrossLayerGate, unbias_gate_output

__all__ = ["initialize", "attach", "swap_gates", "find_moe_layers", "STATE_KEY", "CrossLayerGate", "unbias_gate_output"]
