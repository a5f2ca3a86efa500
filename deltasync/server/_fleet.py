"""The fleet book: what each replica of a run last said it serves, kept in memory, ageing out.

Receivers (``deltasync follow``, the vLLM driver, the vLLM backend) report their replica's step,
state digest, state and last error at each change and as a heartbeat
(:class:`deltasync.signal.FleetReporter`). A replica that has not reported for its time to live
(``ttl_s`` of its report, else the server's ``fleet_ttl_s``) is dropped at the next read or
write: a dead engine leaves the fleet by itself. The book is bounded (``max_replicas`` per run,
``max_fleet_runs`` runs) and not persisted: after a restart of the server the fleet is rebuilt
by the next round of heartbeats. When a run is full, a new *bound* replica (its report bound to
its identity) takes the place of the unbound replica seen longest ago: a flood of unbound
reports cannot lock bound replicas out.

The lag of a replica is computed when the fleet is read, against the run's head (the newest
signalled commit): ``head - step``. The replicas' agreement is kept incrementally: a report may
carry the replica's last behavioural audit; its fingerprint is parsed once, when it arrives, and
the audited step is marked dirty only when the audit (step or fingerprint) or the replica's
binding changes, not at a heartbeat. A reader (:meth:`FleetBook.view`, :meth:`FleetBook.state_counts`,
called from a worker thread, never the event loop) regroups the dirty steps only
(:func:`deltasync.protocol.audit.group_step`, O(n) vector comparisons per step) under the run's
own tolerance (:meth:`FleetBook.set_tolerance`, never a report's) and shows a ``serving`` replica
that is the odd one out as ``diverged`` (docs/audit.md, docs/fleet.md "Scale").
"""

from __future__ import annotations

import json
import math
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from deltasync.errors import ProtocolError
from deltasync.protocol.audit import (
    DEFAULT_TOLERANCE,
    AuditReport,
    FingerprintGroup,
    group_step,
    parse_fingerprint,
)
from deltasync.signal import REPLICA_STATES, ReplicaState

__all__ = ["FleetBook", "FleetFull", "Replica", "Shown", "shown"]


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
    #: whether its report was bound to its identity (a per-replica credential): bound replicas
    #: decide the agreement at a step where any is audited
    bound: bool = False
    #: why its last behavioural audit could not run (None: it ran, or none is configured)
    audit_error: str | None = None

    def alive(self, now: float) -> bool:
        """Whether the replica reported within its time to live."""
        return now - self.last_seen <= self.ttl_s


@dataclass(frozen=True, slots=True)
class Shown:
    """A replica as the fleet view shows it: its state (a ``serving`` odd one out shows
    ``diverged``) and fingerprint group."""

    replica: Replica
    state: ReplicaState
    group: FingerprintGroup | None
    #: the fields that change only with a report (replica, step, digest, last_error, since,
    #: last_seen, ttl_s, audit, audit_error) as a JSON object's members, rendered once per report
    fragment: bytes = b""


