"""The package's architecture, checked from its source: layers import only downwards, no cycles, and
the core never imports a framework."""
import ast
import importlib
import os

import pytest

import eb_deepspeed

pytestmark = pytest.mark.unit
PACKAGE = os.path.dirname(eb_deepspeed.__file__)

# What each layer may import from the package (docs/design.md, "Layout"). The top-level
# `eb_deepspeed/__init__.py` re-exports the public surface and may import any layer.
ALLOWED = {
    "core": {"core"},
    "planning": {"core", "planning"},
    "observe": {"core", "observe"},
    "adapters": {"core", "planning", "observe", "adapters"},
    "tools": {"core", "planning", "observe", "adapters", "tools"},
}
FRAMEWORKS = ("deepspeed", "megatron")


def module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
    return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def imports_of(path: str, known: set[str] = frozenset()) -> set[str]:
    """Absolute names of every module imported anywhere in the file (function-level imports too).
    `from pkg import mod` counts as importing `pkg.mod` when that is one of the `known` modules."""
    name = module_name(path)
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            submodules = {f"{base}.{a.name}" for a in node.names} & set(known)
            out |= submodules if submodules else {base}
    return out


def modules() -> dict[str, str]:
    found = {}
    for root, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                found[module_name(os.path.join(root, f))] = os.path.join(root, f)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: {i for i in imports_of(path, set(mods)) if i in mods and i != m} for m, path in mods.items()}


def test_every_layer_imports_only_the_layers_below_it():
    bad = []
    for mod, deps in graph().items():
        parts = mod.split(".")
        if len(parts) < 2 or parts[1] not in ALLOWED:
            continue
        for dep in deps:
            layer = dep.split(".")[1] if dep.count(".") else "(top level)"
            if layer not in ALLOWED[parts[1]]:
                bad.append(f"{mod} -> {dep}")
    assert not bad, bad


def test_the_core_imports_neither_deepspeed_nor_megatron():
    for mod, path in modules().items():
        if mod.startswith("eb_deepspeed.core"):
            hits = [i for i in imports_of(path) if i.split(".")[0] in FRAMEWORKS]
            assert not hits, f"{mod} imports {hits}"


ADAPTERS = ("deepspeed", "autoep", "megatron", "serving")     # common.py is the kit every adapter may use


def _adapter(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "adapters" and parts[2] in ADAPTERS else None


def test_no_adapter_imports_another_adapters_private_names():
    bad = []
    for mod, path in modules().items():
        if _adapter(mod) is None:
            continue
        package = mod if path.endswith("__init__.py") else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.ImportFrom) and node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                other = _adapter(base)
                private = [a.name for a in node.names if a.name.startswith("_")]
                if other is not None and other != _adapter(mod) and private:
                    bad.append(f"{mod} imports {private} from {base}")
    assert not bad, bad


def test_the_serving_engine_and_its_store_protocol_import_no_framework_and_no_adapter():
    for name in ("eb_deepspeed.adapters.serving.engine", "eb_deepspeed.adapters.serving.store"):
        deps = imports_of(modules()[name], set(modules()))
        frameworks = [i for i in deps if i.split(".")[0] in FRAMEWORKS + ("transformers", )]
        adapters = [i for i in deps if _adapter(i) not in (None, "serving")]
        assert not frameworks and not adapters, (name, frameworks, adapters)


def test_the_import_graph_has_no_cycle():
    g = graph()
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for dep in g[node]:
            if state.get(dep) == 1:
                raise AssertionError(" -> ".join(stack + [node, dep]))
            if dep not in state:
                visit(dep, stack + [node])
        state[node] = 2

    for node in g:
        if node not in state:
            visit(node, [])


def test_the_public_surface_of_the_design_is_importable_from_the_top_level():
    names = ["initialize", "init_inference", "EasyBalanceConfig", "ConfigError", "metrics", "plan_placement", "steer",
             "load_trace"]
    for name in names:
        assert getattr(importlib.import_module("eb_deepspeed"), name) is not None, name
    assert set(names) <= set(eb_deepspeed.__all__)


def test_the_metrics_contract_imports_as_a_module_and_is_the_core_s_one():
    import eb_deepspeed.core.metrics as core_metrics
    import eb_deepspeed.metrics as contract_metrics
    from eb_deepspeed import metrics as attribute_metrics
    from eb_deepspeed.metrics import max_over_mean
    assert contract_metrics is core_metrics is attribute_metrics
    assert max_over_mean is core_metrics.max_over_mean
