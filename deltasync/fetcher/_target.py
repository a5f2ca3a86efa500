"""A sync's target as tensors: the live objects it holds and their flat bits (:class:`TargetTensor`)."""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import numpy as np

from deltasync._util.cpus import parallel_map
from deltasync._util.tensors import (
    DeviceBytes,
    flat_bits,
    numpy_bits,
    require_torch,
    state_tensors,
)
from deltasync.errors import ProtocolError
from deltasync.fetcher._fold import Change, new_bits
from deltasync.protocol import kernels
from deltasync.protocol.digests import DIGEST_CHUNK, Digestible, hex_words, tensor_digests, words_hex, xxh3_128_words
from deltasync.run.adapter import adapter_parameters, is_peft_model

__all__ = [
    "DeviceTensor",
    "HostTensor",
    "TargetTensor",
    "TensorViews",
    "live_tensors",
    "target_digests",
    "target_tensors",
]

Bits = np.ndarray[Any, np.dtype[Any]]


def live_tensors(target: Any) -> dict[str, Any]:
    """The target's tensors as the objects it holds (Parameters for a module), so identity holds; a
    PEFT model's are its active adapter's LoRA Parameters, by the names PEFT saves them with."""
    if is_peft_model(target):
        return adapter_parameters(target)
    torch = require_torch()
    if isinstance(target, torch.nn.Module):
        return dict(target.state_dict(keep_vars=True))
    return state_tensors(target)


def target_tensors(live: Mapping[str, Any]) -> dict[str, TargetTensor]:
    """A :class:`TargetTensor` per live tensor: a numpy view on the CPU, the tensor itself on an accelerator."""
    return {n: _view(t) for n, t in live.items()}


def _view(t: Any) -> TargetTensor:
    if t.device.type == "cpu":
        arr = numpy_bits(t)
        # the key HostTensor would take from the array, from torch (cheaper at 18k tensors a sync)
        ptr = t.data_ptr()
        return HostTensor(arr, key=(ptr, arr.size, arr.dtype.str), addr=ptr)
    return DeviceTensor(flat_bits(t, copy_if_needed=False))


def target_digests(
    tensors: Mapping[str, TargetTensor], names: Iterable[str], format_version: int, *, threads: int = 1
) -> dict[str, str]:
    """The digests of the named tensors in a manifest of ``format_version``, hashed on up to
    ``threads`` threads at once (a large tensor's chunks too, in format 2)."""
    names = list(names)
    return dict(zip(names, digest_list(tensors, names, format_version, threads=threads), strict=True))


def digest_list(
    tensors: Mapping[str, TargetTensor], names: Sequence[str], format_version: int, *, threads: int = 1
) -> list[str]:
    """:func:`target_digests` as a list in the order of ``names``."""
    words = digest_words(tensors, names, format_version, threads=threads)
    return words_hex(words)


def digest_words(
    tensors: Mapping[str, TargetTensor], names: Sequence[str], format_version: int, *, threads: int = 1
) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """The digests of :func:`target_digests` in the order of ``names``, as an ``(n, 2)`` uint64 array
    (:func:`~deltasync.protocol.digests.hex_words`). A flat host tensor whose digest is one xxh3 of
    its bytes is hashed where it lies: all of them in one compiled loop over their addresses, on the
    pool (xxhash's own C function, the GIL released; no Python call per tensor). The rest (and every
    tensor where that loop cannot run) as :func:`tensor_digests` does."""
    mapper = functools.partial(parallel_map, threads=threads)
    out = np.zeros((len(names), 2), dtype=np.uint64)
    index, addrs, lens = host_ranges(tensors)
    at = positions_in(index, names, getattr(tensors, "memo", None))
    whole = lens[at] >= 0
    if format_version >= 2:
        whole &= lens[at] <= DIGEST_CHUNK  # a larger one digests as its chunks' digest (is_tree_digest)
    rest = np.flatnonzero(~whole)
    if whole.any():
        got = xxh3_128_words(addrs[at[whole]], lens[at[whole]], mapper=mapper)
        if got is None:  # no compiled hasher here
            rest = np.arange(len(names))
        else:
            out[whole] = got
    if rest.size:
        picked = [names[i] for i in rest.tolist()]
        hexes = tensor_digests({n: tensors[n].digestible() for n in picked}, format_version, mapper=mapper)
        out[rest] = hex_words([hexes[n] for n in picked])
    return out


