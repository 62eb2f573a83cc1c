"""The size of the house: package lines, names in the submodules' `__all__`, config keys, markdown.

    python -m benchmarks.size            # one JSON object

lines: every line of eb_deepspeed/**/*.py; names: the entries of every submodule's `__all__` (the root's
aside); keys: the leaf keys of the `easybalance` block (`EasyBalanceConfig().to_dict()`); markdown_kb: every
*.md of the checkout outside .venv/, runs/ and .git/, in KiB.
"""
from __future__ import annotations

import glob
import importlib
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def size() -> dict:
    from eb_deepspeed.core.config import EasyBalanceConfig

    def leaves(d):
        return sum(leaves(v) if isinstance(v, dict) else 1 for v in d.values())
    files = sorted(glob.glob(os.path.join(ROOT, "eb_deepspeed", "**", "*.py"), recursive=True))
    lines = sum(sum(1 for _ in open(p, encoding="utf-8")) for p in files)
    names = 0
    for p in files:
        module = os.path.relpath(p, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
        if module != "eb_deepspeed":
            names += len(getattr(importlib.import_module(module), "__all__", []))
    markdown = [p for p in glob.glob(os.path.join(ROOT, "**", "*.md"), recursive=True)
                if not os.path.relpath(p, ROOT).split(os.sep)[0] in (".venv", "runs", ".git")]
    return {"lines": lines, "names": names, "keys": leaves(EasyBalanceConfig().to_dict()),
            "markdown_kb": round(sum(os.path.getsize(p) for p in markdown) / 1024, 1),
            "targets": {"lines_le_9000": lines <= 9000, "names_le_120": names <= 120,
                        "keys_le_26": leaves(EasyBalanceConfig().to_dict()) <= 26}}


if __name__ == "__main__":
    print(json.dumps(size()))
