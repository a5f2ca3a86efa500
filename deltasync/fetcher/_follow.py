"""Follow a run: apply each new committed step as soon as it is signalled.

The signal server (SSE) is a fast hint; the store is the truth. Waiting for the next step is
:class:`deltasync.signal.StepWatcher`'s job: when the server is unreachable it polls the store's
``HEAD.json`` (and now and then the manifest listing) every ``poll_interval`` seconds and keeps
reconnecting with backoff; a resumed stream replays the commits it missed (``Last-Event-ID``).
The loop around it is the one :class:`deltasync.signal.FollowLoop`. This module says what following
a target means (:class:`Follower`, its options in :class:`FollowOptions`): apply the newest step (a
failed one again at the next observation), count it, record metrics, and (with ``replica``) report
what the target serves to the signal server's fleet view. :func:`follow` is the one-call form
(:meth:`DeltaFetcher.follow`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from deltasync._util.retry import RetryPolicy
from deltasync.errors import DeltaSyncError, InventoryMismatch, SignalRejected, StorageError
from deltasync.fetcher._materialize import config_files
from deltasync.protocol import Head
from deltasync.protocol.head import MAX_HEAD_BYTES
from deltasync.protocol.keys import HEAD_KEY
from deltasync.signal import Attempt, FleetReporter, FollowLoop, ReplicaState, StepSeen, StepWatcher, StorePoller

if TYPE_CHECKING:
    import httpx

    from deltasync.fetcher._stats import SyncStats
    from deltasync.fetcher.metrics import SyncMetrics
    from deltasync.run import RunReader
    from deltasync.storage import Store

__all__ = ["FollowOptions", "FollowStats", "Followed", "Follower", "follow"]

log = logging.getLogger("deltasync.follow")


class Followed(Protocol):
    """What :class:`Follower` uses of a :class:`~deltasync.DeltaFetcher` (a Protocol, so that the
    fetcher can offer ``follow`` without an import circle)."""

    store: Store
    reader: RunReader
    last_stats: SyncStats | None

    def sync(self, target: Any, step: int | None = None) -> int: ...

    def materialize(
        self,
        out_dir: str | os.PathLike[str],
        step: int | None = None,
        *,
        config_from: str | os.PathLike[str] | None = None,
    ) -> Path: ...

    def latest_step(self) -> int | None: ...

    def current_step(self, target: Any) -> int | None: ...


MARKER = ".deltasync.json"


@dataclass(slots=True)
class FollowStats:
    """Counters of one :func:`follow` call (pass an instance as ``stats=`` to read them)."""

    applied: int = 0
    signals: int = 0
    polls: int = 0
    signal_failures: int = 0
    apply_failures: int = 0
    connected: bool = False


@dataclass(frozen=True, slots=True)
class FollowOptions:
    """How a :class:`Follower` follows a run (every field has the default of :func:`follow`).

    signal_url, token, run: the signal server, a subscribe token, and the run name (default: the
        store's run id, read from ``HEAD.json`` or the newest manifest). Without ``signal_url`` the
        store is polled.
    until_step: :meth:`Follower.run` returns once the target holds this step (None: until ``stop``).
    poll_interval: seconds between store polls while the server is unreachable.
    heartbeat: keep-alive interval asked of the server (default ``min(poll_interval, 5)``, at least
        0.2); also bounds how late ``stop`` is noticed.
    store_check_interval: while the stream is up, the store's HEAD is still read this often, in case
        a signal was lost.
    reconnect_backoff: the first and the longest pause between reconnects of the stream.
    replica: with ``signal_url``, report the target to the signal server's fleet view as this
        replica (:class:`~deltasync.signal.FleetReporter`) every ``report_heartbeat`` seconds, with
        ``report_token`` (default ``token``).
    config_from: a dir target only: copy this HF model dir's config and tokenizer files into every
        version (see :meth:`DeltaFetcher.materialize`); checked before anything else.
    """

    signal_url: str | None = None
    token: str | None = None
    run: str | None = None
    until_step: int | None = None
    poll_interval: float = 2.0
    heartbeat: float | None = None
    store_check_interval: float = 30.0
    reconnect_backoff: tuple[float, float] = (0.5, 15.0)
    replica: str | None = None
    report_token: str | None = None
    report_heartbeat: float = 10.0
    config_from: str | os.PathLike[str] | None = None

    @property
    def keepalive(self) -> float:
        """The heartbeat asked of the signal server."""
        return self.heartbeat if self.heartbeat is not None else max(0.2, min(self.poll_interval, 5.0))

    @property
    def reconnect(self) -> RetryPolicy:
        """The backoff of the stream's reconnects."""
        first, longest = self.reconnect_backoff
        return RetryPolicy(retries=0, backoff=first, max_backoff=longest)


def _dir_step(out: Path) -> int | None:
    try:
        return int(json.loads((out / MARKER).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _dir_target(target: Any, config_from: str | os.PathLike[str] | None) -> Path | None:
    """The directory a target names (None: a tensor target), checked: a dir not written by
    ``materialize`` is refused, and so is a ``config_from`` that is missing or not for a dir."""
    out = Path(target) if isinstance(target, (str, os.PathLike)) else None
    if out is not None and out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MARKER).is_file())):
        raise StorageError(f"refusing to follow into {out}: it exists and was not written by deltasync materialize")
    if config_from is not None:
        if out is None:
            raise ValueError("config_from applies to a directory target only")
        config_files(config_from)  # a missing dir or config.json fails now, not at every step
    return out


