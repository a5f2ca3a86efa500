"""Downloading a plan's files: one batch, sizes and checksums checked before anything is decoded.

Manifests come from :class:`deltasync.run.RunReader`; decoding is the protocol's
(:func:`deltasync.protocol.anchor_arrays`, :func:`deltasync.protocol.decode_patch`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from deltasync.errors import ChecksumMismatch, ObjectNotFound, ObjectTooLarge
from deltasync.protocol import Manifest, file_key, span_file_key, xxh3_128
from deltasync.storage import Store

__all__ = ["PlanFilesGone", "download"]


class PlanFilesGone(ObjectNotFound):
    """A data file of a planned step is missing: deleted by gc after the plan was made, or the store
    is incomplete. ``steps``: the plan's steps (not pickled: only the message crosses processes)."""

    def __init__(self, message: str, steps: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.steps = steps


def download(
    store: Store,
    manifests: Sequence[Manifest],
    *,
    verify: bool,
    progress: Callable[[int], None] | None = None,
    spans: Sequence[int | None] | None = None,
) -> list[dict[str, bytes]]:
    """All data files of ``manifests`` in one batch, sizes and (when verifying) xxh3-128 checked.

    ``spans``: per manifest, None for a step's own manifest, or the step a span manifest
    starts from (its files live under ``spans/{from}-{to}/``). Returns one
    ``{file name: bytes}`` per manifest. Nothing is decoded here.
    """
    via = list(spans) if spans is not None else [None] * len(manifests)

    def key(i: int, name: str) -> str:
        start, m = via[i], manifests[i]
        return file_key(m.step, name) if start is None else span_file_key(start, m.step, name)

    keys = {key(i, f.path): (i, f) for i, m in enumerate(manifests) for f in m.files}

    def where(i: int) -> str:
        return f"{manifests[i].step}" if via[i] is None else f"{manifests[i].step} (span from {via[i]})"

    try:  # no file is read past the size its manifest gives it
        blobs = store.get_many_bounded({k: f.size for k, (_, f) in keys.items()}) if keys else {}
    except ObjectNotFound as exc:
        steps = tuple(sorted({m.step for m in manifests}))
        raise PlanFilesGone(str(exc), steps) from exc
    except ObjectTooLarge as exc:
        k = next((k for k in keys if f" {k} holds " in str(exc)), None)
        what = f"step {where(keys[k][0])}: file {keys[k][1].path}" if k is not None else "a file of the plan"
        raise ChecksumMismatch(f"{what} is larger than its manifest says (truncated or replaced): {exc}") from None
    out: list[dict[str, bytes]] = [{} for _ in manifests]
    for k, (i, info) in keys.items():
        data = blobs[k]
        step = where(i)
        if len(data) != info.size:
            raise ChecksumMismatch(
                f"step {step}: file {info.path} is {len(data)} bytes, manifest says {info.size} (truncated or replaced)"
            )
        if verify and xxh3_128(data) != info.xxh3_128:
            raise ChecksumMismatch(f"step {step}: file {info.path} fails its xxh3-128 checksum (corrupted)")
        out[i][info.path] = data
        if progress:
            progress(len(data))
    return out
