"""DeltaUploader: diff on push, encode and write in the background."""

from __future__ import annotations

import os
import threading
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np

from deltasync._retry import RetryPolicy
from deltasync._tensors import flat_bits, state_tensors
from deltasync.errors import ProtocolError, WriterFenced
from deltasync.protocol import Committed
from deltasync.protocol.digests import xxh3_128_array
from deltasync.run import RunReader
from deltasync.run.claims import is_fenced, newest_claim
from deltasync.run.gc import RetentionWorker
from deltasync.storage import Store, open_store
from deltasync.uploader import _resume
from deltasync.uploader._commit import StepJob
from deltasync.uploader._config import CommitInfo, UploaderConfig
from deltasync.uploader._diff import Baseline, TensorChange, diff_tensor, inventory_of
from deltasync.uploader._dtypes import warn_dtype_change
from deltasync.uploader._pipeline import commit_loop, digest_loop
from deltasync.uploader._spans import SpanWriter

if TYPE_CHECKING:
    import torch

    from deltasync.signal import Notifier
    from deltasync.uploader._sharded import ShardedPush

__all__ = ["CommitInfo", "DeltaUploader", "UploaderConfig"]


class DeltaUploader:
    """Push training states; each step becomes a sparse patch (or an anchor) in ``store``.

    ``push()`` diffs bit-wise against the last pushed state on the tensors' own
    device, copies out only the changed elements and returns a Future. Two
    background threads do the rest: one hashes the new state (the next push
    waits for it, never for the store), one encodes and writes files, then the
    manifest, then HEAD. Use as a context manager, or call :meth:`close`.
    """

    def __init__(
        self, store: Store | str | os.PathLike[str], *, config: UploaderConfig | None = None, **options: Any
    ) -> None:
        self.store = store if isinstance(store, Store) else open_store(store)  # a URL or path works too
        self.config = replace(config or UploaderConfig(), **options)
        self._baseline = Baseline()
        self._staging: dict[str, torch.Tensor] = {}
        self._digest_cache: dict[str, str] = {}
        self._pushes_since_anchor = 0
        self._last_step: int | None = None
        self._needs_anchor = True
        self._resumed = False  # resume() was called, or a first push proved the store's head
        self._closed = False
        self._prev_job: StepJob | None = None
        # committer state (touched by the commit thread, read under _cond)
        self._cond = threading.Condition()
        self._pending: deque[StepJob] = deque()
        self._last_committed: Committed | None = None
        self._last_ok = True
        self._bytes_since_anchor = 0
        self._anchor_bytes = 0
        self._inflight = 0
        self.failures = 0
        self._fenced: WriterFenced | None = None
        self._reader = RunReader(self.store)
        self._latest_in_store()
        self.run_id = self.config.run_id or (
            self._last_committed.manifest.run_id if self._last_committed else uuid.uuid4().hex[:16]
        )
        # single writer per run prefix: the first push() claims the next epoch (0 until then), so an
        # uploader that never pushes (a refused upload) leaves no claim; a newer claim fences this one off
        self.writer_id = uuid.uuid4().hex[:16]
        self.epoch = 0
        self.notifier: Notifier | None = None  # counts sent / failed signals
        # under torch.distributed (world > 1) every rank pushes its own shards (a collective here)
        self._sharded: ShardedPush | None = None
        if self.config.distributed is not False:
            from deltasync.uploader._sharded import sharded_push

            self._sharded = sharded_push(self)
        if self.config.signal_url:
            from deltasync.signal import Notifier

            run = self.config.signal_run or self.run_id
            self.notifier = Notifier(self.config.signal_url, run, self.config.signal_token)
            if self._sharded is not None and self._sharded.rank != 0:
                self.notifier = None  # only rank 0 commits and signals
        self.retention: RetentionWorker | None = None  # keep_anchors: gc after each committed anchor
        if self.config.keep_anchors is not None and (self._sharded is None or self._sharded.rank == 0):
            self.retention = RetentionWorker(self.store, self.config.keep_anchors, signing_key=self.config.signing_key)
        self._digest_q: deque[StepJob | None] = deque()
        self._digest_cv = threading.Condition()
        self._pool = ThreadPoolExecutor(max(1, self.config.encode_threads), thread_name_prefix="deltasync-encode")
        self._stop = threading.Event()
        #: writes spans after commits (None when ``span_levels`` is empty, or in a sharded push, whose
        #: changes live on their owner ranks); counts written/failed spans
        self.spans: SpanWriter | None = None
        if self.config.span_levels and self._sharded is None:
            self.spans = SpanWriter(
                self.store,
                self.config.span_levels,
                shard_bytes=self.config.shard_bytes,
                signing_key=self.config.signing_key,
                retry=RetryPolicy(self.config.retries, self.config.retry_backoff),
            )
        self._threads = [
            threading.Thread(target=digest_loop, args=(self,), name="deltasync-digest", daemon=True),
            threading.Thread(target=commit_loop, args=(self,), name="deltasync-commit", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------ store state

    def _latest_in_store(self) -> None:
        latest = self._reader.latest_step()  # skips a fenced writer's late commits
        if latest is not None:
            self._last_committed = self._reader.committed(latest)
            self._last_step = latest

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
        return _resume.resume(self, state, step, strict=strict)

    # ------------------------------------------------------------------ push

    def _prepare(self, state: Any) -> dict[str, torch.Tensor]:
        return self._cast(state_tensors(state))

    def _cast(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        cast = self.config.cast_dtype
        if cast is not None:
            tensors = {k: v.to(cast) if v.is_floating_point() and v.dtype != cast else v for k, v in tensors.items()}
        return tensors

    def _anchor_due(self) -> bool:
        cfg = self.config
        if self._needs_anchor or self._pushes_since_anchor + 1 >= cfg.anchor_every:
            return True
        return bool(
            cfg.anchor_bytes_fraction
            and self._anchor_bytes
            and self._bytes_since_anchor > cfg.anchor_bytes_fraction * self._anchor_bytes
        )

    def push(self, state: Any, step: int) -> Future[CommitInfo]:
        """Diff ``state`` (nn.Module or dict of tensors) against the last push; return a Future.

        Returns once the changed elements are copied out: the caller may modify
        its tensors right away. The Future resolves to a :class:`CommitInfo`
        when the step is committed, or raises :class:`CommitFailed`.
        """
        if self._closed:
            raise RuntimeError("push() on a closed DeltaUploader")
        if self._fenced is not None:
            raise self._fenced
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ProtocolError(f"step must be a non-negative integer, got {step!r}")
        if self._last_step is not None and step <= self._last_step:
            if (
                self._prev_job is None
                and not self._resumed
                and self._last_committed is not None
                and self._sharded is None
            ):
                return _resume.push_committed_head(self, state, step)  # a restarted trainer (see resume())
            raise ProtocolError(f"step {step} is not after the last step {self._last_step}; steps must increase")
        if self._sharded is not None:
            return self._sharded.push(state, step)
        if not self.epoch:
            _resume.claim(self)
            if self._last_step is not None and step <= self._last_step:
                raise ProtocolError(
                    f"step {step} is not after step {self._last_step}, which an older uploader of this run committed "
                    "just before this one took over (superseded: readers skip it); push a later step"
                )
        state_in = state_tensors(state)
        tensors = self._cast(state_in)
        inventory = inventory_of(tensors)
        head = self._last_committed.manifest.inventory if self._last_committed else ()
        warn_dtype_change(step, self._baseline.inventory or head, inventory)  # fp32 pushed into a bf16 run
        # the previous step's diff and digests read the baseline and the staging buffers:
        # wait for them before touching either
        if self._prev_job is not None:
            self._prev_job.digests_ready.wait()
        if self.config.on_backlog == "block":
            with self._cond:
                self._cond.wait_for(lambda: len(self._pending) < self.config.max_pending)
        with self._cond:
            failed = not self._last_ok
        total = sum(t.numel for t in inventory)
        if failed or inventory != self._baseline.inventory or self._anchor_due():
            job = self._snapshot_anchor(step, tensors, inventory, total)
        else:
            if self.config.defer_diff:
                # only copy here; the diff against the baseline runs on the digest thread
                job = StepJob(step, "patch", inventory, staged=self._stage(state_in, tensors), total=total)
            else:
                job = StepJob(
                    step, "patch", inventory, staged={k: flat_bits(t) for k, t in tensors.items()}, total=total
                )
                self._diff(job)
            self._pushes_since_anchor += 1
        fut: Future[CommitInfo] = Future()
        fut.set_running_or_notify_cancel()
        job.futures.append((step, fut))
        self._last_step = step
        self._prev_job = job
        with self._cond:
            self._inflight += 1
        with self._digest_cv:
            self._digest_q.append(job)
            self._digest_cv.notify()
        return fut

    def _stage(self, given: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Flat bit views of this step's tensors that the caller cannot change any more.

        Tensors that ``cast_dtype`` just made are ours already; the caller's own are
        copied into reused staging buffers (one memcpy, about one compare pass).
        """
        out: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            bits = flat_bits(t)
            if t is not given.get(name):
                out[name] = bits
                continue
            buf = self._staging.get(name)
            if buf is None or buf.dtype != bits.dtype or buf.shape != bits.shape or buf.device != bits.device:
                buf = self._staging[name] = bits.new_empty(bits.shape)
            if buf.device.type == "cpu":
                np.copyto(buf.numpy(), bits.numpy())  # a plain memcpy; torch's copy_ threads badly under load
            else:
                buf.copy_(bits)
            out[name] = buf
        return out

    def _snapshot_anchor(self, step: int, tensors: dict[str, torch.Tensor], inventory: Any, total: int) -> StepJob:
        same = inventory == self._baseline.inventory
        snapshot: dict[str, Any] = {}
        base = self._baseline.tensors if same else {}
        for name, t in tensors.items():
            bits = flat_bits(t)
            if same:
                base[name].copy_(bits)
            else:
                base[name] = bits.clone()
            snapshot[name] = base[name].cpu().numpy().copy()
        self._baseline = Baseline(base, inventory)
        self._digest_cache.clear()
        self._needs_anchor = False
        self._pushes_since_anchor = 0
        with self._cond:  # count patch bytes from this anchor on, not from its commit (no double anchors)
            self._bytes_since_anchor = 0
        return StepJob(step, "anchor", inventory, snapshot=snapshot, changed=total, total=total)

    # -------------------------------------------------------------- digests

    def _prefault_staging(self) -> None:
        """Allocate and touch the staging buffers now, off the caller's thread, so that the
        next push() copies into warm memory instead of paying the page faults."""
        for name, base in self._baseline.tensors.items():
            buf = self._staging.get(name)
            if buf is None or buf.dtype != base.dtype or buf.shape != base.shape or buf.device != base.device:
                self._staging[name] = base.new_zeros(base.shape)

    def _diff(self, job: StepJob) -> None:
        names = list(job.staged)

        def one(name: str) -> TensorChange | None:
            return diff_tensor(self._baseline.tensors[name], job.staged[name])

        # tensors at once: the compiled diff releases the GIL (each updates its own baseline)
        found = list(self._pool.map(one, names)) if len(names) > 1 else [one(n) for n in names]
        changes = {n: c for n, c in zip(names, found, strict=True) if c is not None}
        job.staged = {}
        job.changes = changes
        job.changed = sum(int(c.idx.size) for c in changes.values())

    def _digest(self, job: StepJob) -> None:
        for info in job.inventory:
            name = info.name
            if job.kind == "anchor":
                arr = job.snapshot[name]
            elif name in job.changes or name not in self._digest_cache:
                arr = self._baseline.tensors[name].cpu().numpy()
            else:
                job.digests[name] = self._digest_cache[name]
                continue
            job.digests[name] = self._digest_cache[name] = xxh3_128_array(arr)

    # --------------------------------------------------------------- commits

    def _check_fence(self) -> None:
        if is_fenced(self.store, self.epoch):
            newer = newest_claim(self.store)
            raise WriterFenced(
                f"another uploader (writer {newer.writer}, epoch {newer.epoch}) took over run prefix "
                f"{self.store} after step {newer.after_step}; this uploader (epoch {self.epoch}) stops committing. "
                "Run one uploader per run prefix."
            )

    # ------------------------------------------------------------- lifecycle

    @property
    def pending(self) -> int:
        """Pushed steps whose Futures are not resolved yet."""
        with self._cond:
            return self._inflight

    @property
    def last_committed_step(self) -> int | None:
        """The newest step this uploader (or the store, at start) has committed."""
        with self._cond:
            return self._last_committed.manifest.step if self._last_committed else None

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every pushed step is committed, skipped or failed (and its spans written)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._inflight == 0, timeout=timeout):
                raise TimeoutError(f"flush: {self._inflight} steps still pending after {timeout} s")
        if self.spans is not None and not self.spans.flush(timeout):
            raise TimeoutError(f"flush: spans still being written after {timeout} s")

    def close(self, timeout: float | None = None) -> None:
        """Flush, then stop the background threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.flush(timeout)
        finally:
            self._stop.set()
            with self._digest_cv:
                self._digest_q.append(None)
                self._digest_cv.notify()
            with self._cond:
                self._cond.notify_all()
            for t in self._threads:
                t.join(timeout)
            if self.spans is not None:
                self.spans.close(timeout)
            self._pool.shutdown(wait=True)
            if self.retention is not None:
                self.retention.close(timeout)
            if self.notifier is not None:
                self.notifier.close()

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
