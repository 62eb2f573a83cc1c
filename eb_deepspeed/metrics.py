"""`import eb_deepspeed.metrics` (DESIGN.md's contract name for the pinned metric definitions).

The definitions live in `eb_deepspeed.core.metrics`; this module puts that very module in its own place in
`sys.modules`, so `import eb_deepspeed.metrics`, `from eb_deepspeed import metrics` and
`eb_deepspeed.core.metrics` are one module object.
"""
import sys

from .core import metrics as _metrics

sys.modules[__name__] = _metrics
