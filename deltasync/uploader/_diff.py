"""Bit-wise diff of a state against the baseline, on the tensors' own device."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from deltasync._util.tensors import flat_bits, inventory_of
from deltasync.protocol import TensorInfo, kernels

if TYPE_CHECKING:
    import torch

__all__ = ["DIFF_CHUNK", "Baseline", "TensorDiff", "diff_tensor", "inventory_of", "join_diffs"]

CHUNK = 1 << 21  # elements per compare chunk: keeps the mask in cache
#: a tensor larger than this many elements is diffed in chunks of it, on several threads at once
DIFF_CHUNK = 1 << 23
Bits = np.ndarray[Any, np.dtype[Any]]


@dataclass(slots=True)
class TensorDiff:
    """The trainer side's diff of one tensor against the baseline: changed flat positions with their
    old and new bits (host memory, owned), what the encoder needs (XOR against the old bits). What a
    step changed, as receivers see it, is :class:`deltasync.protocol.TensorChange`.

    From a CUDA tensor the arrays are pinned host buffers still being filled by
    asynchronous copies: call :meth:`wait` before reading them.
    """

    idx: Bits
    old: Bits
    new: Bits
    ready: Any = None  # a torch.cuda.Event recorded after the copies, or None

    def wait(self) -> None:
        """Block until the arrays hold their data (a no-op for changes from CPU tensors)."""
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None


@dataclass(slots=True)
class Baseline:
    """The last pushed state: one flat bit tensor per name, on each tensor's device."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    inventory: tuple[TensorInfo, ...] = ()
    #: packs (``uploader._pack.Pack``) whose tensors in ``tensors`` are views into ``bufs``
    packs: tuple[Any, ...] = ()
    bufs: tuple[torch.Tensor, ...] = ()


def join_diffs(parts: list[TensorDiff]) -> TensorDiff:
    """One tensor's diff from the diffs of its chunks, in order (positions already absolute)."""
    for p in parts:
        p.wait()
    return TensorDiff(
        np.concatenate([p.idx for p in parts]),
        np.concatenate([p.old for p in parts]),
        np.concatenate([p.new for p in parts]),
    )


def _diff_numpy(base: Bits, new: Bits) -> Bits:
    parts: list[Bits] = []
    mask = np.empty(min(CHUNK, base.size), dtype=bool)
    for start in range(0, base.size, CHUNK):
        b = base[start : start + CHUNK]
        m = mask[: b.size]
        np.not_equal(b, new[start : start + CHUNK], out=m)
        hit = np.flatnonzero(m)
        if hit.size:
            parts.append(hit + start)
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def _diff_kernel(kern: ModuleType, base: Bits, new: Bits) -> TensorDiff | None:
    """Compare, collect and update in one compiled pass (the GIL released)."""
    n = int(kern.count_changed(base, new))  # a vectorised pass sizes the outputs exactly
    if not n:
        return None
    idx = np.empty(n, dtype=np.int64)
    old = np.empty(n, dtype=base.dtype)
    vals = np.empty(n, dtype=base.dtype)
    if kern.diff_words(base, new, idx, old, vals, kern.DEBRUIJN_POS) != n:  # base and new are ours
        raise RuntimeError("the state changed while it was being diffed")
    return TensorDiff(idx, old, vals)


def diff_tensor(base: torch.Tensor, new: torch.Tensor) -> TensorDiff | None:
    """Changed positions of ``new`` against ``base`` (both flat bit views), and update ``base``.

    CPU tensors are compared chunk-wise with numpy on shared memory; other
    devices with torch on the device, copying only the changed elements to host.
    """
    if base.device.type == "cpu":
        b, n = base.numpy(), flat_bits(new).numpy()
        kern = kernels.impl()
        if kern is not None:
            return _diff_kernel(kern, b, n)
        idx = _diff_numpy(b, n)
        if not idx.size:
            return None
        old = b[idx]
        vals = n[idx]
        b[idx] = vals
        return TensorDiff(idx.astype(np.int64, copy=False), old, vals)
    return _diff_torch(base, flat_bits(new))


def _diff_torch(base: torch.Tensor, nb: torch.Tensor) -> TensorDiff | None:
    """The device path: compare, gather the changed elements and update ``base`` on the device; only
    the sparse result crosses to the host (pinned, asynchronously: :meth:`TensorDiff.wait`)."""
    import torch

    idx_t = (base != nb).nonzero().squeeze(1)  # sizing the result is the one host sync
    n = int(idx_t.numel())
    if not n:
        return None
    old_t = base[idx_t]
    new_t = nb[idx_t]
    base[idx_t] = new_t
    if base.device.type != "cuda":
        return TensorDiff(idx_t.cpu().numpy(), old_t.cpu().numpy(), new_t.cpu().numpy())
    host = [torch.empty(n, dtype=t.dtype, pin_memory=True) for t in (idx_t, old_t, new_t)]
    for h, t in zip(host, (idx_t, old_t, new_t), strict=True):
        h.copy_(t, non_blocking=True)
    ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
    ready.record()  # on the current stream, after the copies
    return TensorDiff(host[0].numpy(), host[1].numpy(), host[2].numpy(), ready)
