"""A serving engine's weights, mirrored on the host in checkpoint coordinates.

The engine owns its parameters in its own layout (fused ``qkv_proj``, tensor-parallel
shards, repacked kernels); deltasync knows checkpoint names. The node's one host mirror
(:mod:`~deltasync.serving.node.mirror`: a version of the run per step, in shared memory,
built once per node with :class:`DeltaFetcher`: chain catch-up, checksums, digests) is
brought to a new step in the background while the engine keeps serving; :class:`EngineMirror`
commits it by handing the engine only the tensors that changed through its own loader (vLLM's
``model.load_weights``). The engine pauses only for that load.

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
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
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
from deltasync.fetcher import DeltaFetcher, SyncStats, Verify
from deltasync.protocol import TensorChange
from deltasync.serving.engine.pinning import HostPins
from deltasync.serving.engine.prepared import PreparedFile, PrepareTicket, result_within
from deltasync.serving.node.mirror import NodeMirror
from deltasync.serving.node.store import KEEP
from deltasync.serving.node.versions import Version, populate
from deltasync.serving.worker_api import CommitReport
from deltasync.signal import ReplicaState

__all__ = ["Check", "CommitReport", "EngineMirror", "EngineStatus", "Loader", "Scatter"]

log = logging.getLogger("deltasync.mirror")

#: a prepare is reported as starved (a warning and ``deltasync_prepare_starved_total``) when it took
#: more than this many times its build's own work, plus :data:`STARVED_SLACK` seconds: the build waited
#: for CPU, a lock or a leader instead of working
STARVED_FACTOR = 4.0
STARVED_SLACK = 2.0

#: the engine's loader: takes ``(checkpoint name, host tensor)`` pairs and copies them into the live weights
Loader = Callable[[Iterable[tuple[str, Any]]], Any]
#: checks, before anything is loaded, that the engine takes tensors of this layout (checkpoint name ->
#: (torch dtype, shape)) in place; raises :class:`EngineIncompatible` when it does not. Returns the
#: names the engine ties to another name of the layout (name -> that name; tied embeddings), or None
Check = Callable[[Mapping[str, tuple[Any, tuple[int, ...]]]], Mapping[str, str] | None]
#: writes what changed into the engine, in the pause: takes the changes (one per changed name, positions
#: None where not known: the whole tensor) and the new tensors by name (``scatter.ScatterLoader``)
Scatter = Callable[[Sequence[TensorChange], Mapping[str, Any]], Any]


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

    def to_json(self) -> dict[str, Any]:
        """The JSON object of the status (the workers' RPC answers): every field, but ``node_dir``
        only when there is one."""
        out = asdict(self)
        if self.node_dir is None:
            del out["node_dir"]
        return out


class EngineMirror:
    """One engine worker's view of the run, kept at a deltasync step through the node's mirror.

    The tensors themselves live in the node's shared :class:`~deltasync.serving.node.mirror.NodeMirror`
    (one copy and one download per node and step, whatever the number of workers); this object knows
    which version the engine serves, prepares the next one and commits it.

    fetcher: reads the run (its ``verify`` decides what is proven).
    load: the engine's loader (see :data:`Loader`); called in the pause only.
    seed: the tensors the engine loaded at start, by checkpoint name (or a callable returning them,
        called only when the node does not have that step yet), and ``seed_step`` the step they are,
        when known (a dir written by ``materialize`` says so). ``seed_id`` names the seed's source so
        that the workers of one engine share its version (default: one version per mirror). Without a
        seed the first commit loads every tensor.
    max_bytes: the most a version allocated from the run's inventory may take.
    metrics: a :class:`deltasync.fetcher.metrics.SyncMetrics`-like recorder (``observe_sync``,
        ``observe_pause``, ``observe_failure``), optional.
    agree: for an engine split over ranks (tensor parallel), exchanges one picklable value with
        every rank and returns all of them in rank order (an all-gather); every rank calls it at
        the same points of :meth:`commit`, so the ranks commit or undo together.
    check: see :data:`Check`; called with the seed's layout, and with each version's layout when it
        differs from the one checked last.
    node_dir, spawn, keep: where the node mirror lives and how it builds (see ``NodeMirror``).
    scatter: for a layout, a :data:`Scatter`: a loader of the changes (the one change type,
        :class:`~deltasync.protocol.TensorChange`, as the node's version keeps them) and the new
        tensors by name, that writes only the changed elements where it can (vLLM:
        ``scatter.ScatterLoader``); used in the pause instead of ``load`` (an undo always uses ``load``).
    pin: a :class:`~deltasync.serving.engine.pinning.HostPins` (GPU engines): the mapped tensors of
        the versions the engine serves and prepares are registered with it while they are (in the
        prepare, never in the pause), so that the pause copies them to the device by DMA.
    """

    def __init__(
        self,
        fetcher: DeltaFetcher,
        load: Loader,
        *,
        seed: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None,
        seed_step: int | None = None,
        seed_id: str | None = None,
        max_bytes: int | None = None,
        metrics: Any = None,
        agree: Callable[[Any], list[Any]] | None = None,
        check: Check | None = None,
        clock: Callable[[], float] = time.perf_counter,
        node_dir: str | Path | None = None,
        spawn: bool | None = None,
        keep: int = KEEP,
        scatter: Callable[[Mapping[str, tuple[Any, tuple[int, ...]]]], Scatter] | None = None,
        pin: HostPins | None = None,
    ) -> None:
        self.fetcher = fetcher
        self._pin = pin
        self._scatter_for = scatter
        self._scatter: Scatter | None = None
        self.agree: Callable[[Any], list[Any]] = agree or (lambda mine: [mine])
        self._load = load
        self.metrics = metrics
        self.clock = clock
        self._check = check
        self._checked: Any = None  # the layout last checked
        #: names the engine ties to another name (one parameter): never loaded, equal to it in every version
        self._tied: dict[str, str] = {}
        self.node = NodeMirror(fetcher, root=node_dir, spawn=spawn, max_bytes=max_bytes, keep=keep)
        #: the version the engine holds exactly (None: unknown, the first commit loads every tensor)
        self._served: Version | None = None
        self._served_view: dict[str, Any] = {}  # its tensors, mapped: keeps them alive for an undo
        if seed is not None:
            self._served, self._served_view = self.node.mapped(
                lambda: self.node.seed(seed, seed_step, seed_id=seed_id, check=self._check_layout),
                read_only=self._pinned(),
            )
            self._hold(self._served_view)
        self.serving: int | None = seed_step if self._served is not None else None
        self._prepared: Version | None = None
        self._prepared_view: dict[str, Any] = {}
        self._prepared_stats: SyncStats | None = None
        #: ``serving`` or ``needs_replacement`` (see :attr:`EngineStatus.state`)
        self.state: ReplicaState = "serving"
        self.last_error: str | None = None
        self._lock = threading.RLock()
        self._preparer = SerialWorker("deltasync-prepare")
        #: when each step not served yet was first heard of (a prefetch poll or signal, a prepare or an
        #: update asking for it): the start of its prepare latency
        self._seen: dict[int, float] = {}
        #: the last prepare that settled: ``{"step", "ok", "error", "latency_s", "starved"}`` (None: none yet)
        self.last_prepare: dict[str, Any] | None = None
        #: called with :attr:`last_prepare` each time a prepare settles (from the preparing thread)
        self.on_prepared: Callable[[dict[str, Any]], None] | None = None
        #: where prepares are reported for a waiter (:meth:`report_to`; None: nowhere)
        self.reported: PreparedFile | None = None
        #: what the last ``_advance`` spent: (getting the node's version, the build's own seconds when
        #: this worker's request built it, all of it)
        self._work: tuple[float | None, float | None, float | None] = (None, None, None)

    # ---------------------------------------------------------------- state

    @property
    def prepared(self) -> int | None:
        """The step prepared ahead of ``serving``, ready to commit (None when nothing is)."""
        v = self._prepared
        return v.step if v is not None and v.step != self.serving else None

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
            yield self.serving, self._served_view, self._scatter

    def _require_usable(self) -> None:
        if self.state == "needs_replacement":
            raise WorkerNeedsReplacement(
                f"this worker's weights are in an unknown state since a failed update ({self.last_error}); "
                "restart or replace it"
            )

    def _check_layout(self, layout: Mapping[str, tuple[Any, tuple[int, ...]]]) -> None:
        if layout == self._checked:
            return
        tied = self._check(layout) if self._check is not None else None
        self._tied = dict(tied or {})
        self._checked = dict(layout)
        self._scatter = None
        if self._scatter_for is not None:
            try:
                self._scatter = self._scatter_for({n: s for n, s in layout.items() if n not in self._tied})
            except Exception as exc:  # noqa: BLE001 - the engine's own loader still works
                log.warning(
                    "cannot write changed elements in place (%s: %s): loading whole tensors", type(exc).__name__, exc
                )

    # -------------------------------------------------------------- prepare

    def _advance(self, step: int | None) -> Version | None:
        """The node's version of ``step`` (default: the newest), built if the node has none; under the lock."""
        self._require_usable()
        target = step if step is not None else self.fetcher.latest_step()
        if target is None:
            return None
        if self._prepared is not None and self._prepared.step == target:
            return self._prepared
        reuse = {} if self._served is None else self._served.by_file(self._served_view)
        if self._prepared is not None:
            reuse.update(self._prepared.by_file(self._prepared_view))
        t0 = self.clock()
        version, view = self.node.mapped(lambda: self.node.ensure(target), reuse=reuse, read_only=self._pinned())
        got = self.clock() - t0
        built = next((b for b in self.node.built if b.id == version.id), None)
        if built is not None:  # this worker's leader read the store for it: its sync is this worker's to report
            self.node.built.remove(built)
        self._prepared_stats = _stats(built) if built is not None else None
        self._check_layout(version.layout())
        self._check_tied(version.step, view)
        mapped_before = {id(t) for t in reuse.values()}
        populate(t for t in view.values() if id(t) not in mapped_before)  # page faults here, not in the pause
        self._hold(view)
        self._release(self._prepared_view)
        work = None if built is None else built.stats.get("cpu_s", built.stats.get("seconds"))
        self._work = (got, None if work is None else float(work), self.clock() - t0)
        if self.metrics is not None and hasattr(self.metrics, "observe_node"):
            pinned = {} if self._pin is None else {"pinned": self._pin.nbytes}
            self.metrics.observe_node(nbytes=self.node.versions.nbytes_on_disk(), built=built is not None, **pinned)
        self._prepared, self._prepared_view = version, view
        return version

    def _check_tied(self, step: int | None, view: Mapping[str, Any]) -> None:
        """A version whose tied names do not hold the same bits cannot be served (the engine holds one
        parameter for both): refused while preparing, before the engine is touched."""
        for name, target in self._tied.items():
            a, b = view.get(name), view.get(target)
            if a is not None and b is not None and not _same_bits(a, b):
                raise EngineIncompatible(
                    f"step {step} of the run holds different values in {name} and {target}, which this engine "
                    "ties (one parameter for both: tie_word_embeddings in the model's config), so it cannot serve "
                    "that step bit-exact; start the engine with the trainer's config (tie_word_embeddings: false "
                    f"when the trainer trains them apart). The engine still serves step {self.serving}"
                )

    def _pinned(self) -> bool:
        """Whether views are registered with CUDA: then they are mapped shared and write-protected
        (registered 6.8x faster than copy-on-write mappings; a loader's write would fault)."""
        return self._pin is not None and self._pin.enabled

    def _hold(self, view: Mapping[str, Any]) -> None:
        if self._pin is not None:
            self._pin.hold(view.values())

    def _release(self, view: Mapping[str, Any]) -> None:
        if self._pin is not None:
            self._pin.release(view.values())

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
        if step not in self._seen and (self.serving is None or step > self.serving):
            self._seen[step] = self.clock() if at is None else at
            for old in [s for s in self._seen if s < step - 64]:  # never grows without bound
                del self._seen[old]

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
                self._work = (None, None, None)
                try:
                    v = self._advance(step)
                except DeltaSyncError as exc:
                    self.last_error = f"{type(exc).__name__}: {exc}"
                    if self.metrics is not None:
                        self.metrics.observe_failure("prepare")
                    self._settled(step, None, t0, self.last_error, tag)
                    raise
                self._settled(step, None if v is None else v.step, t0, None, tag)
                return None if v is None else v.step

        return self._preparer.submit(run, coalesce=coalesce)

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
        return PrepareTicket(step, None if self.reported is None else str(self.reported.path), tag)

    def _settled(
        self, asked: int | None, step: int | None, t0: float, error: str | None, tag: str | None = None
    ) -> None:
        """Report a prepare that ended (under the lock): its latency, and whether its build was starved."""
        now = self.clock()
        target = step if step is not None else asked
        since = self._seen.get(target, t0) if target is not None else t0
        latency, took = now - since, now - t0
        got, build_s, _ = self._work if error is None else (None, None, None)
        starved = False
        if error is None and build_s is not None and took > STARVED_FACTOR * build_s + STARVED_SLACK:
            starved = True
            log.warning(
                "the prepare of step %s was starved: %.2f s (%.2f s from first heard of), of which the node's "
                "build worked %.2f CPU s and getting it took %.2f s: the leader or this worker waited for CPU "
                "(a busy engine on few cores), the node lock or a leader start (deltasync_prepare_starved_total)",
                target,
                took,
                latency,
                build_s,
                got if got is not None else float("nan"),
            )
        self._work = (None, None, None)
        report = {
            "step": target,
            "ok": error is None,
            "error": error,
            "latency_s": round(latency, 4),
            "build_s": build_s,
            "starved": starved,
            "tag": tag,
        }
        self.last_prepare = report
        if error is None:
            log.info("step %s prepared %.3f s after it was first heard of (build %s s)", target, latency, build_s)
            if self.metrics is not None and hasattr(self.metrics, "observe_prepare"):
                self.metrics.observe_prepare(latency, starved=starved)
        for hook in (self._write_report, self.on_prepared):
            if hook is not None:
                try:
                    hook(report)
                except Exception:  # noqa: BLE001 - a report must not fail the prepare
                    log.warning("reporting a prepare failed", exc_info=True)

    def report_to(self, name: str) -> PreparedFile:
        """Report each prepare that settles, and this worker's state, in the node folder's
        ``prepared/<name>.json`` (:class:`~deltasync.serving.engine.prepared.PreparedFile`): what a wait
        that must not ask the worker reads. Written now, then at each prepare."""
        self.reported = PreparedFile(self.node.dir / "prepared" / f"{name}.json")
        self._write_report(None)
        return self.reported

    def _write_report(self, report: dict[str, Any] | None) -> None:
        if self.reported is not None:
            self.reported.write(report, prepared=self.prepared, serving=self.serving)

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
            err: str | None = None
            cause: DeltaSyncError | None = None
            version: Version | None = None
            was_prepared = False
            try:
                self._require_usable()
                if step is None:
                    step = self.prepared if self.prepared is not None else self.fetcher.latest_step()
                    if step is None:
                        raise UpdateRolledBack(f"{self.fetcher.store.url} has no committed step to update to")
                was_prepared = self._prepared is not None and self._prepared.step == step
                version = self._advance(step)
            except DeltaSyncError as exc:
                err, cause = f"{type(exc).__name__}: {exc}", exc
                if not isinstance(exc, WorkerNeedsReplacement):
                    self.last_error = err
                if self.metrics is not None:
                    self.metrics.observe_failure("prepare")
            votes = self.agree((err, step))
            failed = [f"rank {r}: {e}" for r, (e, _) in enumerate(votes) if e is not None]
            if not failed and len({s for _, s in votes}) > 1:
                failed = [f"ranks disagree on the step: {[s for _, s in votes]} (name the step)"]
            if failed:
                if self.state == "needs_replacement":
                    raise WorkerNeedsReplacement(f"this worker must be replaced: {self.last_error}") from cause
                if isinstance(cause, EngineIncompatible):
                    raise EngineIncompatible(str(cause)) from cause
                raise UpdateRolledBack(
                    f"step {step} was not applied ({'; '.join(failed)}); the engine still serves step {previous}, "
                    "unchanged"
                ) from cause
            assert step is not None and version is not None
            # a tied name is the same parameter as the name it is tied to: loaded through that one
            names = [n for n in version.changed_from(self._served) if n not in self._tied]
            view = self._prepared_view
            nbytes = version.nbytes(names)
            # what changed (its positions, where the engine holds the version this one was built from)
            changes = version.changes(self._served, names) if self._scatter is not None else {}
            # phase 2: the pause, every rank loads what changed
            t0 = self.clock()
            load_err: BaseException | None = None
            counts: dict[str, int] = {"loaded": len(names)}
            try:
                if names and self._scatter is not None:
                    done = self._scatter([changes[n] for n in names], view)
                    counts = {
                        "loaded": done.loaded + done.copied,
                        "scattered": done.scattered,
                        "elements": done.elements,
                    }
                elif names:
                    self._load([(n, view[n]) for n in names])
            except Exception as exc:  # noqa: BLE001 - any engine failure is undone below
                load_err = exc
            pause = self.clock() - t0
            refused = [f"rank {r}: {e}" for r, e in enumerate(self.agree(_why(load_err))) if e is not None]
            if refused:
                self._undo(names, load_err, "; ".join(refused), step, previous)
            if self.metrics is not None:
                if hasattr(self.metrics, "observe_update"):
                    self.metrics.observe_update(prepared=was_prepared, pause_s=pause)
                if hasattr(self.metrics, "observe_load"):
                    self.metrics.observe_load(**counts)
                if self._prepared_stats is not None:
                    self.metrics.observe_sync(self._prepared_stats, pause_s=pause)
                else:
                    self.metrics.observe_applied(step)
                    self.metrics.observe_pause(pause)
            self._prepared_stats = None
            self._release(self._served_view)  # the prepared view's hold passes to the served one
            if self._pin is not None and self.metrics is not None and hasattr(self.metrics, "observe_node"):
                self.metrics.observe_node(
                    nbytes=self.node.versions.nbytes_on_disk(), built=False, pinned=self._pin.nbytes
                )
            self._served, self._served_view = version, view
            self._prepared, self._prepared_view = None, {}
            self.serving, self.last_error = step, None
            for held in [s for s in self._seen if s <= step]:
                del self._seen[held]
            log.info(
                "engine serves step %d (%d tensors, %.1f MiB loaded in %.3f s)", step, len(names), nbytes / 2**20, pause
            )
            return CommitReport(step, previous, len(names), nbytes, pause, was_prepared)

    def _undo(self, names: list[str], exc: BaseException | None, why: str, step: int, previous: int | None) -> NoReturn:
        """A rank's engine refused part of a step: every rank reloads the same names from the version it served."""
        if self.metrics is not None:
            self.metrics.observe_failure("load")
        again: str | None = None
        served = self._served
        if served is None:
            again = "its previous weights are not known to deltasync (the engine's own checkpoint was not read)"
        else:
            self._release(self._prepared_view)
            self._prepared, self._prepared_view = None, {}
            try:
                self._load([(n, self._served_view[n]) for n in names if n in served.files])
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
        if self.reported is not None:
            self.reported.remove()
        self.node.close()
        self._preparer.close(cancel_pending=True)
        if self._pin is not None:
            self._pin.close()


def _stats(version: Version) -> SyncStats:
    """The :class:`SyncStats` of the sync that built a version (this process's leader's)."""
    fields = dict(version.stats.get("sync") or {})
    fields.setdefault("step", version.step if version.step is not None else -1)
    return SyncStats(**fields)


def _why(exc: BaseException | None) -> str | None:
    return None if exc is None else f"{type(exc).__name__}: {exc}"


def make_mirror(
    store: Any, load: Loader, *, verify: Verify = True, signing_key: bytes | None = None, **options: Any
) -> EngineMirror:
    """An :class:`EngineMirror` over a store or store URL."""
    from deltasync.storage import open_store

    s = open_store(store) if isinstance(store, str) else store
    return EngineMirror(DeltaFetcher(s, verify=verify, signing_key=signing_key), load, **options)


def _same_bits(a: Any, b: Any) -> bool:
    """Whether two host tensors hold the same bits (NaN payloads and signed zeros included)."""
    import torch

    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return bool(torch.equal(a.contiguous().view(bits), b.contiguous().view(bits)))
