"""push()'s side of a step: the baseline it diffs against, the staging copies, the tensor digests.

:class:`Snapshotter` owns the baseline (flat bits of the last pushed state, on each tensor's
device), the staging buffers a deferred diff copies the caller's tensors into, and the
digest cache. ``push`` makes a :class:`StepJob` here (an anchor snapshot, or a patch: staged
or diffed at once); the digest stage finishes it (:meth:`diff`, :meth:`digest`). The
baseline and the staging buffers are read by the previous job's diff and digests: a new
snapshot first waits for them (:meth:`wait_for_last`).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

import numpy as np

from deltasync._util.batches import map_batched, results
from deltasync._util.tensors import accessors, digest_tensors, flat_bits
from deltasync.protocol import TensorInfo, kernels
from deltasync.protocol.digests import digests_comparable, packed_digests
from deltasync.uploader._diff import DIFF_CHUNK, Baseline, TensorDiff, diff_tensor, inventory_of, join_diffs
from deltasync.uploader._job import StepJob
from deltasync.uploader._pack import ChangeSet, Pack, PackedDiff, plan_packs

if TYPE_CHECKING:
    import torch

__all__ = ["Snapshotter"]

#: a pack's buffer is diffed in chunks of this many elements, several at once
PACK_DIFF_CHUNK = 1 << 20


def _gather(kern: Any, pack: Pack, buf: torch.Tensor, src: Sequence[torch.Tensor]) -> bool:
    """Copy ``src`` (the pack's tensors, of its dtype and shapes) into ``buf`` as raw bytes with one
    compiled call, when every one is a contiguous CPU tensor; False (nothing copied) otherwise."""
    a = accessors()
    if not (all(map(a.is_cpu, src)) and all(map(a.is_contiguous, src))):
        return False
    addrs = np.fromiter(map(a.data_ptr, src), dtype=np.int64, count=len(src))
    dst = buf.numpy().view(np.uint8)
    # the sources read in address order: a state's tensors sorted by name are not in the order they
    # were allocated in, and reads that jump about memory restart the prefetchers at each tensor
    order = np.argsort(addrs, kind="stable")
    if not kern.gather_bytes(dst, addrs, pack.starts * pack.itemsize, order):
        raise AssertionError("gather_bytes: a pack's starts outside its buffer")  # pack plans make them
    return True


class Snapshotter:
    """The baseline, staging buffers and digest cache of one uploader (see the module docstring)."""

    def __init__(self, pool: Executor, cast_dtype: Any = None, *, format_version: int) -> None:
        self.pool = pool  # the encode pool: diffs and digests of several tensors run there at once
        self.cast_dtype = cast_dtype
        self.format_version = format_version  # of the manifests written: the digests are its
        self._baseline = Baseline()
        self._staging: dict[str, torch.Tensor] = {}
        #: the staging buffer of each pack of the baseline (same layout), reused step after step
        self._staging_bufs: list[torch.Tensor | None] = []
        #: each buffer's shaped per-tensor views (by id, checked by address, size and dtype; the
        #: buffer itself is held so that its id is not reused while the entry stands)
        self._views: dict[int, tuple[Any, torch.Tensor, list[torch.Tensor]]] = {}
        self._digest_cache: dict[str, str] = {}
        self._last_job: StepJob | None = None
        self._last_layout: tuple[list[str], list[Any], list[Any], tuple[TensorInfo, ...]] | None = None

    def inventory_of(self, tensors: Mapping[str, torch.Tensor]) -> tuple[TensorInfo, ...]:
        """The inventory of ``tensors``: the last one's object again while the names, dtypes and
        shapes are the same (compared in one pass that keeps nothing: building 18k entries, sorting
        them and the collections the kept objects set off cost more than the step's copy)."""
        last = self._last_layout
        if last is not None and len(tensors) == len(last[0]) and list(tensors) == last[0]:
            a, values = accessors(), list(tensors.values())
            # compared as they are read, one C-level pass each
            if list(map(a.dtype, values)) == last[1] and all(map(operator.eq, map(a.shape, values), last[2])):
                return last[3]
        inventory = inventory_of(tensors)
        if inventory == self._baseline.inventory:
            inventory = self._baseline.inventory
        self._last_layout = (
            list(tensors),
            [t.dtype for t in tensors.values()],
            [t.shape for t in tensors.values()],
            inventory,
        )
        return inventory

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
        if same:
            base, packs, bufs = self._baseline.tensors, self._baseline.packs, self._baseline.bufs
        else:
            packs = tuple(plan_packs(inventory, tensors))
            bufs = tuple(p.alloc() for p in packs)
            base = {}
            for pack, buf in zip(packs, bufs, strict=True):
                base.update(pack.views(buf))
            self._staging_bufs, self._views = [None] * len(packs), {}
        packed = self._copy_packs(packs, bufs, tensors)
        for name, t in tensors.items():
            if name in packed:
                continue
            bits = flat_bits(t)
            if same:
                base[name].copy_(bits)
            else:
                base[name] = bits.clone()
        for name in tensors:
            snapshot[name] = base[name].cpu().numpy().copy()
        self._baseline = Baseline(base, inventory, packs, bufs)
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
        job = StepJob(step, "patch", inventory, total=total)
        if defer_diff:  # only copy here; the diff against the baseline runs on the digest stage
            job.staged, job.staged_packs = self.stage(given, tensors)
            return self._made(job)
        packed = self._stage_packs(tensors)
        job.staged_packs = packed
        done = {n for p, _ in packed for n in p.names}
        job.staged = {k: flat_bits(t) for k, t in tensors.items() if k not in done}
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
        packs = tuple(plan_packs(inventory, base))
        bufs = tuple(p.alloc() for p in packs)
        self._copy_packs(packs, bufs, base)
        base = dict(base)
        for pack, buf in zip(packs, bufs, strict=True):
            base.update(pack.views(buf))
        self._staging_bufs, self._views = [None] * len(packs), {}
        self._baseline = Baseline(base, inventory, packs, bufs)
        mine = self.format_version
        self._digest_cache = {
            t.name: digests[t.name]
            for t in inventory
            if t.name in digests and digests_comparable(t.nbytes, format_version, mine)
        }

    def _copy_packs(
        self,
        packs: Sequence[Pack],
        bufs: Sequence[torch.Tensor],
        tensors: Mapping[str, torch.Tensor],
        *,
        laid_out: bool = False,
    ) -> set[str]:
        """Copy each pack's tensors into its buffer (one call per pack); the names copied.
        ``laid_out``: the caller checked that the tensors have the pack's dtype and shapes (push
        compared the inventory), so contiguous CPU ones are copied as raw bytes by one compiled call."""
        import torch

        done: set[str] = set()
        kern = kernels.impl()
        for pack, buf in zip(packs, bufs, strict=True):
            src = list(map(tensors.__getitem__, pack.names))
            done.update(pack.names)
            if laid_out and kern is not None and _gather(kern, pack, buf, src):
                continue
            if [t.shape for t in src] == list(pack.shapes):
                key = (buf.data_ptr(), buf.numel(), src[0].dtype)
                views = self._views.get(id(buf))
                if views is None or views[0] != key:  # 18k views a step cost more than the copy
                    views = self._views[id(buf)] = (key, buf, pack.shaped(buf, src[0].dtype))
                torch._foreach_copy_(views[2], src)
            else:  # flat bits (a resumed baseline)
                flat = buf.view(src[0].dtype)
                s = pack.starts.tolist()
                torch._foreach_copy_([flat[a:b] for a, b in zip(s, s[1:], strict=False)], [t.reshape(-1) for t in src])
        return done

    def _stage_packs(self, tensors: Mapping[str, torch.Tensor]) -> list[tuple[Pack, torch.Tensor]]:
        """Copy the packed tensors into their packs' reused staging buffers (one call per pack)."""
        packs = self._baseline.packs
        if not packs:
            return []
        if len(self._staging_bufs) != len(packs):
            self._staging_bufs = [None] * len(packs)
        out = []
        for i, pack in enumerate(packs):
            buf = self._staging_bufs[i]
            if buf is None:
                buf = self._staging_bufs[i] = pack.alloc()
            self._copy_packs((pack,), (buf,), tensors, laid_out=True)
            out.append((pack, buf))
        return out

    def stage(
        self, given: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], list[tuple[Pack, torch.Tensor]]]:
        """Flat bit views of this step's tensors that the caller cannot change any more, and the
        packs' staging buffers holding the packed ones.

        Packed tensors are copied into their pack's staging buffer (one call per pack). Of the
        others, tensors that ``cast_dtype`` just made are ours already; the caller's own are copied
        into reused staging buffers (one memcpy, about one compare pass).
        """
        packed = self._stage_packs(tensors)
        out: dict[str, torch.Tensor] = {}
        if sum(len(p.names) for p, _ in packed) == len(tensors):
            return out, packed  # every tensor is in a pack (a pack's names are distinct names of the state)
        done = {n for p, _ in packed for n in p.names} if packed else set()
        for name, t in tensors.items():
            if name in done:
                continue
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
        return out, packed

    # ------------------------------------------------------------------ digest stage

    def prefault_staging(self) -> None:
        """Allocate and touch the staging buffers now, off the caller's thread, so that the
        next push() copies into warm memory instead of paying the page faults."""
        packs = self._baseline.packs
        if len(self._staging_bufs) != len(packs):
            self._staging_bufs = [None] * len(packs)
        for i, pack in enumerate(packs):
            if self._staging_bufs[i] is None:
                self._staging_bufs[i] = pack.alloc().zero_()
        packed = {n for p in packs for n in p.names}
        for name, base in self._baseline.tensors.items():
            if name in packed:
                continue
            buf = self._staging.get(name)
            if buf is None or buf.dtype != base.dtype or buf.shape != base.shape or buf.device != base.device:
                self._staging[name] = base.new_zeros(base.shape)

    def diff(self, job: StepJob) -> None:
        """Diff the job's staged bits against the baseline (which takes them): fills ``job.changes``."""
        # (key, start, end, base, new): a tensor (or a pack's buffer) larger than DIFF_CHUNK is diffed
        # in chunks, so one embedding does not hold up a step on one core
        parts: list[tuple[Any, int, int, torch.Tensor, torch.Tensor]] = []
        chunk = DIFF_CHUNK
        for name, t in job.staged.items():
            base = self._baseline.tensors[name]
            n = t.numel()
            parts.extend((name, a, min(n, a + chunk), base, t) for a in range(0, max(n, 1), chunk))
        bufs = dict(zip(self._baseline.packs, self._baseline.bufs, strict=True))
        for i, (pack, staged) in enumerate(job.staged_packs):
            n = pack.numel
            step = PACK_DIFF_CHUNK  # compare and collect passes of a chunk this small share the cache
            parts.extend((i, a, min(n, a + step), bufs[pack], staged) for a in range(0, max(n, 1), step))

        def one(part: tuple[Any, int, int, torch.Tensor, torch.Tensor]) -> TensorDiff | None:
            _, a, b, base, new = part
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
        found = results(map_batched(self.pool if len(parts) > 1 else None, one, parts, [p[2] - p[1] for p in parts]))
        pieces: dict[Any, list[TensorDiff]] = {}
        for part, c in zip(parts, found, strict=True):
            if c is not None:
                pieces.setdefault(part[0], []).append(c)
        other: dict[str, TensorDiff] = {}
        packed: list[PackedDiff] = []
        for key, ps in pieces.items():
            d = ps[0] if len(ps) == 1 else join_diffs(ps)
            if isinstance(key, str):
                other[key] = d
            else:
                packed.append(PackedDiff.of(job.staged_packs[key][0], d.idx, d.old, d.new))
        job.staged, job.staged_packs = {}, []
        job.changes = ChangeSet(packed, other) if packed else other
        job.changed = sum(int(c.idx.size) for c in other.values()) + sum(int(d.idx.size) for d in packed)

    def digest(self, job: StepJob) -> None:
        """The digest of every post-step tensor into ``job.digests`` (unchanged ones from the cache),
        hashed on the pool at once (a device baseline's tensors are copied to the host chunk by chunk)."""
        todo: dict[str, Any] = {}
        fresh: dict[str, str] = {}
        cache = self._digest_cache
        packed: set[str] = set()
        if job.kind != "anchor":  # a packed tensor is hashed in place in its pack's buffer
            for pack, buf in zip(self._baseline.packs, self._baseline.bufs, strict=True):
                s = (pack.starts * pack.itemsize).tolist()
                changes = job.changes
                if (changes.whole(pack) if isinstance(changes, ChangeSet) else False) or (
                    len(changes) >= len(pack.names) and all(map(changes.__contains__, pack.names))
                ):
                    names, starts, stops = pack.names, s[:-1], s[1:]  # every tensor changed (a MoE step)
                else:
                    keep = [i for i, n in enumerate(pack.names) if n in changes or n not in cache]
                    names = [pack.names[i] for i in keep]
                    starts, stops = [s[i] for i in keep], [s[i + 1] for i in keep]
                fresh.update(
                    packed_digests(buf.numpy(), names, starts, stops, self.format_version, mapper=self.pool.map)
                )
                packed.update(pack.names)
        for info in job.inventory:
            name = info.name
            if job.kind == "anchor":
                todo[name] = job.snapshot[name]
            elif name not in packed and (name in job.changes or name not in cache):
                todo[name] = self._baseline.tensors[name]
        fresh.update(digest_tensors(todo, self.format_version, pool=self.pool))
        self._digest_cache.update(fresh)
        for info in job.inventory:
            job.digests[info.name] = self._digest_cache[info.name]
