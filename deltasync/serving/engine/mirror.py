"""A serving engine's weights, mirrored on the host in checkpoint coordinates.

The engine owns its parameters in its own layout (fused ``qkv_proj``, tensor-parallel
shards, repacked kernels); deltasync knows checkpoint names. The node's one host mirror
(:mod:`~deltasync.serving.node.mirror`: a version of the run per step, in shared memory,
built once per node with :class:`DeltaFetcher`: chain catch-up, checksums, digests) is
brought to a new step in the background while the engine keeps serving; :class:`EngineMirror`
commits it by handing the engine only the tensors that changed through its own loader (vLLM's
``model.load_weights``). The engine pauses only for that load.

Its parts: :class:`MirrorOptions` (how it is set up), :class:`~.held.HeldVersions` (the versions it
holds mapped), :class:`~.layout.LayoutGate` (what the engine takes of a layout),
:class:`~.prepare_log.PrepareLog` (how its prepares went) and :class:`~.mirror_metrics.MirrorMetrics`
(what it records; :class:`~.mirror_metrics.NoMetrics` by default).

Failure states, for an orchestrator:

- an engine that cannot take the run's tensors in place (``check`` refuses their layout) is never
  loaded into: :class:`EngineIncompatible`, before the first load;
- a step that fails to download or prove never touches the engine;
- a load the engine refuses is undone: the engine reloads the same names from the version it
  served (kept mapped for this), then
  :class:`UpdateRolledBack` is raised and the engine serves its previous step;
- when that reload fails too, the worker is marked ``needs_replacement`` and every
  later call raises :class:`WorkerNeedsReplacement`.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NoReturn

from deltasync._util.worker import SerialWorker
from deltasync.errors import (
    DeltaSyncError,
    EngineIncompatible,
    UpdateRolledBack,
    WorkerNeedsReplacement,
)
from deltasync.fetcher import DeltaFetcher, Verify
from deltasync.serving.engine.held import HeldVersions
from deltasync.serving.engine.layout import Check, LayoutGate, Loader, Scatter, ScatterFor
from deltasync.serving.engine.mirror_metrics import MirrorMetrics, NoMetrics
from deltasync.serving.engine.pinning import HostPins
from deltasync.serving.engine.prepare_log import STARVED_FACTOR, STARVED_SLACK, BuildWork, PrepareLog, PrepareReport
from deltasync.serving.engine.prepared import PreparedFile, PrepareTicket, result_within
from deltasync.serving.node.mirror import NodeMirror
from deltasync.serving.node.store import KEEP
from deltasync.serving.node.versions import Version
from deltasync.serving.worker_api import CommitReport
from deltasync.signal import ReplicaState

__all__ = [
    "STARVED_FACTOR",
    "STARVED_SLACK",
    "Check",
    "CommitReport",
    "EngineMirror",
    "EngineStatus",
    "Loader",
    "MirrorOptions",
    "Scatter",
]

log = logging.getLogger("deltasync.mirror")

#: the tensors an engine loaded at start, by checkpoint name, or a callable returning them
Seed = Mapping[str, Any] | Callable[[], Mapping[str, Any]]
#: exchanges one picklable value with every rank of the engine; returns all of them in rank order
Agree = Callable[[Any], list[Any]]


@dataclass(frozen=True, slots=True)
class EngineStatus:
    """What an orchestrator wants to know of one engine worker (:meth:`EngineMirror.status`); the
    fleet view's row of the engine is read from it (:func:`deltasync.serving.fleet.replica_state`)."""

    #: the step the engine serves (None: not known to deltasync yet)
    step: int | None
    #: the step prepared ahead of ``step``, ready to commit
    prepared: int | None
    #: ``serving`` (its weights are a step: ``step``, or the checkpoint it started from) or
    #: ``needs_replacement`` (an update failed and its weights could not be restored); never another
    state: ReplicaState
    #: the error of its last failed prepare or update (None once a commit succeeded)
    last_error: str | None
    #: the run's store URL
    store: str | None
    #: where the node's mirror lives (None for a worker that has no mirror yet)
    node_dir: str | None = None

    def to_json(self) -> dict[str, object]:
        """The JSON object of the status (the workers' RPC answers): every field, but ``node_dir``
        only when there is one."""
        out = asdict(self)
        if self.node_dir is None:
            del out["node_dir"]
        return out


