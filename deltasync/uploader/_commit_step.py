"""Committing a step: from a :class:`~deltasync.uploader._job.StepJob` to a committed manifest, and
the step's Futures resolved.

The single-process uploader's commit stage runs :func:`commit_step` with the uploader's one
:class:`CommitContext`; a sharded push (:class:`~deltasync.uploader.sharded.ShardedPush`) builds on
the same pieces. In order:

1. :func:`write_step`: encode the patch files (:func:`build_patch`) or the anchor shards, write
   them create-only (:func:`put_step_files`), check the writer fence and write ``manifest.json``,
   the commit point, then ``HEAD.json`` (:func:`publish_manifest`);
2. every store write goes through :func:`with_retries` (transient errors only, a backoff the
   uploader's stop event cuts short) and :func:`put_idempotent` (a repeated create-only write that
   finds its own bytes counts as written);
3. the outcome goes to the :class:`~deltasync.uploader._chain.ChainState` (the steps folded into it
   to the :class:`FoldLog` first), then :class:`AfterCommit` tells the signal server, the span
   writer and retention, and :func:`resolve_committed` resolves the step's Futures.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import numpy as np

from deltasync._util.retry import RetryPolicy, retry_call
from deltasync.errors import AlreadyExists, CommitFailed, TransientStorageError
from deltasync.protocol import (
    AnchorEntry,
    Committed,
    EncodedTensor,
    FileInfo,
    Head,
    Manifest,
    PatchEntry,
    Stats,
    encode_changes,
    file_key,
    inventory_digest,
    kernels,
    manifest_key,
    xxh3_128,
)
from deltasync.protocol.canonical import MANIFEST_VERSION
from deltasync.protocol.checkpoint import build_checkpoint
from deltasync.protocol.entries import TensorInfo
from deltasync.protocol.keys import HEAD_KEY
from deltasync.protocol.manifest import Writer
from deltasync.protocol.manifest_v2 import InventoryFacts, inventory_facts, inventory_fields
from deltasync.protocol.patchfile import build_patch_files
from deltasync.storage import Store
from deltasync.storage.base import Data
from deltasync.uploader._chain import ChainState
from deltasync.uploader._config import CommitInfo, UploaderConfig
from deltasync.uploader._diff import TensorDiff
from deltasync.uploader._job import StepJob
from deltasync.uploader._pack import ChangeSet
from deltasync.uploader._writer import WriterIdentity

if TYPE_CHECKING:
    from deltasync.run.gc import RetentionWorker
    from deltasync.signal import Notifier

__all__ = [
    "AfterCommit",
    "CommitContext",
    "FoldLog",
    "InventoryMemo",
    "GROUP_NUMEL",
    "build_patch",
    "change_groups",
    "encode_groups",
    "commit_step",
    "make_manifest",
    "publish_manifest",
    "put_idempotent",
    "put_step_files",
    "resolve_committed",
    "with_retries",
    "write_step",
]

#: a failed commit is logged on this child of ``deltasync.uploader``, then raised into the step's futures;
#: a caller that reports every future's error itself (the CLI) quiets it, so the error is told once
failures = logging.getLogger("deltasync.uploader.commits")
log = logging.getLogger("deltasync.uploader")
T = TypeVar("T")


class FoldLog:
    """Counts the pushed steps folded into a later committed step, and says so once.

    In ``on_backlog="coalesce"`` mode a step that finds ``max_pending`` steps waiting for the
    store is merged into the newest waiting one (:func:`~deltasync.uploader._job.merge_jobs`):
    the steps folded that way are never committed as their own. :meth:`record` runs on the
    commit stage when the step they were folded into is committed: the first fold of the
    uploader is a WARNING on ``deltasync.uploader`` that names it and what to do, every later
    one a DEBUG line with the count. ``recent`` keeps the newest ``keep`` (step, committed step)
    pairs.
    """

    def __init__(self, max_pending: int, *, keep: int = 256) -> None:
        self.max_pending = max_pending
        self._lock = threading.Lock()
        self._count = 0
        self._recent: deque[tuple[int, int]] = deque(maxlen=keep)

    @property
    def count(self) -> int:
        """Pushed steps folded into a later committed step so far."""
        with self._lock:
            return self._count

    @property
    def recent(self) -> tuple[tuple[int, int], ...]:
        """The newest folds, oldest first, as (folded step, the committed step holding its changes)."""
        with self._lock:
            return tuple(self._recent)

    def record(self, steps: Sequence[int], into: int) -> None:
        """``steps`` were folded into ``into``, which has just been committed."""
        for step in steps:
            with self._lock:
                self._count += 1
                self._recent.append((step, into))
                count = self._count
            if count == 1:
                log.warning(
                    "deltasync: step %d was folded into step %d: the store fell behind (the commit of an earlier "
                    "step was still running and max_pending=%d steps were already waiting for it; "
                    "on_backlog='coalesce'), so step %d is not committed as its own step and no engine can be "
                    "updated to exactly it (its Future resolves with kind='skipped', committed_step=%d). To "
                    "commit every step: push less often, raise max_pending, use a faster store, or pass "
                    "on_backlog='block' (DeltaSyncCallback: keep_every_step=True; push() then waits for the store "
                    "while it is behind). Further folds are logged at DEBUG and counted in DeltaUploader.folded.",
                    step,
                    into,
                    self.max_pending,
                    step,
                    into,
                )
            else:
                log.debug("deltasync: step %d was folded into step %d (%d steps folded so far)", step, into, count)


@dataclass(slots=True)
class AfterCommit:
    """Who hears of a committed step: the fold log (steps folded into it), the signal server, the
    span writer (its ``submit``: the span writer writes with this module's functions), retention
    (each optional)."""

    folds: FoldLog | None = None
    notifier: Notifier | None = None
    write_spans: Callable[[Committed, Mapping[str, TensorDiff] | None], None] | None = None
    retention: RetentionWorker | None = None


class InventoryMemo:
    """A format-2 manifest's ``inventory`` string and digest, kept while the inventory stays the same
    object (the uploader's, from step to step): one canonical JSON pass and zstd frame per inventory,
    not per step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: tuple[tuple[TensorInfo, ...], str, str] | None = None

    def fields(self, inventory: tuple[TensorInfo, ...]) -> tuple[str, str]:
        """(``inventory`` string, ``inventory_digest``) of ``inventory``."""
        with self._lock:
            last = self._last
        if last is not None and last[0] is inventory:
            return last[1], last[2]
        blob, digest = inventory_fields(inventory)
        with self._lock:
            self._last = (inventory, blob, digest)
        return blob, digest


@dataclass(frozen=True, slots=True)
class CommitContext:
    """What a commit stage works with, single-process (:func:`commit_step`) or sharded
    (:class:`~deltasync.uploader.sharded.ShardedPush`): the store and config, the chain state it
    records outcomes in, the writer identity (fence), the encode pool, who hears of a commit, and
    the uploader's stop event (retry backoffs wait on it)."""

    store: Store
    config: UploaderConfig
    chain: ChainState
    writer: WriterIdentity
    pool: Executor
    after: AfterCommit
    stop: threading.Event
    inventory: InventoryMemo = field(default_factory=lambda: InventoryMemo())


def resolve_committed(job: StepJob, committed: Committed, seconds: float, *, skipped: bool = True) -> None:
    """Resolve the job's Futures with ``committed``: steps folded into it resolve as "skipped", with
    ``committed_step`` the committed step and its numbers (``skipped=False``: every step of the job
    is the committed one, a sharded push)."""
    m = committed.manifest
    for step, fut in job.futures:
        kind: Literal["anchor", "patch", "skipped"] = m.kind if step == m.step or not skipped else "skipped"
        st = m.stats
        done = m.step if skipped else step
        fut.set_result(
            CommitInfo(step, kind, st.nbytes, st.changed, st.total, m.anchor_step, committed.digest, done, seconds)
        )


def commit_step(ctx: CommitContext, job: StepJob) -> None:
    """The commit stage's work in a single-process uploader: write one step (:func:`write_step`),
    record the outcome in the chain state (the steps folded into it in the fold log first), tell
    who hears of a commit, and resolve the step's Futures (a failure goes to them, never raised)."""
    cfg = ctx.config
    t0 = time.perf_counter()
    try:
        if job.kind == "patch" and ctx.chain.failed:
            raise CommitFailed(f"step {job.step}: its parent step was not committed; the next push will be an anchor")
        if job.error is not None or (cfg.tensor_digests and len(job.digests) != len(job.inventory)):
            raise CommitFailed(f"step {job.step}: diffing or hashing the state failed: {job.error}")
        last = ctx.chain.last_committed
        committed = write_step(
            ctx.store,
            job,
            run_id=ctx.writer.run_id,
            parent=last,
            anchor_step=last.manifest.anchor_step if last else job.step,
            shard_bytes=cfg.shard_bytes,
            pool=ctx.pool,
            signing_key=cfg.signing_key,
            writer=ctx.writer.writer,
            fence=ctx.writer.check_fence,
            retry=RetryPolicy(cfg.retries, cfg.retry_backoff),
            stop=ctx.stop,
            format_version=cfg.format_version,
            inventory_memo=ctx.inventory,
        )
    except Exception as exc:  # noqa: BLE001 - re-raised into the futures
        failures.error("commit of step %d failed: %s", job.step, exc)
        err = exc if isinstance(exc, CommitFailed) else CommitFailed(f"step {job.step}: commit failed: {exc}")
        if err is not exc:
            err.__cause__ = exc
        ctx.chain.failed_step(job.futures, err)
        return
    m = committed.manifest
    if ctx.after.folds is not None:  # before the chain hears of it: flush() then sees every fold
        ctx.after.folds.record([s for s, _ in job.futures if s != m.step], m.step)
    ctx.chain.committed(committed, len(job.futures))
    if ctx.after.notifier is not None:
        ctx.after.notifier.notify(m.step, committed.digest, run_id=ctx.writer.run_id, kind=m.kind)
    if ctx.after.write_spans is not None:
        ctx.after.write_spans(committed, job.changes if m.kind == "patch" else None)
    # the job stays referenced until the next push (coalescing): let go of its arrays now
    job.changes, job.snapshot, job.staged = {}, {}, {}
    if m.kind == "anchor" and ctx.after.retention is not None:
        ctx.after.retention.trigger()
    resolve_committed(job, committed, time.perf_counter() - t0)


# ------------------------------------------------------------ writing a step


#: format 2 codes the changes of consecutive small tensors of one dtype as one group entry of about
#: this many elements (one encode, one set of zstd frames, one manifest entry for all of them)
GROUP_NUMEL = 1 << 22


def change_groups(job: StepJob, group_numel: int) -> list[tuple[str, ...]]:
    """The changed tensors, sorted by name, cut into groups: consecutive tensors of one dtype until a
    group holds ``group_numel`` elements; a tensor that large stands alone (0: every tensor alone)."""
    return cut_groups(_sorted_names(job.changes), job.inventory, group_numel)


def _sorted_names(changes: Mapping[str, Any]) -> list[str]:
    """The names of a step's changes, sorted."""
    return changes.sorted_names() if isinstance(changes, ChangeSet) else sorted(changes)


def _facts(inventory: Sequence[TensorInfo]) -> InventoryFacts:
    """An inventory's element counts and entries by name (kept per inventory tuple: every step repeats it)."""
    return inventory_facts(inventory) if isinstance(inventory, tuple) else InventoryFacts(inventory)


def cut_groups(names: Sequence[str], inventory: Sequence[TensorInfo], group_numel: int) -> list[tuple[str, ...]]:
    """:func:`change_groups` of the changed tensors ``names`` (sorted)."""
    facts = _facts(inventory)
    kern = kernels.impl()
    if kern is not None and len(names) > 64 and facts.unique:
        # one compiled pass over the names' dtype codes and sizes (a Python loop cost 10+ ms at 18k)
        codes, numels = facts.arrays()
        at = np.fromiter(map(facts.index.__getitem__, names), dtype=np.int64, count=len(names))
        cuts = np.empty(len(names) + 1, dtype=np.int64)
        n = kern.group_cuts(codes[at], numels[at], group_numel, cuts)
        bounds = [0, *cuts[:n].tolist(), len(names)]
        return [tuple(names[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    info, numel_of = facts.by_name, facts.numel_of
    groups: list[tuple[str, ...]] = []
    cur: list[str] = []
    size, dtype = 0, ""
    for name in names:
        t_dtype, t_numel = info[name].dtype, numel_of[name]
        if cur and (t_dtype != dtype or size + t_numel > group_numel):
            groups.append(tuple(cur))
            cur, size = [], 0
        cur.append(name)
        size, dtype = size + t_numel, t_dtype
    if cur:
        groups.append(tuple(cur))
    return groups


def encode_groups(
    changes: Mapping[str, TensorDiff],
    inventory: Sequence[TensorInfo],
    pool: Executor | None,
    group_numel: int,
) -> list[tuple[str | tuple[str, ...], EncodedTensor]]:
    """Encode every changed tensor (``group_numel`` > 0, format 2: every group of small tensors, see
    :func:`change_groups`), groups on ``pool`` at once; (tensor name or group of names, coding).
    A group of consecutive tensors of one pack is coded straight from the pack's arrays."""
    numel = _facts(inventory).numel_of
    groups = cut_groups(_sorted_names(changes), inventory, group_numel)
    packed = changes if isinstance(changes, ChangeSet) else None

    def enc(group: tuple[str, ...]) -> EncodedTensor:
        if len(group) == 1:
            c = changes[group[0]]
            return encode_changes(numel[group[0]], c.idx, c.old, c.new)
        if packed is not None and (run := packed.group(group)) is not None:
            idx, old, new, total = run
            return encode_changes(total, idx, old, new)
        cs = [changes[n] for n in group]
        offsets = np.cumsum([0] + [numel[n] for n in group[:-1]])
        idx = np.concatenate([c.idx + off for c, off in zip(cs, offsets.tolist(), strict=True)])
        old = np.concatenate([c.old for c in cs])
        new = np.concatenate([c.new for c in cs])
        return encode_changes(sum(numel[n] for n in group), idx, old, new)

    encoded = list(pool.map(enc, groups)) if pool is not None and len(groups) > 1 else [enc(g) for g in groups]
    return [(g if len(g) > 1 else g[0], e) for g, e in zip(groups, encoded, strict=True)]


def build_patch(
    job: StepJob,
    shard_bytes: int,
    pool: Executor | None,
    *,
    writer_id: str | None = None,
    group_numel: int = 0,
) -> tuple[dict[str, bytes], list[PatchEntry]]:
    """Encode every changed tensor (format 2, ``group_numel`` > 0: every group of small tensors, see
    :func:`change_groups`) and pack the blobs into ``patch-NNNNN.safetensors`` files (layout:
    :func:`deltasync.protocol.patchfile.build_patch_files`), named as ``writer_id``'s own."""
    items = encode_groups(job.changes, job.inventory, pool, group_numel)
    # the layout (entry names, metadata, one file per group of tensors) is the protocol's
    return build_patch_files(job.step, items, shard_bytes, writer_id=writer_id)


def write_step(
    store: Store,
    job: StepJob,
    *,
    run_id: str,
    parent: Committed | None,
    anchor_step: int,
    shard_bytes: int,
    pool: Executor | None,
    signing_key: bytes | None,
    writer: Writer | None = None,
    fence: Callable[[], None] | None = None,
    progress: Callable[[str], None] | None = None,
    retry: RetryPolicy | None = None,
    stop: threading.Event | None = None,
    format_version: int = MANIFEST_VERSION,
    inventory_memo: InventoryMemo | None = None,
) -> Committed:
    """Encode, write data files (create-only), then the manifest (create-only), then HEAD.

    ``format_version``: the manifest's (SPEC.md "Versioning"); 2 groups small tensors' changes.

    With ``writer`` the data files are named as that writer's own (``w{id}/...``,
    :func:`~deltasync.protocol.keys.writer_file_name`): no other writer ever writes their keys,
    so a writer racing this one for the same step (one of them fenced) cannot replace them,
    even on a store without create-only writes. ``fence`` runs after the data files and before the manifest: it raises when
    another uploader has taken over the run, so this one commits nothing more.
    Each write is retried on TransientStorageError under ``retry``; a repeated
    create-only write that finds its own bytes already stored is harmless. The
    manifest is only written once every data file is. Setting ``stop`` (the uploader is
    closing) cuts a retry's backoff short: the step then fails with CommitFailed.
    """
    own = writer.id if writer is not None else None
    if job.kind == "patch":
        grouped = GROUP_NUMEL if format_version >= 2 else 0
        files, entries_p = build_patch(job, shard_bytes, pool, writer_id=own, group_numel=grouped)
        entries: tuple[PatchEntry, ...] | tuple[AnchorEntry, ...] = tuple(entries_p)
    else:
        files, entries_a = build_checkpoint(job.inventory, job.snapshot, shard_bytes, writer_id=own)
        entries = tuple(entries_a)
    infos = tuple(FileInfo(name, len(data), xxh3_128(data)) for name, data in sorted(files.items()))
    manifest = make_manifest(
        job,
        infos,
        entries,
        run_id=run_id,
        parent=parent,
        anchor_step=anchor_step,
        writer=writer,
        changed=job.changed,
        format_version=format_version,
        inventory_memo=inventory_memo,
    )
    if signing_key is not None:
        manifest = manifest.signed(signing_key)
    if progress:
        progress(f"step {job.step}: writing {len(files)} files")
    policy = retry or RetryPolicy(retries=0)
    put_step_files(store, job.step, files, policy, stop=stop)
    return publish_manifest(store, manifest, policy, fence, stop=stop)


def make_manifest(
    job: StepJob,
    infos: tuple[FileInfo, ...],
    entries: tuple[PatchEntry, ...] | tuple[AnchorEntry, ...],
    *,
    run_id: str,
    parent: Committed | None,
    anchor_step: int,
    writer: Writer | None,
    changed: int,
    format_version: int = MANIFEST_VERSION,
    inventory_memo: InventoryMemo | None = None,
) -> Manifest:
    """The (unsigned) manifest of ``job`` whose data files are ``infos`` holding ``entries``."""
    blob: str | None = None
    if format_version >= 2:
        blob, inv_digest = (inventory_memo or InventoryMemo()).fields(job.inventory)
    else:
        inv_digest = inventory_digest(job.inventory)
    return Manifest(
        run_id=run_id,
        step=job.step,
        kind=job.kind,
        parent_step=parent.manifest.step if parent else None,
        parent_digest=parent.digest if parent else None,
        anchor_step=job.step if job.kind == "anchor" else anchor_step,
        inventory=job.inventory,
        inventory_digest=inv_digest,
        files=infos,
        entries=entries,
        tensor_digests=dict(job.digests),
        stats=Stats(changed, job.total, sum(f.size for f in infos)),
        writer=writer,
        format_version=format_version,
        inventory_blob=None if blob is None else (blob, job.inventory),
    )


def put_step_files(
    store: Store, step: int, files: Mapping[str, Data], policy: RetryPolicy, *, stop: threading.Event | None = None
) -> None:
    """Write a step's data files (create-only, retried until ``stop``); returns once they are durable.

    Objects already there with other bytes and no manifest for the step are replaced: with
    names of the writer's own (:func:`~deltasync.protocol.keys.writer_file_name`) they can only
    be this writer's leftovers (a retry after a lost reply, a step number it pushes again)."""
    data = {file_key(step, n): d for n, d in files.items()}
    mkey = manifest_key(step)

    def put_files() -> None:
        try:
            put_idempotent(store, data)
        except AlreadyExists:
            # Leftovers of a commit of this writer that never got its manifest: no manifest
            # refers to them, so they may be replaced. Another writer's files have other names.
            if store.exists(mkey):
                raise
            store.put_many(data, mode="overwrite")

    with_retries(put_files, policy, f"step {step}: writing {len(data)} data files", stop=stop)


def publish_manifest(
    store: Store,
    manifest: Manifest,
    policy: RetryPolicy,
    fence: Callable[[], None] | None = None,
    *,
    stop: threading.Event | None = None,
) -> Committed:
    """Check the fence, then write the manifest (create-only) and HEAD.json: commits the step.

    Call only once every data file the manifest lists is written."""
    what = f"step {manifest.step}"
    if fence is not None:
        with_retries(fence, policy, f"{what}: checking the writer fence", stop=stop)
    body = manifest.to_json()
    with_retries(
        lambda: put_idempotent(store, {manifest_key(manifest.step): body}),
        policy,
        f"{what}: writing its manifest",
        stop=stop,
    )
    digest = xxh3_128(body)
    head = Head(manifest.step, digest, manifest.run_id).to_json()
    with_retries(lambda: store.put(HEAD_KEY, head), policy, f"{what}: writing HEAD.json", stop=stop)
    return Committed(manifest, digest)


# ------------------------------------------------------------ store writes: retried, harmless when repeated


def with_retries(
    fn: Callable[[], T],
    policy: RetryPolicy,
    what: str,
    *,
    stop: threading.Event | None = None,
    wait: Callable[[float], object] | None = None,
) -> T:
    """Call ``fn``; on TransientStorageError wait and call again, up to ``policy.retries`` times.

    Gives up with :class:`CommitFailed` naming ``what``, the attempts and the last cause; when
    ``stop`` is set (the uploader is closing) it gives up at once instead of waiting out a backoff.
    ``wait`` replaces the Event wait in tests.
    """

    def give_up(exc: BaseException, attempts: int, stopped: bool) -> BaseException:
        if stopped:
            return CommitFailed(f"{what}: stopped after {attempts} attempts (the uploader is closing): {exc}")
        return CommitFailed(f"{what}: gave up after {attempts} attempts: {exc}")

    return retry_call(
        fn, policy, what, retry_on=(TransientStorageError,), stop=stop, give_up=give_up, logger=log, wait=wait
    )


def _payload_bytes(data: Data) -> bytes:
    return data.read_bytes() if isinstance(data, Path) else memoryview(data).cast("B").tobytes()


def put_idempotent(store: Store, items: Mapping[str, Data]) -> None:
    """Create-only write of ``items``; objects already holding exactly these bytes count as written."""
    try:
        store.put_many(items, mode="create")
        return
    except AlreadyExists:
        pass
    keys = list(items)
    common = os.path.commonprefix(keys)
    present = {o.key for o in store.list(common)} & set(keys)
    if present:
        stored = store.get_many(sorted(present))
        clash = sorted(k for k in present if stored[k] != _payload_bytes(items[k]))
        if clash:
            raise AlreadyExists(f"{store.url}: {clash[0]} already exists with other content")
    rest = {k: v for k, v in items.items() if k not in present}
    if rest:
        store.put_many(rest, mode="create")
