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
vLLM's business. Before the first load, :mod:`~deltasync.integrations.vllm.engine_check` makes
sure the parameters those tensors land in are what the engine computes with. With ``prefetch`` (or :meth:`DeltasyncWorkerExtension.deltasync_prepare`)
the download, checks and decode happen while the engine keeps generating; the
update itself is the in-place load. See :mod:`deltasync.serving.engine.mirror` for the
failure states. Unquantized weights only (bf16/fp16/fp32): a quantized engine, or one
whose CPU backend repacked its linear weights, is refused at init (:class:`EngineIncompatible`).

Payloads never cross the RPC as tensors: the update names a store and a step.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from deltasync.errors import DeltaSyncError, EngineIncompatible, UnsafePath
from deltasync.fetcher import MARKER, DeltaFetcher, Verify
from deltasync.integrations.vllm import engine_core
from deltasync.integrations.vllm.engine_check import check_engine
from deltasync.integrations.vllm.engine_core import BACKEND
from deltasync.serving.engine.mirror import CommitReport, EngineMirror, EngineStatus
from deltasync.serving.engine.prefetch import Prefetcher
from deltasync.serving.engine.prepared import truthy
from deltasync.serving.fleet import EngineReporter

__all__ = [
    "BACKEND",
    "DeltasyncInitInfo",
    "DeltasyncUpdateInfo",
    "DeltasyncWeightTransferEngine",
    "DeltasyncWorkerExtension",
    "register",
]

log = logging.getLogger("deltasync.vllm")


