"""Tools: the `eb` command (`cli`: `eb report`, `eb plan`). The benchmarks run from a checkout: `python -m benchmarks`."""
__all__ = []
