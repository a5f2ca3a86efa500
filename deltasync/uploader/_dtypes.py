"""A pushed state whose tensors changed dtype (fp32 master weights pushed into a bf16 run): say so.

A dtype change makes the step a full anchor in the new dtypes, so every later anchor grows too
(twice the bytes for bf16 -> fp32). Nothing refuses it (a run may change dtypes on purpose); the
uploader logs :func:`dtype_change_warning` once, at the step that changes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from deltasync.protocol import TensorInfo

__all__ = ["dtype_change_warning", "warn_dtype_change"]

log = logging.getLogger("deltasync.uploader")

_SHORT = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"  # pragma: no cover


def dtype_change_warning(step: int, before: Sequence[TensorInfo], after: Sequence[TensorInfo]) -> str | None:
    """The warning for ``step`` when tensors it shares (name and shape) with ``before`` changed dtype, else None."""
    old = {t.name: t for t in before}
    changed = [(old[t.name], t) for t in after if t.name in old and old[t.name].shape == t.shape]
    changed = [(a, b) for a, b in changed if a.dtype != b.dtype]
    if not changed:
        return None
    kinds: dict[tuple[str, str], int] = {}
    for a, b in changed:
        kinds[(a.dtype, b.dtype)] = kinds.get((a.dtype, b.dtype), 0) + 1
    what = ", ".join(f"{n} {a} -> {b}" for (a, b), n in sorted(kinds.items()))
    new_size = sum(t.nbytes for t in after)
    old_size = new_size - sum(b.nbytes - a.nbytes for a, b in changed)
    was = changed[0][0].dtype
    return (
        f"step {step}: {len(changed)} tensors change dtype ({what}, e.g. {changed[0][1].name!r}): this step is "
        f"written as a full anchor of {_size(new_size)} instead of {_size(old_size)} "
        f"({new_size / max(old_size, 1):.2f}x), and every later anchor grows the same way. To keep the run's "
        f"dtype, cast before diffing: delta-upload --cast {_SHORT.get(was, was.lower())}, or "
        f"DeltaUploader(..., cast_dtype=torch.{_torch_name(was)})"
    )


def warn_dtype_change(step: int, before: Sequence[TensorInfo], after: Sequence[TensorInfo]) -> None:
    """Log :func:`dtype_change_warning` (logger ``deltasync.uploader``) when there is one."""
    msg = dtype_change_warning(step, before, after) if tuple(before) != tuple(after) else None
    if msg is not None:
        log.warning("%s", msg)


def _torch_name(st_dtype: str) -> str:
    return {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}.get(st_dtype, st_dtype.lower())
