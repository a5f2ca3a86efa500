"""Owner side of a sharded push: host copies of the owned tensors, their files, rank 0's commit.

Each tensor has one owner rank (:func:`deltasync.uploader.sharded._shardmap.owner_map`).
The owner keeps a host copy of it (about ``1/world`` of the state per rank),
updated from the sparse changes the ranks send it, hashes it, and writes the
tensor's one patch entry or its anchor bytes. Rank 0 then checks what every
rank reports against the store and writes the manifest. Nothing here talks to
other ranks; :mod:`deltasync.uploader.sharded._push` does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from deltasync._util.retry import RetryPolicy
from deltasync.errors import CommitFailed
from deltasync.protocol import AnchorEntry, Committed, FileInfo, PatchEntry, TensorInfo, xxh3_128
from deltasync.protocol.canonical import MANIFEST_VERSION
from deltasync.protocol.checkpoint import CHECKPOINT_METADATA, INDEX_NAME, group_by_size, shard_layout
from deltasync.protocol.digests import tensor_digests as hash_tensors
from deltasync.protocol.dtypes import dtype_info
from deltasync.protocol.keys import file_key, step_prefix, writer_file_name, writer_folder
from deltasync.protocol.manifest import Writer
from deltasync.protocol.patchfile import build_patch_file, patch_file_name
from deltasync.protocol.safetensors_io import TensorBytes, to_bytes
from deltasync.storage import Store
from deltasync.uploader._commit_step import (
    GROUP_NUMEL,
    InventoryMemo,
    encode_groups,
    make_manifest,
    publish_manifest,
    put_step_files,
)
from deltasync.uploader._diff import TensorDiff
from deltasync.uploader._job import StepJob
from deltasync.uploader.sharded._shardmap import AnchorPlan, Box, patch_file_names, write_box

__all__ = ["OwnerCopies", "RankReport", "commit_on_rank0", "write_rank_files"]

Bits = np.ndarray[Any, np.dtype[Any]]


@dataclass(slots=True)
class RankReport:
    """What one rank wrote for a step (sent to rank 0), or why it could not."""

    error: str | None = None
    files: tuple[FileInfo, ...] = ()
    entries: tuple[PatchEntry, ...] | tuple[AnchorEntry, ...] = ()
    digests: dict[str, str] = field(default_factory=dict)
    changed: int = 0


class OwnerCopies:
    """Host copies (flat bits) of the tensors this rank owns, and their digests."""

    def __init__(self) -> None:
        self.arrays: dict[str, Bits] = {}
        self.digests: dict[str, str] = {}
        self._format = 0  # the format of the cached digests

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return sum(int(a.nbytes) for a in self.arrays.values())

    def clear(self) -> None:
        """Forget everything (after a failed step: the next one rebuilds from the ranks' shards)."""
        self.arrays, self.digests = {}, {}

    def fill(self, info: TensorInfo, parts: Iterable[tuple[Box, Bits]]) -> None:
        """Build the copy of ``info`` from the ranks' local shards (boxes that must tile the tensor)."""
        full = np.empty(info.numel, dtype=dtype_info(info.dtype).bits)
        covered = 0
        for box, local in parts:
            if local.size != box.numel:
                raise CommitFailed(f"tensor {info.name!r}: a local shard of {local.size} elements fills a {box}")
            write_box(full, info.shape, box, local)
            covered += box.numel
        if covered != info.numel:
            raise CommitFailed(
                f"tensor {info.name!r}: the ranks' shards cover {covered} of its {info.numel} elements; "
                "every element must be held by exactly one contributing rank (check the DTensor placements/mesh)"
            )
        self.arrays[info.name] = full
        self.digests.pop(info.name, None)

    def apply(self, name: str, parts: Sequence[tuple[Bits, Bits]]) -> TensorDiff | None:
        """Apply the changes (global positions, new bits) the ranks sent for ``name``; return the merged change."""
        parts = [p for p in parts if p[0].size]
        if not parts:
            return None
        if len(parts) == 1:
            idx, new = parts[0]
        else:
            idx = np.concatenate([p[0] for p in parts])
            new = np.concatenate([p[1] for p in parts])
            order = np.argsort(idx, kind="stable")
            idx, new = idx[order], new[order]
            if np.any(idx[1:] == idx[:-1]):
                raise CommitFailed(f"tensor {name!r}: two ranks sent changes for the same element")
        arr = self.arrays[name]
        old = arr[idx]
        arr[idx] = new
        self.digests.pop(name, None)
        return TensorDiff(idx, old, new)

    def digest_all(self, format_version: int, pool: Executor | None = None) -> dict[str, str]:
        """The digest (in a manifest of ``format_version``) of every owned tensor, cached until it
        changes; hashed on ``pool`` at once when given."""
        if format_version != self._format:
            self.digests, self._format = {}, format_version  # another format defines large tensors' otherwise
        todo = {n: a for n, a in self.arrays.items() if n not in self.digests}
        self.digests.update(hash_tensors(todo, format_version, mapper=pool.map if pool is not None else map))
        return dict(self.digests)


def _patch_files(
    step: int,
    rank: int,
    world: int,
    changes: dict[str, TensorDiff],
    inventory: tuple[TensorInfo, ...],
    shard_bytes: int,
    pool: Executor | None,
    writer_id: str,
    format_version: int,
) -> tuple[dict[str, bytes], list[PatchEntry]]:
    items = encode_groups(changes, inventory, pool, GROUP_NUMEL if format_version >= 2 else 0)
    groups = group_by_size([e.nbytes for _, e in items], shard_bytes) if items else []
    files: dict[str, bytes] = {}
    entries: list[PatchEntry] = []
    for fname, group in zip(patch_file_names(rank, world, len(groups), writer_id=writer_id), groups, strict=True):
        files[fname], ents = build_patch_file(step, fname, [items[j] for j in group])
        entries.extend(ents)
    if rank == 0 and not files:  # a patch step has at least one file (SPEC "Patches")
        fname = writer_file_name(writer_id, patch_file_name(0))
        files[fname], _ = build_patch_file(step, fname, [])
    return files, entries


def _anchor_files(
    rank: int, plan: AnchorPlan, infos: dict[str, TensorInfo], copies: OwnerCopies, writer_id: str
) -> tuple[dict[str, bytes], list[AnchorEntry]]:
    """This rank's shards of ``plan`` (named by the plan, in ``writer_id``'s subfolder) and, on
    rank 0, the index beside them: ``w{writer_id}/`` is an ordinary HF checkpoint dir."""
    files: dict[str, bytes] = {}
    entries: list[AnchorEntry] = []
    for fname, names in plan.shards.get(rank, []):
        shard = [TensorBytes(n, infos[n].dtype, infos[n].shape, copies.arrays[n]) for n in names]
        ranges = shard_layout(shard, CHECKPOINT_METADATA)
        files[fname] = to_bytes(shard, CHECKPOINT_METADATA)
        entries.extend(AnchorEntry(n, fname, ranges[n]) for n in names)
    if rank == 0:
        files[writer_file_name(writer_id, INDEX_NAME)] = plan.index
    return files, entries


def write_rank_files(
    store: Store,
    job: StepJob,
    *,
    rank: int,
    world: int,
    copies: OwnerCopies,
    changes: dict[str, TensorDiff],
    plan: AnchorPlan | None,
    shard_bytes: int,
    pool: Executor | None,
    policy: RetryPolicy,
    tensor_digests: bool,
    writer_id: str,
    stop: threading.Event | None = None,
    format_version: int = MANIFEST_VERSION,
) -> RankReport:
    """Encode this rank's part of ``job`` (its owned tensors), write it durably, and report it.

    Every rank names its files as those of ``writer_id``, rank 0's (the group writes as one
    writer, SPEC "Sharded writers"): ``w{writer_id}/...``, disjoint by rank, and disjoint from
    any other writer's racing for the step (SPEC "Commit rule"). ``plan`` is in that subfolder too.
    """
    infos = {t.name: t for t in job.inventory}
    entries: list[PatchEntry] | list[AnchorEntry]
    if job.kind == "patch":
        files, entries = _patch_files(
            job.step, rank, world, changes, job.inventory, shard_bytes, pool, writer_id, format_version
        )
        changed = sum(int(c.idx.size) for c in changes.values())
    else:
        assert plan is not None
        files, entries = _anchor_files(rank, plan, infos, copies, writer_id)
        changed = sum(int(a.size) for a in copies.arrays.values())
    digests = copies.digest_all(format_version, pool) if tensor_digests else {}
    put_step_files(store, job.step, files, policy, stop=stop)
    infos_out = tuple(FileInfo(n, len(d), xxh3_128(d)) for n, d in sorted(files.items()))
    return RankReport(None, infos_out, tuple(entries), digests, changed)  # type: ignore[arg-type]


def commit_on_rank0(
    store: Store,
    job: StepJob,
    reports: Sequence[RankReport],
    *,
    run_id: str,
    parent: Committed | None,
    writer: Writer,
    signing_key: bytes | None,
    policy: RetryPolicy,
    fence: Callable[[], None] | None,
    stop: threading.Event | None = None,
    format_version: int = MANIFEST_VERSION,
    inventory_memo: InventoryMemo | None = None,
) -> Committed:
    """Check every rank's report against the store, then write the step's manifest and HEAD."""
    failed = [f"rank {r}: {rep.error}" for r, rep in enumerate(reports) if rep.error is not None]
    if failed:
        raise CommitFailed(f"step {job.step} failed on {len(failed)} rank(s): " + "; ".join(failed))
    listed = {o.key: o.size for o in store.list(step_prefix(job.step))}
    files: dict[str, FileInfo] = {}
    own = writer_folder(writer.id)  # every rank writes in rank 0's writer's folder
    for r, rep in enumerate(reports):
        for f in rep.files:
            if not f.path.startswith(own):
                raise CommitFailed(f"step {job.step}: rank {r} wrote {f.path}, outside writer {writer.id}'s {own}")
            if f.path in files:
                raise CommitFailed(f"step {job.step}: rank {r} wrote {f.path}, which another rank wrote too")
            got = listed.get(file_key(job.step, f.path))
            if got != f.size:
                raise CommitFailed(
                    f"step {job.step}: rank {r} reported {f.path} of {f.size} bytes, the store holds "
                    f"{'no such object' if got is None else f'{got} bytes'}; not committing"
                )
            files[f.path] = f
    digests: dict[str, str] = {}
    all_entries: list[Any] = []
    for rep in reports:
        digests.update(rep.digests)
        all_entries.extend(rep.entries)
    if job.kind == "patch":
        all_entries.sort(key=lambda e: e.tensor)
    job.digests = digests
    manifest = make_manifest(
        job,
        tuple(files[n] for n in sorted(files)),
        tuple(all_entries),
        run_id=run_id,
        parent=parent,
        anchor_step=parent.manifest.anchor_step if parent else job.step,
        writer=writer,
        changed=sum(rep.changed for rep in reports),
        format_version=format_version,
        inventory_memo=inventory_memo,
    )
    if signing_key is not None:
        manifest = manifest.signed(signing_key)
    return publish_manifest(store, manifest, policy, fence, stop=stop)
