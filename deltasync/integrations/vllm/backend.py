"""deltasync as a vLLM weight-transfer backend, and a worker extension for ``collective_rpc``.

Registered through the ``vllm.general_plugins`` entry point (installing deltasync in
vLLM's environment is enough) under the name ``"deltasync"``::

    vllm serve MODEL_DIR --weight-transfer-config '{"backend": "deltasync"}'

then, at each step the trainer commits, the standard four phases (HTTP twins under
``VLLM_SERVER_DEV_MODE=1``)::

    llm.init_weight_transfer_engine({"init_info": {"store": URL, "prefetch": True}})   # once
    llm.start_weight_update()
    llm.update_weights({"update_info": {"store": URL, "step": N}})
    llm.finish_weight_update(weight_version=str(N))

The same plugin hooks the engine core (:mod:`deltasync.integrations.vllm.engine_core`): when
``update_weights`` returns, the engine's prefix cache no longer holds KV of the previous weights.

Each worker keeps a host mirror in checkpoint names (seeded from the checkpoint dir the
engine loaded), brings it to the step with :class:`~deltasync.DeltaFetcher` (chain
catch-up, checksums, digests) and hands vLLM only the tensors that changed through
the model's own ``load_weights``, so fused parameters and tensor parallelism stay
vLLM's business: :class:`~deltasync.serving.engine.worker.WorkerSync`. Before the first load,
:mod:`~deltasync.integrations.vllm.engine_check` makes sure the parameters those tensors land in are
what the engine computes with. With ``prefetch`` (or ``deltasync_prepare``) the download, checks and
decode happen while the engine keeps generating; the update itself is the in-place load. See
:mod:`deltasync.serving.engine.mirror` for the failure states. Unquantized weights only
(bf16/fp16/fp32): a quantized engine, or one whose CPU backend repacked its linear weights, is
refused at init (:class:`EngineIncompatible`). The vLLM internals this relies on, and the versions
they are tested with: :mod:`~deltasync.integrations.vllm.compat`.

Payloads never cross the RPC as tensors: the update names a store and a step.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from deltasync.integrations.vllm import compat, engine_core
from deltasync.integrations.vllm.engine_core import BACKEND
from deltasync.integrations.vllm.extension import DeltasyncWorkerExtension, make_worker_sync, state_of, worker_rpc
from deltasync.serving.engine.worker import InitOptions, WorkerSync

__all__ = [
    "BACKEND",
    "DeltasyncInitInfo",
    "DeltasyncUpdateInfo",
    "DeltasyncWeightTransferEngine",
    "DeltasyncWorkerExtension",
    "WorkerSync",
    "end_worker_session",
    "register",
]

log = logging.getLogger("deltasync.vllm")

# the names earlier releases had here (tests/vllm_support and user extensions import them)
_state_of = state_of
_worker_rpc = worker_rpc


def register() -> None:
    """The ``vllm.general_plugins`` entry point: make ``{"backend": "deltasync"}`` selectable and hook
    the engine core (see :mod:`~deltasync.integrations.vllm.engine_core`). vLLM runs it in every
    process, maybe more than once; it never raises (that would stop vLLM): a vLLM outside the tested
    range is warned about, one that lacks an internal the hook needs is not hooked, and the backend
    then refuses to start (:mod:`~deltasync.integrations.vllm.compat`)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    with contextlib.suppress(ValueError):  # registered already in this process
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "DeltasyncWeightTransferEngine")
    if not compat.check_vllm():
        engine_core.install(worker_rpc)


@dataclass
class DeltasyncInitInfo(InitOptions, WeightTransferInitInfo):  # type: ignore[misc]
    """``init_weight_transfer_engine`` options: those of :class:`~deltasync.serving.engine.worker.InitOptions`."""


@dataclass
class DeltasyncUpdateInfo(WeightTransferUpdateInfo):  # type: ignore[misc]
    """``update_weights`` payload: ``{"store": URL, "step": N}`` (step default: the newest committed).
    ``prepare_only`` starts preparing the step in the background and returns at once."""

    step: int | None = None
    store: str | None = None
    prepare_only: bool = False


def end_worker_session(engine: object) -> bool:
    """Close the calling vLLM worker's weight-update session as its ``update_weights`` does on an
    error, for a rank that answers an agreed error instead of raising it (vLLM ends the session only
    on a rank that raised, and the next ``start_weight_update`` would be refused). The worker is the
    ``self`` of a calling frame whose ``weight_transfer_engine`` is ``engine``: vLLM hands the backend
    no reference to its worker. Its session flag (:data:`compat.SESSION_FLAG`) and
    ``reset_weight_update_target`` are vLLM internals, tested with vllm 0.32 (``gpu_worker.Worker``,
    which the CPU worker subclasses): see :mod:`~deltasync.integrations.vllm.compat`."""
    frame = inspect.currentframe()
    frame = None if frame is None else frame.f_back
    while frame is not None:
        worker = frame.f_locals.get("self")
        if getattr(worker, "weight_transfer_engine", None) is engine and hasattr(worker, compat.SESSION_FLAG):
            setattr(worker, compat.SESSION_FLAG, False)
            getattr(worker, "weight_transfer_engine").reset_weight_update_target()  # noqa: B009
            return True
        frame = frame.f_back
    log.warning(
        "cannot find the vLLM worker to end its update session (vllm outside %s?): the next start_weight_update "
        "may fail",
        compat.TESTED_VLLM,
    )
    return False


class DeltasyncWeightTransferEngine(WeightTransferEngine[DeltasyncInitInfo, DeltasyncUpdateInfo]):  # type: ignore[misc]
    """vLLM weight-transfer backend ``"deltasync"``: updates name a store and a step; each worker
    applies it in place from its host mirror. start/finish are no-ops (nothing to stage on the device).
    Refuses to start (:class:`~deltasync.errors.EngineIncompatible`) on a vLLM that lacks an internal
    it relies on (:func:`compat.require_internals`)."""

    init_info_cls = DeltasyncInitInfo
    update_info_cls = DeltasyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        compat.require_internals()
        super().__init__(config, vllm_config, device, model)
        #: this worker's deltasync state (also what the worker extension uses: ``extension.state_of``)
        self.sync = make_worker_sync(model, vllm_config)

    def init_transfer_engine(self, init_info: DeltasyncInitInfo) -> None:
        # docstring inherited
        self.sync.call(self.sync.configure, init_info)

    def start_weight_update(self) -> None:
        # docstring inherited; nothing to stage on the device: weights are loaded in place
        return None

    def receive_weights(self, update_info: DeltasyncUpdateInfo) -> None:
        # docstring inherited
        if update_info.prepare_only:
            self.sync.prepare(update_info.store, update_info.step)
        else:
            self.sync.update(update_info.store, update_info.step)

    def update_weights(self, update_info: dict[str, object]) -> None:
        # docstring inherited; synchronizes only where there is an accelerator
        info = self.parse_update_info(update_info)
        work = self.sync.prepare if info.prepare_only else self.sync.update
        answer = self.sync.call(work, info.store, info.step)
        if answer.error is not None:
            # an agreed failure that this rank does not raise (see WorkerSync): vLLM ends the update
            # session only on the rank that raised, so end it here too, or the next update is refused
            end_worker_session(self)
        acc = getattr(torch, "accelerator", None)
        if acc is not None and acc.is_available():
            acc.synchronize()

    def finish_weight_update(self) -> None:
        # docstring inherited
        return None

    def shutdown(self) -> None:
        # docstring inherited
        self.sync.close()
