"""DeltaFetcher: bring live weights or a checkpoint dir to a committed step."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path
from typing import Any, Literal

from deltasync._tensors import inventory_of, require_torch, torch_dtype
from deltasync.errors import ChainBroken, ChecksumMismatch, InventoryMismatch, ObjectNotFound
from deltasync.fetcher._apply import Slot, Undo
from deltasync.fetcher._execute import execute
from deltasync.fetcher._follow import follow as _follow
from deltasync.fetcher._identity import Held, live_tensors, slots_of
from deltasync.fetcher._journal import SyncJournal, SyncStats, restore_held
from deltasync.fetcher._lease import LeaseWriter, dir_step, run_leased
from deltasync.fetcher._materialize import MARKER as MARKER  # re-exported (fetcher.vllm)
from deltasync.fetcher._materialize import MaterializeStats
from deltasync.fetcher._materialize import materialize as _materialize
from deltasync.protocol import Manifest
from deltasync.run import RunReader
from deltasync.storage import Store, open_store

__all__ = ["DeltaFetcher", "SyncJournal", "SyncStats", "Verify"]

#: ``False``: sizes only; ``True``: file checksums, and every tensor a step changes proven by its
#: digest; ``"full"``: also every tensor of the target proven after each sync.
Verify = bool | Literal["full"]


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
    threads: decode up to this many tensors of a step at once (the compiled kernels release the
        GIL; see :mod:`deltasync.protocol.kernels`).

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
        threads: int = 2,
    ) -> None:
        if verify not in (True, False, "full"):
            raise ValueError(f"verify must be True, False or 'full', got {verify!r}")
        self.store = store if isinstance(store, Store) else open_store(store)  # a URL or path works too
        self.verify: Verify = verify
        self.progress = progress
        self.shard_bytes = shard_bytes
        self.reader = reader if reader is not None else RunReader(self.store, signing_key=signing_key, spans=spans)
        self.fold = fold
        self.threads = max(1, threads)
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

        A dict must hold the run's tensor names, shapes and dtypes, or be empty: an empty dict is
        filled with CPU tensors allocated from the step's inventory (and emptied again on failure).

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
        """One :meth:`sync` attempt to ``step``; an empty dict is first filled with the run's tensors."""
        added = _allocate_empty(target, lambda: self.manifest(self._target_step(step)))
        try:
            return self._sync_into(target, step, have_step, journal)
        except BaseException as exc:
            for name in added:  # all or nothing: the dict is empty again
                target.pop(name, None)
            if isinstance(exc, InventoryMismatch) and isinstance(target, Mapping) and not added:
                raise InventoryMismatch(
                    f"{exc}; or pass an empty dict, which sync fills with the run's tensors"
                ) from exc
            raise

    def _sync_into(self, target: Any, step: int, have_step: int | None, journal: SyncJournal | None) -> int:
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
                reached = execute(self, slots, inventory, plan, base, stats, keep, have)
            except ChecksumMismatch:
                # the target may not hold what we believed (changed behind our back): if so, an
                # anchor is the safe start; if it does hold it, the store's data is what is wrong
                if plan.base != "current" or have is None or self._holds(slots, have[0]) is not None:
                    raise
                plan = self.reader.plan(target_step, None)
                stats = SyncStats(target_step, clock=stats.clock)
                reached = execute(self, slots, inventory, plan, None, stats, keep)
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


def _allocate_empty(target: Any, manifest: Callable[[], Manifest]) -> list[str]:
    """Fill an empty dict target with CPU tensors shaped as the run's (``manifest()``'s) inventory,
    so ``fetcher.sync({})`` works without knowing the model; returns the names added."""
    if not isinstance(target, MutableMapping) or len(target) > 0:
        return []
    torch = require_torch()
    added: list[str] = []
    try:
        for info in manifest().inventory:
            target[info.name] = torch.zeros(info.shape, dtype=torch_dtype(info.dtype))
            added.append(info.name)
    except BaseException:
        for name in added:
            target.pop(name, None)
        raise
    return added