@dataclass(slots=True)
class _Run:
    """One run's replicas, their parsed fingerprints and the cached groups per audited step."""

    replicas: dict[str, Replica] = field(default_factory=dict)
    #: replica -> (audited step, probe tag, segment values), parsed once per audit change
    parsed: dict[str, tuple[int, str, npt.NDArray[np.int32]]] = field(default_factory=dict)
    #: audited step -> replicas audited at it
    by_step: dict[int, set[str]] = field(default_factory=dict)
    #: steps whose groups are out of date
    dirty: set[int] = field(default_factory=set)
    #: audited step -> replica -> its group (fresh for the steps not in ``dirty``)
    groups: dict[int, dict[str, FingerprintGroup]] = field(default_factory=dict)
    #: replica -> its audit as JSON (rendered when the audit changes, not at each read)
    audit_json: dict[str, str] = field(default_factory=dict)
    #: replica -> :attr:`Shown.fragment` (rendered at each report: a heartbeat moves ``last_seen``)
    fragments: dict[str, bytes] = field(default_factory=dict)
    #: bumped by every change of what the fleet shows but ``last_seen`` (a state, an audit, a group,
    #: a replica joining or leaving): the metrics' caches are keyed on it
    version: int = 0
    #: no replica ages out before this (a lower bound: a heartbeat only moves its replica's expiry
    #: later), so that a report scans the run's replicas only once one may have
    next_expiry: float = math.inf
    #: the shown states' counts at ``counts[0]`` == ``version``
    counts: tuple[int, dict[ReplicaState, int]] | None = None

    def forget_audit(self, rid: str) -> None:
        old = self.parsed.pop(rid, None)
        if old is not None:
            members = self.by_step[old[0]]
            members.discard(rid)
            self.dirty.add(old[0])
            if not members:
                del self.by_step[old[0]]

    def drop(self, rid: str) -> None:
        del self.replicas[rid]
        self.audit_json.pop(rid, None)
        self.fragments.pop(rid, None)
        self.forget_audit(rid)
        self.version += 1


def _same_audit(a: AuditReport | None, b: AuditReport | None) -> bool:
    """Whether two audits group the same (the divergence and a report's tolerance do not count)."""
    if a is None or b is None:
        return a is b
    return a.audited_step == b.audited_step and a.fingerprint == b.fingerprint


