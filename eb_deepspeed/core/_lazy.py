"""Package attributes imported on first use, so `import eb_deepspeed` (and `eb --help`) does not pay
for torch, DeepSpeed or the simulator until a name that needs them is touched.

    __getattr__, __dir__ = lazy_exports(__name__, {"Balancer": ".core.balancer", "metrics": ".core.metrics"})

A name whose module path ends in the name itself is that submodule; any other name is the attribute of
that module with the same name."""
from __future__ import annotations

import importlib

__all__ = []


def lazy_exports(package: str, exports: dict[str, str]):
    """(__getattr__, __dir__) for `package`: each name in `exports` imported from its module on first use."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str):
        where = exports.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(where, package)
        value = module if where.rsplit(".", 1)[-1] == name else getattr(module, name)
        namespace[name] = value          # later lookups skip __getattr__
        return value

    def __dir__():
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
