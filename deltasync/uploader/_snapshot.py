"""push()'s side of a step: the baseline it diffs against, the staging copies, the tensor digests.

:class:`Snapshotter` owns the baseline (flat bits of the last pushed state, on each tensor's
device), the staging buffers a deferred diff copies the caller's tensors into, and the
digest cache. ``push`` makes a :class:`StepJob` here (an anchor snapshot, or a patch: staged
or diffed at once); the digest stage finishes it (:meth:`diff`, :meth:`digest`). The
baseline and the staging buffers are read by the previous job's diff and digests: a new
snapshot first waits for them (:meth:`wait_for_last`).
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

import numpy as np

from deltasync._util.batches import map_batched, results
from deltasync._util.tensors import digest_tensors, flat_bits
from deltasync.protocol import TensorInfo
from deltasync.protocol.digests import digests_comparable
from deltasync.uploader._diff import DIFF_CHUNK, Baseline, TensorDiff, diff_tensor, join_diffs
from deltasync.uploader._job import StepJob

if TYPE_CHECKING:
    import torch

__all__ = ["Snapshotter"]


class Snapshotter:
    """The baseline, staging buffers and digest cache of one uploader (see the module docstring)."""

    def __init__(self, pool: Executor, cast_dtype: Any = None, *, format_version: int) -> None:
        self.pool = pool  # the encode pool: diffs and digests of several tensors run there at once
        self.cast_dtype = cast_dtype
        self.format_version = format_version  # of the manifests written: the digests are its
        self._baseline = Baseline()
        self._staging: dict[str, torch.Tensor] = {}
        self._digest_cache: dict[str, str] = {}
        self._last_job: StepJob | None = None

    @property
    def inventory(self) -> tuple[TensorInfo, ...]:
        """The inventory of the baseline (empty before the first push)."""
        return self._baseline.inventory

    @property
    def last_job(self) -> StepJob | None:
        """The newest job made here (kept until the next push, for coalescing)."""
        return self._last_job

    def wait_for_last(self) -> None:
        """Wait until the previous job's diff and digests, which read the baseline and staging, are done."""
        if self._last_job is not None:
            self._last_job.digests_ready.wait()

    def cast(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Cast floating-point tensors to ``cast_dtype`` (when set)."""
        cast = self.cast_dtype
        if cast is not None:
            tensors = {k: v.to(cast) if v.is_floating_point() and v.dtype != cast else v for k, v in tensors.items()}
        return tensors

    # ------------------------------------------------------------------ jobs

    def anchor(self, step: int, tensors: dict[str, torch.Tensor], inventory: Any, total: int) -> StepJob:
        """An anchor job: ``tensors`` become the baseline and the job's host snapshot."""
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
        return self._made(StepJob(step, "anchor", inventory, snapshot=snapshot, changed=total, total=total))

    def patch(
        self,
        step: int,
        given: dict[str, torch.Tensor],
        tensors: dict[str, torch.Tensor],
        inventory: Any,
        total: int,
        *,
        defer_diff: bool,
    ) -> StepJob:
        """A patch job: staged copies diffed later (``defer_diff``), or diffed here and now."""
        if defer_diff:  # only copy here; the diff against the baseline runs on the digest stage
            return self._made(StepJob(step, "patch", inventory, staged=self.stage(given, tensors), total=total))
        job = StepJob(step, "patch", inventory, staged={k: flat_bits(t) for k, t in tensors.items()}, total=total)
        self.diff(job)
        return self._made(job)

    def _made(self, job: StepJob) -> StepJob:
        self._last_job = job
        return job

    def adopt(
        self,
        base: dict[str, torch.Tensor],
        inventory: tuple[TensorInfo, ...],
        digests: Mapping[str, str],
        format_version: int,
    ) -> None:
        """Make ``base`` (proven equal to a committed step with ``digests``, in a manifest of
        ``format_version``) the baseline. Digests that this uploader's format defines otherwise
        (a large tensor's, between formats 1 and 2) are not kept: they are hashed again."""
        self._baseline = Baseline(base, inventory)
        mine = self.format_version
        self._digest_cache = {
            t.name: digests[t.name]
            for t in inventory
            if t.name in digests and digests_comparable(t.nbytes, format_version, mine)
        }

    def stage(self, given: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
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

    # ------------------------------------------------------------------ digest stage

    def prefault_staging(self) -> None:
        """Allocate and touch the staging buffers now, off the caller's thread, so that the
        next push() copies into warm memory instead of paying the page faults."""
        for name, base in self._baseline.tensors.items():
            buf = self._staging.get(name)
            if buf is None or buf.dtype != base.dtype or buf.shape != base.shape or buf.device != base.device:
                self._staging[name] = base.new_zeros(base.shape)

    def diff(self, job: StepJob) -> None:
        """Diff the job's staged bits against the baseline (which takes them): fills ``job.changes``."""
        # (name, start, end): a tensor larger than DIFF_CHUNK is diffed in chunks, so one embedding
        # does not hold up a step on one core
        parts: list[tuple[str, int, int]] = []
        chunk = DIFF_CHUNK
        for name, t in job.staged.items():
            n = t.numel()
            if n <= chunk:
                parts.append((name, 0, n))
            else:
                parts.extend((name, a, min(n, a + chunk)) for a in range(0, n, chunk))

        def one(part: tuple[str, int, int]) -> TensorDiff | None:
            name, a, b = part
            base, new = self._baseline.tensors[name], job.staged[name]
            if a == 0 and b == base.numel():
                return diff_tensor(base, new)
            d = diff_tensor(base.reshape(-1)[a:b], new.reshape(-1)[a:b])  # views: the baseline is updated
            if d is not None:
                d.wait()  # a device's copies land asynchronously: only then may the positions move
                d.idx += a
            return d

        # chunks at once, in batches of about even size: the compiled diff releases the GIL (each
        # updates its own part of the baseline), and a pool task per tensor would cost more than a
        # small tensor's diff
        found = results(map_batched(self.pool if len(parts) > 1 else None, one, parts, [b - a for _, a, b in parts]))
        changes: dict[str, TensorDiff] = {}
        pieces: dict[str, list[TensorDiff]] = {}
        for (name, _, _), c in zip(parts, found, strict=True):
            if c is not None:
                pieces.setdefault(name, []).append(c)
        for name, ps in pieces.items():
            changes[name] = ps[0] if len(ps) == 1 else join_diffs(ps)
        job.staged = {}
        job.changes = changes
        job.changed = sum(int(c.idx.size) for c in changes.values())

    def digest(self, job: StepJob) -> None:
        """The digest of every post-step tensor into ``job.digests`` (unchanged ones from the cache),
        hashed on the pool at once (a device baseline's tensors are copied to the host chunk by chunk)."""
        todo: dict[str, Any] = {}
        for info in job.inventory:
            name = info.name
            if job.kind == "anchor":
                todo[name] = job.snapshot[name]
            elif name in job.changes or name not in self._digest_cache:
                todo[name] = self._baseline.tensors[name]
        fresh = digest_tensors(todo, self.format_version, pool=self.pool)
        self._digest_cache.update(fresh)
        for info in job.inventory:
            job.digests[info.name] = self._digest_cache[info.name]
