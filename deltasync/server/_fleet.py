"""The fleet book: what each replica of a run last said it serves, kept in memory, ageing out.

Receivers (``deltasync follow``, the vLLM driver, the vLLM backend) report their replica's step,
state digest, state and last error at each change and as a heartbeat
(:class:`deltasync.signal.FleetReporter`). A replica that has not reported for its time to live
(``ttl_s`` of its report, else the server's ``fleet_ttl_s``) is dropped at the next read or
write: a dead engine leaves the fleet by itself. The book is bounded (``max_replicas`` per run,
``max_fleet_runs`` runs) and not persisted: after a restart of the server the fleet is rebuilt
by the next round of heartbeats.

The lag of a replica is computed when the fleet is read, against the run's head (the newest
signalled commit): ``head - step``. So is the replicas' agreement: a report may carry the replica's
last behavioural audit (fingerprint, divergence, audited step); :func:`shown` groups a run's replicas
by (audited step, agreeing fingerprint) and shows a ``serving`` replica that is the odd one out as
``diverged`` (docs/audit.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from deltasync.protocol.audit import AuditReport, FingerprintGroup, group_fingerprints
from deltasync.signal import ReplicaState

__all__ = ["FleetBook", "FleetFull", "Replica", "shown"]


class FleetFull(Exception):
    """A report from a new replica of a run that has ``max_replicas`` live ones (or a new run past
    ``max_fleet_runs``): 429, retry once others aged out."""


@dataclass(frozen=True, slots=True)
class Replica:
    """One replica's last report."""

    replica: str
    step: int | None
    digest: str | None
    state: ReplicaState
    last_error: str | None
    ttl_s: float
    #: when the server received the first report of this replica (since it last joined), and the last one
    since: float
    last_seen: float
    #: its last behavioural audit (None: it reported none)
    audit: AuditReport | None = None

    def alive(self, now: float) -> bool:
        """Whether the replica reported within its time to live."""
        return now - self.last_seen <= self.ttl_s


class FleetBook:
    """The replicas of every run (thread-safe; ``clock`` is the server's wall clock, injectable)."""

    def __init__(
        self,
        *,
        ttl_s: float,
        max_replicas: int,
        max_runs: int,
        clock: Callable[[], float],
        on_expire: Callable[[int], None],
    ) -> None:
        self.ttl_s = ttl_s
        self.max_replicas = max_replicas
        self.max_runs = max_runs
        self.clock = clock
        self._on_expire = on_expire
        self._lock = threading.Lock()
        self._runs: dict[str, dict[str, Replica]] = {}

    def _prune_run(self, run: str, now: float) -> int:
        book = self._runs.get(run)
        if book is None:
            return 0
        dead = [k for k, r in book.items() if not r.alive(now)]
        for k in dead:
            del book[k]
        if not book:
            del self._runs[run]
        return len(dead)

    def _prune(self, now: float, run: str | None = None) -> None:
        """Drop the replicas past their time to live: of ``run`` only (a request's), or of every run."""
        runs = [run] if run is not None else list(self._runs)
        expired = sum(self._prune_run(r, now) for r in runs)
        if expired:
            self._on_expire(expired)

    def report(
        self,
        run: str,
        replica: str,
        *,
        step: int | None,
        digest: str | None,
        state: ReplicaState,
        last_error: str | None,
        ttl_s: float | None,
        audit: AuditReport | None = None,
    ) -> tuple[Replica, bool]:
        """Record a report; returns the replica's entry and whether it (re)joined the fleet with it.

        Raises :class:`FleetFull` for a new replica of a full run, or a new run past the bound.
        """
        with self._lock:
            now = self.clock()
            self._prune(now, run)
            book = self._runs.get(run)
            if book is None and len(self._runs) >= self.max_runs:
                self._prune(now)  # other runs' fleets may have aged out entirely
            if book is None:
                if len(self._runs) >= self.max_runs:
                    raise FleetFull(f"the server tracks the fleets of {self.max_runs} runs already; retry later")
                book = {}
            old = book.get(replica)
            if old is None and len(book) >= self.max_replicas:
                raise FleetFull(
                    f"run {run!r} has {self.max_replicas} live replicas already (the server's max_replicas); "
                    "retry once one has left or aged out"
                )
            entry = Replica(
                replica,
                step,
                digest,
                state,
                last_error,
                self.ttl_s if ttl_s is None else ttl_s,
                now if old is None else old.since,
                now,
                audit,
            )
            book[replica] = entry
            self._runs[run] = book
            return entry, old is None

    def leave(self, run: str, replica: str) -> bool:
        """Remove a replica (it shut down cleanly); whether it was there."""
        with self._lock:
            self._prune(self.clock(), run)
            book = self._runs.get(run)
            if book is None or replica not in book:
                return False
            del book[replica]
            if not book:
                del self._runs[run]
            return True

    def replicas(self, run: str) -> tuple[float, list[Replica]]:
        """The clock's now and the live replicas of ``run``, sorted by id."""
        with self._lock:
            now = self.clock()
            self._prune(now, run)
            return now, sorted(self._runs.get(run, {}).values(), key=lambda r: r.replica)

    def runs(self) -> tuple[float, dict[str, list[Replica]]]:
        """The clock's now and every run's live replicas (for the metrics)."""
        with self._lock:
            now = self.clock()
            self._prune(now)
            return now, {run: list(book.values()) for run, book in sorted(self._runs.items())}


def shown(replicas: Sequence[Replica]) -> list[tuple[Replica, ReplicaState, FingerprintGroup | None]]:
    """Each replica with the state the fleet shows and its fingerprint group: the state it reported,
    except that a ``serving`` replica whose fingerprint is the odd one out at its audited step shows
    ``diverged``."""
    groups = group_fingerprints({r.replica: r.audit for r in replicas if r.audit is not None})
    out: list[tuple[Replica, ReplicaState, FingerprintGroup | None]] = []
    for r in replicas:
        g = groups.get(r.replica)
        state: ReplicaState = "diverged" if g is not None and g.odd_one_out and r.state == "serving" else r.state
        out.append((r, state, g))
    return out
