"""Megatron-Core adapter: `attach(model, config, optimizer=...)` and the `EBRouter` spec class."""
from .attach import attach, find_routers, load_state, save_state
from .router import EBRouter

__all__ = ["attach", "find_routers", "save_state", "load_state", "EBRouter"]
