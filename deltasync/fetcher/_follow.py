"""Follow a run: apply each new committed step as soon as it is signalled.

The signal server (SSE) is a fast hint; the store is the truth. Waiting for the next step is
:class:`deltasync.signal.StepWatcher`'s job: when the server is unreachable it polls the store's
``HEAD.json`` (and now and then the manifest listing) every ``poll_interval`` seconds and keeps
reconnecting with backoff; a resumed stream replays the commits it missed (``Last-Event-ID``).
The loop around it is the one :class:`deltasync.signal.FollowLoop`. This module says what following
a target means: apply the newest step (a failed one again at the next observation), count it,
record metrics, and (with ``replica``) report what the target serves to the signal server's fleet view.
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
from deltasync.signal import Attempt, FleetReporter, FollowLoop, StepSeen, StepWatcher, StorePoller

if TYPE_CHECKING:
    import httpx

    from deltasync.fetcher._stats import SyncStats
    from deltasync.fetcher.metrics import SyncMetrics
    from deltasync.run import RunReader
    from deltasync.storage import Store

__all__ = ["FollowStats", "Followed", "follow"]

log = logging.getLogger("deltasync.follow")


class Followed(Protocol):
    """What :func:`follow` uses of a :class:`~deltasync.DeltaFetcher` (a Protocol, so that the
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


def _dir_step(out: Path) -> int | None:
    try:
        return int(json.loads((out / MARKER).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


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
    """Keep ``target`` at the newest committed step until ``until_step`` is reached or ``stop`` is set.

    target: an nn.Module / dict of tensors (updated in place with
        :meth:`DeltaFetcher.sync`) or a directory path (rewritten with
        :meth:`DeltaFetcher.materialize`).
    signal_url, token, run: the signal server, a subscribe token, and the run
        name (default: the store's run id, read from ``HEAD.json`` or the newest
        manifest). Without ``signal_url`` the store is polled.
    poll_interval: seconds between store polls while the server is unreachable.
    heartbeat: keep-alive interval asked of the server (default
        ``min(poll_interval, 5)``); also bounds how late ``stop`` is noticed.
    store_check_interval: while the stream is up, the store's HEAD is still
        read this often, in case a signal was lost.
    on_step: called with each step reached.
    config_from: a dir target only: copy this HF model dir's config and tokenizer files into
        every version (see :meth:`DeltaFetcher.materialize`); checked before anything else.
    metrics: a :class:`~deltasync.fetcher.metrics.SyncMetrics` to record the head seen, each step reached
        (with :attr:`DeltaFetcher.last_stats` for tensor targets; step and seconds for a dir) and
        failures (``apply``, ``signal``, ``store``).
    replica: with ``signal_url``, report the target to the signal server's fleet view as this
        replica (:class:`~deltasync.signal.FleetReporter`): its step and manifest digest, ``failed``
        with the error after a failed apply, every ``report_heartbeat`` seconds; it leaves the
        fleet when ``follow`` returns. ``report_token``: the token of the reports (default ``token``).

    Returns the step the target is at (None if the run never had a step).
    Errors of one apply are logged and retried; an :class:`InventoryMismatch`
    (the target cannot hold this run) is raised.
    """
    stop = stop or threading.Event()
    st = stats if stats is not None else FollowStats()
    is_dir = isinstance(target, (str, os.PathLike))
    out = Path(target) if is_dir else None
    if out is not None and out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MARKER).is_file())):
        raise StorageError(f"refusing to follow into {out}: it exists and was not written by deltasync materialize")
    if config_from is not None:
        if out is None:
            raise ValueError("config_from applies to a directory target only")
        config_files(config_from)  # a missing dir or config.json fails now, not at every step
    current: int | None = _dir_step(out) if out is not None else fetcher.current_step(target)
    if metrics is not None and current is not None:
        metrics.observe_applied(current)

    reporter: FleetReporter | None = None
    reporting = replica is not None and signal_url is not None

    def report(step: int | None, state: str, error: str | None = None) -> None:
        nonlocal reporter, reporting
        if not reporting or replica is None or signal_url is None:
            return
        if reporter is None:
            name = run_name()
            if name is None:
                return  # nothing committed yet: the run's name is not known
            try:
                reporter = FleetReporter(
                    signal_url,
                    name,
                    report_token or token,
                    replica=replica,
                    heartbeat=report_heartbeat,
                    transport=transport,
                )
            except SignalRejected as exc:
                reporting = False
                log.warning("not reporting to the fleet view: %s", exc)
                return
        digest = None
        if step is not None:
            with contextlib.suppress(DeltaSyncError):  # the digest is a nicety: the step is what counts
                digest = fetcher.reader.committed(step).digest
        reporter.update(step, state, digest=digest, last_error=error)

    synced: SyncStats | None = None  # the stats of the last act, when it was a sync (a dir leaves none)

    def act(step: int) -> None:
        nonlocal current, synced
        before = fetcher.last_stats
        if out is not None:
            fetcher.materialize(out, step=step, config_from=config_from)
        else:
            fetcher.sync(target, step=step)
        current = step
        reached = fetcher.last_stats
        synced = reached if reached is not None and reached is not before and reached.step == step else None

    def applied(a: Attempt) -> None:
        if a.error is not None:
            st.apply_failures += 1
            if metrics is not None:
                metrics.observe_failure("apply")
            log.warning("cannot apply step %d yet (will retry): %s", a.step, a.error)
            report(current, "failed", f"step {a.step}: {type(a.error).__name__}: {a.error}")
            return
        st.applied += 1
        if metrics is not None:
            if synced is not None:
                metrics.observe_sync(synced)
            else:  # a dir: materialize leaves no stats
                metrics.observe_applied(a.step, seconds=a.seconds)
        report(a.step, "serving")
        if on_step is not None:
            on_step(a.step)

    poller = StorePoller(fetcher.store, fetcher.latest_step)

    def store_latest() -> int | None:
        st.polls += 1
        try:
            return poller()
        except DeltaSyncError as exc:
            if metrics is not None:
                metrics.observe_failure("store")
            log.warning("cannot list the store: %s", exc)
            return None

    def run_name() -> str | None:
        if run is not None:
            return run
        try:
            return Head.from_json(fetcher.store.get_bounded(HEAD_KEY, MAX_HEAD_BYTES)).run_id
        except DeltaSyncError:
            pass
        try:
            latest = fetcher.latest_step()
            if latest is not None:
                return fetcher.reader.committed(latest).manifest.run_id
        except DeltaSyncError:
            pass
        return None

    watcher = StepWatcher(
        store_latest,
        signal_url=signal_url,
        token=token,
        run=run_name,
        heartbeat=heartbeat if heartbeat is not None else max(0.2, min(poll_interval, 5.0)),
        poll_interval=poll_interval,
        store_check_interval=store_check_interval,
        reconnect=RetryPolicy(retries=0, backoff=reconnect_backoff[0], max_backoff=reconnect_backoff[1]),
        transport=transport,
        stop=stop,
        clock=time.monotonic,
    )
    refused = False  # the server refused the stream last time (warned once; quiet until it accepts)

    def observe(seen: StepSeen) -> None:
        nonlocal refused
        if reporter is None and reporting:
            report(current, "starting" if current is None else "serving")  # the run's name may be known now
        if seen.kind == "lost":
            st.signal_failures += 1
            if metrics is not None:
                metrics.observe_failure("signal")
            if isinstance(seen.error, SignalRejected):
                # a refusal (a wrong or missing token, an unknown run) lasts until someone fixes it:
                # say so once, with the fix, then only at DEBUG while it keeps being refused
                if refused:
                    log.debug("signal server still refuses the stream: %s", seen.error)
                else:
                    log.warning(
                        "signal server refused the stream; following by polling the store every %g s, and "
                        "retrying the stream quietly (at most every %g s) until it is accepted: %s",
                        poll_interval,
                        reconnect_backoff[1],
                        seen.error,
                    )
                refused = True
            elif st.connected:
                log.warning("signal stream lost, polling the store meanwhile: %s", seen.error)
            else:
                log.info("signal server unavailable, polling the store: %s", seen.error)
            st.connected = False
        elif seen.kind == "store":
            if metrics is not None and seen.step is not None:
                metrics.observe_head(seen.step)
        else:  # the stream is up
            if refused:
                log.warning("signal server accepts the stream now: following its signals")
                refused = False
            st.connected = True
            if seen.step is not None:
                st.signals += 1
                if metrics is not None:
                    metrics.observe_head(seen.step, seen.committed_at)

    report(current, "starting" if current is None else "serving")
    loop = FollowLoop(
        watcher,
        act,
        held=lambda: current,
        observe=observe,
        report=applied,
        fatal=(InventoryMismatch,),
        until=until_step,
    )
    try:
        return loop.run()
    finally:
        st.connected = False
        if reporter is not None:
            reporter.close()