@dataclass(frozen=True, slots=True)
class MirrorOptions:
    """How an :class:`EngineMirror` is set up (all optional).

    seed: the tensors the engine loaded at start, by checkpoint name (or a callable returning them,
        called only when the node does not have that step yet), and ``seed_step`` the step they are,
        when known (a dir written by ``materialize`` says so). ``seed_id`` names the seed's source so
        that the workers of one engine share its version (default: one version per mirror). Without a
        seed the first commit loads every tensor.
    max_bytes: the most a version allocated from the run's inventory may take.
    agree: for an engine split over ranks (tensor parallel), exchanges one picklable value with
        every rank and returns all of them in rank order (an all-gather); every rank calls it at
        the same points of :meth:`EngineMirror.commit`, so the ranks commit or undo together.
    check: see :data:`~deltasync.serving.engine.layout.Check`; called with the seed's layout, and with
        each version's layout when it differs from the one checked last.
    node_dir, spawn, keep: where the node mirror lives and how it builds (see ``NodeMirror``).
    scatter: for a layout, a :data:`Scatter`: a loader of the changes (the one change type,
        :class:`~deltasync.protocol.TensorChange`, as the node's version keeps them) and the new
        tensors by name, that writes only the changed elements where it can (vLLM:
        ``scatter.ScatterLoader``); used in the pause instead of ``load`` (an undo always uses ``load``).
    pin: a :class:`~deltasync.serving.engine.pinning.HostPins` (GPU engines): the mapped tensors of
        the versions the engine serves and prepares are registered with it while they are (in the
        prepare, never in the pause), so that the pause copies them to the device by DMA.
    """

    seed: Seed | None = None
    seed_step: int | None = None
    seed_id: str | None = None
    max_bytes: int | None = None
    agree: Agree | None = None
    check: Check | None = None
    node_dir: str | Path | None = None
    spawn: bool | None = None
    keep: int = KEEP
    scatter: ScatterFor | None = None
    pin: HostPins | None = None


@dataclass(frozen=True, slots=True)
class _Target:
    """Phase 1 of a commit on this rank: the step and the node's version of it, or why not."""

    step: int | None
    version: Version | None = None
    prepared: bool = False
    error: str | None = None
    cause: DeltaSyncError | None = None


@dataclass(frozen=True, slots=True)
class _Loaded:
    """What a commit's pause wrote: tensors loaded whole, tensors scattered and their elements."""

    loaded: int
    scattered: int = 0
    elements: int = 0


