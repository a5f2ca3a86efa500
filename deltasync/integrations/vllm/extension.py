"""deltasync's worker API on a vLLM worker: the worker extension and what the engine-core hook calls.

Each method parses its arguments with the worker API's request types and answers with its answer
types (:mod:`deltasync.serving.worker_api`); the work is :class:`~deltasync.serving.engine.worker.WorkerSync`'s.
A worker's :class:`WorkerSync` is its ``"deltasync"`` backend's when it has one, else one kept for
it in this module (:func:`state_of`). Imports vLLM only to read the engine's world group.
"""

from __future__ import annotations

import functools
import os
import weakref
from pathlib import Path
from typing import Any

import torch

from deltasync.serving import worker_api
from deltasync.serving.engine.worker import EngineFacts, InitOptions, WorkerSync
from deltasync.serving.worker_api import AuditNote, PrepareRequest

__all__ = ["DeltasyncWorkerExtension", "make_worker_sync", "state_of", "worker_rpc"]

#: the deltasync state of vLLM workers that have no ``"deltasync"`` backend (by worker; dropped with it)
_SYNCS: weakref.WeakKeyDictionary[Any, WorkerSync] = weakref.WeakKeyDictionary()
Json = dict[str, object]


def _agree(mine: object) -> list[object]:
    """Every rank's ``mine`` in rank order, over vLLM's CPU world group (all workers of this engine)."""
    from vllm.distributed.parallel_state import get_world_group

    group = get_world_group()
    out: list[object] = [None] * int(group.world_size)
    torch.distributed.all_gather_object(out, mine, group=group.cpu_group)
    return out


def _env_node_dir() -> Path | None:
    """``$DELTASYNC_NODE_DIR`` as a folder (None when unset or empty): where the node mirror lives."""
    env = os.environ.get("DELTASYNC_NODE_DIR")
    return Path(env).expanduser().absolute() if env else None


def make_worker_sync(model: torch.nn.Module, vllm_config: Any) -> WorkerSync:
    """A vLLM worker's deltasync state, placed in vLLM's world group (all workers of this engine)."""
    from deltasync.integrations.vllm.engine_check import check_engine

    try:
        from vllm.distributed.parallel_state import get_world_group

        world = get_world_group()
        rank, size = int(world.rank_in_group), int(world.world_size)
    except (ImportError, AssertionError, AttributeError):  # no distributed state: one process
        rank, size = 0, 1
    model_config = vllm_config.model_config
    path = Path(str(getattr(model_config, "model", "")))
    quantization = getattr(model_config, "quantization", None)
    facts = EngineFacts(
        model_dir=path if path.is_dir() else None,
        tensor_parallel=int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1),
        check=functools.partial(check_engine, quantization=quantization),
        node_dir=_env_node_dir(),
    )
    return WorkerSync(model, facts, rank, size, _agree if size > 1 else None)


def state_of(worker: Any) -> WorkerSync:
    """A vLLM worker's deltasync state: its ``"deltasync"`` backend's, else one kept for the worker."""
    sync = getattr(getattr(worker, "weight_transfer_engine", None), "sync", None)
    if isinstance(sync, WorkerSync):
        return sync
    kept = _SYNCS.get(worker)
    if kept is None:
        kept = _SYNCS[worker] = make_worker_sync(worker.model_runner.get_model(), worker.vllm_config)
    return kept


