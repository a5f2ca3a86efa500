"""Building a node mirror's version of a step: the leader's work (see :mod:`.leader`), or the calling
thread's for a mirror that cannot spawn one (``memory://`` stores)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

from deltasync._util import gcpause
from deltasync.errors import InventoryMismatch
from deltasync.fetcher import DeltaFetcher, SyncJournal
from deltasync.protocol import TensorChange
from deltasync.serving.node.datafiles import Carver, map_writable
from deltasync.serving.node.lock import NodeLock
from deltasync.serving.node.store import COMPACT_BELOW, VersionStore
from deltasync.serving.node.versions import (
    PACK_ALIGN,
    PositionsRef,
    Version,
    VersionFile,
    changed_positions,
    step_id,
    trim_heap,
)

__all__ = ["POSITIONS_DENSITY", "SYNC_FIELDS", "BuildInfo", "build", "build_locked", "builder_fetcher"]

if TYPE_CHECKING:
    import torch

log = logging.getLogger("deltasync.node")

#: a tensor whose changed elements are at most this fraction of it gets a positions file (the engine
#: may then write only those elements); beyond it, copying the whole tensor is as cheap
POSITIONS_DENSITY = 0.3
#: the :class:`~deltasync.fetcher.SyncStats` fields a leader reports
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


def builder_fetcher(fetcher: DeltaFetcher, max_bytes: int | None) -> DeltaFetcher:
    """A fetcher of the builds' own that reads ``fetcher``'s run the same way (its store, checks and
    reader: one manifest cache) and allocates at most ``max_bytes`` (default: as ``fetcher`` does)
    for a version built from the run's inventory; ``fetcher`` itself is left as it is."""
    return DeltaFetcher(
        fetcher.store,
        verify=fetcher.verify,
        reader=fetcher.reader,
        fold=fetcher.fold,
        threads=fetcher.threads,
        progress=fetcher.progress,
        max_alloc_bytes=fetcher.max_alloc_bytes if max_bytes is None else max_bytes,
    )


def build_locked(
    versions: VersionStore,
    fetcher: DeltaFetcher,
    step: int,
    *,
    phase: Callable[[str], None] = lambda _: None,
    timeout: float,
    stop: threading.Event | None = None,
) -> Mapping[str, object]:
    """Under the node lock (waiting up to ``timeout``, or until ``stop``): :func:`build` unless the
    version of ``step`` exists by then (``{}``); collects before and after, and says who builds in
    ``building.json`` meanwhile."""
    lock = NodeLock(versions.dir / "lock")
    lock.acquire(timeout, stop)
    try:
        if versions.version(step) is not None:  # built while this one waited for the lock
            return {}
        versions.collect()
        versions.mark_building(step, "waiting")
        try:
            with gcpause.paused():  # ~10 objects per tensor: no full collection per few thousand of them
                return build(versions, fetcher, step, phase)
        finally:
            versions.done_building()
    finally:
        try:
            versions.collect()
        finally:
            lock.release()


class BuildInfo(TypedDict):
    """What one build did and cost (a version's ``stats``; a leader's answer)."""

    #: the version it was built from (None: from the run's anchor)
    base: str | None
    tensors_written: int
    #: the pack the changed tensors were copied into before the sync (None: none)
    pack: str | None
    bytes_written: int
    #: bytes read from the store, and the sync's stats (:data:`SYNC_FIELDS`)
    store_bytes: int
    sync: dict[str, object]
    seconds: float
    #: the build's own work: CPU seconds of this process (all its threads) while it built
    cpu_s: float
    pid: int


@dataclass
class _Build:
    """One build as it goes: the version it starts from, the tensors the sync writes into (by name),
    the pack the tensors it is expected to change were copied into, and the sync's journal."""

    base: Version | None
    view: dict[str, torch.Tensor] = field(default_factory=dict)
    packed: dict[str, VersionFile] = field(default_factory=dict)
    journal: SyncJournal = field(default_factory=SyncJournal)


