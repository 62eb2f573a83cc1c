"""The size of the house: package lines, names in the submodules' `__all__`, config keys, markdown, the README,
and the import circles of the package and of benchmarks/.

    python -m benchmarks.size            # one JSON object

lines: every line of eb_deepspeed/**/*.py; names: the entries of every submodule's `__all__` (the root's
aside); keys: the leaf keys of the `easybalance` block (`EasyBalanceConfig().to_dict()`); markdown_kb: every
*.md of the checkout outside .venv/, runs/ and .git/, in KiB; readme_bytes: README.md; circles: per tree, each
import circle among its modules as "a -> b -> a" (function-level imports count; tests/test_layout.py checks the
package's layers with the same graph).
"""
from __future__ import annotations

import ast
import glob
import importlib
import json
import os

__all__ = ["size", "modules", "imports_of", "import_graph", "circles"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = {"lines": 9000, "names": 120, "keys": 25, "markdown_kb": 120, "readme_bytes": 8192}


def modules(top: str) -> dict[str, str]:
    """{dotted module name: path} of every *.py under the package directory `top` (`a/b/__init__.py` is `a.b`)."""
    found = {}
    for path in sorted(glob.glob(os.path.join(top, "**", "*.py"), recursive=True)):
        found[os.path.relpath(path, os.path.dirname(top))[:-3].replace(os.sep, ".").removesuffix(".__init__")] = path
    return found


def imports_of(module: str, path: str, known=frozenset()) -> set[str]:
    """Absolute names of every module the file `path` of `module` imports anywhere (function-level imports too).
    `from pkg import mod` counts as importing `pkg.mod` when that is one of the `known` modules."""
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            submodules = {f"{base}.{a.name}" for a in node.names} & set(known)
            out |= submodules if submodules else {base}
    return out


def import_graph(top: str) -> dict[str, set[str]]:
    """{module: the other modules under `top` it imports} for the package directory `top`."""
    mods = modules(top)
    return {m: {i for i in imports_of(m, path, set(mods)) if i in mods and i != m} for m, path in mods.items()}


def circles(graph: dict[str, set[str]]) -> list[str]:
    """The import circles of `graph` ({module: the modules it imports}): "a -> b -> a", one for each edge back to a
    module a depth-first walk is still inside ([] for none)."""
    state, found = {}, []

    def visit(node, path):
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                found.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def size() -> dict:
    from eb_deepspeed.core.config import EasyBalanceConfig

    def leaves(d):
        return sum(leaves(v) if isinstance(v, dict) else 1 for v in d.values())
    files = modules(os.path.join(ROOT, "eb_deepspeed"))
    lines = sum(sum(1 for _ in open(p, encoding="utf-8")) for p in files.values())
    names = sum(len(getattr(importlib.import_module(m), "__all__", [])) for m in files if m != "eb_deepspeed")
    markdown = [p for p in glob.glob(os.path.join(ROOT, "**", "*.md"), recursive=True)
                if not os.path.relpath(p, ROOT).split(os.sep)[0] in (".venv", "runs", ".git")]
    found = {"lines": lines, "names": names, "keys": leaves(EasyBalanceConfig().to_dict()),
             "markdown_kb": round(sum(os.path.getsize(p) for p in markdown) / 1024, 1),
             "readme_bytes": os.path.getsize(os.path.join(ROOT, "README.md"))}
    tangles = {top: circles(import_graph(os.path.join(ROOT, top))) for top in ("eb_deepspeed", "benchmarks")}
    targets = {f"{key}_le_{limit}": found[key] <= limit for key, limit in TARGETS.items()}
    return {**found, "circles": tangles, "targets": {**targets, "no_circles": not any(tangles.values())}}


if __name__ == "__main__":
    print(json.dumps(size()))
