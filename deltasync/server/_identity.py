"""Who holds each replica id of a run's fleet: the identity rules of reports and goodbyes (docs/fleet.md).

A report comes *bound* (a replica token of that replica, or the publish token) or *unbound* (the
shared report or subscribe token). :class:`ReplicaClaims` remembers, for each live replica id, whether
a bound reporter holds it and, for an unbound one, the hash of the lease secret it reports with
(header ``Deltasync-Lease``, drawn by each :class:`~deltasync.signal.FleetReporter` at start):

- a bound report always goes through, and binds the id (an unbound holder loses it);
- an unbound report or goodbye for an id a bound reporter holds is refused (403);
- an unbound report or goodbye for an id another lease holds is refused (409): another reporter
  picked the same id. An unbound holder without a lease (a reporter older than leases) protects
  nothing: any report takes its id over, as before leases;
- the publish token (the operator) may report or remove any id.

A claim lives exactly as long as the fleet book's entry it was recorded with (the same
``last_seen`` and ``ttl_s``, the same clock), and goes when the replica leaves. Claims are recorded
only for entries the book accepted, so they are bounded like the book (``max_replicas`` per run,
``max_runs`` runs); an eviction guard keeps that bound even if the two were ever out of step.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["IdentityRefused", "ReplicaClaims"]

T = TypeVar("T")


class IdentityRefused(Exception):
    """A report or goodbye for a replica id held by another credential (403) or another lease (409)."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


@dataclass(slots=True)
class _Claim:
    bound: bool
    lease: bytes | None  # sha256 of the unbound holder's lease (None: it sent none)
    last_seen: float
    ttl_s: float

    def alive(self, now: float) -> bool:
        return now - self.last_seen <= self.ttl_s


def _hash(lease: str | None) -> bytes | None:
    return None if lease is None else hashlib.sha256(lease.encode()).digest()


class ReplicaClaims:
    """The holder of every live replica id, per run (thread-safe; ``clock`` as the fleet book's)."""

    def __init__(self, *, clock: Callable[[], float], max_replicas: int, max_runs: int) -> None:
        self.clock = clock
        self.max_replicas = max_replicas
        self.max_runs = max_runs
        self._lock = threading.Lock()
        self._runs: dict[str, dict[str, _Claim]] = {}

    def _live(self, run: str, replica: str, now: float) -> _Claim | None:
        claims = self._runs.get(run)
        c = None if claims is None else claims.get(replica)
        if c is not None and not c.alive(now):
            del claims[replica]  # type: ignore[union-attr]
            c = None
        return c

    def _check(self, run: str, replica: str, bound: bool, lease: bytes | None, now: float, what: str) -> None:
        if bound:
            return
        held = self._live(run, replica, now)
        if held is None:
            return
        if held.bound:
            raise IdentityRefused(
                403,
                f"replica {replica!r} of run {run!r} is held by its replica token: {what} it with that token "
                f"(`deltasync replica-token --run {run} --replica {replica}` mints it with the server's key), "
                "or pick another replica id",
            )
        if held.lease is not None and (lease is None or not hmac.compare_digest(held.lease, lease)):
            raise IdentityRefused(
                409,
                f"replica id {replica!r} of run {run!r} is held by another reporter (another lease); pick another "
                f"replica id, or wait ttl_s ({held.ttl_s:g} s) after its last report for it to age out",
            )

    def report(
        self,
        run: str,
        replica: str,
        *,
        bound: bool,
        lease: str | None,
        record: Callable[[], T],
        seen: Callable[[T], tuple[float, float]],
    ) -> T:
        """Admit a report of ``replica`` (``bound``: with its replica token or the publish token;
        ``lease``: the reporter's lease secret, if it sent one), else an :class:`IdentityRefused`.

        ``record`` records the report in the fleet book (its exceptions pass through, and nothing is
        claimed); ``seen`` gives the ``(last_seen, ttl_s)`` of what it returned, the claim's life.
        """
        h = _hash(lease)
        with self._lock:
            self._check(run, replica, bound, h, self.clock(), "report")
            out = record()
            last_seen, ttl_s = seen(out)
            self._hold(run, replica, _Claim(bound, None if bound else h, last_seen, ttl_s))
            return out

    def leave(self, run: str, replica: str, *, bound: bool, lease: str | None, remove: Callable[[], T]) -> T:
        """Admit a goodbye of ``replica`` (as :meth:`report`), run ``remove`` and free the id."""
        with self._lock:
            self._check(run, replica, bound, _hash(lease), self.clock(), "remove")
            out = remove()
            claims = self._runs.get(run)
            if claims is not None:
                claims.pop(replica, None)
                if not claims:
                    del self._runs[run]
            return out

    def _hold(self, run: str, replica: str, claim: _Claim) -> None:
        now = self.clock()
        claims = self._runs.get(run)
        if claims is None:
            if len(self._runs) >= self.max_runs:
                self._sweep(now)
            claims = self._runs.setdefault(run, {})
        if replica not in claims and len(claims) >= self.max_replicas:
            for k in [k for k, c in claims.items() if not c.alive(now)]:
                del claims[k]
            if len(claims) >= self.max_replicas:  # only if the book and the claims disagree: the stalest goes
                del claims[min(claims, key=lambda k: claims[k].last_seen)]
        claims[replica] = claim

    def _sweep(self, now: float) -> None:
        for run in list(self._runs):
            claims = self._runs[run]
            for k in [k for k, c in claims.items() if not c.alive(now)]:
                del claims[k]
            if not claims:
                del self._runs[run]
        while len(self._runs) >= self.max_runs:  # as in _hold: the run seen least recently goes
            del self._runs[min(self._runs, key=lambda r: max(c.last_seen for c in self._runs[r].values()))]

    def holder(self, run: str, replica: str) -> str | None:
        """``"bound"``, ``"lease"``, ``"unbound"`` (no lease) or None: who holds ``replica`` now (tests, docs)."""
        with self._lock:
            c = self._live(run, replica, self.clock())
            if c is None:
                return None
            return "bound" if c.bound else "lease" if c.lease is not None else "unbound"

    def __len__(self) -> int:
        """Claims held (live or not yet pruned), over every run."""
        with self._lock:
            return sum(len(c) for c in self._runs.values())
