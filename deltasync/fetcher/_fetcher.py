"""DeltaFetcher: bring live weights or a checkpoint dir to a committed step."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from deltasync._tensors import inventory_of
from deltasync.errors import (
    ChainBroken,
    ChecksumMismatch,
    InventoryMismatch,
    ObjectNotFound,
    ProtocolError,
)
from deltasync.fetcher._apply import (
    NumpySlot,
    Slot,
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
from deltasync.fetcher._fold import Change, fold_steps, new_bits
from deltasync.fetcher._follow import follow as _follow
from deltasync.fetcher._identity import Held, live_tensors, slots_of
from deltasync.fetcher._journal import SyncJournal, SyncStats, restore_held
from deltasync.fetcher._lease import LeaseWriter, dir_step, run_leased
from deltasync.fetcher._materialize import MARKER as MARKER  # re-exported (fetcher.vllm)
from deltasync.fetcher._materialize import MaterializeStats
from deltasync.fetcher._materialize import materialize as _materialize
from deltasync.fetcher._reader import download
from deltasync.protocol import Committed, FetchPlan, Manifest, TensorInfo, anchor_arrays, decode_patch
from deltasync.protocol.digests import xxh3_128_array
from deltasync.storage import RunReader, Store, open_store

__all__ = ["DeltaFetcher", "SyncJournal", "SyncStats", "Verify"]

log = logging.getLogger("deltasync.fetcher")

Bits = np.ndarray[Any, np.dtype[Any]]
#: ``False``: sizes only; ``True``: file checksums, and every tensor a step changes proven by its
#: digest; ``"full"``: also every tensor of the target proven after each sync.
Verify = bool | Literal["full"]


@dataclass(frozen=True, slots=True)
class _Loaded:
    """A plan's steps, downloaded, checked and decoded; nothing applied yet.

    ``steps`` holds one manifest per plan element (a span's own manifest for a span), so
    ``steps[-1]`` carries the target's inventory and digests; ``patches`` are the decoded
    patch elements, or one element (the target's manifest) when folded.
    """

    steps: tuple[Committed, ...]
    anchor: Mapping[str, Bits] | None
    patches: tuple[tuple[Manifest, tuple[Change, ...], tuple[str, ...]], ...]


class DeltaFetcher:
    """Fetch committed steps from ``store`` and apply them bit-exactly.

    verify: ``True`` (default) checks every file's xxh3-128 before applying and,
        after applying, proves every tensor a step changes (it has an entry, or
        its digest differs from the parent's) against the manifest's digest.
        ``"full"`` also proves every tensor of the target after each sync
        (needs manifests with tensor digests). ``False`` checks sizes only.
        A failed proof restores the target's previous state and raises.
    signing_key: require manifests signed with this HMAC key.
    progress: a callback ``(bytes_done, bytes_total)`` for downloads.
    reader: share a :class:`~deltasync.storage.RunReader` (its manifest cache) with other users.
    spans: catch up through the run's spans when cheaper (SPEC.md "Spans"); a span that
        fails a check is dropped and the sync goes on through patches.
    fold: apply consecutive patches (and spans) as one change per tensor, so each changed
        element is written once; verification then proves the final step's digests.
    lease_ttl: write a lease (``leases/<id>.json``, see :class:`~deltasync.fetcher._lease.LeaseWriter`)
        at the start and end of each sync, valid this many seconds, so ``deltasync gc`` keeps what
        this fetcher holds and fetches. None (default): no lease, the store is only read.

    A sync is all or nothing: the target ends at the step returned, or the call
    raises with the target as it was.
    """

    def __init__(
        self,
        store: Store | str | os.PathLike[str],
        *,
        verify: Verify = True,
        signing_key: bytes | None = None,
        progress: Callable[[int, int], None] | None = None,
        shard_bytes: int = 2 << 30,
        reader: RunReader | None = None,
        spans: bool = True,
        fold: bool = True,
        lease_ttl: float | None = None,
    ) -> None:
        if verify not in (True, False, "full"):
            raise ValueError(f"verify must be True, False or 'full', got {verify!r}")
        self.store = store if isinstance(store, Store) else open_store(store)  # a URL or path works too
        self.verify: Verify = verify
        self.progress = progress
        self.shard_bytes = shard_bytes
        self.reader = reader if reader is not None else RunReader(self.store, signing_key=signing_key, spans=spans)
        self.fold = fold
        self._held: dict[int, Held] = {}
        self.lease = LeaseWriter(self.store, lease_ttl) if lease_ttl is not None else None
        #: timings and bytes of the last :meth:`sync` (None before the first)
        self.last_stats: SyncStats | None = None

    # ----------------------------------------------------------- discovery

    def steps(self) -> list[int]:
        """Committed steps in the store, ascending."""
        return self.reader.steps()

    def latest_step(self) -> int | None:
        """Newest committed step of the run, or None for an empty run.

        Skips steps that a fenced-off writer committed after a newer uploader
        took over the run (SPEC.md "Single writer").
        """
        return self.reader.latest_step()

    def manifest(self, step: int) -> Manifest:
        """The manifest of committed ``step`` (cached)."""
        return self.reader.manifest(step)

    def _target_step(self, step: int | None) -> int:
        if step is not None:
            return step
        latest = self.latest_step()
        if latest is None:
            if not self.reader.exists():
                self.reader.require()
            raise ChainBroken(f"{self.store.url} has no committed steps yet")
        return latest

    # -------------------------------------------------------------- loading

    def _load(
        self, plan: FetchPlan, inventory: Sequence[TensorInfo], base: Manifest | None, stats: SyncStats | None = None
    ) -> _Loaded:
        """Download, check and decode every step of ``plan`` (one batch of files); touches no target."""
        elements = plan.elements
        steps = tuple(
            self.reader.committed(e.step) if e.span is None else self.reader.span(e.span, e.step) for e in elements
        )
        final = steps[-1].manifest
        for c in steps:
            check_inventory(inventory, c.manifest)
        if self.verify == "full":
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
            if self.progress:
                self.progress(done, total)

        stats = stats or SyncStats(final.step)
        with stats.timing("download"):
            files = download(
                self.store,
                [c.manifest for c in steps],
                verify=bool(self.verify),
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
                    changes = tuple(decode_patch(m, f))
                    patches.append((m, changes, tuple(changed_names(m, parent, changes))))
                parent = m
            if self.fold and len(patches) > 1:
                # one change per tensor; every tensor any step touches is proven against the final digests
                names = tuple(sorted({n for _, _, ns in patches for n in ns}))
                folded: tuple[Change, ...] = tuple(fold_steps([ch for _, ch, _ in patches]))
                return _Loaded(steps, anchor, ((final, folded, names),))
        return _Loaded(steps, anchor, tuple(patches))

    def _prove_anchor_plan(self, slots: Mapping[str, Slot], loaded: _Loaded) -> None:
        """Replay the whole plan tensor by tensor off the target: every digest on the way is proven
        (when verifying) and tied names must change alike; the target is not touched."""
        assert loaded.anchor is not None
        anchor_m = loaded.steps[0].manifest
        final = loaded.steps[-1].manifest
        check_anchor(slots, anchor_m, loaded.anchor, verify=bool(self.verify))
        by_step = [({c.tensor: c for c in ch}, set(names)) for _, ch, names in loaded.patches]
        twins: dict[str, list[str]] = {}
        for name, primary in alias_groups(slots).items():
            twins.setdefault(primary, [])
            if primary != name:
                twins[primary].append(name)
        for primary, others in twins.items():
            if not self.verify and not others:
                continue  # nothing to prove without digests; ties need the replay
            arr = np.array(loaded.anchor[primary])
            proven = {n: anchor_m.tensor_digests.get(n) for n in (primary, *others)}  # check_anchor proved them
            for (m, _, _), (by, names) in zip(loaded.patches, by_step, strict=True):
                c = by.get(primary)
                for twin in others:
                    if not same_effect(NumpySlot(arr, key=primary), c, by.get(twin)):
                        raise InventoryMismatch(
                            f"target ties {primary!r} and {twin!r} to one tensor, but step {m.step} changes them differently"
                        )
                if c is not None:
                    arr[c.idx] = new_bits(c, arr[c.idx])
                if not self.verify:
                    continue
                digest: str | None = None
                for n in (primary, *others):
                    if n in names:
                        proven[n] = want = m.tensor_digests.get(n)
                        if want is not None and want != (digest := digest or xxh3_128_array(arr)):
                            raise ChecksumMismatch(
                                f"step {m.step}: tensor {n!r} is not bit-exact after applying (digest mismatch)"
                            )
            if self.verify == "full":
                for n in (primary, *others):
                    want = final.tensor_digests.get(n)
                    if want is None or (proven[n] != want and xxh3_128_array(arr) != want):
                        raise ChecksumMismatch(f"step {final.step}: tensor {n!r} does not match its digest")

    def _apply(
        self, slots: Mapping[str, Slot], loaded: _Loaded, stats: SyncStats | None = None, keep: Undo | None = None
    ) -> None:
        """Apply a loaded plan in place, all or nothing; ``keep`` receives the undo log on success."""
        stats = stats or SyncStats(loaded.steps[-1].manifest.step)
        undo = Undo()
        try:
            if loaded.anchor is not None:
                # every digest was proven off the target: from here only the writes are left
                with stats.timing("apply"):
                    if keep is None:
                        for name, primary in alias_groups(slots).items():
                            if primary == name:
                                slots[name].load(loaded.anchor[name])
                        for _, changes, _ in loaded.patches:
                            apply_changes(slots, changes, undo)
                    else:
                        # the caller keeps the undo: write (and remember) only tensors whose bits differ
                        by_step = [{c.tensor: c for c in changes} for _, changes, _ in loaded.patches]
                        for name, primary in alias_groups(slots).items():
                            if primary != name:
                                continue
                            arr = np.array(loaded.anchor[name])
                            for by in by_step:
                                if (c := by.get(name)) is not None:
                                    arr[c.idx] = new_bits(c, arr[c.idx])
                            if not np.array_equal(old := slots[name].snapshot(), arr):
                                undo.load(slots[name], old, arr)
                                undo.names.add(name)
                if keep is not None:
                    keep.extend(undo)
                return
            for m, changes, names in loaded.patches:
                with stats.timing("apply"):
                    check_aliases(slots, m, changes)
                    apply_changes(slots, changes, undo)
                if self.verify:
                    with stats.timing("verify"):
                        check_digests(slots, names, m)
            if self.verify == "full":
                # what the last step proved is proven; the rest of the target is hashed now
                final = loaded.steps[-1].manifest
                done = set(loaded.patches[-1][2]) if loaded.patches and self.verify else set()
                with stats.timing("verify"):
                    check_digests(slots, sorted(set(slots) - done), final)
                missing = sorted(n for n in slots if n not in final.tensor_digests)
                if missing:
                    raise ChecksumMismatch(f"step {final.step}: no tensor digest to prove {missing[:5]}")
        except BaseException:
            undo.rollback()
            raise
        if keep is not None:
            keep.extend(undo)

    def _execute(
        self,
        slots: Mapping[str, Slot],
        inventory: Sequence[TensorInfo],
        plan: FetchPlan,
        base: Manifest | None,
        stats: SyncStats,
        keep: Undo | None,
        have: tuple[int, str] | None = None,
    ) -> Committed:
        """Load and apply ``plan`` (all or nothing); returns the committed target step.

        A plan through spans that fails (a span's file missing or corrupt, or its
        content caught by verification) is rolled back, its spans are never used
        again, and the target is planned again from ``have`` without them.
        """
        while True:
            try:
                loaded = self._load(plan, inventory, base, stats)
                if loaded.anchor is not None:
                    with stats.timing("verify"):
                        self._prove_anchor_plan(slots, loaded)
                self._apply(slots, loaded, stats, keep)
                return self.reader.committed(plan.target_step)
            except (ChecksumMismatch, ProtocolError, ObjectNotFound) as exc:
                if not isinstance(exc, ObjectNotFound):
                    # the bad bytes may be a cached manifest (read corrupted, or since repaired):
                    # read the plan's manifests afresh next time instead of failing forever
                    self.reader.forget(plan.steps)
                if not plan.spans:
                    raise
                log.warning("step %d: spans %s failed (%s); going on without them", plan.target_step, plan.spans, exc)
                self.reader.distrust_spans(plan.spans)
                stats.span_fallbacks += 1
                plan = self.reader.plan(plan.target_step, have)
                base = self.reader.committed(have[0]).manifest if plan.base == "current" and have else None

    # ---------------------------------------------------------------- sync

    def _holds(self, slots: Mapping[str, Slot], step: int) -> tuple[int, str] | None:
        """(step, digest) when every tensor provably equals committed ``step`` (by digests), else None."""
        try:
            c = self.reader.committed(step)
        except ObjectNotFound:
            return None  # not (or no longer) committed: start from an anchor
        digests = c.manifest.tensor_digests
        if set(digests) != set(slots) or any(slots[n].digest() != d for n, d in digests.items()):
            return None
        return step, c.digest

    def sync(
        self, target: Any, step: int | None = None, *, have_step: int | None = None, journal: SyncJournal | None = None
    ) -> int:
        """Bring ``target`` (nn.Module or dict of tensors) in place to ``step`` (default: latest).

        Patches forward when the target provably holds an earlier step of the
        chain: it holds the very tensors this fetcher last wrote, unmodified
        since (torch version counters, memory addresses), or ``have_step`` is
        given and (when verifying) the tensors match its digests. Otherwise
        loads the nearest anchor. All or nothing: on any error the target is
        left as it was. Returns the step reached.

        journal: a fresh :class:`SyncJournal` that records what this sync wrote,
        so it can be undone later (a live engine that refused the new tensors).
        Timings and bytes of the sync are left in :attr:`last_stats`.
        """
        return run_leased(
            self, step, lambda: self.current_step(target), lambda s: self._sync(target, s, have_step, journal)
        )

    def _sync(self, target: Any, step: int, have_step: int | None, journal: SyncJournal | None) -> int:
        """One :meth:`sync` attempt to ``step``."""
        stats = SyncStats(-1)
        t0 = stats.clock()
        live = live_tensors(target)
        inventory = inventory_of(live)
        slots = slots_of(live)
        target_step = self._target_step(step)
        for key in [k for k, h in self._held.items() if h.gone()]:
            del self._held[key]  # targets that were collected
        held = self._held.get(id(target))
        have: tuple[int, str] | None = None
        if held is not None and held.same(target, live, slots):
            have = (held.step, held.digest)
        elif held is not None:
            # another object at a reused id, or tensors changed behind our back: prove it or forget it
            have = self._holds(slots, held.step) if self.verify else None
            if have is None:
                del self._held[id(target)]
        if have is None and have_step is not None:
            if self.verify:
                have = self._holds(slots, have_step)
            else:
                try:
                    have = (have_step, self.reader.committed(have_step).digest)
                except ObjectNotFound:
                    have = None
        plan = self.reader.plan(target_step, have)
        before = self._held.get(id(target))
        keep = Undo() if journal is not None else None
        stats.step = target_step
        if plan.is_noop:
            reached = self.reader.committed(target_step)
        else:
            base = self.reader.committed(have[0]).manifest if plan.base == "current" and have else None
            stats.base_step = have[0] if base is not None and have else None
            try:
                reached = self._execute(slots, inventory, plan, base, stats, keep, have)
            except ChecksumMismatch:
                # the target may not hold what we believed (changed behind our back): if so, an
                # anchor is the safe start; if it does hold it, the store's data is what is wrong
                if plan.base != "current" or have is None or self._holds(slots, have[0]) is not None:
                    raise
                plan = self.reader.plan(target_step, None)
                stats = SyncStats(target_step, clock=stats.clock)
                reached = self._execute(slots, inventory, plan, None, stats, keep)
        self._held[id(target)] = Held.record(target_step, reached.digest, target, live, slots)
        if journal is not None and keep is not None:
            key, records = id(target), self._held

            def restore() -> None:
                restore_held(records, key, before, target, live, slots)

            journal._record(keep, slots, target_step, have[0] if have else None, restore)
        elif journal is not None:
            journal._record(Undo(), slots, target_step, target_step, lambda: None)
        stats.total_s = stats.clock() - t0
        self.last_stats = stats
        if journal is not None:
            journal.stats = stats
        return target_step

    def follow(self, target: Any, **options: Any) -> int | None:
        """Apply each new step to ``target`` as it is signalled (SSE), polling the store when the
        signal server is unreachable. Options: see :func:`deltasync.fetcher._follow.follow`
        (``signal_url``, ``token``, ``run``, ``until_step``, ``stop``, ``poll_interval``, ``on_step``).
        """
        return _follow(self, target, **options)

    def current_step(self, target: Any) -> int | None:
        """The step this fetcher last brought ``target`` to, if it still holds those tensors unchanged."""
        held = self._held.get(id(target))
        if held is None:
            return None
        live = live_tensors(target)
        slots = slots_of(live)
        return held.step if held.same(target, live, slots) else None

    # --------------------------------------------------------- materialize

    #: what the last :meth:`materialize` did: shards written vs hard-linked, the swap used (None before)
    last_materialize: MaterializeStats | None = None

    def materialize(
        self,
        out_dir: str | os.PathLike[str],
        step: int | None = None,
        *,
        config_from: str | os.PathLike[str] | None = None,
    ) -> Path:
        """Write step ``step`` (default latest) as a safetensors checkpoint dir, atomically.

        The dir holds ``model-*.safetensors`` shards and ``model.safetensors.index.json``
        (transformers/vLLM load it as is, given a config.json) plus a ``.deltasync.json`` marker.
        Each version is built next to ``out_dir`` and swapped in atomically (Linux
        ``RENAME_EXCHANGE``; elsewhere two renames, with a warning): a reader of ``out_dir`` sees
        the old or the new version, never a missing or mixed one. When ``out_dir`` already holds
        an earlier materialized step of this chain, only the patches since are downloaded, and
        shards that did not change are hard-linked, not rewritten (``last_materialize`` counts
        them). Files next to the weights (config.json, tokenizer files...) carry over to the new
        version; ``config_from``: also copy the non-weight files of this HF model dir (it must hold
        a config.json). An existing dir without the marker is never replaced. Memory is sized
        from bytes present (the anchor or the dir), never from a manifest's declared shapes alone.
        """
        out, stats = run_leased(
            self, step, lambda: dir_step(out_dir), lambda s: _materialize(self, out_dir, s, config_from)
        )
        self.last_materialize = stats
        return out
