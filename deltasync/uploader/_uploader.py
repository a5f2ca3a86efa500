"""DeltaUploader: diff on push, encode and write in the background.

The facade composes the uploader's parts, each the one owner of its state:
:class:`~deltasync.uploader._chain.ChainState` (where the chain stands),
:class:`~deltasync.uploader._snapshot.Snapshotter` (the baseline push() diffs against),
:class:`~deltasync.uploader._writer.WriterIdentity` (run id, writer id, epoch),
:class:`~deltasync.uploader._pipeline.CommitPipeline` (digest and commit stages),
:func:`~deltasync.uploader._commit_step.commit_step` (the commit stage's work, with the uploader's
one :class:`~deltasync.uploader._commit_step.CommitContext`) or, under torch.distributed,
:class:`~deltasync.uploader.sharded.ShardedPush`, and :class:`~deltasync.uploader._resume.Resumer`.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from deltasync._util.cpus import usable_cpus
from deltasync._util.retry import RetryPolicy
from deltasync._util.tensors import state_tensors
from deltasync.errors import ProtocolError
from deltasync.protocol.manifest_v2 import inventory_facts
from deltasync.run import RunReader
from deltasync.run.gc import RetentionWorker
from deltasync.storage import Store, open_store
from deltasync.uploader._adapter import AdapterGuard
from deltasync.uploader._chain import ChainState
from deltasync.uploader._commit_step import AfterCommit, CommitContext, FoldLog, commit_step
from deltasync.uploader._config import CommitInfo, UploaderConfig
from deltasync.uploader._dtypes import warn_dtype_change
from deltasync.uploader._pipeline import CommitPipeline
from deltasync.uploader._resume import Resumer
from deltasync.uploader._snapshot import Snapshotter
from deltasync.uploader._spans import SpanWriter
from deltasync.uploader._writer import WriterIdentity
from deltasync.uploader.sharded import ShardedPush, sharded_wanted

if TYPE_CHECKING:
    from deltasync.protocol.probes import ProbeSet, Reference
    from deltasync.signal import FleetView, Notifier
    from deltasync.uploader._reference import ReferenceWriter

__all__ = ["CommitInfo", "DeltaUploader", "UploaderConfig"]


class DeltaUploader:
    """Push training states; each step becomes a sparse patch (or an anchor) in ``store``.

    ``push()`` diffs bit-wise against the last pushed state on the tensors' own
    device, copies out only the changed elements and returns a Future. Two
    background workers do the rest: one hashes the new state (the next push
    waits for it, never for the store), one encodes and writes files, then the
    manifest, then HEAD. Use as a context manager, or call :meth:`close`.
    """

    def __init__(
        self, store: Store | str | os.PathLike[str], *, config: UploaderConfig | None = None, **options: Any
    ) -> None:
        self.store = store if isinstance(store, Store) else open_store(store)  # a URL or path works too
        self.config = cfg = replace(config or UploaderConfig(), **options)
        self._closed = False
        self._stop = threading.Event()  # set by close(): cuts retry backoffs short
        self._reader = RunReader(self.store)
        self._chain = ChainState()
        self._chain.load_head(self._reader)
        head = self._chain.last_committed
        # single writer per run prefix: the first push() claims the next epoch (0 until then), so an
        # uploader that never pushes (a refused upload) leaves no claim; a newer claim fences this one off
        self._writer = WriterIdentity(self.store, cfg.run_id, head.manifest.run_id if head else None)
        threads = cfg.encode_threads if cfg.encode_threads is not None else usable_cpus()
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="deltasync-encode")
        self._snapshots = Snapshotter(self._pool, cfg.cast_dtype, format_version=cfg.format_version)
        self._folds = FoldLog(cfg.max_pending)  # steps folded into later ones ("coalesce"): counted, told once
        self._after = AfterCommit(folds=self._folds)  # the listeners below join it once they exist
        #: what the commit stage works with (single-process or sharded): built once
        self._ctx = CommitContext(
            self.store, cfg, chain=self._chain, writer=self._writer, pool=self._pool, after=self._after, stop=self._stop
        )
        # under torch.distributed (world > 1) every rank pushes its own shards (a collective here)
        self._sharded: ShardedPush | None = None
        if sharded_wanted(cfg):
            self._sharded = ShardedPush(self._ctx)
        rank0 = self._sharded is None or self._sharded.rank == 0  # only rank 0 commits and signals
        self.notifier: Notifier | None = None  # counts sent / failed signals
        if cfg.signal_url and rank0:
            from deltasync.signal import Notifier  # the signal client only when signalling

            self.notifier = Notifier(cfg.signal_url, cfg.signal_run or self.run_id, cfg.signal_token)
        self.retention: RetentionWorker | None = None  # keep_anchors: gc after each committed anchor
        if cfg.keep_anchors is not None and rank0:
            self.retention = RetentionWorker(self.store, cfg.keep_anchors, signing_key=cfg.signing_key)
        #: writes spans after commits (None when ``span_levels`` is empty, or in a sharded push, whose
        #: changes live on their owner ranks); counts written/failed spans
        self.spans: SpanWriter | None = None
        if cfg.span_levels and self._sharded is None:
            self.spans = SpanWriter(
                self.store,
                cfg.span_levels,
                shard_bytes=cfg.shard_bytes,
                signing_key=cfg.signing_key,
                retry=RetryPolicy(cfg.retries, cfg.retry_backoff),
            )
        self._after.notifier, self._after.retention = self.notifier, self.retention
        self._after.write_spans = self.spans.submit if self.spans is not None else None
        ctx = self._ctx
        commit = self._sharded.commit if self._sharded is not None else lambda job: commit_step(ctx, job)
        self._pipeline = CommitPipeline(
            self._snapshots,
            commit,
            max_pending=cfg.max_pending,
            coalesce=cfg.on_backlog == "coalesce",
            defer_diff=cfg.defer_diff,
            tensor_digests=cfg.tensor_digests,
            stop=self._stop,
        )
        #: a pushed PEFT model becomes its adapter's tensors; the run's adapter_config.json is kept here
        self._adapter = AdapterGuard(self.store, lambda: self._chain.last_step, sharded=self._sharded is not None)
        self._probes: ProbeSet | None = None  # the run's probe set, once asked for (probes())
        self._references: ReferenceWriter | None = None  # writes attach_reference()'s objects
        self._resumer = Resumer(
            self.store,
            self._reader,
            anchor_every=cfg.anchor_every,
            chain=self._chain,
            snapshots=self._snapshots,
            writer=self._writer,
            spans=self.spans,
        )

    # ------------------------------------------------------------ identity

    @property
    def run_id(self) -> str:
        """The run id written into every manifest (the store's, when it holds a run already)."""
        return self._writer.run_id

    @property
    def writer_id(self) -> str:
        """This uploader's writer id (in its claim and every manifest it writes)."""
        return self._writer.writer_id

    @property
    def epoch(self) -> int:
        """This uploader's writer epoch: 0 until its first push (or resume) claims one."""
        return self._writer.epoch

    @property
    def failures(self) -> int:
        """Pushed steps that failed to commit."""
        return self._chain.failures

    @property
    def folded(self) -> int:
        """Pushed steps folded into a later step (``on_backlog="coalesce"`` while the store was behind).

        A folded step is never committed as its own step: its changes are committed as part of
        a later step, and its Future resolves with ``kind="skipped"`` and that step as
        ``committed_step`` (:attr:`CommitInfo.folded`). Counted when that later step is
        committed; the first fold is also logged as a warning on ``deltasync.uploader``.
        """
        return self._folds.count

    @property
    def folded_steps(self) -> tuple[tuple[int, int], ...]:
        """The newest folds (at most 256), oldest first: ``(folded step, the step committed with its changes)``."""
        return self._folds.recent

    # ------------------------------------------------------------ resume

    def resume(self, state: Any, step: int, *, strict: bool = False) -> bool:
        """Continue the run from committed ``step``, whose weights the caller holds as ``state``.

        Call it before the first push of an uploader on an existing run (a restarted
        trainer, with the state of the checkpoint it restarted from). Returns True
        when ``state`` is proven equal to ``step`` by the tensor digests and ``step``
        is the store's newest step: the next push is then a patch on it (unless an
        anchor is due). Returns False when it cannot be proven (``step`` is not
        committed, the state differs, or a reader could not rebuild ``step``: a step
        or file of its chain is missing): the next push is an anchor; with
        ``strict=True`` that raises instead (ProtocolError, ChainBroken,
        InventoryMismatch or ChecksumMismatch). A ``step`` older than the store's newest step always
        raises ProtocolError: the store is ahead of the trainer. Claims this
        uploader's writer epoch, so an older uploader of the run still alive is
        fenced off from then on.
        """
        if self._sharded is not None:
            return self._sharded.resume(strict=strict)
        return self._resumer.resume(self._adapter.state_of(state), step, strict=strict)

    # ------------------------------------------------------------------ push

    def push(self, state: Any, step: int) -> Future[CommitInfo]:
        """Diff ``state`` (nn.Module or dict of tensors) against the last push; return a Future.

        A ``peft.PeftModel`` pushes its active LoRA adapter only (docs/lora.md): its tensors under
        the names PEFT saves, and on the first push its ``adapter_config.json``, written once at the
        run's root and checked at every later push (AdapterMismatch naming the changed fields;
        UnsupportedAdapter for what vLLM cannot serve: ``modules_to_save``, DoRA, biases, several
        active adapters, LoRA on ``lm_head``).

        Returns once the changed elements are copied out: the caller may modify
        its tensors right away. The Future resolves to a :class:`CommitInfo`
        when the step is committed, or raises :class:`CommitFailed`. A step folded
        into a later one (``on_backlog="coalesce"`` while ``max_pending`` steps wait
        for the store) is not committed as its own step: its Future resolves when that
        later step is committed, with ``kind="skipped"``, ``committed_step`` the later
        step and that step's numbers (:attr:`CommitInfo.folded` is True); see :attr:`folded`.
        """
        if self._closed:
            raise RuntimeError("push() on a closed DeltaUploader")
        state = self._adapter.state_of(state)  # a PEFT model: its active adapter's LoRA tensors
        if self._sharded is not None:  # every rank's push joins the step's collective, a refused one too
            return self._sharded.push(state, step, self._pipeline.enqueue)
        chain, snaps, cfg = self._chain, self._snapshots, self.config
        chain.raise_if_fenced()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ProtocolError(f"step must be a non-negative integer, got {step!r}")
        last_step = chain.last_step
        if last_step is not None and step <= last_step:
            if snaps.last_job is None and not chain.resumed and chain.last_committed is not None:
                return self._resumer.push_committed_head(state, step)  # a restarted trainer (see resume())
            raise ProtocolError(
                f"step {step} is not after the last step {last_step}; steps must increase: push step {last_step + 1} "
                "or later"
            )
        if not self._writer.epoch:
            self._writer.claim(self._reader, chain)
            last_step = chain.last_step
            if last_step is not None and step <= last_step:
                raise ProtocolError(
                    f"step {step} is not after step {last_step}, which an older uploader of this run committed "
                    "just before this one took over (superseded: readers skip it); push a later step"
                )
        state_in = state_tensors(state)
        tensors = snaps.cast(state_in)
        inventory = snaps.inventory_of(tensors)  # the same object step after step: its manifest fields are kept
        head = chain.last_committed
        warn_dtype_change(step, snaps.inventory or (head.manifest.inventory if head else ()), inventory)
        # the previous step's diff and digests read the baseline and the staging buffers:
        # wait for them before touching either
        snaps.wait_for_last()
        if cfg.on_backlog == "block":
            self._pipeline.wait_for_room()
        total = inventory_facts(inventory).total  # kept per inventory tuple (the Snapshotter keeps the object)
        if (
            chain.failed
            or inventory != snaps.inventory
            or chain.anchor_due(cfg.anchor_every, cfg.anchor_bytes_fraction)
        ):
            job = snaps.anchor(step, tensors, inventory, total)
            chain.begin_anchor()
        else:
            job = snaps.patch(step, state_in, tensors, inventory, total, defer_diff=cfg.defer_diff)
            chain.count_patch()
        fut: Future[CommitInfo] = Future()
        fut.set_running_or_notify_cancel()
        job.futures.append((step, fut))
        chain.pushed(step)
        self._pipeline.submit(job)
        return fut

    # ------------------------------------------------------------- lifecycle

    @property
    def pending(self) -> int:
        """Pushed steps whose Futures are not resolved yet."""
        return self._chain.inflight

    @property
    def last_committed_step(self) -> int | None:
        """The newest step this uploader (or the store, at start) has committed."""
        last = self._chain.last_committed
        return last.manifest.step if last else None

    def wait_for_replicas(
        self,
        step: int | None = None,
        *,
        max_lag: int = 0,
        quorum: int | float | None = None,
        min_replicas: int = 1,
        unreachable: Literal["exclude", "wait"] = "exclude",
        healthy_only: bool = False,
        timeout: float = 600.0,
        poll: float = 0.5,
    ) -> FleetView:
        """The staleness gate: wait until the run's live replicas serve ``step - max_lag`` or newer.

        ``step`` defaults to the newest committed step. Every live replica must (default), or
        ``quorum`` of them (an int, or a fraction in (0, 1]), with at least ``min_replicas`` reporting; a
        replica reported ``unreachable`` is left out (``"exclude"``, named in a warning) or waited for
        (``"wait"``); with ``healthy_only`` only ``serving`` replicas count (not ``failed`` or
        ``diverged`` ones, whose behavioural audit failed: docs/audit.md). The
        replicas report to the signal server of ``signal_url`` under ``signal_run`` (default: the
        run id); reading the fleet takes ``signal_token``. Returns the fleet that passed; raises
        :class:`~deltasync.errors.StalenessTimeout` after ``timeout`` seconds, naming who is behind.
        See :func:`deltasync.signal.wait_for_fleet`.
        """
        cfg = self.config
        if not cfg.signal_url:
            raise ValueError(
                "wait_for_replicas needs a signal server: DeltaUploader(..., signal_url=URL) where the replicas "
                "report (docs/fleet.md)"
            )
        if step is None:
            step = self.last_committed_step
            if step is None:
                raise ValueError("wait_for_replicas: nothing is committed yet; push a step first or name one")
        if self.notifier is not None:
            self.notifier.flush(min(timeout, 10.0))  # the server knows the head, so lags are right
        from deltasync.signal import SignalClient, wait_for_fleet

        with SignalClient(cfg.signal_url, cfg.signal_token) as client:
            return wait_for_fleet(
                client,
                cfg.signal_run or self.run_id,
                step,
                max_lag=max_lag,
                quorum=quorum,
                min_replicas=min_replicas,
                unreachable=unreachable,
                healthy_only=healthy_only,
                timeout=timeout,
                poll=poll,
            )

    # ------------------------------------------------------------ audit

    def probes(self, probes: ProbeSet | None = None) -> ProbeSet:
        """The run's probe set (``probes.json``, docs/audit.md), stored once.

        The store's when it holds one (``probes``, if given, must be the same set: AlreadyExists
        otherwise); else ``probes``, or the default derived from the run
        (:func:`deltasync.run.probes.default_probes` of the pushed inventory and the run id), written
        now. Without ``probes``, needs a pushed or committed step (ValueError otherwise).
        """
        from deltasync.run.probes import default_probes, read_probes, write_probes

        if self._probes is not None and (probes is None or probes == self._probes):
            return self._probes
        stored = read_probes(self.store)
        if stored is None or (probes is not None and probes != stored):
            if probes is None:
                head = self._chain.last_committed
                inventory = self._snapshots.inventory or (head.manifest.inventory if head else ())
                if not inventory:
                    raise ValueError(
                        "probes(): the run has no probe set and nothing is pushed yet to derive one from: "
                        "push a step first, or pass a ProbeSet"
                    )
                probes = default_probes(inventory, self.run_id)
            write_probes(self.store, probes)  # AlreadyExists when the run holds another set
            stored = probes
        self._probes = stored
        return stored

    def attach_reference(
        self, step: int, model_or_logprobs: Any, *, probes: ProbeSet | None = None, dtype: str | None = None
    ) -> Future[Reference]:
        """Attach the trainer's reference logprobs of the run's probes at ``step`` (docs/audit.md).

        ``model_or_logprobs``: the model holding ``step``'s weights (an HF-style causal LM: one small
        batched no-grad forward runs here, on the caller's thread, in the model's own numerics), or
        the logprobs already computed (one row of ``len(probe) - 1`` floats per probe; ``dtype`` names
        the numerics they were computed in, default the model's parameter dtype, else ``unknown``). The object
        ``references/{step:012d}.json`` is written once in the background; the returned Future
        resolves to the :class:`~deltasync.protocol.probes.Reference` when it is stored (it raises
        CommitFailed / AlreadyExists / ProtocolError when it could not be). Receivers compare their
        engines' probe logprobs of ``step`` with it. The first call stores the run's probe set
        (:meth:`probes`).
        """
        from deltasync.protocol.probes import Reference
        from deltasync.uploader._reference import ReferenceWriter, model_dtype, probe_logprobs, rows_of

        if self._closed:
            raise RuntimeError("attach_reference() on a closed DeltaUploader")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ProtocolError(f"step must be a non-negative integer, got {step!r}")
        ps = self.probes(probes)
        if hasattr(model_or_logprobs, "parameters"):
            rows, dtype = probe_logprobs(model_or_logprobs, ps), dtype or model_dtype(model_or_logprobs)
        else:
            rows, dtype = rows_of(model_or_logprobs), dtype or "unknown"
        ref = Reference(step, ps.digest, ps.check_logprobs(rows, f"reference of step {step}"), dtype)
        if self._references is None:
            cfg = self.config
            self._references = ReferenceWriter(self.store, RetryPolicy(cfg.retries, cfg.retry_backoff), self._stop)
        return self._references.submit(ref, ps)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every pushed step is committed, skipped or failed (and its spans and references written)."""
        if not self._chain.wait_until_idle(timeout):
            raise TimeoutError(f"flush: {self._chain.inflight} steps still pending after {timeout} s")
        if self.spans is not None and not self.spans.flush(timeout):
            raise TimeoutError(f"flush: spans still being written after {timeout} s")
        if self._references is not None and not self._references.flush(timeout):
            raise TimeoutError(f"flush: references still being written after {timeout} s")

    def close(self, timeout: float | None = None) -> None:
        """Flush, then stop the background workers. Idempotent.

        When ``timeout`` passes first (flush raises TimeoutError) or flush is interrupted, the
        stop event is set before the workers stop: a commit waiting out a retry backoff gives up
        at once, its step failing with CommitFailed (the uploader is closing).
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.flush(timeout)
        finally:
            self._stop.set()
            self._pipeline.close(timeout)
            if self.spans is not None:
                self.spans.close(timeout)
            if self._references is not None:
                self._references.close(timeout)
            self._pool.shutdown(wait=True)
            if self.retention is not None:
                self.retention.close(timeout)
            if self.notifier is not None:
                self.notifier.close()
            if self._sharded is not None:
                self._sharded.close()

    def __enter__(self) -> DeltaUploader:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None and not getattr(self, "_closed", True):
            stop.set()