class DeltasyncWorkerExtension:
    """deltasync's worker API, driven by ``llm.collective_rpc`` (also where the weight-transfer API is
    not used)::

        llm.collective_rpc("deltasync_prepare", kwargs={"store": URL, "step": N})  # returns at once
        llm.collective_rpc("deltasync_update", kwargs={"store": URL, "step": N})   # the pause
        llm.collective_rpc("deltasync_status")
        llm.collective_rpc("deltasync_metrics")

    Every answer but the metrics' is a worker API type's JSON (read it back with its ``from_json``).
    Any engine in an environment where deltasync is installed answers these: the plugin's engine-core
    hook sends them to the workers as :func:`worker_rpc` calls. Starting the engine with
    ``worker_extension_cls="deltasync.integrations.vllm.backend.DeltasyncWorkerExtension"`` is needed only
    where vLLM plugins are turned off (``VLLM_PLUGINS``). Shares the worker's state with the
    ``"deltasync"`` backend when both are configured.
    """

    def deltasync_init(self, **init_info: object) -> Json:
        """Configure (the options of :class:`~deltasync.serving.engine.worker.InitOptions`); a :class:`WorkerStatus`."""
        sync = state_of(self)
        return sync.call(lambda: sync.configure(InitOptions.from_kwargs(**init_info))).to_json()

    def deltasync_prepare(
        self, store: object = None, step: object = None, wait: object = False, timeout: object = None
    ) -> Json:
        """Start bringing the mirror to ``step`` (default: the newest) in the background while the engine
        serves (:class:`~deltasync.serving.worker_api.PrepareRequest`); returns at once, or with ``wait``
        once it is prepared (raising a failed prepare's error), at most ``timeout`` seconds (default 600;
        then a DeltaSyncError, the prepare goes on), so that the pause that follows only commits. In an
        engine core of its own process the core waits, not the workers: the engine keeps generating
        (``engine_core``, docs/vllm.md). Answers a :class:`WorkerStatus` with ``preparing``,
        ``prepared_file`` and ``prepare_id``."""
        sync = state_of(self)

        def prepare() -> worker_api.WorkerStatus:
            r = PrepareRequest.from_kwargs(store, step, wait, timeout)
            return sync.prepare(r.store, r.step, r.wait, r.timeout)

        return sync.call(prepare).to_json()

    def deltasync_update(self, store: str | None = None, step: int | str | None = None) -> Json:
        """Make the engine serve ``step`` (default: newest); raises UpdateRolledBack / WorkerNeedsReplacement.
        Answers a :class:`WorkerStatus` with the commit's ``report``."""
        sync = state_of(self)
        return sync.call(lambda: sync.update(store, None if step is None else int(step))).to_json()

    def deltasync_status(self) -> Json:
        """This worker's :class:`~deltasync.serving.worker_api.WorkerStatus`."""
        return state_of(self).status().to_json()

    def deltasync_audit_params(self, start: object = 0, max_bytes: object = 64 << 20) -> Json:
        """Re-hash the served parameters against the step's digests from the ``start``-th tensor, up to
        ``max_bytes`` (:class:`~deltasync.serving.worker_api.ParamsRequest`); a
        :class:`~deltasync.serving.worker_api.ParamsChunk`."""
        return state_of(self).audit_params(start, max_bytes).to_json()

    def deltasync_audit_report(self, audit: object = None, problems: object = None) -> Json:
        """Record the engine's behavioural audit (``serving.audit``: an :class:`AuditNote`) for its fleet
        reports: ``diverged`` while ``problems``, until the next update. A malformed note is refused
        (:class:`~deltasync.errors.ProtocolError`). Answers a :class:`WorkerStatus`."""
        sync = state_of(self)
        return sync.call(lambda: sync.note_audit(AuditNote.from_kwargs(audit, problems))).to_json()

    def deltasync_metrics(self) -> str:
        """Prometheus text of this worker's sync metrics (staleness, bytes, verify/apply/pause seconds)."""
        return state_of(self).render_metrics()


def worker_rpc(worker: Any, name: str, args: tuple[object, ...], kwargs: dict[str, object]) -> object:
    """Run deltasync's worker method ``name`` on a vLLM worker (what the engine-core hook sends for
    ``collective_rpc(name)``): the engine's worker extension's where it has one, else
    :class:`DeltasyncWorkerExtension`'s, with the worker as ``self``."""
    if name not in worker_api.RPCS:
        raise ValueError(f"{name!r} is not one of deltasync's worker methods ({', '.join(sorted(worker_api.RPCS))})")
    target = getattr(worker, "worker", worker)  # vLLM calls with its WorkerWrapperBase
    method = getattr(target, name, None)
    if method is None:
        method = functools.partial(getattr(DeltasyncWorkerExtension, name), target)
    return method(*args, **kwargs)
