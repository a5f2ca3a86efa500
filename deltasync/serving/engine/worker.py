"""One engine worker's deltasync state, and its answers to deltasync's worker RPCs.

:class:`WorkerSync` holds what one worker of a serving engine keeps for deltasync: its
:class:`~deltasync.serving.engine.mirror.EngineMirror`, its options (:class:`InitOptions`), the
background prefetch, its metrics, the fleet reporter (rank 0 with ``signal``), the last behavioural
audit handed to it and the parameter audit. Every answer it gives is a type of the worker API
(:mod:`deltasync.serving.worker_api`): :class:`~deltasync.serving.worker_api.WorkerStatus`,
:class:`~deltasync.serving.worker_api.ParamsChunk`.

Nothing here imports vLLM: the adapter (:mod:`deltasync.integrations.vllm`) builds a
:class:`WorkerSync` from what it reads of the engine (:class:`EngineFacts`) and hands it the
exchange between the engine's ranks (``agree``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from deltasync.errors import DeltaSyncError, EngineIncompatible, UnsafePath, error_code
from deltasync.fetcher import MARKER, DeltaFetcher, Verify
from deltasync.fetcher.metrics import MetricsServer, SyncMetrics
from deltasync.serving.engine.mirror import EngineMirror, EngineStatus, MirrorOptions
from deltasync.serving.engine.params_audit import ParamsAuditor
from deltasync.serving.engine.pinning import PINNED_MAX_DENSITY, HostPins
from deltasync.serving.engine.prefetch import Prefetcher, PrefetchOptions
from deltasync.serving.engine.scatter import ScatterLoader
from deltasync.serving.fleet import EngineReporter
from deltasync.serving.worker_api import MAX_TEXT, AuditNote, ParamsChunk, ParamsRequest, WorkerState, WorkerStatus

__all__ = ["Agree", "EngineFacts", "InitOptions", "ModelCheck", "WorkerSync"]

log = logging.getLogger("deltasync.vllm")

T = TypeVar("T")
#: exchanges one picklable value with every rank of the engine; returns all of them in rank order
Agree = Callable[[Any], list[Any]]
#: checkpoint name -> (dtype, shape) of the tensors an engine is to be loaded with
Layout = Mapping[str, tuple[Any, tuple[int, ...]]]
#: refuses, before anything is loaded, a model whose parameters cannot take tensors of a layout in place
#: (:class:`EngineIncompatible`); returns the names it ties to another one (vLLM: ``engine_check.check_engine``)
ModelCheck = Callable[[torch.nn.Module, Layout], Mapping[str, str]]


@dataclass
class InitOptions:
    """A worker's deltasync options (``init_weight_transfer_engine``'s ``init_info``, ``deltasync_init``);
    all optional.

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

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> InitOptions:
        """The options as an RPC hands them; a name that is not an option is a ValueError naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(
                f"unknown deltasync option(s) {', '.join(unknown)}; the options are {', '.join(sorted(known))}"
            )
        return cls(**kwargs)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What a worker needs to know of its engine: the checkpoint dir it loaded (None: not a local
    dir), its tensor-parallel size, the check of its parameters (None: none), and where the node
    mirror lives when the options name no ``node_dir`` (vLLM: ``$DELTASYNC_NODE_DIR``; None: the
    node's default, ``/dev/shm``)."""

    model_dir: Path | None = None
    tensor_parallel: int = 1
    check: ModelCheck | None = None
    node_dir: Path | None = None


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


def _clip(text: str | None) -> str | None:
    """A text field of an answer, cut to what the worker API accepts (:data:`MAX_TEXT`)."""
    return text if text is None or len(text) <= MAX_TEXT else text[: MAX_TEXT - 3] + "..."


def _message(exc: BaseException) -> str:
    """An error's message for the wire: its own text for deltasync's errors (their class travels as
    their code), the class name and text for anything else."""
    return str(exc) if isinstance(exc, DeltaSyncError) else f"{type(exc).__name__}: {exc}"


def _normalise(url: str) -> str:
    from deltasync.storage import open_store

    return open_store(url).url


