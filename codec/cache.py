"""Small JSON tables kvreel measures once per machine and keeps in
``$XDG_CACHE_HOME/kvreel`` (default ``~/.cache/kvreel``): the codec's tiling per
model shape, the fetch controller's decode-time profile."""

from __future__ import annotations

import json
import os
from pathlib import Path


def cache_file(name: str) -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "kvreel" / name


def read_json(path: Path) -> dict:
    """The table at ``path``; empty when it is missing or unreadable (a cache miss)."""
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def write_json(path: Path, table: dict) -> None:
    """Replace the table atomically (concurrent readers see the old or the new
    one); OSError when the cache is unwritable, which callers may ignore."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(table, indent=1))
    os.replace(tmp, path)
