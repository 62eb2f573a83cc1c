"""Reading files that may be hostile: only regular files (never a device, FIFO or socket, so never a hang or an
endless read), of bounded size, JSON of bounded depth. Every reader of a user's file (ds_config, balance logs,
traces, saved results) opens it through here.

    doc = load_json("ds.json", "a JSON DeepSpeed config")     # ValueError "ds.json: not a JSON ... (why)"
    with open_regular(path, max_bytes) as f: ...                  # binary, refused unless a regular file"""
from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from typing import Any

__all__ = []

MAX_JSON_BYTES = 64 * 2 ** 20   # one JSON document (a ds_config, a plan, a saved result): real ones are < 1 MiB
MAX_JSON_DEPTH = 100            # its nesting: a DeepSpeed config nests about 4 levels; ~300 break deepcopy


def open_regular(path, max_bytes: int | None = None):
    """`path` opened to read bytes, only when it is a regular file (a link is followed to its final target)
    of at most `max_bytes`: a device, FIFO, socket or directory is a ValueError, never a hang or an endless
    read. OSError when it cannot be opened."""
    _refuse_irregular(path, os.stat(path).st_mode)   # before the open: opening some devices does something
    # O_NONBLOCK: a FIFO swapped in since the stat cannot block the open (on a regular file it changes nothing)
    f = os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb")
    try:
        st = os.fstat(f.fileno())
        _refuse_irregular(path, st.st_mode)
        if max_bytes is not None and st.st_size > max_bytes:
            raise ValueError(f"{path} holds {st.st_size} bytes, more than the {_mib(max_bytes)} read from such a file")
    except ValueError:
        f.close()
        raise
    return f


def _refuse_irregular(path, mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a device or socket"
        raise ValueError(f"{path} is {kind}, not a regular file: only regular files are read")


def load_json(path, what: str, max_bytes: int = MAX_JSON_BYTES, object_pairs_hook=None) -> Any:
    """One JSON document from the regular file `path` of at most `max_bytes`, nested at most MAX_JSON_DEPTH
    deep; ValueError "PATH: not WHAT (the problem)" otherwise, OSError when it cannot be read."""
    with open_regular(path, max_bytes) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:                  # grown since it was opened
        raise ValueError(f"{path} holds more than the {_mib(max_bytes)} read from such a file")
    try:
        doc = json.loads(data.decode("utf-8"), object_pairs_hook=object_pairs_hook)
    except RecursionError:
        raise ValueError(f"{path}: not {what} (nested too deeply to parse)") from None
    except ValueError as e:                  # bad JSON or UTF-8, an integer of thousands of digits
        if type(e) not in (ValueError, json.JSONDecodeError, UnicodeDecodeError):
            raise                            # the hook's own error (a duplicate key in a ds_config) stands
        raise ValueError(f"{path}: not {what} ({e})") from None
    if too_deep := json_too_deep(doc):
        raise ValueError(f"{path}: not {what} (nested deeper than {MAX_JSON_DEPTH} levels, at {too_deep})")
    return doc


def json_too_deep(doc: Any, limit: int = MAX_JSON_DEPTH) -> str | None:
    """The path (`.key[3].key`) of the first dict or list nested `limit` deep in `doc`, or None. Iterative
    (no recursion to overflow); each container is visited once, so shared or self-holding dicts end."""
    containers = (Mapping, list, tuple)
    stack, seen = [(doc, 0, None)] if isinstance(doc, containers) else [], set()
    while stack:                               # entries: (container, depth, (key, parent's chain) or None)
        value, depth, chain = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if depth >= limit:
            keys = []
            while chain:
                keys, chain = [chain[0], *keys], chain[1]
            where = "".join(f".{k}" if isinstance(k, str) else f"[{k}]" for k in keys)
            return clip(where)
        items = value.items() if isinstance(value, Mapping) else enumerate(value)
        stack.extend((v, depth + 1, (k, chain)) for k, v in items if isinstance(v, containers))
    return None


def clip(text: str, limit: int = 60) -> str:
    """`text` cut to `limit` characters for a message (a hostile value can be huge)."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2 ** 20:g} MiB" if nbytes >= 2 ** 20 else f"{nbytes} bytes"
