"""deltasync in vLLM's engine core: what an update needs beyond the workers.

vLLM runs every weight update as a collective RPC from its engine core (the loop that schedules
requests, in its own process or in the ``LLM``'s) to its workers, through
``EngineCore.collective_rpc``; ``LLM.update_weights``, the HTTP route ``/update_weights`` and
``LLM.collective_rpc`` all end there. :func:`install` (run by deltasync's ``vllm.general_plugins``
entry point, which vLLM loads in every process, engine core included) wraps that one method so that:

* **No rollout is served from state computed with older weights.** vLLM's prefix cache keys KV
  blocks by token ids, not by weights, and a weight update leaves it alone (vLLM 0.32): a prompt
  of one KV block or more that was served before an update is answered from KV of the previous
  weights (issue 24: the output leaves a fresh engine's at the 1st or 2nd token). So right after an
  RPC that may have changed the weights through deltasync (``update_weights`` on an engine whose
  weight-transfer backend is ``"deltasync"``, unless ``prepare_only``; ``deltasync_update``),
  inside the same engine-core call, before anything else is scheduled, the engine core runs
  :func:`reset_caches`: the prefix cache (and a KV connector's, e.g. CPU offload) is dropped, running
  requests are preempted and recomputed with the new weights, and a multimodal model's encoder
  cache (vision-encoder outputs) is dropped. The multimodal *processor* cache holds preprocessed
  inputs, which do not depend on the weights; it stays.
* **deltasync's worker API needs no worker extension.** ``collective_rpc("deltasync_status")`` and
  the other :data:`RPCS` are sent to the workers as a call of the function given to :func:`install`,
  which runs the method of the engine's worker extension where it has one and deltasync's own
  otherwise: an engine started with only ``--weight-transfer-config '{"backend": "deltasync"}'``
  (or with nothing of deltasync's) answers them.

* **A prepare's wait does not stop the engine.** ``deltasync_prepare`` with ``wait`` on an engine core in
  its own process answers through a future vLLM's ``EngineCoreProc`` resolves later: the engine keeps
  generating, the workers are not asked meanwhile (:mod:`deltasync.serving.engine.prepared`).

Everything else passes through untouched. Without the plugin (``VLLM_PLUGINS`` set without
``deltasync``) nothing of this runs: the backend is not registered either.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from deltasync.errors import PrefixCacheNotReset
from deltasync.integrations.vllm.compat import missing_internals
from deltasync.serving import worker_api
from deltasync.serving.engine.prepared import deferred_prepare
from deltasync.serving.worker_api import PrepareRequest

__all__ = ["BACKEND", "RPCS", "WorkerCall", "changes_weights", "install", "reset_caches"]

log = logging.getLogger("deltasync.vllm")

#: the weight-transfer backend's name (``--weight-transfer-config '{"backend": "deltasync"}'``)
BACKEND = "deltasync"
#: deltasync's worker methods, callable with ``collective_rpc`` on any engine once :func:`install` ran
#: (the worker API's: :data:`deltasync.serving.worker_api.RPCS`)
RPCS = worker_api.RPCS
_MARK = "__deltasync_engine_core__"

#: ``worker_call(worker, name, args, kwargs)``: runs deltasync's worker method ``name`` on a vLLM worker
WorkerCall = Callable[[Any, str, tuple[object, ...], dict[str, object]], object]


def changes_weights(method: Any, args: Any, kwargs: Mapping[str, Any] | None, backend: str | None) -> bool:
    """Whether a ``collective_rpc(method, args=..., kwargs=...)`` may change the weights through
    deltasync, on an engine whose weight-transfer backend is ``backend`` (None: none)."""
    if method == worker_api.UPDATE:
        return True
    if method != "update_weights" or backend != BACKEND:
        return False
    info = (kwargs or {}).get("update_info", args[0] if args else None)
    infos = info if isinstance(info, list) else [info]
    return not all(isinstance(i, Mapping) and i.get("prepare_only") for i in infos)


def reset_caches(core: Any) -> None:
    """Drop what an engine core holds that was computed with the previous weights.

    ``core`` is a ``vllm.v1.engine.core.EngineCore``. Running requests are preempted (their KV
    is recomputed with the new weights when they are scheduled again). Raises
    :class:`~deltasync.errors.PrefixCacheNotReset` when vLLM reports that the cache could not be dropped.
    """
    try:
        ok = core.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
    except RuntimeError as exc:
        ok, why = False, str(exc)
    else:
        why = "vLLM's reset_prefix_cache returned False (KV blocks still held by a KV connector)"
    if not ok:
        raise PrefixCacheNotReset(
            f"the engine's weights changed but its prefix cache could not be dropped ({why}); until "
            "llm.reset_prefix_cache(reset_running_requests=True, reset_connector=True) returns True "
            "(HTTP: POST /reset_prefix_cache?reset_running_requests=true&reset_external=true), prompts it "
            "served before may be answered from KV of the previous weights: retry it, or restart the engine"
        )
    if getattr(getattr(core.vllm_config, "model_config", None), "is_multimodal_model", False):
        core.reset_encoder_cache()


def _waiting_prepare(method: object, args: Sequence[object], kwargs: Mapping[str, Any] | None) -> PrepareRequest | None:
    """The request of a ``deltasync_prepare`` with ``wait`` (None: another call, or arguments the workers
    are to refuse themselves)."""
    if method != worker_api.PREPARE or args:
        return None
    try:
        request = PrepareRequest.from_kwargs(**(kwargs or {}))
    except (TypeError, ValueError):
        return None  # the workers answer it with its error
    return request if request.wait else None


def _answers(out: object) -> list[object]:
    """The workers' answers ``collective_rpc`` returned (a list, one per worker)."""
    return list(out) if isinstance(out, list | tuple) else [out]