def register() -> None:
    """The ``vllm.general_plugins`` entry point: make ``{"backend": "deltasync"}`` selectable and hook
    the engine core (see :mod:`~deltasync.integrations.vllm.engine_core`). vLLM runs it in every
    process, maybe more than once."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    with contextlib.suppress(ValueError):  # registered already in this process
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "DeltasyncWeightTransferEngine")
    engine_core.install(_worker_rpc)


@dataclass
class DeltasyncInitInfo(WeightTransferInitInfo):  # type: ignore[misc]
    """``init_weight_transfer_engine`` options (all optional).

    store: the run's URL (``hf://buckets/...``, ``s3://...``, a local dir); updates may name it instead.
    verify: ``True`` (checksums and digests of every changed tensor), ``"full"`` or ``False``.
    signing_key: require manifests signed with this HMAC key (UTF-8).
    prefetch: prepare each new committed step in the background as soon as it lands (polled, and signalled by ``signal``).
    poll_interval: seconds between store polls while prefetching.
    metrics_port: serve Prometheus metrics on 127.0.0.1 at this port plus the worker's rank.
    node_dir: the node's shared mirror (default ``$DELTASYNC_NODE_DIR``, else ``/dev/shm``), one copy and download per
        run: a folder this user owns with mode 0700, or made so (else ``UnsafePath`` at init: docs/vllm.md).
    scatter: in the pause, write only the changed elements into the parameters where the model's
        loaders allow it (``scatter.ScatterLoader``); False hands every changed tensor to ``load_weights``.
    pin: on a CUDA engine, register the node mirror's pages of the versions it serves and prepares
        with CUDA (while preparing), so that the pause copies them by DMA (``pinning.HostPins``).
    signal: a signal server URL: rank 0 reports the engine to its fleet view (step, state digest, state,
        last error) at init, after each update and every ``report_heartbeat`` seconds (docs/fleet.md).
    signal_token: the token of the reports (a report, subscribe or publish token).
    signal_run: the run's name at the signal server (default: the run id the store records).
    replica: this engine's replica id in the fleet view (default: ``<hostname>-<pid>`` of rank 0).
    """

    store: str | None = None
    verify: bool | str = True
    signing_key: str | None = None
    prefetch: bool = False
    poll_interval: float = 2.0
    metrics_port: int | None = None
    node_dir: str | None = None
    scatter: bool = True
    pin: bool = True
    signal: str | None = None
    signal_token: str | None = None
    signal_run: str | None = None
    replica: str | None = None
    report_heartbeat: float = 10.0


@dataclass
class DeltasyncUpdateInfo(WeightTransferUpdateInfo):  # type: ignore[misc]
    """``update_weights`` payload: ``{"store": URL, "step": N}`` (step default: the newest committed).
    ``prepare_only`` starts preparing the step in the background and returns at once."""

    step: int | None = None
    store: str | None = None
    prepare_only: bool = False


def _model_dir(vllm_config: Any) -> Path | None:
    path = Path(str(getattr(vllm_config.model_config, "model", "")))
    return path if path.is_dir() else None


@dataclass(frozen=True)
class _Seed:
    """The checkpoint dir the engine loaded: read only when the node has no version of it yet."""

    dir: Path
    step: int | None
    id: str

    def load(self) -> dict[str, torch.Tensor]:
        from deltasync._util.checkpoint_io import load_checkpoint

        return load_checkpoint(self.dir, mmap=True)  # page cache, no private copy


def _seed(model_dir: Path | None) -> _Seed | None:
    """The checkpoint dir the engine loaded (its deltasync step when it says so), if it can be read."""
    if model_dir is None:
        return None
    from deltasync._util.checkpoint_io import checkpoint_files

    try:
        files = checkpoint_files(model_dir)
        ident = ";".join(f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    except (OSError, ValueError, DeltaSyncError) as exc:
        log.warning("cannot read %s to seed the mirror (%s): the first update loads every tensor", model_dir, exc)
        return None
    try:
        step: int | None = int(json.loads((model_dir / MARKER).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        step = None
    return _Seed(model_dir, step, ident)


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """One worker's answer to deltasync's RPCs: its engine's status and its rank, with the commit an
    update made, or the agreed error that this rank does not raise (see :class:`WorkerSync`)."""

    engine: EngineStatus
    rank: int
    report: CommitReport | None = None
    error: str | None = None
    extra: dict[str, Any] | None = None  # a prepare's step, report file and id (EngineMirror.ask)

    def to_json(self) -> dict[str, Any]:
        """The RPC's JSON answer: the engine's status, ``rank``, then ``report``, ``error``, ``extra``."""
        out = {**self.engine.to_json(), "rank": self.rank}
        if self.report is not None:
            out["report"] = asdict(self.report)
        if self.error is not None:
            out["error"] = self.error
        return {**out, **(self.extra or {})}


def _env_node_dir() -> Path | None:
    """``$DELTASYNC_NODE_DIR`` as a folder (None when unset or empty)."""
    env = os.environ.get("DELTASYNC_NODE_DIR")
    return Path(env).expanduser().absolute() if env else None


class WorkerSync:
    """One worker's deltasync state: its mirror, options, background prefetch and metrics.

    Ranks of one engine (tensor/pipeline parallel) commit or undo together: they exchange their
    outcome over vLLM's CPU world group at each phase. Only the last rank raises an agreed error:
    vLLM's multiprocess executor stops reading replies at the first failed one, and the replies of
    later ranks would then answer the next RPC (observed with vllm 0.32, TP=2).
    """

    def __init__(self, model: torch.nn.Module, vllm_config: Any, rank: int = 0, world_size: int = 1) -> None:
        self.model = model
        self.vllm_config = vllm_config
        self.rank = rank
        self.world_size = world_size
        self.options = DeltasyncInitInfo()
        self.mirror: EngineMirror | None = None
        self._refusal: str | None = None  # why this engine cannot be updated in place (engine_check)
        self._prefetcher: Prefetcher | None = None
        self._host_pins: Any = None  # pinning.HostPins of a CUDA engine
        self._lock = threading.Lock()
        from deltasync.fetcher.metrics import SyncMetrics

        self.metrics = SyncMetrics(labels={"rank": str(rank)})
        self._metrics_server: Any = None
        self._reporter: EngineReporter | None = None  # rank 0 with the ``signal`` option
        self._audit: dict[str, Any] = {}  # the last behavioural audit's report (deltasync_audit_report)
        self._params_audit: Any = None  # serving.engine.params_audit.ParamsAuditor, made on first use
        #: where the node mirror lives when init_info names no ``node_dir``: ``$DELTASYNC_NODE_DIR``, else
        #: the node's default (None: ``/dev/shm``)
        self.default_node_dir = _env_node_dir()

    # ------------------------------------------------------------ options

    def configure(self, info: DeltasyncInitInfo) -> WorkerStatus:
        if info.verify not in (True, False, "full"):
            raise ValueError(f"verify must be true, false or 'full', got {info.verify!r}")
        self.options = info
        if info.signal is not None and self.rank == 0 and self._reporter is None:
            self._reporter = EngineReporter(
                info.signal,
                info.signal_token,
                run=info.signal_run,
                replica=info.replica,
                heartbeat=info.report_heartbeat,
            )
        try:
            if info.store is not None:
                self.mirror_for(info.store)
            if info.metrics_port is not None:
                self._serve_metrics(info.metrics_port + self.rank)
            if info.prefetch:
                self._start_prefetch()
        finally:
            self._report()  # a refused engine reports its refusal too
        return self.status()

    def _report(self) -> None:
        """Tell the fleet view what this engine serves now (rank 0 with ``signal``; never raises)."""
        if self._reporter is not None:
            from deltasync.protocol.audit import AuditReport

            a = self._audit
            audit = AuditReport.from_dict(a["audit"]) if a else None
            self._reporter.report(self.status().engine, audit, a.get("problems", ()))

    def _serve_metrics(self, port: int) -> None:
        if self._metrics_server is None:
            self._metrics_server = self.metrics.serve(port)

    def mirror_for(self, store: str | None) -> EngineMirror:
        """The mirror of ``store`` (the configured one when None), created on first use; raises
        :class:`EngineIncompatible` for an engine that cannot take the run's tensors in place."""
        with self._lock:
            if self._refusal is not None:
                raise EngineIncompatible(self._refusal)
            url = store or self.options.store
            if url is None:
                if self.mirror is not None:
                    return self.mirror
                raise ValueError('name the run: {"store": URL} in init_info or in update_info')
            if self.mirror is not None:
                if self.mirror.fetcher.store.url != _normalise(url):
                    raise ValueError(
                        f"this worker follows {self.mirror.fetcher.store.url}; restart the engine to follow {url}"
                    )
                return self.mirror
            from deltasync.storage import open_store

            verify: Verify = self.options.verify  # type: ignore[assignment]
            key = self.options.signing_key.encode() if self.options.signing_key else None
            fetcher = DeltaFetcher(open_store(url), verify=verify, signing_key=key)
            seed = _seed(_model_dir(self.vllm_config))
            local = sum(p.numel() * p.element_size() for p in self.model.parameters())
            tp = int(getattr(self.vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
            self._host_pins = self._pins()

            def new_mirror(seeded: _Seed | None) -> EngineMirror:
                return EngineMirror(
                    fetcher,
                    self._load,
                    seed=None if seeded is None else seeded.load,
                    seed_step=None if seeded is None else seeded.step,
                    seed_id=None if seeded is None else seeded.id,
                    max_bytes=2 * local * tp + (64 << 20),
                    metrics=self.metrics,
                    agree=self._agree,
                    check=self._check,
                    node_dir=self.options.node_dir if self.options.node_dir is not None else self.default_node_dir,
                    scatter=self._scatter_loader if self.options.scatter else None,
                    pin=self._host_pins,
                )

            try:
                self.mirror = new_mirror(seed)
            except (OSError, ValueError, DeltaSyncError) as exc:
                if seed is None or isinstance(exc, (EngineIncompatible, UnsafePath)):  # not the seed's fault
                    raise
                log.warning("cannot seed the mirror from %s (%s): the first update loads every tensor", seed.dir, exc)
                self.mirror = new_mirror(None)
            self.mirror.warm()  # the node's leader starts and compiles while the engine serves
            self.mirror.report_to(f"{os.getpid()}-r{self.rank}")  # for a wait in the engine core
            return self.mirror

    def _check(self, layout: Any) -> dict[str, str]:
        """Refuse (once and for all) an engine whose parameters are not what it computes with; return the
        names it ties to another name (see ``engine_check.tied_names``)."""
        try:
            return check_engine(
                self.model, layout, quantization=getattr(self.vllm_config.model_config, "quantization", None)
            )
        except EngineIncompatible as exc:
            self._refusal = str(exc)
            raise

    def _agree(self, mine: Any) -> list[Any]:
        if self.world_size == 1:
            return [mine]
        from vllm.distributed.parallel_state import get_world_group

        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, mine, group=get_world_group().cpu_group)
        return out

    def call(self, fn: Callable[..., WorkerStatus], *args: Any) -> WorkerStatus:
        """Run one RPC's work; an error is raised by the last rank only (see the class docstring)."""
        try:
            return fn(*args)
        except Exception as exc:
            if self.rank == self.world_size - 1:
                raise
            log.warning("rank %d: %s: %s", self.rank, type(exc).__name__, exc)
            return replace(self.status(), error=f"{type(exc).__name__}: {exc}")

    def _pins(self) -> Any:
        """Registration of the mirror's pages with CUDA, for an engine whose weights are on a CUDA device."""
        if not self.options.pin or not any(p.is_cuda for p in self.model.parameters()):
            return None
        from deltasync.serving.engine.pinning import HostPins

        return HostPins()

    def _scatter_loader(self, layout: Any) -> Any:
        from deltasync.serving.engine.pinning import PINNED_MAX_DENSITY
        from deltasync.serving.engine.scatter import ScatterLoader

        pinned = self._host_pins is not None and self._host_pins.enabled
        return ScatterLoader(self.model, layout, self._load, max_density=PINNED_MAX_DENSITY if pinned else None)

    def _load(self, pairs: Any) -> None:
        with torch.no_grad():
            self.model.load_weights(iter(pairs))  # type: ignore[operator]

    # ----------------------------------------------------------- prefetch

    def _start_prefetch(self) -> None:
        if self._prefetcher is not None:
            return
        o, mirror = self.options, lambda: self.mirror_for(None)
        signal: dict[str, Any] = {"signal_url": o.signal, "signal_token": o.signal_token, "run": o.signal_run}
        self._prefetcher = Prefetcher(mirror, metrics=self.metrics, poll_interval=o.poll_interval, **signal)
        self._prefetcher.start()

    # ------------------------------------------------------------- phases

    def prepare(self, store: str | None, step: int | None, wait: bool = False, timeout: Any = None) -> WorkerStatus:
        """``EngineMirror.ask``: start preparing ``step``, with ``wait`` until prepared (bounded)."""
        asked = self.mirror_for(store).ask(step, wait=wait, timeout=timeout)
        return replace(self.status(), extra=asked)  # the status once prepared (with wait)

    def update(self, store: str | None, step: int | None) -> WorkerStatus:
        if step is not None:
            self.metrics.observe_head(step)
        try:
            report = self.mirror_for(store).commit(step)
            self._audit = {}  # the new step is not audited yet
        finally:
            self._report()
        return replace(self.status(), report=report)

    def audit_params(self, start: int, max_bytes: int) -> dict[str, Any]:
        """One chunk of the parameter audit (``serving.engine.params_audit``)."""
        if self._params_audit is None:
            from deltasync.serving.engine.params_audit import ParamsAuditor

            self._params_audit = ParamsAuditor(self.model, self._load)
        return {**self._params_audit.chunk(self.mirror_for(None), start, max_bytes), "rank": self.rank}

    def status(self) -> WorkerStatus:
        if self.mirror is None:
            why = None if self._refusal is None else f"EngineIncompatible: {self._refusal}"
            return WorkerStatus(EngineStatus(None, None, "serving", why, self.options.store), self.rank)
        return WorkerStatus(self.mirror.status(), self.rank)

    def render_metrics(self) -> str:
        return self.metrics.render()

    def close(self) -> None:
        if self._reporter is not None:
            self._reporter.close()
            self._reporter = None
        if self._prefetcher is not None:
            self._prefetcher.close(timeout=30)
            self._prefetcher = None
        if self._metrics_server is not None:
            self._metrics_server.close()
            self._metrics_server = None
        if self.mirror is not None:
            self.mirror.close()


def _normalise(url: str) -> str:
    from deltasync.storage import open_store

    return open_store(url).url


def _worker_sync(model: torch.nn.Module, vllm_config: Any) -> WorkerSync:
    """A worker's state, placed in vLLM's world group (all workers of this engine)."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        world = get_world_group()
        rank, size = int(world.rank_in_group), int(world.world_size)
    except (ImportError, AssertionError, AttributeError):  # no distributed state: one process
        rank, size = 0, 1
    return WorkerSync(model, vllm_config, rank, size)


def _end_worker_session(engine: Any) -> bool:
    """Close the calling vLLM worker's weight-update session as its ``update_weights`` does on an
    error (vllm 0.32 ``Worker.update_weights``): the worker is the caller frame's ``self``."""
    frame: Any = sys._getframe(1)
    while frame is not None:
        worker: Any = frame.f_locals.get("self")
        if getattr(worker, "weight_transfer_engine", None) is engine and hasattr(worker, "_weight_update_active"):
            worker._weight_update_active = False
            worker.weight_transfer_engine.reset_weight_update_target()
            return True
        frame = frame.f_back
    log.warning("cannot find the vLLM worker to end its update session: the next start_weight_update may fail")
    return False


class DeltasyncWeightTransferEngine(WeightTransferEngine[DeltasyncInitInfo, DeltasyncUpdateInfo]):  # type: ignore[misc]
    """vLLM weight-transfer backend ``"deltasync"``: updates name a store and a step; each worker
    applies it in place from its host mirror. start/finish are no-ops (nothing to stage on the device)."""

    init_info_cls = DeltasyncInitInfo
    update_info_cls = DeltasyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.sync = _worker_sync(model, vllm_config)

    def init_transfer_engine(self, init_info: DeltasyncInitInfo) -> None:
        # docstring inherited
        self.sync.call(self.sync.configure, init_info)

    def start_weight_update(self) -> None:
        # docstring inherited; nothing to stage on the device: weights are loaded in place
        return None

    def receive_weights(self, update_info: DeltasyncUpdateInfo) -> None:
        # docstring inherited
        work = self.sync.prepare if update_info.prepare_only else self.sync.update
        work(update_info.store, update_info.step)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # docstring inherited; synchronizes only where there is an accelerator
        info = self.parse_update_info(update_info)
        work = self.sync.prepare if info.prepare_only else self.sync.update
        if self.sync.call(work, info.store, info.step).error is not None:
            # an agreed failure that this rank does not raise (see WorkerSync): vLLM ends the update
            # session only on the rank that raised, so end it here too, or the next update is refused
            _end_worker_session(self)
        acc = getattr(torch, "accelerator", None)
        if acc is not None and acc.is_available():
            acc.synchronize()

    def finish_weight_update(self) -> None:
        # docstring inherited
        return None

    def shutdown(self) -> None:
        # docstring inherited
        self.sync.close()


def _state_of(worker: Any) -> WorkerSync:
    """A vLLM worker's deltasync state: its ``"deltasync"`` backend's, else one kept on the worker."""
    engine = getattr(worker, "weight_transfer_engine", None)
    if isinstance(engine, DeltasyncWeightTransferEngine):
        return engine.sync
    sync: WorkerSync | None = getattr(worker, "_deltasync_sync", None)
    if sync is None:
        sync = _worker_sync(worker.model_runner.get_model(), worker.vllm_config)
        worker._deltasync_sync = sync
    return sync


class DeltasyncWorkerExtension:
    """deltasync's worker API, driven by ``llm.collective_rpc`` (also where the weight-transfer API is
    not used)::

        llm.collective_rpc("deltasync_prepare", kwargs={"store": URL, "step": N})  # returns at once
        llm.collective_rpc("deltasync_update", kwargs={"store": URL, "step": N})   # the pause
        llm.collective_rpc("deltasync_status")
        llm.collective_rpc("deltasync_metrics")

    Any engine in an environment where deltasync is installed answers these: the plugin's engine-core
    hook sends them to the workers as :func:`_worker_rpc` calls. Starting the engine with
    ``worker_extension_cls="deltasync.integrations.vllm.backend.DeltasyncWorkerExtension"`` is needed only
    where vLLM plugins are turned off (``VLLM_PLUGINS``). Shares the worker's state with the
    ``"deltasync"`` backend when both are configured.
    """

    def deltasync_init(self, **init_info: Any) -> dict[str, Any]:
        """Configure (same options as :class:`DeltasyncInitInfo`)."""
        sync = _state_of(self)
        return sync.call(lambda: sync.configure(DeltasyncInitInfo(**init_info))).to_json()

    def deltasync_prepare(
        self, store: str | None = None, step: int | str | None = None, wait: bool | str = False, timeout: Any = None
    ) -> dict[str, Any]:
        """Start bringing the mirror to ``step`` (default: the newest) in the background while the engine
        serves; returns at once, or with ``wait`` once it is prepared (raising a failed prepare's error), at
        most ``timeout`` seconds (default 600; then a DeltaSyncError, the prepare goes on), so that the
        pause that follows only commits. In an engine core of its own process the core waits, not the
        workers: the engine keeps generating (``engine_core``, docs/vllm.md). Contract (the HTTP driver
        relies on it): this name; ``step``, ``wait`` and ``timeout`` may be strings (HTTP
        ``/collective_rpc``); one answer per worker, with ``preparing`` and ``prepared``."""
        sync = _state_of(self)
        number = None if step is None else int(step)
        return sync.call(sync.prepare, store, number, truthy(wait), timeout).to_json()

    def deltasync_update(self, store: str | None = None, step: int | None = None) -> dict[str, Any]:
        """Make the engine serve ``step`` (default: newest); raises UpdateRolledBack / WorkerNeedsReplacement."""
        sync = _state_of(self)
        return sync.call(sync.update, store, step).to_json()

    def deltasync_status(self) -> dict[str, Any]:
        """``{"step", "prepared", "state", "last_error", "store", "node_dir", "rank"}``."""
        return _state_of(self).status().to_json()

    def deltasync_audit_params(self, start: int | str = 0, max_bytes: int | str = 64 << 20) -> dict[str, Any]:
        """Re-hash the served parameters against the step's digests from the ``start``-th tensor, up to
        ``max_bytes``: ``{"step", "checked", "nbytes", "mismatched", "unchecked", "next", "rank"}``."""
        return _state_of(self).audit_params(int(start), int(max_bytes))

    def deltasync_audit_report(self, audit: dict[str, Any], problems: list[str] | None = None) -> None:
        """Record the engine's behavioural audit (``serving.audit``) for its fleet reports: ``diverged``
        while ``problems``, until the next update."""
        sync = _state_of(self)
        sync._audit = {"audit": audit, "problems": list(problems or ())}
        sync._report()

    def deltasync_metrics(self) -> str:
        """Prometheus text of this worker's sync metrics (staleness, bytes, verify/apply/pause seconds)."""
        return _state_of(self).render_metrics()


def _worker_rpc(worker: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run deltasync's worker method ``name`` on a vLLM worker (what the engine-core hook sends for
    ``collective_rpc(name)``): the engine's worker extension's where it has one, else
    :class:`DeltasyncWorkerExtension`'s, with the worker as ``self``."""
    if name not in engine_core.RPCS:
        raise ValueError(f"{name!r} is not one of deltasync's worker methods ({', '.join(sorted(engine_core.RPCS))})")
    target = getattr(worker, "worker", worker)  # vLLM calls with its WorkerWrapperBase
    method = getattr(target, name, None)
    if method is None:
        method = functools.partial(getattr(DeltasyncWorkerExtension, name), target)
    return method(*args, **kwargs)
