"""``delta-upload``'s local baseline cache: one copy of the last pushed state per store.

Layout, under ``$XDG_CACHE_HOME/deltasync/upload/<16 hex of the store URL's xxh3>/`` (or ``--cache DIR``):

* ``state.safetensors``: the state pushed last (after ``--cast``), the next upload's baseline;
* ``state.json``: ``{"step", "manifest_digest", "store"}``, written last: the cache is valid only
  with it, and only for that step of that store.

That is the only copy kept. Without a valid cache (first upload on this machine, another
machine pushed since, ``--no-cache``) the baseline is synced from the store straight into memory
(never written to disk). Earlier versions materialized it into ``materialized/`` and kept that
second copy forever: :func:`drop_legacy_materialized` removes it (only the files deltasync wrote).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from deltasync.protocol import xxh3_128

__all__ = [
    "CACHE_FILES",
    "cache_dir",
    "cache_size",
    "cached_baseline",
    "drop_cache",
    "drop_legacy_materialized",
    "write_cache",
]

CACHE_FILES = ("state.json", "state.json.tmp", "state.safetensors", "state.safetensors.tmp")
LEGACY_DIR = "materialized"


def cache_dir(store_url: str, override: str | None) -> Path:
    """The cache dir of ``store_url``: ``override``, else under ``$XDG_CACHE_HOME`` (``~/.cache``)."""
    if override:
        return Path(override)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "deltasync" / "upload" / xxh3_128(store_url.encode())[:16]


def cached_baseline(cache: Path, store_url: str, step: int) -> dict[str, Any] | None:
    """The cached state when it is the one of committed ``step`` of ``store_url`` (memory-mapped), else None."""
    from deltasync._util.checkpoint_io import load_checkpoint
    from deltasync.errors import DeltaSyncError

    try:
        meta = json.loads((cache / "state.json").read_text())
        if isinstance(meta, dict) and meta.get("step") == step and meta.get("store") == store_url:
            return load_checkpoint(cache / "state.safetensors", mmap=True)
    except (OSError, ValueError, DeltaSyncError):
        pass
    return None


def write_cache(cache: Path, state: dict[str, Any], info: Any, store_url: str) -> None:
    """Keep the pushed state as the next upload's baseline; ``state.json`` (written last) makes it valid."""
    from deltasync._util.checkpoint_io import save_checkpoint

    meta = cache / "state.json"
    meta.unlink(missing_ok=True)  # the cache of the previous step stops being valid first
    save_checkpoint(state, cache / "state.safetensors")
    gate = os.environ.get("DELTASYNC_TEST_CACHE_GATE")
    if gate:  # test hook: hold here, the cache half written, until that file exists
        print(f"test hook: waiting for {gate}", file=sys.stderr, flush=True)
        while not os.path.exists(gate):
            time.sleep(0.01)
    tmp = cache / "state.json.tmp"
    tmp.write_text(json.dumps({"step": info.step, "manifest_digest": info.manifest_digest, "store": store_url}))
    os.replace(tmp, meta)


def drop_cache(cache: Path) -> None:
    """Remove the baseline cache's files, whole or partial (best effort; nothing else in the dir)."""
    for name in CACHE_FILES:  # the dir stays: a --cache dir may be the user's
        with contextlib.suppress(OSError):
            (cache / name).unlink(missing_ok=True)


def cache_size(cache: Path) -> int:
    """Bytes of the cache's own files."""
    total = 0
    for name in CACHE_FILES:
        with contextlib.suppress(OSError):
            total += (cache / name).stat().st_size
    return total


def drop_legacy_materialized(cache: Path, store_url: str) -> int:
    """Remove ``cache/materialized`` as earlier versions left it; returns the bytes freed.

    Only a dir whose ``.deltasync.json`` marker names ``store_url`` is touched, and in it only
    the marker, ``model.safetensors.index.json`` and the shards that index lists; the dir goes
    when nothing else is left in it.
    """
    from deltasync.protocol.checkpoint import INDEX_NAME

    old = cache / LEGACY_DIR
    try:
        marker = json.loads((old / ".deltasync.json").read_text())
        index = json.loads((old / INDEX_NAME).read_text())
        shards = sorted(set(index["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0
    if not isinstance(marker, dict) or marker.get("store") != store_url:
        return 0
    freed = 0
    for name in [*shards, INDEX_NAME, ".deltasync.json"]:
        path = old / name
        if not isinstance(name, str) or "/" in name or name.startswith("..") or not path.is_file():
            continue
        with contextlib.suppress(OSError):
            size = path.stat().st_size
            path.unlink()
            freed += size
    with contextlib.suppress(OSError):
        old.rmdir()
    return freed
