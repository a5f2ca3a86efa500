"""torch interop shared by the uploader and the fetcher. torch is imported lazily."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from deltasync._util.cpus import parallel_map
from deltasync.errors import AllocationFailed, InventoryMismatch
from deltasync.protocol.digests import Digestible, tensor_digests
from deltasync.protocol.manifest import TensorInfo

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_MAX_ALLOC_BYTES",
    "DeviceBytes",
    "allocate",
    "Accessors",
    "accessors",
    "digest_tensors",
    "flat_bits",
    "digestible",
    "inventory_nbytes",
    "inventory_of",
    "numpy_bits",
    "require_torch",
    "st_dtype",
    "state_tensors",
    "torch_bits_dtype",
    "torch_dtype",
]

_ST_NAMES = {
    "bfloat16": "BF16",
    "float16": "F16",
    "float32": "F32",
    "float64": "F64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int8": "I8",
    "uint8": "U8",
    "int16": "I16",
    "uint16": "U16",
    "int32": "I32",
    "uint32": "U32",
    "int64": "I64",
    "uint64": "U64",
    "bool": "BOOL",
}


class Accessors(NamedTuple):
    """Getters of a torch tensor's facts, each mapped over a state's tensors in one C-level pass
    (``list(map(a.data_ptr, tensors))``): torch's own descriptors and unbound methods, called
    straight (half the cost of attrgetter and methodcaller at 18k tensors, and no Python frame per
    tensor as a generator has; a Tensor subclass is still a Tensor to them)."""

    data_ptr: Callable[[Any], int]
    stride: Callable[[Any], tuple[int, ...]]
    shape: Callable[[Any], Any]
    dtype: Callable[[Any], Any]
    is_contiguous: Callable[[Any], bool]
    is_cpu: Callable[[Any], bool]


_ACCESSORS: list[Accessors] = []


def accessors() -> Accessors:
    """The :class:`Accessors` of torch tensors (made once)."""
    if not _ACCESSORS:
        T = require_torch().Tensor
        _ACCESSORS.append(
            Accessors(T.data_ptr, T.stride, T.shape.__get__, T.dtype.__get__, T.is_contiguous, T.is_cpu.__get__)
        )
    return _ACCESSORS[0]


def require_torch() -> Any:
    """Import torch or explain how to get it."""
    try:
        import torch
    except ImportError:  # pragma: no cover - exercised only without torch
        raise ImportError("this part of deltasync needs PyTorch: pip install torch") from None
    return torch


def st_dtype(dtype: torch.dtype) -> str:
    """safetensors dtype name of a torch dtype."""
    name = str(dtype).removeprefix("torch.")
    try:
        return _ST_NAMES[name]
    except KeyError:
        raise InventoryMismatch(f"dtype {dtype} is not supported (supported: {', '.join(sorted(_ST_NAMES))})") from None


def torch_dtype(st: str) -> torch.dtype:
    """torch dtype for a safetensors dtype name."""
    torch = require_torch()
    for k, v in _ST_NAMES.items():
        if v == st:
            return getattr(torch, k)  # type: ignore[no-any-return]
    raise InventoryMismatch(f"safetensors dtype {st} has no torch equivalent")


def torch_bits_dtype(itemsize: int) -> torch.dtype:
    """Signed integer torch dtype of the given width."""
    import torch  # callers hold tensors: torch is there (no dict built per call: 18k tensors a step)

    if itemsize == 2:
        return torch.int16
    if itemsize == 4:
        return torch.int32
    return torch.int8 if itemsize == 1 else torch.int64


def flat_bits(t: torch.Tensor, *, copy_if_needed: bool = True) -> torch.Tensor:
    """1-D signed-integer view of a tensor's bits (shares memory when ``t`` is contiguous)."""
    if not t.is_contiguous():
        if not copy_if_needed:
            raise InventoryMismatch("target tensor is not contiguous; deltasync applies patches in place")
        t = t.contiguous()
    return t.detach().view(-1).view(torch_bits_dtype(t.element_size()))


def numpy_bits(t: torch.Tensor) -> np.ndarray[Any, Any]:
    """numpy view (shared memory) of a CPU tensor's flat bits."""
    return flat_bits(t, copy_if_needed=False).numpy()


# ------------------------------------------------------------------ digests


class DeviceBytes:
    """An accelerator tensor's bytes as a :class:`~deltasync.protocol.digests.ByteSource`: each read
    copies one range (at most a digest chunk) to the host, never the whole tensor at once."""

    __slots__ = ("_bytes", "nbytes")

    def __init__(self, t: torch.Tensor) -> None:
        import torch

        self._bytes = flat_bits(t).view(torch.uint8)
        self.nbytes = int(self._bytes.numel())

    def read(self, start: int, stop: int) -> memoryview:
        """Bytes ``start:stop``, copied to the host."""
        return self._bytes[start:stop].cpu().numpy().data