def positions_in(index: Mapping[str, int], names: Sequence[str], memo: dict[Any, Any] | None) -> np.ndarray[Any, Any]:
    """``index[name]`` of each name, as int64 (KeyError: a name ``index`` does not hold). The last
    answer is kept in ``memo``, the dict kept with ``index`` (which must not change while it is):
    a model synced step after step asks for the same 18k names each time, the very string objects."""
    key = tuple(names)
    last = None if memo is None else memo.get("positions_in")
    if last is not None and last[0] is index and last[1] == key:
        hit: np.ndarray[Any, Any] = last[2]
        return hit
    at = np.fromiter(map(index.__getitem__, key), dtype=np.int64, count=len(key))
    at.flags.writeable = False  # shared by the callers that ask again
    if memo is not None:
        memo["positions_in"] = (index, key, at)
    return at


def host_ranges(
    tensors: Mapping[str, TargetTensor],
) -> tuple[dict[str, int], np.ndarray[Any, np.dtype[np.int64]], np.ndarray[Any, np.dtype[np.int64]]]:
    """(position of each name, data addresses, byte sizes) of a target's tensors, the size -1 where a
    tensor is not a flat C-contiguous host array. Kept with a :class:`TensorViews` (whose tensors keep
    their memory and layout while it is handed out)."""
    memo = getattr(tensors, "memo", None)
    if memo is not None and "host_ranges" in memo:
        hit: tuple[dict[str, int], np.ndarray[Any, np.dtype[np.int64]], np.ndarray[Any, np.dtype[np.int64]]]
        hit = memo["host_ranges"]
        return hit
    lays = [t.layout if isinstance(t, HostTensor) else None for t in tensors.values()]
    addrs = np.fromiter((0 if lay is None else lay[0] for lay in lays), dtype=np.int64, count=len(lays))
    lens = np.fromiter((-1 if lay is None else lay[1] * lay[2] for lay in lays), dtype=np.int64, count=len(lays))
    found = ({n: i for i, n in enumerate(tensors)}, addrs, lens)
    if memo is not None:
        memo["host_ranges"] = found
    return found


class TargetTensor(ABC):
    """One tensor of a sync's target, seen as its flat bits wherever they live: what a step is
    applied to (read, written, hashed, rolled back)."""

    key: Any = None
    #: (address, elements, itemsize) of a flat C-contiguous host array that compiled code may write
    #: in place through its address (format 2 groups: :class:`~deltasync.fetcher._apply.HostGroup`);
    #: None otherwise
    layout: tuple[int, int, int] | None = None

    @abstractmethod
    def take(self, idx: Bits) -> Bits:
        """Bits at ``idx`` (a host copy)."""

    @abstractmethod
    def put(self, idx: Bits, vals: Bits) -> None:
        """Write bits at ``idx``."""

    @abstractmethod
    def load(self, arr: Bits) -> None:
        """Overwrite the whole tensor."""

    @abstractmethod
    def digestible(self) -> Digestible:
        """The tensor's bytes as :func:`~deltasync.protocol.digests.tensor_digests` reads them (see
        :func:`target_digests`)."""

    def apply(self, c: Change) -> Bits:
        """Apply one change in place; returns the bits it overwrote (for the undo log)."""
        old = self.take(c.idx)
        self.put(c.idx, new_bits(c, old))
        return old

    @abstractmethod
    def snapshot(self) -> Bits:
        """A host copy of all the bits."""


