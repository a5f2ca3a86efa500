"""Turning one step's changes into files + a manifest, and writing them in commit order."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from typing import Any

import numpy as np

from deltasync._util.retry import RetryPolicy
from deltasync.errors import AlreadyExists
from deltasync.protocol import (
    AnchorEntry,
    Committed,
    FileInfo,
    Head,
    Manifest,
    PatchEntry,
    Stats,
    encode_changes,
    file_key,
    inventory_digest,
    manifest_key,
    xxh3_128,
)
from deltasync.protocol.checkpoint import build_checkpoint
from deltasync.protocol.keys import HEAD_KEY
from deltasync.protocol.manifest import Writer
from deltasync.protocol.patchfile import build_patch_files
from deltasync.storage import Store
from deltasync.storage.base import Data
from deltasync.uploader._job import StepJob
from deltasync.uploader._writes import put_idempotent, with_retries

__all__ = [
    "build_patch",
    "make_manifest",
    "publish_manifest",
    "put_step_files",
    "write_step",
]
Bits = np.ndarray[Any, np.dtype[Any]]


def build_patch(
    job: StepJob, shard_bytes: int, pool: Executor | None, *, writer_id: str | None = None
) -> tuple[dict[str, bytes], list[PatchEntry]]:
    """Encode every changed tensor and pack the blobs into ``patch-NNNNN.safetensors`` files
    (layout: :func:`deltasync.protocol.patchfile.build_patch_files`), named as ``writer_id``'s own."""
    numel = {t.name: t.numel for t in job.inventory}
    names = sorted(job.changes)

    def enc(name: str) -> Any:
        c = job.changes[name]
        return encode_changes(numel[name], c.idx, c.old, c.new)

    encoded = list(pool.map(enc, names)) if pool is not None and len(names) > 1 else [enc(n) for n in names]
    # the layout (entry names, metadata, one file per group of tensors) is the protocol's
    return build_patch_files(job.step, list(zip(names, encoded, strict=True)), shard_bytes, writer_id=writer_id)


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
) -> Committed:
    """Encode, write data files (create-only), then the manifest (create-only), then HEAD.

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
        files, entries_p = build_patch(job, shard_bytes, pool, writer_id=own)
        entries: tuple[PatchEntry, ...] | tuple[AnchorEntry, ...] = tuple(entries_p)
    else:
        files, entries_a = build_checkpoint(job.inventory, job.snapshot, shard_bytes, writer_id=own)
        entries = tuple(entries_a)
    infos = tuple(FileInfo(name, len(data), xxh3_128(data)) for name, data in sorted(files.items()))
    manifest = make_manifest(
        job, infos, entries, run_id=run_id, parent=parent, anchor_step=anchor_step, writer=writer, changed=job.changed
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
) -> Manifest:
    """The (unsigned) manifest of ``job`` whose data files are ``infos`` holding ``entries``."""
    return Manifest(
        run_id=run_id,
        step=job.step,
        kind=job.kind,
        parent_step=parent.manifest.step if parent else None,
        parent_digest=parent.digest if parent else None,
        anchor_step=job.step if job.kind == "anchor" else anchor_step,
        inventory=job.inventory,
        inventory_digest=inventory_digest(job.inventory),
        files=infos,
        entries=entries,
        tensor_digests=dict(job.digests),
        stats=Stats(changed, job.total, sum(f.size for f in infos)),
        writer=writer,
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
