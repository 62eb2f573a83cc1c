"""The package's architecture, checked from its source: layers import only downwards, no cycles (none in
benchmarks/ either), and the core never imports a framework; `python -m benchmarks.size` reports the same graph."""
import ast
import importlib
import os

import pytest

import eb_deepspeed
from benchmarks import size
from benchmarks.size import circles, imports_of

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


def modules() -> dict[str, str]:
    return size.modules(PACKAGE)


def graph() -> dict[str, set[str]]:
    return size.import_graph(PACKAGE)


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
            hits = [i for i in imports_of(mod, path) if i.split(".")[0] in FRAMEWORKS]
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
    name = "eb_deepspeed.adapters.serving.engine"       # the `SlotStore` protocol lives there too
    deps = imports_of(name, modules()[name], set(modules()))
    frameworks = [i for i in deps if i.split(".")[0] in FRAMEWORKS + ("transformers", )]
    adapters = [i for i in deps if _adapter(i) not in (None, "serving")]
    assert not frameworks and not adapters, (frameworks, adapters)


def test_the_import_graph_has_no_cycle():
    assert circles(graph()) == []


def test_benchmarks_have_no_import_circle_main_dispatches_and_nothing_imports_it_back():
    bench = size.import_graph(os.path.join(os.path.dirname(PACKAGE), "benchmarks"))
    assert circles(bench) == []
    assert [m for m, deps in bench.items() if "benchmarks.__main__" in deps] == []


def test_a_circle_is_named_by_its_modules_and_each_one_is_found():
    # a leads into b <-> c; d -> e -> f -> d; g imports into both: two circles, neither a nor g in one
    g = {"a": {"b"}, "b": {"c"}, "c": {"b"}, "d": {"e"}, "e": {"f"}, "f": {"d"}, "g": {"a", "e"}}
    assert circles(g) == ["b -> c -> b", "d -> e -> f -> d"]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_benchmarks_size_reports_the_readme_and_both_trees_circles_against_its_targets(monkeypatch):
    found, root = size.size(), os.path.dirname(PACKAGE)
    readme = os.path.getsize(os.path.join(root, "README.md"))
    trees = {top: circles(size.import_graph(os.path.join(root, top))) for top in ("eb_deepspeed", "benchmarks")}
    assert found["readme_bytes"] == readme and found["circles"] == trees
    assert found["targets"] == {"lines_le_9000": found["lines"] <= 9000, "names_le_120": found["names"] <= 120,
                                "keys_le_25": found["keys"] <= 25, "markdown_kb_le_120": found["markdown_kb"] <= 120,
                                "readme_bytes_le_8192": readme <= 8192, "no_circles": not any(trees.values())}
    monkeypatch.setattr(size, "circles", lambda graph: ["a -> b -> a"] if "benchmarks.ranks" in graph else [])
    tangled = size.size()
    assert tangled["circles"] == {"eb_deepspeed": [], "benchmarks": ["a -> b -> a"]}
    assert tangled["targets"]["no_circles"] is False


def test_the_public_surface_of_the_design_is_importable_from_the_top_level():
    names = ["initialize", "init_inference", "EasyBalanceConfig", "ConfigError", "metrics", "plan_placement", "steer",
             "load_trace"]
    for name in names:
        assert getattr(importlib.import_module("eb_deepspeed"), name) is not None, name
    assert set(names) <= set(eb_deepspeed.__all__)


def test_the_metrics_contract_is_the_cores_module_as_an_attribute_of_the_package():
    import eb_deepspeed.core.metrics as core_metrics
    from eb_deepspeed import metrics as attribute_metrics
    assert attribute_metrics is core_metrics is eb_deepspeed.metrics
    assert attribute_metrics.max_over_mean is core_metrics.max_over_mean
    assert not (__import__("pathlib").Path(eb_deepspeed.__file__).parent / "metrics.py").exists()   # no shim