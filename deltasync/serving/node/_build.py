"""Building a node mirror's version of a step: the leader's work (see :mod:`.leader`), or the calling
thread's for a mirror that cannot spawn one (``memory://`` stores). The caller holds the node lock."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from deltasync.errors import InventoryMismatch
from deltasync.serving.node.versions import Version, changed_positions, step_id, trim_heap

__all__ = ["POSITIONS_DENSITY", "SYNC_FIELDS", "build"]

log = logging.getLogger("deltasync.node")

#: a tensor whose changed elements are at most this fraction of it gets a positions file (the engine
#: may then write only those elements); beyond it, copying the whole tensor is as cheap
POSITIONS_DENSITY = 0.3
#: the :class:`~deltasync.fetcher._stats.SyncStats` fields a leader reports
SYNC_FIELDS = (
    "step",
    "base_step",
    "steps",
    "spans",
    "span_fallbacks",
    "nbytes",
    "download_s",
    "decode_s",
    "verify_s",
    "apply_s",
    "total_s",
)


class Node(Protocol):
    """What a build needs of the :class:`~deltasync.serving.node.mirror.NodeMirror` it builds into
    (a protocol: the node calls this module, so this module does not import the node)."""

    fetcher: Any
    max_bytes: int | None
    data: Path

    def all_versions(self) -> list[Version]: ...

    def current(self, version: Version | None) -> bool: ...

    def _new_file(self, tensor: Any) -> tuple[str, str, tuple[int, ...]]: ...

    def _new_positions(self, positions: Any, numel: int) -> str: ...

    def _publish(
        self,
        vid: str,
        step: int | None,
        files: Mapping[str, tuple[str, str, tuple[int, ...]]],
        stats: Mapping[str, Any],
        base: str | None = None,
        positions: Mapping[str, str] | None = None,
    ) -> Version: ...


def build(node: Node, step: int, phase: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Build the node's version of ``step`` from its newest version (the leader's work; the caller holds
    the lock). Only the tensors the step changed get new data files. ``phase`` hears of each phase."""
    from deltasync.fetcher import SyncJournal

    t0 = time.perf_counter()
    candidates = [v for v in node.all_versions() if v.step is None or (v.step <= step and node.current(v))]
    base = max(candidates, key=lambda v: (v.step is not None, v.step or 0), default=None)
    phase("start")
    view: dict[str, Any] = base.tensors() if base is not None else {}
    journal = SyncJournal()
    fetcher = node.fetcher
    if node.max_bytes is not None:
        fetcher.max_alloc_bytes = node.max_bytes
    try:
        fetcher.sync(view, step, have_step=base.step if base is not None else None, journal=journal)
    except InventoryMismatch:
        if base is None:
            raise
        # the newest version is an engine checkpoint of another layout: start from the run's inventory
        log.warning("the node's newest version is not this run's layout: building step %d from its anchor", step)
        base, view, journal = None, {}, SyncJournal()
        fetcher.sync(view, step, journal=journal)
    phase("synced")
    files = dict(base.files) if base is not None else {}
    written = set(journal.names) if base is not None else set(view)
    new = 0
    positions: dict[str, str] = {}
    for name in sorted(written):
        tensor = view[name]
        layout = (str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))
        if base is not None and name in base.files and base.files[name][1:] == layout:
            changed = changed_positions(base.tensors([name])[name], tensor)
            if changed.numel() == 0:
                continue  # rewritten with the same bits (an anchor over a version that has them)
            if changed.numel() <= POSITIONS_DENSITY * tensor.numel():
                positions[name] = node._new_positions(changed, tensor.numel())
        files[name] = node._new_file(tensor)
        new += 1
        phase("wrote")
    for name in [n for n in files if n not in view]:
        del files[name]
    stats = fetcher.last_stats
    info = {
        "base": None if base is None else base.id,
        "tensors_written": new,
        "bytes_written": sum(node.data.joinpath(files[n][0]).stat().st_size for n in written if n in files),
        "store_bytes": 0 if stats is None else stats.nbytes,
        "sync": {} if stats is None else {f: getattr(stats, f) for f in SYNC_FIELDS},
        "seconds": round(time.perf_counter() - t0, 4),
        "pid": os.getpid(),
    }
    phase("publish")
    node._publish(step_id(step), step, files, info, None if base is None else base.id, positions)
    del view, journal
    trim_heap()
    return info