class HostTensor(TargetTensor):
    """A tensor in host memory as a numpy bit array (CPU torch tensors are viewed this way, sharing
    memory; a materialized dir's tensors are plain arrays)."""

    def __init__(self, arr: Bits, key: Any = None, *, addr: int | None = None) -> None:
        """``addr``: the address of ``arr``'s data when the caller has it at hand (read from it otherwise)."""
        self.arr = arr
        if addr is None:
            addr = int(arr.__array_interface__["data"][0])
        self.key = key if key is not None else (addr, arr.size, arr.dtype.str)
        if arr.flags.c_contiguous and arr.flags.writeable:
            self.layout = (addr, arr.size, arr.dtype.itemsize)

    def take(self, idx: Bits) -> Bits:
        # docstring inherited
        return self.arr[idx]

    def put(self, idx: Bits, vals: Bits) -> None:
        # docstring inherited
        self.arr[idx] = vals

    def load(self, arr: Bits) -> None:
        # docstring inherited
        np.copyto(self.arr, arr)

    def digestible(self) -> Digestible:
        # docstring inherited
        return self.arr  # hashed in place

    def apply(self, c: Change) -> Bits:
        # docstring inherited
        kern = kernels.impl()
        coding = c.coding
        idx = c.idx
        if (
            kern is None
            or coding == "mixed"
            or not idx.size
            or idx.dtype != np.int64
            or c.values.dtype.itemsize != self.arr.dtype.itemsize
            or not self.arr.flags.c_contiguous
        ):
            return super().apply(c)
        if int(idx[0]) < 0 or int(idx[-1]) >= self.arr.size:  # sorted positions: the ends bound them all
            raise ProtocolError(f"{c.tensor!r}: positions outside a tensor of {self.arr.size} elements")
        old: Bits = np.empty(idx.size, dtype=self.arr.dtype)
        vals = c.values.view(self.arr.dtype)
        (kern.xor_apply if coding == "xor-rank" else kern.set_apply)(self.arr.reshape(-1), idx, vals, old)
        return old

    def snapshot(self) -> Bits:
        # docstring inherited
        out: Bits = self.arr.copy()
        return out


class DeviceTensor(TargetTensor):
    """A tensor on an accelerator, as a flat torch bit view; host data is moved once per call."""

    def __init__(self, t: Any) -> None:
        self.t = t
        self.key = (t.device.type, t.data_ptr(), t.numel(), str(t.dtype))

    def _idx(self, idx: Bits) -> Any:
        import torch

        return torch.from_numpy(idx).to(self.t.device, non_blocking=True)

    def take(self, idx: Bits) -> Bits:
        # docstring inherited
        return self.t[self._idx(idx)].cpu().numpy()  # type: ignore[no-any-return]

    def put(self, idx: Bits, vals: Bits) -> None:
        # docstring inherited
        import torch

        self.t[self._idx(idx)] = torch.from_numpy(np.ascontiguousarray(vals)).to(self.t.device)

    def load(self, arr: Bits) -> None:
        # docstring inherited
        import torch

        self.t.copy_(torch.from_numpy(np.array(arr)))

    def digestible(self) -> Digestible:
        # docstring inherited
        return DeviceBytes(self.t)  # copied to the host one digest chunk at a time

    def snapshot(self) -> Bits:
        # docstring inherited
        out: Bits = np.array(self.t.cpu().numpy())
        return out


class TensorViews(dict[str, TargetTensor]):
    """A target's :class:`TargetTensor` by name (what :meth:`TargetViews.of` returns), read-only, so
    what is derived from it is computed once and kept with it: the tied names
    (:func:`~deltasync.fetcher._apply.alias_groups`)."""

    __slots__ = ("__weakref__", "_aliases", "memo")

    def __init__(self, items: Mapping[str, TargetTensor]) -> None:
        super().__init__(items)
        self._aliases: dict[str, str] | None = None
        #: what callers derive from these views and keep with them (bounded by whoever adds to it)
        self.memo: dict[Any, Any] = {}

    def aliases(self) -> dict[str, str]:
        """Each name to the first name (sorted) sharing its memory (computed once)."""
        if self._aliases is None:
            first: dict[Any, str] = {}
            self._aliases = {name: first.setdefault(self[name].key, name) for name in sorted(self)}
            self.memo["tied"] = len(first) != len(self._aliases)
        return self._aliases

    def tied(self) -> bool:
        """Whether any two names share memory (computed once)."""
        self.aliases()
        return bool(self.memo["tied"])

    def raw_writes(self) -> bool:
        """Whether every tensor here is written through its memory (:class:`HostTensor`: numpy and the
        compiled kernels), never by a torch operation, so writing bumps no version counter (computed once)."""
        found = self.memo.get("raw_writes")
        if found is None:
            found = self.memo["raw_writes"] = all(type(t) is HostTensor for t in self.values())
        return bool(found)

    def keys_of(self, names: Sequence[str]) -> list[Any]:
        """The :attr:`TargetTensor.key` of each name, in order (kept for the last list of names asked)."""
        last = self.memo.get("keys_of")
        if last is not None and last[0] == names:
            return cast(list[Any], last[1])
        keys = [self[n].key for n in names]
        self.memo["keys_of"] = (list(names), keys)
        return keys

    def _frozen(self, *_: Any, **__: Any) -> Any:
        raise TypeError("a target's views are read-only")

    __setitem__ = __delitem__ = __ior__ = _frozen
    clear = pop = popitem = setdefault = update = _frozen