class FleetBook:
    """The replicas of every run (thread-safe; ``clock`` is the server's wall clock, injectable).

    ``on_expire`` / ``on_evict`` are told how many replicas aged out / were evicted by a bound
    replica. ``recomputes`` counts the (run, step) regroupings and ``comparisons`` the fingerprint
    vector comparisons they made: the work a read costs, for tests and benchmarks.
    """

    def __init__(
        self,
        *,
        ttl_s: float,
        max_replicas: int,
        max_runs: int,
        clock: Callable[[], float],
        on_expire: Callable[[int], None],
        on_evict: Callable[[int], None] | None = None,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_replicas = max_replicas
        self.max_runs = max_runs
        self.clock = clock
        self._on_expire = on_expire
        self._on_evict = on_evict
        self._lock = threading.Lock()
        #: serializes regroupings: concurrent readers wait for one, not compute twice
        self._compute = threading.Lock()
        self._runs: dict[str, _Run] = {}
        self._tolerance: dict[str, float] = {}
        self.recomputes = 0
        self.comparisons = 0

    # ------------------------------------------------------------------ bookkeeping (under _lock)

    def _prune_run(self, run: str, now: float) -> int:
        book = self._runs.get(run)
        if book is None or now < book.next_expiry:  # nobody can have aged out yet: no scan
            return 0
        dead = [k for k, r in book.replicas.items() if not r.alive(now)]
        for k in dead:
            book.drop(k)
        book.next_expiry = min((r.last_seen + r.ttl_s for r in book.replicas.values()), default=math.inf)
        if not book.replicas:
            del self._runs[run]
        return len(dead)

    def _prune(self, now: float, run: str | None = None) -> None:
        """Drop the replicas past their time to live: of ``run`` only (a request's), or of every run."""
        runs = [run] if run is not None else list(self._runs)
        expired = sum(self._prune_run(r, now) for r in runs)
        if expired:
            self._on_expire(expired)

    def _make_room(self, run: str, book: _Run, bound: bool) -> None:
        """Room for a new replica in a full run: a bound one evicts the unbound one seen longest ago."""
        if len(book.replicas) < self.max_replicas:
            return
        victim = None
        if bound:
            unbound = [r for r in book.replicas.values() if not r.bound]
            victim = min(unbound, key=lambda r: (r.last_seen, r.replica), default=None)
        if victim is None:
            raise FleetFull(
                f"run {run!r} has {self.max_replicas} live replicas already (the server's max_replicas); "
                "retry once one has left or aged out"
            )
        book.drop(victim.replica)
        if self._on_evict is not None:
            self._on_evict(1)

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
        bound: bool = False,
        audit_error: str | None = None,
    ) -> tuple[Replica, bool]:
        """Record a report; returns the replica's entry and whether it (re)joined the fleet with it.

        ``bound``: the report was authenticated by the replica's own credential. ``audit_error``: why
        its last audit could not run (shown as is: the route escaped it). A new or changed
        audit is parsed here (once); a heartbeat with the same audit changes no group.
        Raises :class:`FleetFull` for a new replica of a full run (unless a bound one can evict an
        unbound one), or a new run past the bound.
        """
        known = self._runs.get(run)  # a peek (no lock): a heartbeat repeating its audit is not parsed again
        seen = None if known is None else known.replicas.get(replica)
        same = seen is not None and _same_audit(seen.audit, audit)
        parsed = None if audit is None or same else parse_fingerprint(audit.fingerprint)
        with self._lock:
            now = self.clock()
            self._prune(now, run)
            book = self._runs.get(run)
            if book is None and len(self._runs) >= self.max_runs:
                self._prune(now)  # other runs' fleets may have aged out entirely
            if book is None:
                if len(self._runs) >= self.max_runs:
                    raise FleetFull(f"the server tracks the fleets of {self.max_runs} runs already; retry later")
                book = _Run()
            old = book.replicas.get(replica)
            if old is None:
                self._make_room(run, book, bound)
            if old is not None and old.audit is not None and audit is not None and old.audit == audit:
                audit = old.audit  # one object per audit, however many heartbeats repeat it
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
                bound,
                audit_error,
            )
            if audit is None:
                book.audit_json.pop(replica, None)
            elif old is None or audit is not old.audit:
                book.audit_json[replica] = _audit_json(audit)
            regroup = old is None or old.bound != bound or not _same_audit(old.audit, audit)
            book.replicas[replica] = entry
            book.next_expiry = min(book.next_expiry, now + entry.ttl_s)
            book.fragments[replica] = _fragment(entry, book.audit_json.get(replica))
            if old is None or regroup or old.state != state or old.audit is not audit or old.audit_error != audit_error:
                book.version += 1
            if regroup:
                book.forget_audit(replica)
                if audit is not None and parsed is None:  # another report changed it since the peek
                    parsed = parse_fingerprint(audit.fingerprint)
                if audit is not None and parsed is not None:
                    book.parsed[replica] = (audit.audited_step, parsed[0], parsed[1])
                    book.by_step.setdefault(audit.audited_step, set()).add(replica)
                    book.dirty.add(audit.audited_step)
            self._runs[run] = book
            return entry, old is None

    def fragment(self, run: str, replica: str) -> bytes:
        """The replica's :attr:`Shown.fragment` as its last report rendered it (KeyError: not in the book)."""
        return self._runs[run].fragments[replica]

    def leave(self, run: str, replica: str) -> bool:
        """Remove a replica (it shut down cleanly); whether it was there."""
        with self._lock:
            self._prune(self.clock(), run)
            book = self._runs.get(run)
            if book is None or replica not in book.replicas:
                return False
            book.drop(replica)
            if not book.replicas:
                del self._runs[run]
            return True

    def set_tolerance(self, run: str, tolerance: float) -> None:
        """The fingerprint tolerance (nats) the run's replicas are grouped with: its policy's.

        Reports cannot set it (a report's ``tolerance`` is shown, never used to group).
        """
        if not 0 <= tolerance <= 100:
            raise ProtocolError(
                f"fingerprint tolerance must be in [0, 100] nats, got {tolerance!r}: fix the run's audit policy"
            )
        with self._lock:
            if self._tolerance.get(run, DEFAULT_TOLERANCE) == tolerance:
                return
            self._tolerance[run] = tolerance
            book = self._runs.get(run)
            if book is not None:
                book.dirty |= set(book.by_step)

    def tolerance(self, run: str) -> float:
        """The run's fingerprint tolerance (:data:`~deltasync.protocol.audit.DEFAULT_TOLERANCE` unless set)."""
        with self._lock:
            return self._tolerance.get(run, DEFAULT_TOLERANCE)

    # ------------------------------------------------------------------ reads

    def _regroup(self, runs: Sequence[str]) -> None:
        """Regroup the dirty steps of ``runs`` (blocking: call it from a worker thread)."""
        with self._compute:
            for run in runs:
                with self._lock:
                    book = self._runs.get(run)
                    if book is None or not book.dirty:
                        continue
                    tolerance = self._tolerance.get(run, DEFAULT_TOLERANCE)
                    work = []
                    for step in sorted(book.dirty):
                        ids = book.by_step.get(step, set())
                        vectors = {rid: book.parsed[rid][1:] for rid in ids}
                        bound = {rid for rid in ids if book.replicas[rid].bound}
                        work.append((step, vectors, bound))
                    book.dirty.clear()
                results = []
                for step, vectors, bound in work:
                    counted: list[int] = []
                    groups = group_step(step, vectors, tolerance, bound, on_compare=counted.append)
                    results.append((step, groups, sum(counted)))
                with self._lock:
                    for step, groups, compared in results:
                        self.recomputes += 1
                        self.comparisons += compared
                        if groups:
                            book.groups[step] = groups
                        else:
                            book.groups.pop(step, None)
                    book.version += 1

    def view(self, run: str) -> tuple[float, list[Shown]]:
        """The clock's now and the live replicas of ``run`` as shown, sorted by id (regroups the
        dirty steps first: blocking, call it from a worker thread)."""
        with self._lock:
            self._prune(self.clock(), run)
        self._regroup([run])
        with self._lock:  # a snapshot (references, no copies of entries); the rows are built outside
            now = self.clock()
            self._prune(now, run)
            book = self._runs.get(run)
            if book is None:
                return now, []
            entries = list(book.replicas.values())
            groups = dict(book.groups)
            fragments = dict(book.fragments)
        entries.sort(key=lambda r: r.replica)
        return now, [_shown(r, groups, fragments) for r in entries]

    def grouped(self, run: str) -> bool:
        """Whether ``run``'s groups are up to date (a read regroups nothing): a reader may then
        build the view where it runs, without a worker thread."""
        with self._lock:
            book = self._runs.get(run)
            return book is None or not book.dirty

    def counted(self, versions: dict[str, int]) -> bool:
        """Whether the metrics' figures are up to date: no run has a step to regroup, every run's
        state counts are cached, and ``versions`` (what a caller's own caches were built at) are the
        runs' versions. Then a scrape computes nothing and needs no worker thread."""
        with self._lock:
            self._prune(self.clock())
            return versions == {run: b.version for run, b in self._runs.items()} and all(
                not b.dirty and b.counts is not None and b.counts[0] == b.version for b in self._runs.values()
            )

    def versions(self) -> dict[str, int]:
        """Every run's :attr:`_Run.version`: what a cache of its shown fleet (but ``last_seen``) is keyed on."""
        with self._lock:
            self._prune(self.clock())
            return {run: book.version for run, book in self._runs.items()}

    def replicas(self, run: str) -> tuple[float, list[Replica]]:
        """The clock's now and the live replicas of ``run``, sorted by id."""
        with self._lock:
            now = self.clock()
            self._prune(now, run)
            book = self._runs.get(run)
            return now, [] if book is None else [r for _, r in sorted(book.replicas.items())]

    def runs(self) -> tuple[float, dict[str, list[Replica]]]:
        """The clock's now and every run's live replicas (for the metrics)."""
        with self._lock:
            now = self.clock()
            self._prune(now)
            return now, {run: list(book.replicas.values()) for run, book in sorted(self._runs.items())}

    def state_counts(self) -> dict[str, dict[ReplicaState, int]]:
        """Every run's live replicas counted by the state the fleet shows (for the metrics; regroups
        dirty steps first, once however many scrapes ask: call it from a worker thread)."""
        with self._lock:
            self._prune(self.clock())
            runs = [run for run, book in self._runs.items() if book.dirty]
        self._regroup(runs)
        out: dict[str, dict[ReplicaState, int]] = {}
        with self._lock:
            todo = {
                run: (book, book.version, list(book.replicas.values()), dict(book.groups))
                for run, book in self._runs.items()
                if book.counts is None or book.counts[0] != book.version
            }
        for run, (book, version, entries, groups) in todo.items():  # counted outside the lock
            c = Counter(_shown(r, groups, {}).state for r in entries)
            counted = {s: c.get(s, 0) for s in REPLICA_STATES}
            with self._lock:
                if book.version == version:
                    book.counts = (version, counted)
            out[run] = counted
        with self._lock:
            for run, book in self._runs.items():
                if run not in out and book.counts is not None:
                    out[run] = book.counts[1]
        return dict(sorted(out.items()))


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


