"""DeltaFetcher: bring live weights or a checkpoint dir to a committed step (a thin facade).

A sync is :class:`~deltasync.fetcher._sync.Sync` (have -> plan -> execute -> recover); a
materialize is :func:`~deltasync.fetcher._materialize.materialize`. The fetcher holds what
outlives one call: the run reader (its manifest cache), the lease, and what it left in each target.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deltasync._util.cpus import usable_cpus
from deltasync._util.tensors import DEFAULT_MAX_ALLOC_BYTES
from deltasync.errors import DeltaSyncError
from deltasync.fetcher._apply import changed_names
from deltasync.fetcher._follow import follow as _follow
from deltasync.fetcher._identity import HeldStates
from deltasync.fetcher._journal import SyncJournal
from deltasync.fetcher._lease import LeaseWriter, dir_step, run_leased
from deltasync.fetcher._materialize import MARKER as MARKER  # re-exported (integrations.vllm)
from deltasync.fetcher._materialize import MaterializeStats
from deltasync.fetcher._materialize import materialize as _materialize
from deltasync.fetcher._source import Source
from deltasync.fetcher._source import Verify as Verify  # re-exported (integrations.vllm)
from deltasync.fetcher._stats import SyncStats
from deltasync.fetcher._sync import Sync
from deltasync.fetcher._target import live_tensors, target_tensors
from deltasync.protocol import Manifest
from deltasync.protocol.adapter import READER_IGNORES
from deltasync.run import RunReader
from deltasync.run.adapter import AdapterConfig, AdapterMismatch, adapter_config_of, is_peft_model, read_adapter_config
from deltasync.storage import Store, open_store

__all__ = ["DeltaFetcher", "SyncJournal", "SyncStats", "Verify"]


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
    reader: share a :class:`~deltasync.run.RunReader` (its manifest cache) with other users.
    spans: catch up through the run's spans when cheaper (SPEC.md "Spans"); a span that
        fails a check is dropped and the sync goes on through patches.
    fold: apply consecutive patches (and spans) as one change per tensor, so each changed
        element is written once; verification then proves the final step's digests.
    lease_ttl: write a lease (``leases/<id>.json``, see :class:`~deltasync.fetcher._lease.LeaseWriter`)
        at the start and end of each sync, valid this many seconds, so ``deltasync gc`` keeps what
        this fetcher holds and fetches. None (default): no lease, the store is only read.
    threads: decode and apply up to this many tensors (format 2: groups) of a step at once (the
        compiled kernels release the GIL; see :mod:`deltasync.protocol.kernels`); None (default):
        one per CPU this process may use (``os.sched_getaffinity``).
    max_alloc_bytes: the most bytes of tensors ``sync({})`` allocates from a run's inventory
        (default 256 GiB); a run declaring more is refused with InventoryMismatch before
        anything is allocated (a manifest's shapes are claims).

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
        threads: int | None = None,
        max_alloc_bytes: int = DEFAULT_MAX_ALLOC_BYTES,
    ) -> None:
        if verify not in (True, False, "full"):
            raise ValueError(f"verify must be True, False or 'full', got {verify!r}")
        self.store = store if isinstance(store, Store) else open_store(store)  # a URL or path works too
        self.verify: Verify = verify
        self.progress = progress
        self.shard_bytes = shard_bytes
        self.reader = reader if reader is not None else RunReader(self.store, signing_key=signing_key, spans=spans)
        self.fold = fold
        self.threads = max(1, threads if threads is not None else usable_cpus())
        self.max_alloc_bytes = max_alloc_bytes
        self._held = HeldStates()
        self.lease = LeaseWriter(self.store, lease_ttl) if lease_ttl is not None else None
        #: timings and bytes of the last :meth:`sync` (None before the first)
        self.last_stats: SyncStats | None = None
        #: the run's kind once known: its adapter config (written once), False for full weights
        self._adapter: AdapterConfig | bool | None = None

    @property
    def signing_key(self) -> bytes | None:
        """The HMAC key every manifest must be signed with (None: unsigned manifests are accepted)."""
        return self.reader.signing_key

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

    def _source(self) -> Source:
        """The run and this fetcher's settings for reading it, as they are now (one per sync or materialize)."""
        return Source(self.store, self.reader, self.verify, self.fold, self.threads, self.progress)

    # ---------------------------------------------------------------- sync

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
        so it can be undone later (a live engine that refused the new tensors), and
        what it applied to each tensor (``journal.changes``: one
        :class:`~deltasync.protocol.TensorChange` per tensor written, with the positions
        the patches carried, folded; None where it wrote a whole tensor).
        Timings and bytes of the sync are left in :attr:`last_stats`.

        A ``peft.PeftModel`` target of an adapter run (docs/lora.md) gets the run's LoRA tensors
        written into its active adapter's Parameters, in place; its adapter config must be the
        run's (AdapterMismatch naming the fields that differ, or when the run holds full weights).
        """
        if is_peft_model(target):
            self._check_adapter(target)
        sync = Sync(
            self._source(),
            self._held,
            target,
            step,
            have_step=have_step,
            journal=journal,
            lease=self.lease,
            max_alloc_bytes=self.max_alloc_bytes,
        )
        reached = sync.run()
        self.last_stats = sync.stats
        return reached

    def _check_adapter(self, model: Any) -> None:
        """Refuse a PEFT model whose active adapter's config is not the run's (or a full-weights run)."""
        run = self._run_adapter(committed=False)
        if run is None:
            raise AdapterMismatch(
                f"{self.store.url} is not an adapter run (no adapter_config.json): it holds full weights; sync them "
                "into the base model (the PEFT model's base_model), or point at the adapter run's store"
            )
        adapter_config_of(model).check_same(run, self.store.url, READER_IGNORES)

    def _run_adapter(self, *, committed: bool) -> AdapterConfig | None:
        """The run's adapter config, None for a full-weights run. Read until known; ``committed``: the
        run holds a committed step, so a missing config means full weights for good (an adapter
        uploader writes its config before its first step), and that is remembered too."""
        if self._adapter is None:
            found = read_adapter_config(self.store)
            if found is not None or committed:
                self._adapter = found if found is not None else False
            return found
        return self._adapter if isinstance(self._adapter, AdapterConfig) else None

    def expected_changes(self, have_step: int, step: int) -> list[str] | None:
        """The tensors a sync of a target holding committed ``have_step`` to ``step`` is expected to
        write, as the manifests of its plan say (a tensor whose digest differs from its parent's),
        before anything is downloaded: sorted names, or None where the plan loads an anchor (which
        rewrites every tensor) or cannot be made now (a sync would say why). A guess to place data by
        (a node mirror's build copies these tensors where the step is then applied); a sync proves
        what it writes either way."""
        try:
            reader = self.reader
            have = reader.committed(have_step)
            plan = reader.plan(step, (have_step, have.digest))
            if plan.base != "current":
                return None
            parent = have.manifest
            names: set[str] = set()
            for e in plan.elements:
                m = (reader.committed(e.step) if e.span is None else reader.span(e.span, e.step)).manifest
                names.update(changed_names(m, parent, ()))
                parent = m
        except DeltaSyncError:
            return None
        return sorted(names)

    def follow(self, target: Any, **options: Any) -> int | None:
        """Apply each new step to ``target`` as it is signalled (SSE), polling the store when the
        signal server is unreachable: a :class:`~deltasync.fetcher.Follower`, run. Options: the fields
        of :class:`~deltasync.fetcher.FollowOptions` (``signal_url``, ``token``, ``run``, ``until_step``,
        ``poll_interval``, ...) and the follower's ``stop``, ``on_step``, ``metrics``, ``stats``.
        """
        return _follow(self, target, **options)

    def current_step(self, target: Any) -> int | None:
        """The step this fetcher last brought ``target`` to, if it still holds those tensors unchanged."""
        live = live_tensors(target)
        return self._held.current_step(target, live, target_tensors(live))

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
        source = self._source()
        out, stats = run_leased(
            source,
            self.lease,
            step,
            lambda: dir_step(out_dir),
            lambda s: _materialize(
                source, out_dir, s, config_from, shard_bytes=self.shard_bytes, adapter=self._run_adapter
            ),
        )
        self.last_materialize = stats
        return out
