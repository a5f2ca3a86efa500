"""Sharded push: every rank of a torch.distributed group pushes its own (DTensor) shards.

Each rank keeps a baseline of its local shards on their device and diffs them
there; the changed positions, mapped to global flat positions, go to each
tensor's owner rank over a dedicated gloo group; owners keep host copies of
the tensors they own, encode them and write their own files; rank 0 checks the
ranks' reports against the store and commits the manifest. No rank holds the
whole state. One step is in flight at a time, so every rank takes the same
decisions (anchor or patch, rebuild or not) from the same history.

:class:`ShardedPush` replaces a :class:`~deltasync.uploader.DeltaUploader`'s
push and commit: it works with the uploader's chain state, writer identity and
commit pipeline through their methods.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from deltasync._util.retry import RetryPolicy
from deltasync.errors import CommitFailed, ProtocolError, WriterFenced
from deltasync.protocol import Committed, TensorInfo, inventory_digest
from deltasync.protocol.keys import manifest_key
from deltasync.protocol.manifest import MAX_MANIFEST_BYTES
from deltasync.run.manifests import parse_committed
from deltasync.uploader._commit_step import CommitContext, resolve_committed
from deltasync.uploader._config import CommitInfo, UploaderConfig
from deltasync.uploader._diff import TensorDiff, diff_tensor
from deltasync.uploader._job import StepJob
from deltasync.uploader.sharded._channel import ChannelError, RankChannel, next_uploader_number
from deltasync.uploader.sharded._dtensor import local_shards
from deltasync.uploader.sharded._owner import OwnerCopies, RankReport, commit_on_rank0, write_rank_files
from deltasync.uploader.sharded._shardmap import AnchorPlan, Box, anchor_plan, owner_map, rounds, to_global

if TYPE_CHECKING:
    import torch

__all__ = ["ShardedJob", "ShardedPush", "sharded_wanted"]

log = logging.getLogger("deltasync.uploader")


def sharded_wanted(config: UploaderConfig) -> bool:
    """Whether an uploader with ``config`` pushes sharded: torch.distributed runs with world > 1
    (or ``distributed=True``, which then requires an initialized group)."""
    want = config.distributed
    if want is False:
        return False
    torch_mod = sys.modules.get("torch")  # never imported: no group can be initialized
    dist = getattr(torch_mod, "distributed", None) if torch_mod is not None else None
    active = dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if want is None and not active:
        return False
    if want and not (dist is not None and dist.is_available() and dist.is_initialized()):
        raise ValueError("distributed=True needs an initialized torch.distributed process group")
    return True


@dataclass(frozen=True, slots=True)
class _Header:
    seq: int  # the n-th push() of this uploader on this rank
    step: Any  # what the rank pushed (an int, unless its push was refused)
    kind: str  # "anchor", "patch" or "resume" (a first push of the committed head)
    inventory_digest: str
    rebuild: bool
    error: str | None


@dataclass(frozen=True, slots=True)
class _Outcome:
    committed: Committed | None
    error: str | None
    fenced: bool = False
    writer: tuple[str, int] = ("", 0)
    resumed: bool = False  # every rank re-pushed the committed head: nothing written


@dataclass(slots=True)
class ShardedJob(StepJob):
    """A step on one rank: its local changes (local flat positions) and whether owners rebuild."""

    rebuild: bool = False
    local: dict[str, TensorDiff] = field(default_factory=dict)
    seq: int = 0
    pushed: Any = None  # the step argument as given to push()
    resume: bool = False


class ShardedPush:
    """The per-rank engine. Constructing it is a collective (every rank opens the uploader's gloo group).

    Each step is one agreed fact: the ranks exchange headers (a rank whose push was refused
    takes part with its error), rank 0 commits or not, and every rank resolves the step the same
    way. When the group loses contact mid-step (a rank slower than ``distributed_timeout``, or
    dead), each rank settles the step from the store (committed iff rank 0's manifest is there),
    drops the group, and the next push opens a new one, waiting up to :data:`JOIN_FACTOR` times
    ``distributed_timeout`` for the late ranks; that step is an anchor.
    """

    #: a new group waits this many times ``distributed_timeout`` for every rank to join
    JOIN_FACTOR = 4

    def __init__(self, ctx: CommitContext) -> None:
        self.ctx = ctx  # ctx.after: rank 0 only: a notifier and retention (no spans in a sharded push)
        self._name = f"u{next_uploader_number()}"
        self.channel: RankChannel | None = None
        try:
            self.channel = self._open(0)
            # rank 0's view of the run is everyone's
            writer, chain = ctx.writer, ctx.chain
            run_id, committed, last_step, rank0_writer = self.channel.broadcast(
                (writer.run_id, chain.last_committed, chain.last_step, writer.writer_id)
            )
        except ChannelError as exc:
            raise CommitFailed(
                f"creating a sharded DeltaUploader: {exc}. Every rank of the torch.distributed group must "
                "create the uploader (it is a collective call)"
            ) from exc
        self.rank, self.world = self.channel.rank, self.channel.world
        writer.adopt(run_id, writer.writer_id, writer.epoch)
        chain.set_view(committed, last_step)
        self.rank0_writer: str = rank0_writer  # whose manifests are this group's commits
        self.seq = 0  # pushes so far (the same on every rank: each pushes every step)
        self.base: dict[str, torch.Tensor] = {}  # flat bits of the local shards this rank contributes
        self.staging: dict[str, torch.Tensor] = {}  # defer_diff: this step's shards, diffed on the commit thread
        self.boxes: dict[str, Box] = {}
        self.inventory: tuple[TensorInfo, ...] = ()
        self.owners: dict[str, int] = {}
        self.plan: AnchorPlan | None = None
        self.copies = OwnerCopies()
        self._written: Committed | None = None  # rank 0: the step it committed, until every rank knows

    def _open(self, seq: int) -> RankChannel:
        t = self.ctx.config.distributed_timeout
        return RankChannel(f"{self._name}/{seq}", timeout=t, join_timeout=t * self.JOIN_FACTOR)

    def close(self) -> None:
        """Drop the group's connections."""
        if self.channel is not None:
            self.channel.close()

    @property
    def buffer_bytes(self) -> int:
        """Bytes this rank's uploader holds: baseline and staged shards plus its owner copies."""
        return _nbytes(self.base) + _nbytes(self.staging) + self.copies.nbytes

    def resume(self, *, strict: bool) -> bool:
        """A sharded state cannot be proven (no rank holds whole tensors): False (or ProtocolError
        with ``strict``); the first push is an anchor."""
        msg = "resume() cannot prove a sharded state (no rank holds whole tensors); the first push is an anchor"
        if strict:
            raise ProtocolError(msg)
        log.warning("%s", msg)
        return False

    # ------------------------------------------------------------------ push

    def push(self, state: Any, step: int, enqueue: Callable[[StepJob], None]) -> Future[CommitInfo]:
        """Diff this rank's shards against its baseline and ``enqueue`` the step (see DeltaUploader.push).

        A push this rank refuses (a step that is not after the last one, not an integer) still
        takes part in the step's collective with its error, so every rank fails the step with the
        same CommitFailed and the group stays in step.
        """
        chain = self.ctx.chain
        chain.wait_until_idle()  # one step in flight: the previous outcome is known here on every rank
        chain.raise_if_fenced()  # the fence is an agreed outcome: every rank raises here alike
        self.seq += 1
        job = ShardedJob(step if _is_step(step) else -1, "patch", (), seq=self.seq, pushed=step)
        try:
            self._check_step(job, step)
            self._snapshot(job, state)
        except Exception as exc:  # noqa: BLE001 - every rank must still take part in the step's commit
            if not isinstance(exc, ProtocolError):
                log.exception("sharded push of step %r failed on rank %d", step, self.rank)
            job.error = exc
            self.base, self.boxes = {}, {}
        job.digests_ready.set()
        fut: Future[CommitInfo] = Future()
        fut.set_running_or_notify_cancel()
        job.futures.append((job.step, fut))
        chain.pushed(job.step if job.error is None else None)
        enqueue(job)
        return fut

    def _check_step(self, job: ShardedJob, step: Any) -> None:
        chain = self.ctx.chain
        if not _is_step(step):
            raise ProtocolError(f"step must be a non-negative integer, got {step!r}")
        last = chain.last_step
        if last is None or step > last:
            return
        head = chain.last_committed
        if self.seq == 1 and head is not None and step == head.manifest.step and not chain.resumed:
            job.resume = True  # a restarted trainer re-pushing the store's newest step: writes nothing
            return
        if self.seq == 1 and head is not None and step < head.manifest.step:
            raise ProtocolError(
                f"step {step} is older than the store's newest step {head.manifest.step}: the store is ahead of "
                "the trainer; push a step after it (it becomes an anchor) or use a new run prefix"
            )
        raise ProtocolError(f"step {step} is not after the last step {last}; push step {last + 1} or later")

    def _snapshot(self, job: ShardedJob, state: Any) -> None:
        cfg = self.ctx.config
        bits, boxes_in, infos = local_shards(state, cfg.cast_dtype)
        inventory = tuple(infos)
        if inventory != self.inventory:
            self.owners = owner_map(inventory, self.world)
            self.plan = None
        boxes: dict[str, Box] = {}
        for info in inventory:
            b = boxes_in[info.name]
            if b is None:  # replicated: only its owner takes it
                if self.owners[info.name] == self.rank:
                    boxes[info.name] = Box.whole(info.shape)
            elif b.numel:
                boxes[info.name] = b
        rebuild = self.ctx.chain.needs_anchor or inventory != self.inventory or boxes != self.boxes
        job.inventory, job.total = inventory, sum(t.numel for t in inventory)
        anchor_due = self.ctx.chain.anchor_due(cfg.anchor_every, cfg.anchor_bytes_fraction)
        job.kind = "anchor" if rebuild or anchor_due else "patch"
        job.rebuild = rebuild
        self.inventory = inventory
        if rebuild:
            self.base = {name: bits[name].clone() for name in boxes}
            self.boxes = boxes
            self.staging = {}
            return
        if cfg.defer_diff:  # one copy of this rank's shards now; the diff runs on the commit thread
            job.staged = {name: self._stage(name, bits[name]) for name in boxes}
            return
        for name in boxes:
            c = diff_tensor(self.base[name], bits[name])
            if c is not None:
                job.local[name] = c

    def _stage(self, name: str, bits: torch.Tensor) -> torch.Tensor:
        buf = self.staging.get(name)
        if buf is None or buf.dtype != bits.dtype or buf.shape != bits.shape or buf.device != bits.device:
            buf = self.staging[name] = bits.new_empty(bits.shape)
        if buf.device.type == "cpu":
            np.copyto(buf.numpy(), bits.numpy())  # a plain memcpy
        else:
            buf.copy_(bits)
        return buf

    # --------------------------------------------------------------- commit

    def commit(self, job: StepJob) -> None:
        """The commit thread's work for one step, in lockstep with every other rank."""
        assert isinstance(job, ShardedJob)
        t0 = time.perf_counter()
        self._written = None
        try:
            if self.channel is None:  # the last group lost contact: every rank opens a new one for this push
                self.channel = self._open(job.seq)
            outcome = self._commit_collective(job)
        except ChannelError as exc:
            outcome = self._settle_from_store(job, exc)
        self._resolve(job, outcome, t0)

    def _settle_from_store(self, job: ShardedJob, exc: ChannelError) -> _Outcome:
        """The group lost contact during ``job``: decide its outcome from the store, drop the group.

        Rank 0 knows whether it wrote the manifest; the other ranks look for it (rank 0 may
        still be writing it: they look for up to ``distributed_timeout``). A commit found there is
        reported as a commit: a step is never reported failed once it is committed.
        """
        if self.channel is not None:  # never used again: the next push opens a new group
            self.channel.close()
            self.channel = None
        log.error("step %r: rank %d lost contact with the rank group: %s", job.pushed, self.rank, exc)
        if self._written is not None:
            return _Outcome(self._written, None, writer=(self.ctx.writer.writer_id, self.ctx.writer.epoch))
        found = None if self.rank == 0 or job.error is not None else self._find_commit(job.step)
        if found is not None:
            w = found.manifest.writer
            return _Outcome(found, None, writer=(w.id, w.epoch) if w else ("", 0))
        return _Outcome(
            None,
            f"step {job.pushed}: the rank group lost contact during the step ({exc}); the step was not committed. "
            f"A rank slower than distributed_timeout={self.ctx.config.distributed_timeout:g} s or a dead rank does "
            "this. Keep pushing on every rank: the next push waits for every rank to rejoin and is an anchor",
        )

    def _find_commit(self, step: int) -> Committed | None:
        """Rank 0's manifest of ``step`` in the store, looked for up to ``distributed_timeout`` seconds."""
        store, key = self.ctx.store, manifest_key(step)
        deadline = time.monotonic() + self.ctx.config.distributed_timeout
        wait = 0.05
        while True:
            try:
                body = store.get_bounded(key, MAX_MANIFEST_BYTES) if store.exists(key) else None
                if body is not None:
                    c = parse_committed(step, bytes(body), where=store.url)
                    w = c.manifest.writer
                    return c if w is not None and w.id == self.rank0_writer else None
            except Exception as exc:  # noqa: BLE001 - an unreadable store: the step counts as not committed
                log.warning("step %d: could not read its manifest to settle the step: %s", step, exc)
                return None
            left = deadline - time.monotonic()
            if left <= 0 or self.ctx.stop.wait(min(wait, left)):
                return None
            wait = min(wait * 2, 1.0)

    def _commit_collective(self, job: ShardedJob) -> _Outcome:
        assert self.channel is not None
        cfg, writer, chain = self.ctx.config, self.ctx.writer, self.ctx.chain
        err = None if job.error is None else f"{type(job.error).__name__}: {job.error}"
        if self.rank == 0 and not writer.epoch and err is None and not job.resume:
            try:
                last = chain.last_committed
                writer.claim_after(last.manifest.step if last else None)
            except Exception as exc:  # noqa: BLE001 - fails the step on every rank
                err = f"claiming the writer epoch: {exc}"
        inv = inventory_digest(job.inventory) if job.inventory else ""
        kind = "resume" if job.resume else job.kind
        headers: list[_Header] = self.channel.all_gather(_Header(job.seq, job.pushed, kind, inv, job.rebuild, err))
        self.seq = max(h.seq for h in headers)  # a rank that skipped a push catches up with the others
        steps = [h.step for h in headers if h.error is None and _is_step(h.step)]
        if steps:
            chain.skip_to(max(steps))  # every rank refuses the same step numbers from now on
        problem = _disagreement(headers)
        if problem is not None:  # named by the highest step pushed: the same text on every rank
            return _Outcome(None, f"step {max(steps) if steps else job.pushed}: {problem}")
        if job.resume:
            return _Outcome(chain.last_committed, None, resumed=True)
        job.kind = "anchor" if any(h.kind == "anchor" for h in headers) else "patch"
        report = RankReport()
        try:
            changes = self._to_owners(job, any(h.rebuild for h in headers))
            if job.kind == "anchor" and self.plan is None:
                # every rank names the files as rank 0's writer's own (ctx.writer is rank 0's only after a commit)
                self.plan = anchor_plan(
                    job.inventory, self.owners, self.world, cfg.shard_bytes, writer_id=self.rank0_writer
                )
            report = write_rank_files(
                self.ctx.store,
                job,
                rank=self.rank,
                world=self.world,
                copies=self.copies,
                changes=changes,
                plan=self.plan,
                shard_bytes=cfg.shard_bytes,
                pool=self.ctx.pool,
                policy=self._policy,
                tensor_digests=cfg.tensor_digests,
                writer_id=self.rank0_writer,
                stop=self.ctx.stop,
                format_version=cfg.format_version,
            )
        except ChannelError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported to rank 0, fails the step everywhere
            log.exception("step %d failed on rank %d", job.step, self.rank)
            report = RankReport(f"{type(exc).__name__}: {exc}")
        reports = self.channel.all_gather(report)
        outcome: _Outcome | None = None
        if self.rank == 0:
            try:
                committed = commit_on_rank0(
                    self.ctx.store,
                    job,
                    reports,
                    run_id=writer.run_id,
                    parent=chain.last_committed,
                    writer=writer.writer,
                    signing_key=cfg.signing_key,
                    policy=self._policy,
                    fence=writer.check_fence,
                    stop=self.ctx.stop,
                    format_version=cfg.format_version,
                    inventory_memo=self.ctx.inventory,
                )
                self._written = committed
                outcome = _Outcome(committed, None, writer=(writer.writer_id, writer.epoch))
            except Exception as exc:  # noqa: BLE001 - broadcast to every rank
                log.error("commit of step %d failed: %s", job.step, exc)
                outcome = _Outcome(None, str(exc), isinstance(exc, WriterFenced))
        result: _Outcome = self.channel.broadcast(outcome)
        return result

    @property
    def _policy(self) -> RetryPolicy:
        return RetryPolicy(self.ctx.config.retries, self.ctx.config.retry_backoff)

    def _to_owners(self, job: ShardedJob, rebuild: bool) -> dict[str, TensorDiff]:
        """Move this step's data to the owners: whole shards when rebuilding, else sparse changes."""
        local_error: Exception | None = None
        if rebuild:
            self.copies.clear()
            infos = {t.name: t for t in job.inventory}
            for names in rounds(job.inventory):
                out: dict[int, list[tuple[str, Box, Any]]] = {}
                try:
                    for n in names:
                        if n in self.base:
                            out.setdefault(self.owners[n], []).append((n, self.boxes[n], self.base[n].cpu().numpy()))
                except Exception as exc:  # noqa: BLE001 - still take part in the exchange
                    local_error, out = exc, {}
                got = self._send(out)
                try:
                    for n in names:
                        if local_error is None and self.owners[n] == self.rank:
                            parts = [(box, arr) for r in sorted(got) for (m, box, arr) in got[r] if m == n]
                            self.copies.fill(infos[n], parts)
                except Exception as exc:  # noqa: BLE001 - the next rounds are collectives too
                    local_error = exc
            if local_error is not None:
                raise local_error
            return {}
        sparse: dict[int, list[tuple[str, Any, Any]]] = {}
        try:
            for n, staged in job.staged.items():
                c = diff_tensor(self.base[n], staged)
                if c is not None:
                    job.local[n] = c
            job.staged = {}
            shapes = {t.name: t.shape for t in job.inventory}
            for n, c in job.local.items():
                c.wait()
                gidx = to_global(c.idx, self.boxes[n], shapes[n])
                sparse.setdefault(self.owners[n], []).append((n, gidx, c.new))
        except Exception as exc:  # noqa: BLE001 - still take part in the exchange
            local_error, sparse = exc, {}
        got_s = self._send(sparse)
        if local_error is not None:
            raise local_error
        if not self.copies.arrays and any(o == self.rank for o in self.owners.values()):
            raise CommitFailed("owner copies are missing (an earlier step failed); the next push is an anchor")
        by_name: dict[str, list[tuple[Any, Any]]] = {}
        for r in sorted(got_s):
            for n, gidx, new in got_s[r]:
                by_name.setdefault(n, []).append((gidx, new))
        changes: dict[str, TensorDiff] = {}
        for n, parts in by_name.items():
            merged = self.copies.apply(n, parts)
            if merged is not None:
                changes[n] = merged
        return changes

    def _send(self, outgoing: dict[int, Any]) -> dict[int, Any]:
        assert self.channel is not None
        return self.channel.send_to(outgoing)

    # -------------------------------------------------------------- outcome

    def _resolve(self, job: ShardedJob, outcome: _Outcome, t0: float) -> None:
        """Apply the step's agreed outcome (rank 0's broadcast, or the store's word when the group lost
        contact) and resolve the step's Future."""
        chain = self.ctx.chain
        c = outcome.committed
        if c is None:
            err = (WriterFenced if outcome.fenced else CommitFailed)(outcome.error or f"step {job.step} failed")
            self.copies.clear()
            chain.failed_step(job.futures, err)
            return
        m = c.manifest
        if outcome.resumed:  # the baseline is the pushed state; it cannot be proven: the next push is an anchor
            chain.resumed_head(len(job.futures))
            total = sum(t.numel for t in m.inventory)
            info = CommitInfo(m.step, "skipped", 0, 0, total, m.anchor_step, c.digest, m.step, time.perf_counter() - t0)
            for _, fut in job.futures:
                fut.set_result(info)
            return
        if self.rank != 0:
            self.ctx.writer.adopt(self.ctx.writer.run_id, *outcome.writer)
        chain.committed(c, len(job.futures), count_pushes=True)
        if self.channel is None:  # committed, but the group lost contact: owner copies are rebuilt next step
            self.copies.clear()
            chain.require_anchor()
        if self.rank == 0 and self.ctx.after.notifier is not None:
            self.ctx.after.notifier.notify(m.step, c.digest, run_id=self.ctx.writer.run_id, kind=m.kind)
        if m.kind == "anchor" and self.ctx.after.retention is not None:  # rank 0 only (keep_anchors)
            self.ctx.after.retention.trigger()
        resolve_committed(job, c, time.perf_counter() - t0, skipped=False)


def _is_step(step: Any) -> bool:
    return isinstance(step, int) and not isinstance(step, bool) and step >= 0


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _disagreement(headers: list[_Header]) -> str | None:
    """Why the ranks cannot commit this step together, the same text on every rank; None when they can."""
    errors = [f"rank {r}: {h.error}" for r, h in enumerate(headers) if h.error]
    if errors:
        return "failed on " + "; ".join(errors)
    if len({h.step for h in headers}) > 1:
        steps = ", ".join(f"rank {r}: {h.step}" for r, h in enumerate(headers))
        return f"the ranks pushed different steps ({steps}); every rank must push the same step"
    if len({h.inventory_digest for h in headers}) > 1:
        return "the ranks pushed different tensor inventories (names, dtypes, global shapes); they must agree"
    return None