def _audit_json(a: AuditReport) -> str:
    """The audit as the fleet view's JSON (``AuditBody``'s fields; a non-finite number as null)."""
    d = a.divergence
    body = {
        "audited_step": a.audited_step,
        "fingerprint": a.fingerprint,
        "divergence": None
        if d is None
        else {"mean_abs": _finite(d.mean_abs), "max_abs": _finite(d.max_abs), "kl": _finite(d.kl)},
        "tolerance": _finite(a.tolerance),
    }
    return json.dumps(body, separators=(",", ":"), allow_nan=False)


def _json_float(v: float) -> str:
    return repr(float(v)) if math.isfinite(v) else "null"


def _fragment(r: Replica, audit_json: str | None) -> bytes:
    """:attr:`Shown.fragment` of ``r`` (strings through ``json.dumps``: every character escaped)."""
    return (
        f'"replica":{json.dumps(r.replica)},"step":{"null" if r.step is None else int(r.step)},'
        f'"digest":{json.dumps(r.digest)},"last_error":{json.dumps(r.last_error)},'
        f'"since":{_json_float(r.since)},"last_seen":{_json_float(r.last_seen)},"ttl_s":{_json_float(r.ttl_s)},'
        f'"audit":{audit_json or "null"},"audit_error":{json.dumps(r.audit_error)}'
    ).encode()