class EngineMirror:
    """One engine worker's view of the run, kept at a deltasync step through the node's mirror.

    The tensors themselves live in the node's shared :class:`~deltasync.serving.node.mirror.NodeMirror`
    (one copy and one download per node and step, whatever the number of workers); this object knows
    which version the engine serves, prepares the next one and commits it.

    fetcher: reads the run (its ``verify`` decides what is proven).
    load: the engine's loader (see :data:`Loader`); called in the pause only.
    options: see :class:`MirrorOptions`.
    metrics: a :class:`~deltasync.serving.engine.mirror_metrics.MirrorMetrics` (e.g.
        :class:`deltasync.fetcher.metrics.SyncMetrics`); default: records nothing.
    clock: the clock of prepare latencies and pauses.
    """

    def __init__(
        self,
        fetcher: DeltaFetcher,
        load: Loader,
        options: MirrorOptions | None = None,
        *,
        metrics: MirrorMetrics | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        o = options if options is not None else MirrorOptions()
        self.fetcher = fetcher
        self.options = o
        self.agree: Agree = o.agree or (lambda mine: [mine])
        self._load = load
        self.metrics: MirrorMetrics = metrics if metrics is not None else NoMetrics()
        self.clock = clock
        #: what the engine takes of a layout (checked once per layout), its tied names and scatter loader
        self.gate = LayoutGate(o.check, o.scatter)
        #: how this worker's prepares went
        self.prepares = PrepareLog(clock, self.metrics)
        self.node = NodeMirror(fetcher, root=o.node_dir, spawn=o.spawn, max_bytes=o.max_bytes, keep=o.keep)
        #: the versions this worker holds mapped: the one the engine serves, the one prepared next
        self.held = HeldVersions(self.node, self.gate, o.pin, metrics=self.metrics, clock=clock)
        if o.seed is not None:
            self.held.seed(o.seed, o.seed_step, o.seed_id)
        self.serving: int | None = o.seed_step if self.held.served is not None else None
        #: ``serving`` or ``needs_replacement`` (see :attr:`EngineStatus.state`)
        self.state: ReplicaState = "serving"
        self.last_error: str | None = None
        self._lock = threading.RLock()
        self._preparer = SerialWorker("deltasync-prepare")

    # ---------------------------------------------------------------- state

    @property
    def prepared(self) -> int | None:
        """The step prepared ahead of ``serving``, ready to commit (None when nothing is)."""
        v = self.held.prepared
        return v.step if v is not None and v.step != self.serving else None

    @property
    def last_prepare(self) -> PrepareReport | None:
        """The last prepare that settled (None: none yet)."""
        return self.prepares.last

    @property
    def on_prepared(self) -> Callable[[PrepareReport], None] | None:
        """Called with each :class:`PrepareReport` as its prepare settles (from the preparing thread)."""
        return self.prepares.on_prepared

    @on_prepared.setter
    def on_prepared(self, hook: Callable[[PrepareReport], None] | None) -> None:
        self.prepares.on_prepared = hook

    def status(self) -> EngineStatus:
        """What an orchestrator wants to know (never waits for a running prepare)."""
        return EngineStatus(
            self.serving, self.prepared, self.state, self.last_error, self.fetcher.store.url, str(self.node.dir)
        )

    @contextlib.contextmanager
    def served_state(self) -> Iterator[tuple[int | None, Mapping[str, Any], Scatter | None]]:
        """Under the mirror's lock (no update meanwhile): the step the engine serves, that version's
        tensors by checkpoint name (mapped) and the scatter loader (None: whole tensors go to ``load``)."""
        with self._lock:
            yield self.serving, self.held.served_view, self.gate.scatter

    def _require_usable(self) -> None:
        if self.state == "needs_replacement":
            raise WorkerNeedsReplacement(
                f"this worker's weights are in an unknown state since a failed update ({self.last_error}); "
                "restart or replace it"
            )

    # -------------------------------------------------------------- prepare

    def _advance(self, step: int | None) -> Version | None:
        """The node's version of ``step`` (default: the newest), built if the node has none; under the lock."""
        self._require_usable()
        target = step if step is not None else self.fetcher.latest_step()
        if target is None:
            return None
        if self.held.prepared is not None and self.held.prepared.step == target:
            return self.held.prepared
        version = self.held.fetch(target, self.serving)
        self.prepares.work = self.held.work
        return version

    def warm(self) -> Future[None]:
        """Start the node's leader in the background (it warms up while the engine serves), ahead of the
        first step: the first prepare then pays only its build. Queued before any prepare."""
        return self._preparer.submit(self.node.start_leader)

    def latest_step(self) -> int | None:
        """The run's newest committed step (None for an empty run)."""
        return self.fetcher.latest_step()

    def seen(self, step: int, at: float | None = None) -> None:
        """Note that ``step`` was committed and heard of at ``at`` (this mirror's clock; default now),
        unless it was heard of before: its prepare latency counts from there."""
        self.prepares.seen(step, self.serving, at)

    def prepare(
        self, step: int | None = None, *, coalesce: Hashable | None = None, tag: str | None = None
    ) -> Future[int | None]:
        """Start bringing the node's mirror to ``step`` (default: the newest) in the background; the
        engine keeps serving. Returns a future of the step prepared. Errors are kept for the commit.

        ``coalesce``: a prepare queued with the same key and not started yet is superseded (its
        future cancelled), as the prefetcher does with each newer step. ``tag``: names this prepare in
        its report (``tag``), so that a waiter tells its own outcome from another prepare's.

        Each prepare that settles is reported (:attr:`last_prepare`, :attr:`on_prepared`, the metrics'
        ``observe_prepare``): its latency from when the step was first heard of (:meth:`seen`) to
        prepared, and whether it was starved: far longer than its build's own work
        (:data:`STARVED_FACTOR`), which is also logged as a warning."""
        with self._lock:
            self._require_usable()
        if step is not None:
            self.seen(step)

        def run() -> int | None:
            t0 = self.clock()
            with self._lock:
                self.prepares.work = BuildWork()
                try:
                    v = self._advance(step)
                except DeltaSyncError as exc:
                    self.last_error = f"{type(exc).__name__}: {exc}"
                    self.metrics.observe_failure("prepare")
                    self._settled(self.prepares.settle(step, None, t0, self.last_error, tag))
                    raise
                self._settled(self.prepares.settle(step, None if v is None else v.step, t0, None, tag))
                return None if v is None else v.step

        return self._preparer.submit(run, coalesce=coalesce)

    def _settled(self, report: PrepareReport) -> None:
        self.prepares.tell(report, prepared=self.prepared, serving=self.serving)

    def ask(self, step: int | None, *, wait: bool = False, timeout: float | None = None) -> PrepareTicket:
        """A prepare someone asked for (``deltasync_prepare``): ``step`` (None: the newest, resolved now)
        is prepared in the background; with ``wait`` this returns once it is, raising its error, at most
        ``timeout`` seconds (:func:`~deltasync.serving.engine.prepared.result_within`). Returns what a
        waiter elsewhere needs (:class:`~deltasync.serving.engine.prepared.PrepareTicket`)."""
        step = self.latest_step() if step is None else step
        tag = secrets.token_hex(8)
        prepared = self.prepare(step, tag=tag)
        if wait:
            result_within(prepared, step, timeout)
        file = self.prepares.file
        return PrepareTicket(step, None if file is None else str(file.path), tag)

    def report_to(self, name: str) -> PreparedFile:
        """Report each prepare that settles, and this worker's state, in the node folder's
        ``prepared/<name>.json`` (:class:`~deltasync.serving.engine.prepared.PreparedFile`): what a wait
        that must not ask the worker reads. Written now, then at each prepare."""
        path = self.node.dir / "prepared" / f"{name}.json"
        return self.prepares.report_to(path, prepared=self.prepared, serving=self.serving)

    def wait_prepared(self, timeout: float | None = None) -> bool:
        """Wait until every prepare started so far has finished; False when ``timeout`` passed first."""
        return self._preparer.flush(timeout)

    # --------------------------------------------------------------- commit

    def commit(self, step: int | None = None) -> CommitReport:
        """Make the engine serve ``step`` (default: the newest prepared, else the newest committed).

        Uses what :meth:`prepare` already did; prepares now (inside the pause) when it did not.
        All or nothing, across every rank sharing ``agree``: on failure (here or on another rank) the
        engine serves its previous step (:class:`UpdateRolledBack`) or, where that cannot be restored,
        the worker is marked for replacement (:class:`WorkerNeedsReplacement`).
        """
        with self._lock:
            previous = self.serving
            # phase 1: every rank has the node's version of the step (the engine is untouched)
            target = self._target(step)
            votes = self.agree((target.error, target.step))
            replaced = self.last_error if self.state == "needs_replacement" else None
            step, version = _agreed(target, votes, previous, replaced)
            # a tied name is the same parameter as the name it is tied to: loaded through that one
            names = self.gate.loaded(version.changed_from(self.held.served))
            nbytes = version.nbytes(names)
            # phase 2: the pause, every rank loads what changed (undone on every rank if one refused)
            pause, loaded = self._pause(version, names, step, previous)
            self._record(step, target.prepared, pause, loaded)
            self._publish(step)
            log.info(
                "engine serves step %d (%d tensors, %.1f MiB loaded in %.3f s)", step, len(names), nbytes / 2**20, pause
            )
            return CommitReport(step, previous, len(names), nbytes, pause, target.prepared)

    def _target(self, step: int | None) -> _Target:
        """Phase 1 on this rank: the step to serve and the node's version of it (or why not)."""
        try:
            self._require_usable()
            if step is None:
                step = self.prepared if self.prepared is not None else self.fetcher.latest_step()
                if step is None:
                    raise UpdateRolledBack(f"{self.fetcher.store.url} has no committed step to update to")
            was_prepared = self.held.prepared is not None and self.held.prepared.step == step
            return _Target(step, self._advance(step), was_prepared)
        except DeltaSyncError as exc:
            err = f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, WorkerNeedsReplacement):
                self.last_error = err
            self.metrics.observe_failure("prepare")
            return _Target(step, error=err, cause=exc)

    def _pause(self, version: Version, names: list[str], step: int, previous: int | None) -> tuple[float, _Loaded]:
        """Load ``names`` of ``version`` into the engine (only their changed elements where a scatter
        loader can); returns the pause and what was written. A rank that failed makes every rank undo."""
        view, scatter = self.held.prepared_view, self.gate.scatter
        # what changed (its positions, where the engine holds the version this one was built from)
        changes = version.changes(self.held.served, names) if scatter is not None else {}
        t0 = self.clock()
        load_err: BaseException | None = None
        loaded = _Loaded(len(names))
        try:
            if names and scatter is not None:
                done = scatter([changes[n] for n in names], view)
                loaded = _Loaded(done.loaded + done.copied, done.scattered, done.elements)
            elif names:
                self._load([(n, view[n]) for n in names])
        except Exception as exc:  # noqa: BLE001 - any engine failure is undone below
            load_err = exc
        pause = self.clock() - t0
        refused = [f"rank {r}: {e}" for r, e in enumerate(self.agree(_why(load_err))) if e is not None]
        if refused:
            self._undo(names, load_err, "; ".join(refused), step, previous)
        return pause, loaded

    def _record(self, step: int, prepared: bool, pause: float, loaded: _Loaded) -> None:
        """The metrics of a commit: the update, what it loaded, and the sync that built its version."""
        m = self.metrics
        m.observe_update(prepared=prepared, pause_s=pause)
        m.observe_load(loaded=loaded.loaded, scattered=loaded.scattered, elements=loaded.elements)
        if self.held.built_stats is not None:
            m.observe_sync(self.held.built_stats, pause_s=pause)
        else:
            m.observe_applied(step)
            m.observe_pause(pause)

    def _publish(self, step: int) -> None:
        """The engine serves ``step`` now: its version becomes the served one."""
        self.held.promote()
        self.serving, self.last_error = step, None
        self.prepares.served(step)

    def _undo(self, names: list[str], exc: BaseException | None, why: str, step: int, previous: int | None) -> NoReturn:
        """A rank's engine refused part of a step: every rank reloads the same names from the version it served."""
        self.metrics.observe_failure("load")
        again: str | None = None
        served = self.held.served
        if served is None:
            again = "its previous weights are not known to deltasync (the engine's own checkpoint was not read)"
        else:
            self.held.drop_prepared()
            view = self.held.served_view
            try:
                self._load([(n, view[n]) for n in names if n in served.files])
            except Exception as second:  # noqa: BLE001
                again = f"{type(second).__name__}: {second}"
        lost = [f"rank {r}: {e}" for r, e in enumerate(self.agree(again)) if e is not None]
        if lost:
            self.state = "needs_replacement"
            self.last_error = f"{why}; restoring step {previous} failed: {'; '.join(lost)}"
            raise WorkerNeedsReplacement(
                f"loading step {step} into the engine failed ({why}) and restoring step {previous} failed too "
                f"({'; '.join(lost)}): restart or replace this worker"
            ) from exc
        self.last_error = why
        raise UpdateRolledBack(
            f"the engine refused step {step} ({why}); its {len(names)} tensors were restored and it still serves "
            f"step {previous}, bit-exact"
        ) from exc

    def close(self) -> None:
        """Stop the background preparer (waits for a running prepare)."""
        self.prepares.close()
        self.node.close()
        self._preparer.close(cancel_pending=True)
        self.held.close()


