"""Executing a fetch plan: download, check and decode its steps (:func:`decode_plan`), prove them, and
apply them all or nothing (:func:`apply_decoded`). No recovery here: that is the sync's (``_sync.py``)."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from deltasync._util.cpus import parallel_map
from deltasync.errors import ChecksumMismatch, InventoryMismatch
from deltasync.fetcher._apply import (
    Undo,
    alias_groups,
    apply_changes,
    changed_names,
    check_aliases,
    check_anchor,
    check_digests,
    check_inventory,
    same_effect,
)
from deltasync.fetcher._download import download
from deltasync.fetcher._fold import Folded, StepChange, fold_steps, new_bits, per_tensor
from deltasync.fetcher._source import Source, Verify
from deltasync.fetcher._stats import SyncStats
from deltasync.fetcher._target import HostTensor, TargetTensor
from deltasync.protocol import (
    Committed,
    FetchPlan,
    Manifest,
    TensorChange,
    TensorInfo,
    anchor_arrays,
)
from deltasync.protocol.changes import union_positions
from deltasync.protocol.digests import tensor_digests
from deltasync.protocol.patchfile import DecodedGroup, decode_patch_groups

__all__ = ["Applied", "DecodedPlan", "apply_decoded", "decode_plan", "prove_anchor_plan"]

Bits = np.ndarray[Any, np.dtype[Any]]


@dataclass(frozen=True, slots=True)
class DecodedPlan:
    """A plan's steps, downloaded, checked and decoded; nothing applied yet.

    ``steps`` holds one manifest per plan element (a span's own manifest for a span), so
    ``steps[-1]`` carries the target's inventory and digests; ``patches`` are the decoded
    patch elements, or one element (the target's manifest) when folded.
    """

    steps: tuple[Committed, ...]
    anchor: Mapping[str, Bits] | None
    patches: tuple[tuple[Manifest, tuple[StepChange, ...], tuple[str, ...]], ...]


def decode_plan(
    source: Source,
    plan: FetchPlan,
    inventory: Sequence[TensorInfo],
    base: Manifest | None,
    stats: SyncStats | None = None,
) -> DecodedPlan:
    """Download, check and decode every step of ``plan`` (one batch of files); touches no target."""
    elements = plan.elements
    steps = tuple(
        source.reader.committed(e.step) if e.span is None else source.reader.span(e.span, e.step) for e in elements
    )
    final = steps[-1].manifest
    for c in steps:
        check_inventory(inventory, c.manifest)
    if source.verify == "full":
        missing = sorted({t.name for t in inventory} - set(final.tensor_digests))
        if missing:
            raise ChecksumMismatch(
                f"step {final.step} carries no tensor digest for {missing[:5]}: verify='full' cannot prove it "
                "(the uploader ran with tensor_digests=False; use verify=True)"
            )
    total, done = plan.nbytes, 0

    def tick(n: int) -> None:
        nonlocal done
        done += n
        if source.progress:
            source.progress(done, total)

    stats = stats or SyncStats(final.step)
    with stats.timing("download"):
        files = download(
            source.store,
            [c.manifest for c in steps],
            verify=bool(source.verify),
            progress=tick,
            spans=[e.span for e in elements],
        )
    stats.nbytes += sum(len(b) for f in files for b in f.values())
    stats.steps += len(steps)
    stats.spans += len(plan.spans)
    anchor: Mapping[str, Bits] | None = None
    patches = []
    parent = base
    with stats.timing("decode"):
        for c, f in zip(steps, files, strict=True):
            m = c.manifest
            if m.kind == "anchor":
                anchor = anchor_arrays(m, f)
            else:
                changes = tuple(_decode(m, f, source.threads))
                patches.append((m, changes, tuple(changed_names(m, parent, changes))))
            parent = m
        if source.fold and len(patches) > 1:
            # one change per tensor; every tensor any step touches is proven against the final digests
            names = tuple(sorted({n for _, _, ns in patches for n in ns}))
            # a decoded step holds no Folded change (only this fold makes them)
            steps_decoded = [[c for c in ch if not isinstance(c, Folded)] for _, ch, _ in patches]
            folded: tuple[StepChange, ...] = tuple(fold_steps(steps_decoded))
            return DecodedPlan(steps, anchor, ((final, folded, names),))
    return DecodedPlan(steps, anchor, tuple(patches))


#: an anchor plan's proof replays its tensors in groups of about this many bytes (copies of the anchor's
#: tensors), so that each step's digests of a group are hashed at once on every thread
PROVE_GROUP_BYTES = 256 << 20
#: a patch step of at most this many bytes is decoded on the calling thread: a pool's threads cost
#: more to start than a small step's decode
INLINE_BYTES = 256 << 10


def prove_anchor_plan(
    tensors: Mapping[str, TargetTensor], decoded: DecodedPlan, verify: Verify, *, threads: int = 1
) -> None:
    """Replay the whole plan off the target: every digest on the way is proven (when verifying, in
    each step's format, on up to ``threads`` threads at once) and tied names must change alike; the
    target is not touched."""
    assert decoded.anchor is not None
    anchor_m = decoded.steps[0].manifest
    final = decoded.steps[-1].manifest
    check_anchor(tensors, anchor_m, decoded.anchor, verify=bool(verify), threads=threads)
    if not decoded.patches:
        if verify == "full":
            missing = sorted(n for n in tensors if final.tensor_digests.get(n) is None)
            if missing:
                raise ChecksumMismatch(f"step {final.step}: tensor {missing[0]!r} does not match its digest")
        return  # the anchor is the target: check_anchor proved it
    twins: dict[str, list[str]] = {}
    for name, primary in alias_groups(tensors).items():
        twins.setdefault(primary, [])
        if primary != name:
            twins[primary].append(name)
    # nothing to prove without digests; ties need the replay
    primaries = [p for p, others in twins.items() if verify or others]
    group: list[str] = []
    nbytes = 0
    for primary in primaries:
        group.append(primary)
        nbytes += int(decoded.anchor[primary].nbytes)
        if nbytes >= PROVE_GROUP_BYTES:
            _prove_group(group, twins, decoded, verify, threads)
            group, nbytes = [], 0
    if group:
        _prove_group(group, twins, decoded, verify, threads)


def _prove_group(
    group: Sequence[str], twins: Mapping[str, Sequence[str]], decoded: DecodedPlan, verify: Verify, threads: int
) -> None:
    """:func:`prove_anchor_plan` for the tensors of ``group`` (primaries) and their tied names."""
    assert decoded.anchor is not None
    anchor_m = decoded.steps[0].manifest
    final = decoded.steps[-1].manifest
    arrays = {p: np.array(decoded.anchor[p]) for p in group}
    # the digest each name was last proven against (check_anchor proved the anchor's)
    proven = {n: anchor_m.tensor_digests.get(n) for p in group for n in (p, *twins[p])}
    for m, changes, names in decoded.patches:
        by = {c.tensor: c for c in per_tensor(changes)}
        need: dict[str, list[tuple[str, str]]] = {}  # primary -> (name, digest) to prove after this step
        for p in group:
            arr, c = arrays[p], by.get(p)
            for twin in twins[p]:
                if not same_effect(HostTensor(arr, key=p), c, by.get(twin)):
                    raise InventoryMismatch(
                        f"target ties {p!r} and {twin!r} to one tensor, but step {m.step} changes them differently"
                    )
            if c is not None:
                arr[c.idx] = new_bits(c, arr[c.idx])
            if not verify:
                continue
            for n in (p, *twins[p]):
                if n in names:
                    proven[n] = want = m.tensor_digests.get(n)
                    if want is not None:
                        need.setdefault(p, []).append((n, want))
        _check(arrays, need, m, threads, "is not bit-exact after applying (digest mismatch)")
    if verify == "full":
        need = {}
        for p in group:
            for n in (p, *twins[p]):
                want = final.tensor_digests.get(n)
                if want is None:
                    raise ChecksumMismatch(f"step {final.step}: tensor {n!r} does not match its digest")
                if proven[n] != want:  # last proven against another digest (or format): hash it again
                    need.setdefault(p, []).append((n, want))
        _check(arrays, need, final, threads, "does not match its digest")


def _check(
    arrays: Mapping[str, Bits], need: Mapping[str, Sequence[tuple[str, str]]], m: Manifest, threads: int, what: str
) -> None:
    """Raise ChecksumMismatch unless each array of ``need`` hashes (in ``m``'s format) to the digests listed."""
    if not need:
        return
    got = tensor_digests(
        {p: arrays[p] for p in need}, m.format_version, mapper=functools.partial(parallel_map, threads=threads)
    )
    for p, wants in need.items():
        for n, want in wants:
            if got[p] != want:
                raise ChecksumMismatch(f"step {m.step}: tensor {n!r} {what}")


class Applied:
    """What an apply wrote, per tensor: the positions of every change applied to it, or the whole
    tensor (an anchor load: which elements changed is not known without comparing, which is left to
    whoever needs it). Read as :class:`~deltasync.protocol.TensorChange` values with :meth:`changes`."""

    def __init__(self) -> None:
        self._parts: dict[str, list[Bits]] = {}
        self._whole: set[str] = set()
        #: groups applied, split per member only when :meth:`changes` is asked
        self._groups: list[tuple[DecodedGroup, Mapping[str, str]]] = []

    def add(self, changes: Sequence[StepChange], alias: Mapping[str, str]) -> None:
        """Record ``changes`` as applied (a tied name's change is applied through its primary's)."""
        for c in changes:
            if isinstance(c, DecodedGroup):
                self._groups.append((c, alias))
            elif alias.get(c.tensor, c.tensor) == c.tensor and c.tensor not in self._whole:
                self._parts.setdefault(c.tensor, []).append(c.idx)

    def _split_groups(self) -> None:
        # the union of a tensor's positions does not depend on the order its parts were added in
        for g, alias in self._groups:
            for c in g.split():
                if alias.get(c.tensor, c.tensor) == c.tensor and c.tensor not in self._whole:
                    self._parts.setdefault(c.tensor, []).append(c.idx)
        self._groups.clear()

    def whole(self, name: str) -> None:
        """Record that the whole of ``name`` was written."""
        self._whole.add(name)
        self._parts.pop(name, None)

    def changes(self, tensors: Mapping[str, TargetTensor], written: set[str]) -> dict[str, TensorChange]:
        """One change per name whose memory was written (``written``: the primaries), tied names
        included (they share their primary's memory, hence its change)."""
        self._split_groups()
        by_primary: dict[str, TensorChange] = {}
        for name in written:
            parts = self._parts.get(name)
            positions = None if name in self._whole or parts is None else union_positions(parts)
            by_primary[name] = TensorChange(name, positions)
        out: dict[str, TensorChange] = {}
        for name, primary in alias_groups(tensors).items():
            if (c := by_primary.get(primary)) is not None:
                out[name] = c if name == primary else TensorChange(name, c.positions, c.values)
        return out


def apply_decoded(
    tensors: Mapping[str, TargetTensor],
    decoded: DecodedPlan,
    *,
    verify: Verify,
    stats: SyncStats | None = None,
    keep: Undo | None = None,
    threads: int = 1,
    applied: Applied | None = None,
) -> None:
    """Apply a decoded plan in place, all or nothing; ``keep`` receives the undo log on success.
    ``threads``: tensors written at once. ``applied`` hears what was written (see :class:`Applied`)."""
    stats = stats or SyncStats(decoded.steps[-1].manifest.step)
    undo = Undo()
    try:
        if decoded.anchor is not None:
            # every digest was proven off the target: from here only the writes are left
            with stats.timing("apply"):
                if keep is None:
                    for name, primary in alias_groups(tensors).items():
                        if primary == name:
                            tensors[name].load(decoded.anchor[name])
                            if applied is not None:
                                applied.whole(name)
                    for _, changes, _ in decoded.patches:
                        apply_changes(tensors, changes, undo, threads=threads)
                else:
                    # the caller keeps the undo: write (and remember) only tensors whose bits differ
                    by_step = [{c.tensor: c for c in per_tensor(changes)} for _, changes, _ in decoded.patches]
                    for name, primary in alias_groups(tensors).items():
                        if primary != name:
                            continue
                        arr = np.array(decoded.anchor[name])
                        for by in by_step:
                            if (c := by.get(name)) is not None:
                                arr[c.idx] = new_bits(c, arr[c.idx])
                        if not np.array_equal(old := tensors[name].snapshot(), arr):
                            undo.load(tensors[name], old, arr)
                            undo.names.add(name)
                            if applied is not None:
                                applied.whole(name)
            if keep is not None:
                keep.extend(undo)
            return
        for m, changes, names in decoded.patches:
            with stats.timing("apply"):
                check_aliases(tensors, m, changes)
                apply_changes(tensors, changes, undo, threads=threads)
            if applied is not None:
                applied.add(changes, alias_groups(tensors))
            if verify:
                with stats.timing("verify"):
                    check_digests(tensors, names, m, threads=threads)
        if verify == "full":
            # what the last step proved is proven; the rest of the target is hashed now
            final = decoded.steps[-1].manifest
            done = set(decoded.patches[-1][2]) if decoded.patches and verify else set()
            with stats.timing("verify"):
                check_digests(tensors, sorted(set(tensors) - done), final, threads=threads)
            missing = sorted(n for n in tensors if n not in final.tensor_digests)
            if missing:
                raise ChecksumMismatch(f"step {final.step}: no tensor digest to prove {missing[:5]}")
    except BaseException:
        undo.rollback()
        raise
    if keep is not None:
        keep.extend(undo)


def _decode(m: Manifest, files: Mapping[str, Any], threads: int) -> list[StepChange]:
    """Decode a patch step, up to ``threads`` entries at once (the compiled decoders release the GIL);
    a group stays whole (split only where it is not applied as one)."""
    if threads <= 1 or len(m.entries) < 2 or m.total_bytes <= INLINE_BYTES:
        return list(decode_patch_groups(m, files))
    # the pool's map keeps the manifest's order and re-raises the first failing entry's error
    with ThreadPoolExecutor(min(threads, len(m.entries)), thread_name_prefix="deltasync-decode") as pool:
        return list(decode_patch_groups(m, files, mapper=pool.map))
