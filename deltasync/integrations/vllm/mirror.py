"""A serving engine's weights, mirrored on the host in checkpoint coordinates.

The engine owns its parameters in its own layout (fused ``qkv_proj``, tensor-parallel
shards, repacked kernels); deltasync knows checkpoint names. :class:`EngineMirror`
keeps one host copy per checkpoint name, brings it to a new step in the background
with :class:`DeltaFetcher` (chain catch-up, checksums, digests) while the engine
keeps serving, and commits by handing the engine only the tensors that changed
through its own loader (vLLM's ``model.load_weights``). The engine pauses only for
that load.

Failure states, for an orchestrator:

- an engine that cannot take the run's tensors in place (``check`` refuses their layout) is never
  loaded into: :class:`EngineIncompatible`, before the first load;
- a step that fails to download or prove never touches the engine;
- a load the engine refuses is undone: the mirror rolls back (its journals) and
  the engine reloads the same names at their previous bits, then
  :class:`UpdateRolledBack` is raised and the engine serves its previous step;
- when that reload fails too, the worker is marked ``needs_replacement`` and every
  later call raises :class:`WorkerNeedsReplacement`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

from deltasync._tensors import allocate, torch_dtype
from deltasync._worker import SerialWorker
from deltasync.errors import (
    DeltaSyncError,
    EngineIncompatible,
    InventoryMismatch,
    UpdateRolledBack,
    WorkerNeedsReplacement,
)
from deltasync.fetcher._fetcher import DeltaFetcher, Verify
from deltasync.fetcher._journal import SyncJournal

__all__ = ["Check", "CommitReport", "EngineMirror", "Loader"]

log = logging.getLogger("deltasync.mirror")

#: the engine's loader: takes ``(checkpoint name, host tensor)`` pairs and copies them into the live weights
Loader = Callable[[Iterable[tuple[str, Any]]], Any]
#: checks, before anything is loaded, that the engine takes tensors of this layout (checkpoint name ->
#: (torch dtype, shape)) in place; raises :class:`EngineIncompatible` when it does not
Check = Callable[[Mapping[str, tuple[Any, tuple[int, ...]]]], None]
State = Literal["serving", "needs_replacement"]


@dataclass(frozen=True, slots=True)
class CommitReport:
    """One committed update: the step now served, what was loaded, and how long the engine paused."""

    step: int
    previous: int | None
    tensors: int
    nbytes: int
    pause_s: float
    prepared: bool


class EngineMirror:
    """Host mirror of one engine worker's weights, kept at a deltasync step.

    fetcher: reads the run (its ``verify`` decides what is proven).
    load: the engine's loader (see :data:`Loader`); called in the pause only.
    seed: the tensors the engine loaded at start, by checkpoint name (read from its
        checkpoint dir), and ``seed_step`` the step they are, when known (a dir written by
        ``materialize`` says so). Without a seed the mirror is allocated from the run's
        inventory, bounded by ``max_bytes``, and the first commit loads every tensor.
    metrics: a :class:`deltasync.fetcher.metrics.SyncMetrics`-like recorder (``observe_sync``,
        ``observe_pause``, ``observe_failure``), optional.
    agree: for an engine split over ranks (tensor parallel), exchanges one picklable value with
        every rank and returns all of them in rank order (an all-gather); every rank calls it at
        the same points of :meth:`commit`, so the ranks commit or undo together.
    check: see :data:`Check`; called with the seed's layout here, and with the run's inventory when
        the mirror is allocated from it (no seed, or a seed that is not the run's layout).
    """

    def __init__(
        self,
        fetcher: DeltaFetcher,
        load: Loader,
        *,
        seed: Mapping[str, Any] | None = None,
        seed_step: int | None = None,
        max_bytes: int | None = None,
        metrics: Any = None,
        agree: Callable[[Any], list[Any]] | None = None,
        check: Check | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.fetcher = fetcher
        self.agree: Callable[[Any], list[Any]] = agree or (lambda mine: [mine])
        self._load = load
        self.metrics = metrics
        self.clock = clock
        self.max_bytes = max_bytes
        self._check = check
        if seed is not None and check is not None:
            check({n: (t.dtype, tuple(t.shape)) for n, t in seed.items()})
        self._mirror: dict[str, Any] | None = dict(seed) if seed is not None else None
        self._seed_step = seed_step
        # whether the engine holds exactly the mirror's bits at ``serving`` (False: load everything once)
        self._engine_known = seed is not None
        self.serving: int | None = seed_step
        self._pending: list[SyncJournal] = []
        self.state: State = "serving"
        self.last_error: str | None = None
        self._lock = threading.RLock()
        self._preparer = SerialWorker("deltasync-prepare")

    # ---------------------------------------------------------------- state

    @property
    def prepared(self) -> int | None:
        """The step the mirror holds, ready to commit (None when nothing is ahead of ``serving``)."""
        pending = list(self._pending)
        return pending[-1].step if pending else None

    def status(self) -> dict[str, Any]:
        """What an orchestrator wants to know, JSON-safe (never waits for a running prepare)."""
        pending = list(self._pending)
        return {
            "step": self.serving,
            "prepared": pending[-1].step if pending else None,
            "state": self.state,
            "last_error": self.last_error,
            "store": self.fetcher.store.url,
        }

    def _require_usable(self) -> None:
        if self.state == "needs_replacement":
            raise WorkerNeedsReplacement(
                f"this worker's weights are in an unknown state since a failed update ({self.last_error}); "
                "restart or replace it"
            )

    def _mirror_step(self) -> int | None:
        return self._pending[-1].step if self._pending else self.serving

    # -------------------------------------------------------------- prepare

    def _ensure_mirror(self, step: int) -> dict[str, Any]:
        if self._mirror is None:
            inventory = self.fetcher.manifest(step).inventory
            if self._check is not None:
                self._check({t.name: (torch_dtype(t.dtype), tuple(t.shape)) for t in inventory})
            limit = self.max_bytes if self.max_bytes is not None else 1 << 62
            self._mirror = allocate(inventory, limit, option="EngineMirror(max_bytes=...)", zeroed=False)
        return self._mirror

    def _advance(self, step: int | None) -> int | None:
        """Bring the mirror (not the engine) to ``step`` (default: the newest); under the lock."""
        self._require_usable()
        target = step if step is not None else self.fetcher.latest_step()
        if target is None:
            return None
        current = self._mirror_step()
        if current is not None and target == current and self._engine_known:
            return current
        mirror = self._ensure_mirror(target)
        journal = SyncJournal()
        try:
            have = current if current is not None else self._seed_step
            self.fetcher.sync(mirror, target, have_step=have, journal=journal)
        except InventoryMismatch:
            if self._mirror is None or not self._engine_known or self._pending:
                raise
            # the engine's own files are not this run's layout (another dtype, extra tensors): start
            # from the run's inventory, and load every tensor once
            log.warning("the engine's checkpoint does not match the run's tensors: loading every tensor once")
            self._mirror, self._engine_known, self._seed_step = None, False, None
            mirror = self._ensure_mirror(target)
            journal = SyncJournal()
            self.fetcher.sync(mirror, target, journal=journal)
        self._seed_step = None
        self._pending.append(journal)
        return target

    def latest_step(self) -> int | None:
        """The run's newest committed step (None for an empty run)."""
        return self.fetcher.latest_step()

    def prepare(self, step: int | None = None, *, coalesce: Hashable | None = None) -> Future[int | None]:
        """Start bringing the mirror to ``step`` (default: the newest) in the background; the engine keeps
        serving. Returns a future of the step prepared. Errors are kept for the commit.

        ``coalesce``: a prepare queued with the same key and not started yet is superseded (its
        future cancelled), as the prefetcher does with each newer step."""
        with self._lock:
            self._require_usable()

        def run() -> int | None:
            with self._lock:
                try:
                    return self._advance(step)
                except DeltaSyncError as exc:
                    self.last_error = f"{type(exc).__name__}: {exc}"
                    if self.metrics is not None:
                        self.metrics.observe_failure("prepare")
                    raise

        return self._preparer.submit(run, coalesce=coalesce)

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
            # phase 1: every rank brings its mirror to the step (the engine is untouched)
            err: str | None = None
            cause: DeltaSyncError | None = None
            names: list[str] = []
            was_prepared = False
            try:
                self._require_usable()
                if step is None:
                    step = self._mirror_step() if self._pending else self.fetcher.latest_step()
                    if step is None:
                        raise UpdateRolledBack(f"{self.fetcher.store.url} has no committed step to update to")
                # a mirror prepared past the asked step goes back to it (newest journals first)
                while self._pending and self._pending[-1].step is not None and self._pending[-1].step > step:
                    self._pending.pop().rollback()
                was_prepared = bool(self._pending) and self._pending[-1].step == step
                self._advance(step)
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
            assert step is not None
            mirror = self._mirror
            assert mirror is not None
            names = sorted({n for j in self._pending for n in j.names}) if self._engine_known else sorted(mirror)
            nbytes = sum(mirror[n].numel() * mirror[n].element_size() for n in names)
            # phase 2: the pause, every rank loads what changed
            t0 = self.clock()
            load_err: BaseException | None = None
            try:
                if names:
                    self._load([(n, mirror[n]) for n in names])
            except Exception as exc:  # noqa: BLE001 - any engine failure is undone below
                load_err = exc
            pause = self.clock() - t0
            refused = [f"rank {r}: {e}" for r, e in enumerate(self.agree(_why(load_err))) if e is not None]
            if refused:
                self._undo(names, load_err, "; ".join(refused), step, previous)
            if self.metrics is not None:
                done = [j.stats for j in self._pending if j.stats is not None]
                for i, stats in enumerate(done):
                    self.metrics.observe_sync(stats, pause_s=pause if i == len(done) - 1 else None)
                if not done:
                    self.metrics.observe_applied(step)
                    self.metrics.observe_pause(pause)
            self._pending.clear()
            self.serving, self._engine_known, self.last_error = step, True, None
            log.info(
                "engine serves step %d (%d tensors, %.1f MiB loaded in %.3f s)", step, len(names), nbytes / 2**20, pause
            )
            return CommitReport(step, previous, len(names), nbytes, pause, was_prepared)

    def _undo(self, names: list[str], exc: BaseException | None, why: str, step: int, previous: int | None) -> NoReturn:
        """A rank's engine refused part of a step: every rank puts its mirror back and reloads the same names."""
        if self.metrics is not None:
            self.metrics.observe_failure("load")
        mirror = self._mirror
        assert mirror is not None
        again: str | None = None
        if not self._engine_known:
            again = "its previous weights are not known to deltasync (the engine's own checkpoint was not read)"
        else:
            for journal in reversed(self._pending):
                journal.rollback()
            self._pending.clear()
            try:
                self._load([(n, mirror[n]) for n in names])
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
        self._preparer.close(cancel_pending=True)


def _why(exc: BaseException | None) -> str | None:
    return None if exc is None else f"{type(exc).__name__}: {exc}"


def make_mirror(
    store: Any, load: Loader, *, verify: Verify = True, signing_key: bytes | None = None, **options: Any
) -> EngineMirror:
    """An :class:`EngineMirror` over a store or store URL."""
    from deltasync.storage import open_store

    s = open_store(store) if isinstance(store, str) else store
    return EngineMirror(DeltaFetcher(s, verify=verify, signing_key=signing_key), load, **options)