def digestible(t: torch.Tensor | np.ndarray[Any, Any]) -> Digestible:
    """What :func:`~deltasync.protocol.digests.tensor_digests` hashes for ``t``: a host array as it is,
    a CPU tensor's bits in place (copied only if it is not contiguous), an accelerator's tensor read
    chunk by chunk (:class:`DeviceBytes`)."""
    if isinstance(t, np.ndarray):
        return t
    if t.device.type == "cpu":
        return flat_bits(t).numpy()
    return DeviceBytes(t)


def digest_tensors(
    tensors: Mapping[str, torch.Tensor | np.ndarray[Any, Any]],
    format_version: int,
    *,
    threads: int | None = None,
    pool: Executor | None = None,
) -> dict[str, str]:
    """Each tensor's digest in a manifest of ``format_version``, by name, hashed at once: on ``pool``
    when given, else on a pool of ``threads`` (default: every usable CPU) for the call."""
    mapper = pool.map if pool is not None else functools.partial(parallel_map, threads=threads)
    return tensor_digests({n: digestible(t) for n, t in tensors.items()}, format_version, mapper=mapper)


def inventory_of(state: Mapping[str, torch.Tensor]) -> tuple[TensorInfo, ...]:
    """Inventory (sorted by name) of a state dict."""
    return tuple(
        sorted((TensorInfo(k, st_dtype(v.dtype), tuple(v.shape)) for k, v in state.items()), key=lambda t: t.name)
    )


def state_tensors(target: Any) -> dict[str, torch.Tensor]:
    """Tensors of an nn.Module (its state_dict) or a mapping of name -> tensor."""
    torch = require_torch()
    if isinstance(target, torch.nn.Module):
        return dict(target.state_dict())
    if isinstance(target, Mapping):
        if all(map(isinstance, target, itertools.repeat(str))) and all(
            map(isinstance, target.values(), itertools.repeat(torch.Tensor))
        ):
            return dict(target)
        bad = [k for k, v in target.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
        if bad:
            raise TypeError(f"expected a mapping of str -> torch.Tensor; bad entries: {bad[:5]}")
        return dict(target)
    raise TypeError(f"expected an nn.Module or a dict of tensors, got {type(target).__name__}")


#: the most bytes of tensors ``DeltaFetcher.sync({})`` allocates from a run's inventory unless told
#: otherwise (its ``max_alloc_bytes``): a manifest's shapes are claims, not bytes present
DEFAULT_MAX_ALLOC_BYTES = 256 << 30


def inventory_nbytes(inventory: Iterable[TensorInfo]) -> int:
    """Bytes the tensors of ``inventory`` declare (numel times element size, summed)."""
    torch = require_torch()
    total = 0
    for t in inventory:
        n = 1
        for d in t.shape:
            n *= d
        total += n * torch.empty((), dtype=torch_dtype(t.dtype)).element_size()
    return total


def allocate(
    inventory: Iterable[TensorInfo], limit_bytes: int, *, option: str, zeroed: bool = True
) -> dict[str, torch.Tensor]:
    """CPU tensors shaped as ``inventory``, by name: THE allocator from a run's inventory.

    Refuses (InventoryMismatch, naming ``option``, the setting that raises the cap) an inventory
    declaring more than ``limit_bytes`` in all, before allocating anything. ``zeroed``: filled with
    zeros, else left uninitialised (the caller overwrites every element).
    """
    torch = require_torch()
    infos = list(inventory)
    total = inventory_nbytes(infos)
    if total > limit_bytes:
        raise InventoryMismatch(
            f"the run declares {total:,} bytes of weights, more than the {limit_bytes:,} bytes allowed by "
            f"{option} (a run of another model, or a manifest that lies; raise {option} if it is right)"
        )
    make = torch.zeros if zeroed else torch.empty
    out: dict[str, Any] = {}
    for t in infos:
        try:
            out[t.name] = make(t.shape, dtype=torch_dtype(t.dtype))
        except (RuntimeError, MemoryError) as exc:  # the allocator's own error: the host is out of room
            out.clear()  # what was allocated is given back
            raise AllocationFailed(
                f"cannot allocate tensor {t.name!r} ({inventory_nbytes([t]):,} bytes; {total:,} bytes for the whole "
                f"run, within the {limit_bytes:,} bytes {option} allows): {type(exc).__name__}: "
                f"{(str(exc).splitlines() or [''])[0][:200]}. Free memory (or address space: ulimit -v), or lower "
                f"{option} to refuse such runs before allocating"
            ) from exc
    return out