def _defers(core: Any) -> bool:
    """Whether ``core`` answers a utility call once a future it returned completes (not in-process)."""
    from vllm.v1.engine.core import EngineCoreProc  # compat.INTERNALS: tested with vllm 0.32

    return isinstance(core, EngineCoreProc)


def _backend_of(core: Any) -> str | None:
    config = getattr(core.vllm_config, "weight_transfer_config", None)
    return None if config is None else str(getattr(config, "backend", None))


def install(worker_call: WorkerCall) -> bool:
    """Wrap ``EngineCore.collective_rpc`` (see the module docstring); idempotent. ``worker_call`` must
    be a module-level function: vLLM sends it to worker processes by reference.

    Returns False, with an error logged, where this vLLM has no ``EngineCore`` of the expected shape.
    """
    missing = missing_internals()
    if missing:
        log.error(
            "this vLLM lacks %s: deltasync cannot reset its prefix cache after an update; call "
            "llm.reset_prefix_cache(reset_running_requests=True, reset_connector=True) after each one",
            ", ".join(it.name for it in missing),
        )
        return False
    from vllm.v1.engine.core import EngineCore

    original = EngineCore.collective_rpc  # compat.INTERNALS: tested with vllm 0.32
    if getattr(original, _MARK, False):
        return True

    @functools.wraps(original)
    def collective_rpc(
        self: Any,
        method: Any,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> Any:
        resets = changes_weights(method, args, kwargs, _backend_of(self))
        waits = _waiting_prepare(method, args, kwargs)
        if waits is not None and _defers(self):
            rpc = functools.partial(original, self, worker_call, timeout)
            return deferred_prepare(lambda req: _answers(rpc((worker_api.PREPARE, (), req.to_kwargs()), None)), waits)
        if isinstance(method, str) and method in RPCS:
            method, args, kwargs = worker_call, (method, tuple(args), dict(kwargs or {})), None
        try:
            out = original(self, method, timeout, args, kwargs)
        except BaseException:
            if resets:  # the weights are the previous step's again, or unknown: drop the cache all the same
                try:
                    reset_caches(self)
                except Exception as exc:  # noqa: BLE001 - the update's own error is the one to raise
                    log.error("after a failed update: %s", exc)
            raise
        if resets:
            reset_caches(self)
        return out

    setattr(collective_rpc, _MARK, True)
    EngineCore.collective_rpc = collective_rpc
    return True
