"""One step on its way to the store (:class:`StepJob`), and folding a waiting step into a newer one
(``on_backlog="coalesce"``: :func:`merge_jobs`)."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

from deltasync.protocol import TensorInfo
from deltasync.uploader._diff import TensorDiff
from deltasync.uploader._pack import ChangeSet, PackedDiff

__all__ = ["StepJob", "changed_count", "merge_change_sets", "merge_changes", "merge_jobs"]
Bits = np.ndarray[Any, np.dtype[Any]]


@dataclass(slots=True)
class StepJob:
    """One step on its way to the store. Owns all the memory it references."""

    step: int
    kind: Literal["anchor", "patch"]
    inventory: tuple[TensorInfo, ...]
    changes: Mapping[str, TensorDiff] = field(default_factory=dict)  # a dict, or a packed ChangeSet
    snapshot: dict[str, Bits] = field(default_factory=dict)
    changed: int = 0
    total: int = 0
    digests: dict[str, str] = field(default_factory=dict)
    digests_ready: threading.Event = field(default_factory=threading.Event)
    staged: dict[str, Any] = field(default_factory=dict)  # patch: new flat bits, diffed in the background
    staged_packs: list[Any] = field(default_factory=list)  # patch: (pack, staging buffer), diffed likewise
    error: BaseException | None = None
    futures: list[tuple[int, Future[Any]]] = field(default_factory=list)


def merge_changes(a: TensorDiff, b: TensorDiff) -> TensorDiff | None:
    """Change ``a`` then change ``b`` of one tensor as one change (None when nothing is left changed)."""
    idx = np.concatenate([a.idx, b.idx])
    order = np.argsort(idx, kind="stable")
    idx_s = idx[order]
    first = np.ones(idx_s.size, dtype=bool)
    first[1:] = idx_s[1:] != idx_s[:-1]
    last = np.ones(idx_s.size, dtype=bool)
    last[:-1] = first[1:]
    old = np.concatenate([a.old, b.old])[order][first]
    new = np.concatenate([a.new, b.new])[order][last]
    keep = old != new
    if not keep.any():
        return None
    return TensorDiff(idx_s[first][keep], old[keep], new[keep])


def changed_count(changes: Mapping[str, TensorDiff]) -> int:
    """Elements changed in all (a packed set counts without making its tensors' changes)."""
    if isinstance(changes, ChangeSet):
        return changes.changed
    return sum(int(c.idx.size) for c in changes.values())


def merge_change_sets(a: Mapping[str, TensorDiff], b: Mapping[str, TensorDiff]) -> Mapping[str, TensorDiff]:
    """The changes of ``a`` then ``b`` as one set (elements that end where they started drop out).
    Two packed sets of the same packs merge pack by pack, each as one sorted array; anything else
    tensor by tensor."""
    if isinstance(a, ChangeSet) and isinstance(b, ChangeSet) and a.mergeable(b):
        by_pack: dict[int, PackedDiff] = {id(d.pack): d for d in a.packed}
        packed: list[PackedDiff] = []
        for d in b.packed:
            prev = by_pack.pop(id(d.pack), None)
            if prev is None:
                packed.append(d)
                continue
            m = merge_changes(TensorDiff(prev.idx, prev.old, prev.new), TensorDiff(d.idx, d.old, d.new))
            if m is not None:
                packed.append(PackedDiff.of(d.pack, m.idx, m.old, m.new))
        packed.extend(by_pack.values())
        return ChangeSet(packed, _merge_dicts(a.other, b.other))
    return _merge_dicts(a, b)


def _merge_dicts(a: Mapping[str, TensorDiff], b: Mapping[str, TensorDiff]) -> dict[str, TensorDiff]:
    out = dict(a)
    for name, c in b.items():
        merged = merge_changes(out[name], c) if name in out else c
        if merged is None:
            out.pop(name, None)
        else:
            out[name] = merged
    return out


def merge_jobs(a: StepJob, b: StepJob) -> StepJob:
    """Fold waiting job ``a`` and newer job ``b`` into one job at ``b.step``."""
    futures = a.futures + b.futures
    if b.kind == "anchor":
        return replace(b, futures=futures)
    if a.kind == "anchor":
        for name, c in b.changes.items():
            a.snapshot[name][c.idx] = c.new
        return replace(b, kind="anchor", snapshot=a.snapshot, changes={}, changed=b.total, futures=futures)
    changes = merge_change_sets(a.changes, b.changes)
    return replace(b, changes=changes, changed=changed_count(changes), futures=futures)
