"""Each run's audit policy as the fleet view uses it: read from the run's ``probes.json``, never from a report.

The fleet groups replicas' fingerprints within a tolerance (docs/audit.md). A report's own
``tolerance`` is ignored: one replica reporting ``tolerance: 100`` would otherwise agree with every
fingerprint and mask a diverged one. The tolerance is the run's policy (``probes.json``, written
once by the trainer), read from the server's store (``Settings.store_url``) when the run's first
audit report arrives: in a worker thread, never on the event loop, one read at a time per run.
Without a store, or while the policy cannot be read, it is the default
(:data:`~deltasync.protocol.audit.DEFAULT_TOLERANCE`).

A policy read is kept for good (``probes.json`` is written once); a run without ``probes.json``, or
whose read failed, keeps the default and is read again after ``retry_s``. The cache holds at most
``max_runs`` runs (the least recently used goes first).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from deltasync.protocol.audit import DEFAULT_TOLERANCE
from deltasync.run.probes import read_probes
from deltasync.storage import Store

__all__ = ["RunPolicies"]

log = logging.getLogger("deltasync.server")


@dataclass(frozen=True, slots=True)
class _Known:
    tolerance: float
    #: when to read again (None: never, the run's policy was read)
    retry_at: float | None


class RunPolicies:
    """The fingerprint tolerance of each run's audit policy (see the module doc).

    ``store_for``: the run's store (None: the server has none, every run gets the default);
    ``clock``: when to retry a failed read (``retry_s`` later); ``wait_s``: the longest a report waits
    for a read in progress.
    """

    def __init__(
        self,
        store_for: Callable[[str], Store] | None,
        *,
        clock: Callable[[], float],
        max_runs: int,
        retry_s: float = 60.0,
        wait_s: float = 5.0,
    ) -> None:
        self.store_for = store_for
        self.clock = clock
        self.max_runs = max_runs
        self.retry_s = retry_s
        self.wait_s = wait_s
        self._known: OrderedDict[str, _Known] = OrderedDict()
        self._reading: dict[str, asyncio.Task[float]] = {}

    def cached(self, run: str) -> float | None:
        """The run's tolerance if it is known and need not be read again, else None."""
        k = self._known.get(run)
        if k is None or (k.retry_at is not None and self.clock() >= k.retry_at):
            return None
        self._known.move_to_end(run)
        return k.tolerance

    async def tolerance(self, run: str) -> float:
        """The run's fingerprint tolerance: its policy's, else the default. The store is read once at a
        time per run, in a worker thread; a report waits for it at most ``wait_s`` (then it is grouped
        with the default, and the read goes on for the next one)."""
        hit = self.cached(run)
        if hit is not None:
            return hit
        if self.store_for is None:
            self._keep(run, _Known(DEFAULT_TOLERANCE, None))
            return DEFAULT_TOLERANCE
        task = self._reading.get(run)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._load(run))
            self._reading[run] = task
        try:
            return await asyncio.wait_for(asyncio.shield(task), self.wait_s)
        except TimeoutError:
            log.warning(
                "the audit policy of run %r is still being read after %g s: this report is grouped with the "
                "default tolerance %g nats",
                run,
                self.wait_s,
                DEFAULT_TOLERANCE,
            )
            return DEFAULT_TOLERANCE

    async def _load(self, run: str) -> float:
        try:
            known = await asyncio.to_thread(self._read, run)
        finally:
            self._reading.pop(run, None)
        self._keep(run, known)
        return known.tolerance

    def _read(self, run: str) -> _Known:
        """Read the run's policy (in a worker thread: it touches nothing shared)."""
        assert self.store_for is not None
        try:
            probes = read_probes(self.store_for(run))
        except Exception as exc:  # any failure of the store or the file: the default, read again later
            log.warning(
                "cannot read the audit policy of run %r (the fleet groups fingerprints with the default tolerance "
                "%g nats meanwhile; read again in %g s): %s: %s",
                run,
                DEFAULT_TOLERANCE,
                self.retry_s,
                type(exc).__name__,
                exc,
            )
            return _Known(DEFAULT_TOLERANCE, self.clock() + self.retry_s)
        if probes is None:  # no audit policy (yet): probes.json may be written later
            return _Known(DEFAULT_TOLERANCE, self.clock() + self.retry_s)
        return _Known(probes.policy.fingerprint_tolerance, None)

    def _keep(self, run: str, known: _Known) -> None:
        self._known[run] = known
        self._known.move_to_end(run)
        while len(self._known) > self.max_runs:
            self._known.popitem(last=False)
