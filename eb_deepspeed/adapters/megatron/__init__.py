"""Megatron-Core adapter: `attach(model, config, optimizer=...)`, the `EBRouter` class and `eb_router_spec`."""
from .attach import attach, find_routers, load_state, save_state
from .router import EBRouter, eb_router_spec

__all__ = ["attach", "save_state", "load_state", "EBRouter", "eb_router_spec"]
