"""The node mirror's pages, registered with CUDA: copies to a GPU engine run at DMA speed.

A GPU worker copies each changed tensor from the node mirror's mapped files (shared memory) into its
parameters. From pageable pages the driver stages every byte through a bounce buffer; the same pages
registered with ``cudaHostRegister`` are read by the copy engine directly. Measured with
``benchmarks/bench_pinned_mirror.py`` on an H200 (the Qwen3-0.6B tensors, 1.11 GiB bf16): every
tensor copied from pageable pages took 128 ms (9.3 GB/s), from registered ones 22 ms (53 GB/s),
0.17x. Registering is a one-off per mapping and is done while preparing (the engine keeps serving):
89 ms for those 1.11 GiB. The views of a registered engine are mapped shared and write-protected
(:func:`~deltasync.serving.node.datafiles.map_file` ``read_only``): CUDA registers those 6.8x
faster than copy-on-write mappings (605 ms), nothing is copied (the process's private memory did
not grow), and a loader that wrote into its input would fault rather than change the node's copy.

:class:`HostPins` keeps a count per mapping, so a tensor shared by the version an engine serves and
the one it prepares stays registered until neither needs it. A registration that fails (no CUDA,
a locked-memory limit) is logged once and the mirror carries on from pageable pages: an optimisation
never fails an update.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["PINNED_MAX_DENSITY", "HostPins"]

log = logging.getLogger("deltasync.vllm")

#: cudaHostRegisterReadOnly: the device only reads these pages (a private mapping is not copied)
_READ_ONLY = 0x08
#: with the mirror registered, copying a tensor whole beats gathering and scattering its changed
#: elements above about this fraction of them (bench_scatter.py --pin on an H200)
PINNED_MAX_DENSITY = 0.01


def _cuda_register(ptr: int, nbytes: int) -> None:
    import torch

    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _READ_ONLY)  # type: ignore[no-untyped-call]
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {err}")


def _cuda_unregister(ptr: int) -> None:
    import torch

    torch.cuda.cudart().cudaHostUnregister(ptr)  # type: ignore[no-untyped-call]


class HostPins:
    """Registers host tensors (the node mirror's mappings) with CUDA while some view holds them.

    register(ptr, nbytes) and unregister(ptr) replace the CUDA calls (tests). Thread-safe.
    """

    def __init__(
        self,
        register: Callable[[int, int], None] = _cuda_register,
        unregister: Callable[[int], None] = _cuda_unregister,
    ) -> None:
        self._register = register
        self._unregister = unregister
        self._lock = threading.Lock()
        self._held: dict[int, tuple[int, Any]] = {}  # data_ptr -> (count, the tensor: keeps its mapping alive)
        #: False once a registration failed: from then on the mirror is read from pageable pages
        self.enabled = True
        #: bytes registered now, and seconds spent registering in all
        self.nbytes = 0
        self.seconds = 0.0

    def hold(self, tensors: Iterable[Any]) -> None:
        """Register every tensor not registered yet; count one more holder of the others."""
        with self._lock:
            for t in tensors:
                nbytes = t.numel() * t.element_size()
                if not nbytes:
                    continue
                ptr = t.data_ptr()
                count, kept = self._held.get(ptr, (0, t))
                if count == 0:
                    if not self.enabled:
                        continue
                    t0 = time.perf_counter()
                    try:
                        self._register(ptr, nbytes)
                    except Exception as exc:  # noqa: BLE001 - pageable copies still work
                        self.enabled = False
                        log.warning(
                            "cannot register the node mirror's pages with CUDA (%s: %s): copies to the GPU read "
                            "pageable memory (slower; raise the locked-memory limit, `ulimit -l`, to fix)",
                            type(exc).__name__,
                            exc,
                        )
                        continue
                    finally:
                        self.seconds += time.perf_counter() - t0
                    self.nbytes += nbytes
                self._held[ptr] = (count + 1, kept)

    def release(self, tensors: Iterable[Any]) -> None:
        """One holder fewer of each tensor; unregister those nobody holds any more."""
        with self._lock:
            for t in tensors:
                ptr = t.data_ptr()
                entry = self._held.get(ptr)
                if entry is None:
                    continue
                count, kept = entry
                if count > 1:
                    self._held[ptr] = (count - 1, kept)
                    continue
                del self._held[ptr]
                self.nbytes -= kept.numel() * kept.element_size()
                try:
                    self._unregister(ptr)
                except Exception as exc:  # noqa: BLE001 - the mapping goes with its tensor anyway
                    log.debug("cudaHostUnregister failed: %s", exc)

    def held(self) -> int:
        """How many mappings are registered now."""
        with self._lock:
            return len(self._held)

    def close(self) -> None:
        """Unregister everything."""
        with self._lock:
            ptrs = list(self._held)
            self._held.clear()
            self.nbytes = 0
        for ptr in ptrs:
            try:
                self._unregister(ptr)
            except Exception as exc:  # noqa: BLE001
                log.debug("cudaHostUnregister failed: %s", exc)
