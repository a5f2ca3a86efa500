"""Which implementation runs the codec's hot loops: compiled (numba) kernels or the numpy fallback.

Both produce the same bytes and the same arrays; the kernels are one pass per
tensor with the GIL released. ``numba`` is a dependency, but on a platform
without a wheel (or with ``DELTASYNC_KERNELS=numpy``) deltasync runs on numpy
alone. The first use of each kernel in a process compiles it (about a second,
cached on disk under ``__pycache__`` or numba's user cache afterwards).

    >>> from deltasync.protocol import kernels
    >>> kernels.backend() in ("numba", "numpy")
    True
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Literal

__all__ = ["Backend", "available", "backend", "impl", "set_backend", "using"]

Backend = Literal["numba", "numpy"]
#: "numba", "numpy" or "auto" (the default). A process-wide switch between two implementations that
#: write the same bytes (as NUMBA_DISABLE_JIT), read once at the codec's first use: the codec runs in
#: processes no deltasync entry point starts (a trainer's script, vLLM's workers), so that first use is
#: its edge. protocol imports nothing of ours (DESIGN.md); code switches with set_backend / using.
ENV = "DELTASYNC_KERNELS"

log = logging.getLogger(__name__)
_lock = threading.Lock()
_state: dict[str, ModuleType | None | str] = {}


def _load() -> ModuleType | None:
    try:
        from deltasync.protocol import _numba_kernels
    except ImportError as exc:  # no wheel for this platform, or a numba/numpy mismatch
        log.info("deltasync: numba kernels unavailable (%s); using the numpy fallback", exc)
        return None
    return _numba_kernels


def _choose(want: str) -> ModuleType | None:
    if want == "numpy":
        return None
    mod = _load()
    if mod is None and want == "numba":
        raise RuntimeError(f"{ENV}=numba but numba cannot be imported: pip install numba, or unset {ENV}")
    return mod


def impl() -> ModuleType | None:
    """The kernel module in use, or None for the numpy fallback (decided once, on first use)."""
    try:
        return _state["impl"]  # type: ignore[return-value]
    except KeyError:
        pass
    with _lock:
        if "impl" not in _state:
            want = os.environ.get(ENV, "auto").strip().lower() or "auto"
            if want not in ("auto", "numba", "numpy"):
                raise ValueError(f"{ENV}={want!r}: expected auto, numba or numpy")
            _state["impl"] = _choose(want)
    return _state["impl"]  # type: ignore[return-value]


def available() -> bool:
    """Whether the compiled kernels can run here (whatever the current choice)."""
    return _load() is not None


def backend() -> Backend:
    """``"numba"`` when the compiled kernels run, ``"numpy"`` for the fallback."""
    return "numpy" if impl() is None else "numba"


def set_backend(name: Backend | Literal["auto"]) -> None:
    """Switch implementations for this process (tests and benchmarks compare the two)."""
    with _lock:
        _state["impl"] = _choose(name)


@contextmanager
def using(name: Backend) -> Iterator[None]:
    """Run a block on one implementation, then restore the previous one."""
    before = impl()
    set_backend(name)
    try:
        yield
    finally:
        with _lock:
            _state["impl"] = before