def _agreed(target: _Target, votes: list[Any], previous: int | None, replaced: str | None) -> tuple[int, Version]:
    """Every rank's phase 1 (``votes``: each rank's error and step), agreed: this rank's step and version
    when every rank has the same step, else the failure to raise on every rank (the engine untouched;
    ``replaced``: why this worker must be replaced, when it must)."""
    failed = [f"rank {r}: {e}" for r, (e, _) in enumerate(votes) if e is not None]
    if not failed and len({s for _, s in votes}) > 1:
        failed = [f"ranks disagree on the step: {[s for _, s in votes]} (name the step)"]
    cause = target.cause
    if failed:
        if replaced is not None:
            raise WorkerNeedsReplacement(f"this worker must be replaced: {replaced}") from cause
        if isinstance(cause, EngineIncompatible):
            raise EngineIncompatible(str(cause)) from cause
        raise UpdateRolledBack(
            f"step {target.step} was not applied ({'; '.join(failed)}); the engine still serves step "
            f"{previous}, unchanged"
        ) from cause
    assert target.step is not None and target.version is not None
    return target.step, target.version


def _why(exc: BaseException | None) -> str | None:
    return None if exc is None else f"{type(exc).__name__}: {exc}"


def make_mirror(
    store: Any,
    load: Loader,
    options: MirrorOptions | None = None,
    *,
    verify: Verify = True,
    signing_key: bytes | None = None,
    metrics: MirrorMetrics | None = None,
) -> EngineMirror:
    """An :class:`EngineMirror` over a store or store URL."""
    from deltasync.storage import open_store

    s = open_store(store) if isinstance(store, str) else store
    return EngineMirror(DeltaFetcher(s, verify=verify, signing_key=signing_key), load, options, metrics=metrics)