class Follower:
    """Keeps one target at a run's newest committed step, on :class:`~deltasync.signal.FollowLoop`.

    fetcher: reads the run (:class:`Followed`: a :class:`~deltasync.DeltaFetcher`).
    target: an nn.Module / dict of tensors (updated in place with :meth:`DeltaFetcher.sync`) or a
        directory path (rewritten with :meth:`DeltaFetcher.materialize`); a directory that exists and
        was not written by deltasync is refused here (:class:`StorageError`).
    options: see :class:`FollowOptions`.
    stop: set to end :meth:`run`. on_step: called with each step reached.
    metrics: a :class:`~deltasync.fetcher.metrics.SyncMetrics` to record the head seen, each step
        reached (with :attr:`DeltaFetcher.last_stats` for tensor targets; step and seconds for a dir)
        and failures (``apply``, ``signal``, ``store``).
    stats: the counters to keep (:class:`FollowStats`; default a new one, :attr:`stats`).
    transport: replaces the network of the signal stream and the fleet reports (tests).
    """

    def __init__(
        self,
        fetcher: Followed,
        target: Any,
        options: FollowOptions | None = None,
        *,
        stop: threading.Event | None = None,
        on_step: Callable[[int], None] | None = None,
        metrics: SyncMetrics | None = None,
        stats: FollowStats | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.fetcher = fetcher
        self.target = target
        self.options = options if options is not None else FollowOptions()
        self.stop = stop if stop is not None else threading.Event()
        self.on_step = on_step
        self.metrics = metrics
        self.stats = stats if stats is not None else FollowStats()
        self.transport = transport
        self.out = _dir_target(target, self.options.config_from)
        #: the step the target holds (None: none yet)
        self.current: int | None = _dir_step(self.out) if self.out is not None else fetcher.current_step(target)
        self._synced: SyncStats | None = None  # the stats of the last apply, when it was a sync (a dir leaves none)
        self._refused = False  # the server refused the stream last time (warned once; quiet until it accepts)
        self._unanswered = False  # the server never answered yet (warned once: following by polling)
        self._reporter: FleetReporter | None = None
        self._reporting = self.options.replica is not None and self.options.signal_url is not None
        self._poller = StorePoller(fetcher.store, fetcher.latest_step)

    # ------------------------------------------------------------------ run

    def run(self, watcher: StepWatcher | None = None) -> int | None:
        """Follow until ``until_step`` is held or ``stop`` is set; returns the step the target holds
        (None if the run never had a step). ``watcher``: the one to follow with (tests inject one with
        their own clock and wait; default :meth:`watcher`). Errors of one apply are logged and
        retried; an :class:`InventoryMismatch` (the target cannot hold this run) is raised. The
        replica leaves the fleet view when this returns."""
        if self.metrics is not None and self.current is not None:
            self.metrics.observe_applied(self.current)
        self.report(self.current, "starting" if self.current is None else "serving")
        loop = FollowLoop(
            watcher if watcher is not None else self.watcher(),
            self.apply,
            held=lambda: self.current,
            observe=self.observe,
            report=self.count,
            fatal=(InventoryMismatch,),
            until=self.options.until_step,
        )
        try:
            return loop.run()
        finally:
            self.stats.connected = False
            if self._reporter is not None:
                self._reporter.close()

    def watcher(self) -> StepWatcher:
        """The step watcher of :attr:`options`: the signal stream, falling back to polling the store,
        on this module's monotonic clock and the ``stop`` event's wait."""
        o = self.options
        return StepWatcher(
            self.store_latest,
            signal_url=o.signal_url,
            token=o.token,
            run=self.run_name,
            heartbeat=o.keepalive,
            poll_interval=o.poll_interval,
            store_check_interval=o.store_check_interval,
            reconnect=o.reconnect,
            transport=self.transport,
            stop=self.stop,
            clock=time.monotonic,
        )

    # ------------------------------------------------------- apply, count

    def apply(self, step: int) -> None:
        """Bring the target to ``step``: a sync in place, or a new version of the dir."""
        before = self.fetcher.last_stats
        if self.out is not None:
            self.fetcher.materialize(self.out, step=step, config_from=self.options.config_from)
        else:
            self.fetcher.sync(self.target, step=step)
        self.current = step
        reached = self.fetcher.last_stats
        fresh = reached is not None and reached is not before and reached.step == step
        self._synced = reached if fresh else None

    def count(self, attempt: Attempt) -> None:
        """One apply's outcome: counted, recorded, reported to the fleet view and to ``on_step``."""
        if attempt.error is not None:
            self.stats.apply_failures += 1
            if self.metrics is not None:
                self.metrics.observe_failure("apply")
            log.warning("cannot apply step %d yet (will retry): %s", attempt.step, attempt.error)
            error = f"step {attempt.step}: {type(attempt.error).__name__}: {attempt.error}"
            self.report(self.current, "failed", error)
            return
        self.stats.applied += 1
        if self.metrics is not None:
            if self._synced is not None:
                self.metrics.observe_sync(self._synced)
            else:  # a dir: materialize leaves no stats
                self.metrics.observe_applied(attempt.step, seconds=attempt.seconds)
        self.report(attempt.step, "serving")
        if self.on_step is not None:
            self.on_step(attempt.step)

    # ------------------------------------------------------ observations

    def store_latest(self) -> int | None:
        """The store's newest committed step (a poll; None when the store cannot be read now)."""
        self.stats.polls += 1
        try:
            return self._poller()
        except DeltaSyncError as exc:
            if self.metrics is not None:
                self.metrics.observe_failure("store")
            log.warning("cannot list the store: %s", exc)
            return None

    def observe(self, seen: StepSeen) -> None:
        """Every observation of the watcher: counters, metrics, and one log line per change of the
        signal stream's state."""
        if self._reporter is None and self._reporting:
            self.report(self.current, "starting" if self.current is None else "serving")  # the run may be known now
        if seen.kind == "lost":
            self._lost(seen)
        elif seen.kind == "store":
            if self.metrics is not None and seen.step is not None:
                self.metrics.observe_head(seen.step)
        else:  # the stream is up
            if self._refused or self._unanswered:
                log.warning("signal server accepts the stream now: following its signals")
                self._refused = self._unanswered = False
            self.stats.connected = True
            if seen.step is not None:
                self.stats.signals += 1
                if self.metrics is not None:
                    self.metrics.observe_head(seen.step, seen.committed_at)

    def _lost(self, seen: StepSeen) -> None:
        self.stats.signal_failures += 1
        if self.metrics is not None:
            self.metrics.observe_failure("signal")
        if isinstance(seen.error, SignalRejected):
            # a refusal (a wrong or missing token, an unknown run) lasts until someone fixes it:
            # say so once, with the fix, then only at DEBUG while it keeps being refused
            if self._refused:
                log.debug("signal server still refuses the stream: %s", seen.error)
            else:
                log.warning(
                    "signal server refused the stream; following by polling the store every %g s, and "
                    "retrying the stream quietly (at most every %g s) until it is accepted: %s",
                    self.options.poll_interval,
                    self.options.reconnect_backoff[1],
                    seen.error,
                )
            self._refused = True
        elif self.stats.connected:
            log.warning("signal stream lost, polling the store meanwhile: %s", seen.error)
        elif not self._unanswered:
            # never reached yet: say once that following goes on by polling, then only at DEBUG
            log.warning(
                "signal server %s does not answer (%s); following by polling the store every %g s until it answers",
                self.options.signal_url,
                seen.error,
                self.options.poll_interval,
            )
            self._unanswered = True
        else:
            log.debug("signal server still does not answer: %s", seen.error)
        self.stats.connected = False

    # -------------------------------------------------------- fleet view

    def run_name(self) -> str | None:
        """The run's name: the one given, else the store's (None while nothing is committed)."""
        if self.options.run is not None:
            return self.options.run
        try:
            return Head.from_json(self.fetcher.store.get_bounded(HEAD_KEY, MAX_HEAD_BYTES)).run_id
        except DeltaSyncError:
            pass
        try:
            latest = self.fetcher.latest_step()
            if latest is not None:
                return self.fetcher.reader.committed(latest).manifest.run_id
        except DeltaSyncError:
            pass
        return None

    @property
    def reporter(self) -> FleetReporter | None:
        """The fleet view's reporter of the target (None: not reporting, or the run's name not known yet)."""
        return self._reporter

    def report(self, step: int | None, state: ReplicaState, error: str | None = None) -> None:
        """Tell the fleet view what the target serves (with ``replica`` and ``signal_url`` only)."""
        reporter = self._fleet_reporter()
        if reporter is None:
            return
        digest = None
        if step is not None:
            with contextlib.suppress(DeltaSyncError):  # the digest is a nicety: the step is what counts
                digest = self.fetcher.reader.committed(step).digest
        reporter.update(step, state, digest=digest, last_error=error)

    def _fleet_reporter(self) -> FleetReporter | None:
        """The fleet reporter, made once the run's name is known (None: not reporting, or not yet)."""
        o = self.options
        if self._reporter is not None or not self._reporting or o.signal_url is None:
            return self._reporter
        name = self.run_name()
        if name is None:
            return None  # nothing committed yet: the run's name is not known
        try:
            self._reporter = FleetReporter(
                o.signal_url,
                name,
                o.report_token or o.token,
                replica=o.replica,
                heartbeat=o.report_heartbeat,
                transport=self.transport,
            )
        except SignalRejected as exc:
            self._reporting = False
            log.warning("not reporting to the fleet view: %s", exc)
        return self._reporter


def follow(
    fetcher: Followed,
    target: Any,
    *,
    signal_url: str | None = None,
    token: str | None = None,
    run: str | None = None,
    until_step: int | None = None,
    stop: threading.Event | None = None,
    poll_interval: float = 2.0,
    on_step: Callable[[int], None] | None = None,
    heartbeat: float | None = None,
    store_check_interval: float = 30.0,
    reconnect_backoff: tuple[float, float] = (0.5, 15.0),
    transport: httpx.BaseTransport | None = None,
    stats: FollowStats | None = None,
    config_from: str | os.PathLike[str] | None = None,
    metrics: SyncMetrics | None = None,
    replica: str | None = None,
    report_token: str | None = None,
    report_heartbeat: float = 10.0,
) -> int | None:
    """Keep ``target`` at the newest committed step until ``until_step`` is reached or ``stop`` is set:
    a :class:`Follower` of these :class:`FollowOptions` (where each option is described), run.

    stop, on_step, metrics, stats, transport: see :class:`Follower`. Returns the step the target is at
    (None if the run never had a step). Errors of one apply are logged and retried; an
    :class:`InventoryMismatch` (the target cannot hold this run) is raised.
    """
    options = FollowOptions(
        signal_url=signal_url,
        token=token,
        run=run,
        until_step=until_step,
        poll_interval=poll_interval,
        heartbeat=heartbeat,
        store_check_interval=store_check_interval,
        reconnect_backoff=reconnect_backoff,
        replica=replica,
        report_token=report_token,
        report_heartbeat=report_heartbeat,
        config_from=config_from,
    )
    follower = Follower(
        fetcher, target, options, stop=stop, on_step=on_step, metrics=metrics, stats=stats, transport=transport
    )
    return follower.run()