def _shown(r: Replica, groups: dict[int, dict[str, FingerprintGroup]], fragments: dict[str, bytes]) -> Shown:
    g = None
    if r.audit is not None:
        g = groups.get(r.audit.audited_step, {}).get(r.replica)
    state: ReplicaState = "diverged" if g is not None and g.odd_one_out and r.state == "serving" else r.state
    return Shown(r, state, g, fragments.get(r.replica, b""))


def shown(
    replicas: Sequence[Replica], tolerance: float = DEFAULT_TOLERANCE
) -> list[tuple[Replica, ReplicaState, FingerprintGroup | None]]:
    """Each replica with the state the fleet shows and its fingerprint group, grouped from scratch
    (the book's :meth:`FleetBook.view` keeps them incrementally): the state it reported, except that
    a ``serving`` replica whose fingerprint is the odd one out at its audited step shows ``diverged``."""
    book = _Run()
    for r in replicas:
        book.replicas[r.replica] = r
        if r.audit is not None:
            tag, vec = parse_fingerprint(r.audit.fingerprint)
            book.parsed[r.replica] = (r.audit.audited_step, tag, vec)
            book.by_step.setdefault(r.audit.audited_step, set()).add(r.replica)
    for step, ids in book.by_step.items():
        vectors = {rid: book.parsed[rid][1:] for rid in ids}
        bound = {rid for rid in ids if book.replicas[rid].bound}
        book.groups[step] = group_step(step, vectors, tolerance, bound)
    out = []
    for r in replicas:
        s = _shown(r, book.groups, {})
        out.append((r, s.state, s.group))
    return out