@dataclass(frozen=True, slots=True)
class _Written:
    """The entries of the new version, once its data files are written."""

    files: dict[str, VersionFile]
    written: set[str]
    new: int
    positions: dict[str, PositionsRef]
    moved: dict[str, VersionFile]


def build(
    versions: VersionStore, fetcher: DeltaFetcher, step: int, phase: Callable[[str], None] = lambda _: None
) -> BuildInfo:
    """Build the node's version of ``step`` from its newest version, reading the run with ``fetcher``
    (the build's own: see :func:`builder_fetcher`); the caller holds the lock. Only the tensors the
    step changed get new data, in one pack file: the ones the step's manifests say it changes are
    copied from the base version into the pack first and the step is applied there in place (no
    copy-on-write fault per page, no second write); any other tensor the sync wrote goes to a second
    pack after it. ``phase`` hears of each phase."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    b = _start(versions, fetcher, step, phase)
    _sync(b, fetcher, step)
    phase("synced")
    w = _write(versions, b, phase)
    stats = fetcher.last_stats
    info: BuildInfo = {
        "base": None if b.base is None else b.base.id,
        "tensors_written": w.new,
        "pack": next(iter(b.packed.values())).name if b.packed else None,
        "bytes_written": versions.file_bytes({n: w.files[n] for n in w.written if n in w.files}),
        "store_bytes": 0 if stats is None else stats.nbytes,
        "sync": {} if stats is None else {f: getattr(stats, f) for f in SYNC_FIELDS},
        "seconds": round(time.perf_counter() - t0, 4),
        "cpu_s": round(time.process_time() - cpu0, 4),
        "pid": os.getpid(),
    }
    phase("publish")
    base_id = None if b.base is None else b.base.id
    versions.publish(step_id(step), step, w.files, info, base_id, w.positions, w.moved)
    del b, w  # the sync's tensors and journal: unmapped before the heap is trimmed
    trim_heap()
    return info


def _start(versions: VersionStore, fetcher: DeltaFetcher, step: int, phase: Callable[[str], None]) -> _Build:
    """The build's start: its base (the newest current version not past ``step``), the tensors the step
    is expected to change (and those left alone in packs it would keep alive) copied into a new pack,
    and every tensor mapped for the sync (the pack's shared and writable, the rest copy-on-write)."""
    candidates = [v for v in versions.all_versions() if v.step is None or (v.step <= step and versions.current(v))]
    base = max(candidates, key=lambda v: (v.step is not None, v.step or 0), default=None)
    phase("start")
    b = _Build(base)
    if base is not None:
        expected = _expected(fetcher, base, step)
        ahead = [*expected, *_to_compact(versions, base, set(expected))]
        if ahead:
            b.packed = versions.copy_pack(base, ahead)
            phase("wrote")
        b.view = base.tensors([n for n in base.files if n not in b.packed])  # the rest: mapped copy-on-write
        if b.packed:
            b.view.update(_map_pack(versions, b.packed))
    return b


def _sync(b: _Build, fetcher: DeltaFetcher, step: int) -> None:
    """Apply the run up to ``step`` onto the build's tensors (from its anchor when the base turns out to
    be an engine checkpoint of another layout)."""
    try:
        fetcher.sync(b.view, step, have_step=b.base.step if b.base is not None else None, journal=b.journal)
    except InventoryMismatch:
        if b.base is None:
            raise
        # the newest version is an engine checkpoint of another layout: start from the run's inventory
        log.warning("the node's newest version is not this run's layout: building step %d from its anchor", step)
        b.base, b.view, b.journal, b.packed = None, {}, SyncJournal(), {}
        fetcher.sync(b.view, step, journal=b.journal)


def _write(versions: VersionStore, b: _Build, phase: Callable[[str], None]) -> _Written:
    """The new version's entries: the base's, with what the sync changed in the pack (or in a second
    pack, for what it wrote outside it), the positions of the sparse changes, and the tensors compacted
    into the pack unchanged (``moved``)."""
    base, view, packed = b.base, b.view, b.packed
    files: dict[str, VersionFile] = dict(base.files) if base is not None else {}
    written = set(b.journal.names) if base is not None else set(view)
    rest: list[str] = []  # written by the sync outside the pack
    sparse: list[tuple[str, Any, int]] = []
    new = 0
    for name in sorted(written):
        tensor = view[name]
        had = None if base is None else base.files.get(name)
        if base is not None and had is not None and had.holds_layout_of(tensor):
            changed = _positions(b.journal.changes.get(name), base, name, tensor)
            if changed.size == 0:
                continue  # rewritten with the same bits (an anchor over a version that has them)
            if changed.size <= POSITIONS_DENSITY * tensor.numel():
                sparse.append((name, changed, tensor.numel()))
        if name in packed:
            files[name] = packed[name]
        else:
            rest.append(name)
        new += 1
    moved: dict[str, VersionFile] = {}
    for name, entry in packed.items():  # compacted (or expected and not written): the pack's copy
        if name not in written and base is not None and name in base.files:
            moved[name] = base.files[name]
            files[name] = entry
    if rest:
        files.update(versions.write_pack((n, view[n]) for n in rest))
        phase("wrote")
    positions = versions.write_positions(sparse) if sparse else {}
    for name in [n for n in files if n not in view]:
        del files[name]
    return _Written(files, written, new, positions, moved)


def _expected(fetcher: DeltaFetcher, base: Version, step: int) -> list[str]:
    """The tensors of ``base`` a sync from it to ``step`` is expected to write
    (:meth:`DeltaFetcher.expected_changes`; none where the plan loads an anchor or base is of no step)."""
    if base.step is None:
        return []
    names = fetcher.expected_changes(base.step, step)
    return [] if names is None else [n for n in names if n in base.files]


def _to_compact(versions: VersionStore, base: Version, moving: set[str]) -> list[str]:
    """The tensors of ``base`` (not ``moving`` to the new pack) that lie in packs of which the new
    version would name less than :data:`COMPACT_BELOW` of the pages: copied into the new pack so
    that those packs can go (the version says they moved with their bits, ``Version.moved``: an
    engine does not load them again; the copy is paid only by steps that leave most of a pack alone)."""
    named: dict[str, list[str]] = {}
    for name, f in base.files.items():
        if name not in moving:
            named.setdefault(f.name, []).append(name)
    out: list[str] = []
    for file, names in named.items():
        entry = base.files[names[0]]
        if len(names) == 1 and entry.offset == 0 and not file.endswith(".pack"):
            continue  # a format-1 file of one tensor: all of it is named
        try:
            size = versions.file_size(file)
        except FileNotFoundError:
            continue  # the sync will say what is missing
        live = sum(-(-base.files[n].nbytes // PACK_ALIGN) * PACK_ALIGN for n in names)  # pages they take
        if live < COMPACT_BELOW * size:
            out.extend(names)
    return out


def _map_pack(versions: VersionStore, packed: dict[str, VersionFile]) -> dict[str, torch.Tensor]:
    """The tensors of a pack just written, mapped shared and writable: the sync applies into the pack."""
    import torch

    file = next(iter(packed.values())).name
    nbytes = max(e.offset + e.nbytes for e in packed.values())
    carve = Carver(map_writable(os.path.join(versions.data, file), nbytes)) if nbytes else None
    return {
        name: carve(e) if carve is not None and e.nbytes else torch.empty(e.shape, dtype=getattr(torch, e.dtype))
        for name, e in packed.items()
    }


def _positions(change: TensorChange | None, base: Version, name: str, tensor: Any) -> Any:
    """The flat positions (sorted, numpy) of ``name`` that the sync wrote since ``base``: the ones the
    fetcher reports it applied (the decoded patches' own, folded). Only where it wrote the whole
    tensor (an anchor loaded over the base version: it cannot tell which elements differ) are they
    found by comparing the tensor with the base's, bit by bit."""
    if change is not None and change.positions is not None:
        return change.positions
    return changed_positions(base.tensors([name])[name], tensor).numpy()