class WorkerSync:
    """One worker's deltasync state: its mirror, options, background prefetch and metrics.

    Ranks of one engine (tensor/pipeline parallel) commit or undo together: they exchange their
    outcome with ``agree`` at each phase. Only the last rank raises an agreed error (:meth:`call`):
    vLLM's multiprocess executor stops reading replies at the first failed one, and the replies of
    later ranks would then answer the next RPC (observed with vllm 0.32, TP=2).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        engine: EngineFacts | None = None,
        rank: int = 0,
        world_size: int = 1,
        agree: Agree | None = None,
    ) -> None:
        self.model = model
        self.engine = engine or EngineFacts()
        self.rank = rank
        self.world_size = world_size
        self.agree: Agree = agree or (lambda mine: [mine])
        self.options = InitOptions()
        self.mirror: EngineMirror | None = None
        self.metrics = SyncMetrics(labels={"rank": str(rank)})
        #: where the node mirror lives when the options name no ``node_dir`` (:attr:`EngineFacts.node_dir`)
        self.default_node_dir = self.engine.node_dir
        self._refusal: str | None = None  # why this engine cannot be updated in place (engine check)
        self._prefetcher: Prefetcher | None = None
        self._host_pins: HostPins | None = None  # a CUDA engine's
        self._lock = threading.Lock()
        self._metrics_server: MetricsServer | None = None
        self._reporter: EngineReporter | None = None  # rank 0 with the ``signal`` option
        self._audit: AuditNote | None = None  # the last behavioural audit handed over (note_audit)
        self._params_audit: ParamsAuditor | None = None  # made on first use

    # ------------------------------------------------------------ options

    def configure(self, info: InitOptions) -> WorkerStatus:
        """Take ``info`` (see :class:`InitOptions`): follow its store, serve metrics, prefetch."""
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
            if info.metrics_port is not None and self._metrics_server is None:
                self._metrics_server = self.metrics.serve(info.metrics_port + self.rank)
            if info.prefetch:
                self._start_prefetch()
        finally:
            self.report()  # a refused engine reports its refusal too
        return self.status()

    def report(self) -> None:
        """Tell the fleet view what this engine serves now, with the audit it was handed (rank 0 with
        ``signal``; never raises)."""
        if self._reporter is not None:
            note = self._audit
            problems = () if note is None else note.problems
            self._reporter.report(self.engine_status(), None if note is None else note.audit, problems)

    def note_audit(self, note: AuditNote) -> WorkerStatus:
        """Record the engine's behavioural audit for its fleet reports (``diverged`` while it has
        ``problems``, until the next update) and report it now."""
        self._audit = note
        self.report()
        return self.status()

    # ------------------------------------------------------------- mirror

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
            self.mirror = self._new_mirror(url)
            self.mirror.warm()  # the node's leader starts and compiles while the engine serves
            self.mirror.report_to(f"{os.getpid()}-r{self.rank}")  # for a wait in the engine core
            return self.mirror

    def _new_mirror(self, url: str) -> EngineMirror:
        """The mirror of ``url``, seeded from the engine's checkpoint dir where that can be read."""
        from deltasync.storage import open_store

        verify: Verify = self.options.verify  # type: ignore[assignment]
        key = self.options.signing_key.encode() if self.options.signing_key else None
        fetcher = DeltaFetcher(open_store(url), verify=verify, signing_key=key)
        local = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self._host_pins = self._pins()
        node_dir = self.options.node_dir if self.options.node_dir is not None else self.default_node_dir

        def make(seeded: _Seed | None) -> EngineMirror:
            options = MirrorOptions(
                seed=None if seeded is None else seeded.load,
                seed_step=None if seeded is None else seeded.step,
                seed_id=None if seeded is None else seeded.id,
                max_bytes=2 * local * self.engine.tensor_parallel + (64 << 20),
                agree=self.agree,
                check=self._check,
                node_dir=node_dir,
                scatter=self._scatter_loader if self.options.scatter else None,
                pin=self._host_pins,
            )
            return EngineMirror(fetcher, self._load, options, metrics=self.metrics)

        seed = _seed(self.engine.model_dir)
        try:
            return make(seed)
        except (OSError, ValueError, DeltaSyncError) as exc:
            if seed is None or isinstance(exc, (EngineIncompatible, UnsafePath)):  # not the seed's fault
                raise
            log.warning("cannot seed the mirror from %s (%s): the first update loads every tensor", seed.dir, exc)
            return make(None)

    def _check(self, layout: Layout) -> Mapping[str, str] | None:
        """Refuse (once and for all) an engine whose parameters are not what it computes with; return the
        names it ties to another name (:data:`ModelCheck`)."""
        if self.engine.check is None:
            return None
        try:
            return self.engine.check(self.model, layout)
        except EngineIncompatible as exc:
            self._refusal = str(exc)
            raise

    def _pins(self) -> HostPins | None:
        """Registration of the mirror's pages with CUDA, for an engine whose weights are on a CUDA device."""
        if not self.options.pin or not any(p.is_cuda for p in self.model.parameters()):
            return None
        return HostPins()

    def _scatter_loader(self, layout: Layout) -> ScatterLoader:
        pinned = self._host_pins is not None and self._host_pins.enabled
        return ScatterLoader(self.model, layout, self._load, max_density=PINNED_MAX_DENSITY if pinned else None)

    def _load(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            self.model.load_weights(iter(pairs))  # type: ignore[operator]

    def _start_prefetch(self) -> None:
        if self._prefetcher is not None:
            return
        o = self.options
        options = PrefetchOptions(
            poll_interval=o.poll_interval, signal_url=o.signal, signal_token=o.signal_token, run=o.signal_run
        )
        self._prefetcher = Prefetcher(lambda: self.mirror_for(None), options, metrics=self.metrics)
        self._prefetcher.start()

    # ---------------------------------------------------------------- RPCs

    def call(self, fn: Callable[..., T], *args: object) -> T | WorkerStatus:
        """Run one RPC's work. Its error is raised by the last rank only (see the class docstring):
        every other rank answers its status with the error's message and code
        (:meth:`WorkerStatus.raise_error` raises the same class on the asking side)."""
        try:
            return fn(*args)
        except Exception as exc:
            if self._raises(exc):
                raise
            return dataclasses.replace(self.status(), error=_clip(_message(exc)), error_code=error_code(exc))

    def _raises(self, exc: Exception) -> bool:
        """Whether this rank raises ``exc`` (the last one), else logs it for its answer to carry."""
        if self.rank == self.world_size - 1:
            return True
        log.warning("rank %d: %s: %s", self.rank, type(exc).__name__, exc)
        return False

    def prepare(
        self, store: str | None, step: int | None, wait: bool = False, timeout: float | None = None
    ) -> WorkerStatus:
        """``EngineMirror.ask``: start preparing ``step``, with ``wait`` until prepared (bounded); the
        status (once prepared, with ``wait``) with the prepare's ticket."""
        ticket = self.mirror_for(store).ask(step, wait=wait, timeout=timeout)
        return dataclasses.replace(
            self.status(), preparing=ticket.step, prepared_file=_clip(ticket.file), prepare_id=ticket.id
        )

    def update(self, store: str | None, step: int | None) -> WorkerStatus:
        """Make the engine serve ``step`` (None: the newest); the status with the commit's report."""
        if step is not None:
            self.metrics.observe_head(step)
        try:
            report = self.mirror_for(store).commit(step)
            self._audit = None  # the new step is not audited yet
        finally:
            self.report()
        return dataclasses.replace(self.status(), report=report)

    def audit_params(self, start: object = 0, max_bytes: object = 64 << 20) -> ParamsChunk:
        """One chunk of the parameter audit (``serving.engine.params_audit``), its arguments as the RPC
        hands them (:class:`ParamsRequest`); an error as :meth:`call` answers it, in the chunk."""
        try:
            request = ParamsRequest.from_kwargs(start, max_bytes)
            if self._params_audit is None:
                self._params_audit = ParamsAuditor(self.model, self._load)
            return self._params_audit.chunk(self.mirror_for(None), request.start, request.max_bytes, rank=self.rank)
        except Exception as exc:
            if self._raises(exc):
                raise
            step = None if self.mirror is None else self.mirror.serving
            return ParamsChunk(self.rank, step, 0, 0, error=_clip(_message(exc)), error_code=error_code(exc))

    def engine_status(self) -> EngineStatus:
        """The engine's status as its mirror knows it (a refused engine: its refusal as last error)."""
        if self.mirror is None:
            why = None if self._refusal is None else f"EngineIncompatible: {self._refusal}"
            return EngineStatus(None, None, "serving", why, self.options.store)
        return self.mirror.status()

    def status(self) -> WorkerStatus:
        """This worker's answer to ``deltasync_status``."""
        e = self.engine_status()
        state: WorkerState = "needs_replacement" if e.state == "needs_replacement" else "serving"
        return WorkerStatus(
            self.rank, e.step, e.prepared, state, _clip(e.last_error), _clip(e.store), _clip(e.node_dir)
        )

    def render_metrics(self) -> str:
        """Prometheus text of this worker's sync metrics."""
        return self.metrics.render()

    def close(self) -> None:
        """Stop reporting, prefetching and serving metrics; close the mirror."""
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
