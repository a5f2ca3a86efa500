"""The signal server's identity book and policy cache on their own (no HTTP): ReplicaClaims stays
within the fleet book's bounds and claims nothing for a refused report; RunPolicies reads a run's
probes.json once however many reports race for it, off the event loop, and retries a failed read
only after retry_s of the injected clock."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from deltasync.errors import TransientStorageError
from deltasync.protocol.audit import DEFAULT_TOLERANCE, AuditPolicy
from deltasync.protocol.probes import ProbeSet
from deltasync.run import write_probes
from deltasync.server._identity import IdentityRefused, ReplicaClaims
from deltasync.server._policy import RunPolicies
from deltasync.storage import MemoryStore, Store


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def claim(claims: ReplicaClaims, run: str, replica: str, *, bound: bool = False, lease: str | None = None) -> None:
    now = claims.clock()
    claims.report(run, replica, bound=bound, lease=lease, record=lambda: (now, 10.0), seen=lambda out: out)


def test_claims_stay_within_the_books_bounds_whatever_reports() -> None:
    clock = Clock()
    claims = ReplicaClaims(clock=clock, max_replicas=3, max_runs=2)
    for run in ("a", "b", "c", "d"):
        for i in range(10):
            claim(claims, run, f"r{i}", lease=f"lease-of-{run}-{i}")
            clock.t += 0.01
            assert len(claims) <= 3 * 2
    assert claims.holder("d", "r9") == "lease"  # the newest stay
    clock.t += 11
    assert claims.holder("d", "r9") is None  # aged out with the book's entry


def test_a_refused_record_claims_nothing() -> None:
    claims = ReplicaClaims(clock=Clock(), max_replicas=4, max_runs=4)

    def full() -> tuple[float, float]:
        raise RuntimeError("the book refused it")

    with pytest.raises(RuntimeError):
        claims.report("r", "x", bound=False, lease="mine-0123456789abcdef", record=full, seen=lambda out: out)
    assert claims.holder("r", "x") is None and len(claims) == 0
    claim(claims, "r", "x", lease="another-0123456789abcdef")  # the id is free


def test_holders_bound_lease_and_unleased() -> None:
    claims = ReplicaClaims(clock=Clock(), max_replicas=4, max_runs=4)
    claim(claims, "r", "b", bound=True)
    claim(claims, "r", "l", lease="lease-0123456789abcdef")
    claim(claims, "r", "u")
    assert [claims.holder("r", k) for k in ("b", "l", "u", "none")] == ["bound", "lease", "unbound", None]
    with pytest.raises(IdentityRefused) as refused:
        claim(claims, "r", "b", lease="lease-0123456789abcdef")
    assert refused.value.status == 403
    with pytest.raises(IdentityRefused) as refused:
        claims.leave("r", "l", bound=False, lease=None, remove=lambda: True)
    assert refused.value.status == 409
    assert claims.leave("r", "l", bound=True, lease=None, remove=lambda: True) is True  # the operator
    assert claims.holder("r", "l") is None


class CountingStore:
    """The run's store as the policy cache opens it: counts the opens (one per read of probes.json),
    holds them until ``gate`` is set, fails with ``fail`` when set."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.reads = 0
        self.gate = threading.Event()
        self.fail: Exception | None = None

    def __call__(self, run: str) -> Store:
        self.reads += 1
        assert self.gate.wait(30)
        if self.fail is not None:
            raise self.fail
        return self.inner


def test_racing_reports_read_the_policy_once_and_off_the_event_loop() -> None:
    store = MemoryStore("p")
    write_probes(store, ProbeSet(((1, 2, 3, 4, 5),), 8, AuditPolicy(fingerprint_tolerance=0.3)))
    spy = CountingStore(store)
    policies = RunPolicies(spy, clock=Clock(), max_runs=4, wait_s=30)

    async def main() -> list[float]:
        tasks = [asyncio.create_task(policies.tolerance("r")) for _ in range(8)]
        await asyncio.sleep(0)  # every task is waiting; the loop is free while the store is read
        loop_ran = asyncio.Event()
        asyncio.get_running_loop().call_soon(loop_ran.set)
        await loop_ran.wait()
        spy.gate.set()
        return await asyncio.gather(*tasks)

    assert asyncio.run(main()) == [0.3] * 8
    assert spy.reads == 1
    assert policies.cached("r") == 0.3


def test_a_slow_read_does_not_hold_a_report_and_the_next_one_gets_its_result() -> None:
    store = MemoryStore("p")
    write_probes(store, ProbeSet(((1, 2, 3, 4, 5),), 8, AuditPolicy(fingerprint_tolerance=0.3)))
    spy = CountingStore(store)
    policies = RunPolicies(spy, clock=Clock(), max_runs=4, wait_s=0)

    async def main() -> tuple[float, float]:
        first = await policies.tolerance("r")  # the read is held: this report goes on with the default
        spy.gate.set()
        policies.wait_s = 30
        return first, await policies.tolerance("r")  # joins the read in progress

    assert asyncio.run(main()) == (DEFAULT_TOLERANCE, 0.3)
    assert spy.reads == 1


def test_a_failed_read_keeps_the_default_until_retry_s(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="deltasync.server")
    clock = Clock()
    store = MemoryStore("p")
    write_probes(store, ProbeSet(((1, 2, 3, 4, 5),), 8, AuditPolicy(fingerprint_tolerance=0.3)))
    spy = CountingStore(store)
    spy.gate.set()
    spy.fail = TransientStorageError("the store is down (test)")
    policies = RunPolicies(spy, clock=clock, max_runs=4, retry_s=60)
    assert asyncio.run(policies.tolerance("r")) == DEFAULT_TOLERANCE
    assert "cannot read the audit policy of run 'r'" in caplog.text
    spy.fail = None
    assert asyncio.run(policies.tolerance("r")) == DEFAULT_TOLERANCE and spy.reads == 1  # not before retry_s
    clock.t += 60
    assert asyncio.run(policies.tolerance("r")) == 0.3 and spy.reads == 2


def test_the_policy_cache_is_bounded() -> None:
    policies = RunPolicies(None, clock=Clock(), max_runs=3)
    for i in range(10):
        assert asyncio.run(policies.tolerance(f"run{i}")) == DEFAULT_TOLERANCE
    assert [policies.cached(f"run{i}") for i in range(10)].count(None) == 7
