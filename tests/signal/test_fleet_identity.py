"""Replica identity from the receivers' side: replica tokens (mint, parse, verify) and FleetReporter
with a lease or a replica token against a real signal server on 127.0.0.1. A second reporter of the
same replica id is refused (409 or 403), logged once with the server's message, retried and never
raised; the first keeps its row. Waits are on events; nothing asserts a duration."""

from __future__ import annotations

import logging
import threading

import httpx
import pytest
from server_harness import ThreadServer

from deltasync._util.retry import RetryPolicy
from deltasync.errors import SignalConflict, SignalRejected
from deltasync.signal import (
    REPLICA_TOKEN_PREFIX,
    FleetReporter,
    SignalClient,
    derive_replica_key,
    new_lease,
    parse_replica_token,
    replica_key,
    replica_token,
    token_covers,
    verify_replica_token,
)

PUB = "publish-token-ident"
SUB = "subscribe-token-ident"
KEY = derive_replica_key(PUB)
WAIT = 30.0


class Counting(httpx.BaseTransport):
    """Passes requests to the network; counts them and the refusals (status >= 400)."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.refused = 0
        self.cond = threading.Condition()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        r = self.inner.handle_request(request)
        if r.status_code >= 400:
            with self.cond:
                self.refused += 1
                self.cond.notify_all()
        return r

    def refusals(self, n: int) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.refused >= n, WAIT)

    def close(self) -> None:
        self.inner.close()


FAST = RetryPolicy(retries=0, backoff=0.001, max_backoff=0.01)


# ---------------------------------------------------------------------- tokens


def test_a_token_names_its_run_and_identity_and_verifies_only_for_them() -> None:
    t = replica_token(KEY, "run.v2", "node3:8000")
    assert t.startswith(REPLICA_TOKEN_PREFIX) and parse_replica_token(t) == ("run.v2", "node3:8000")
    assert verify_replica_token(KEY, t, "run.v2", "node3:8000") == "node3:8000"
    assert verify_replica_token(KEY, t, "run.v2", "node3:8000-1") == "node3:8000"
    with pytest.raises(SignalRejected, match="for run 'run.v2', not 'run'"):
        verify_replica_token(KEY, t, "run", "node3:8000")
    with pytest.raises(SignalRejected, match="not 'node3'"):
        verify_replica_token(KEY, t, "run.v2", "node3")
    with pytest.raises(SignalRejected, match="replica key"):
        verify_replica_token(derive_replica_key("another-publish-token"), t, "run.v2", "node3:8000")
    run, identity, mac = t[len(REPLICA_TOKEN_PREFIX) :].split("~")
    forged = f"{REPLICA_TOKEN_PREFIX}{run}~node4~{mac}"  # another identity with a valid token's MAC
    with pytest.raises(SignalRejected, match="replica key"):
        verify_replica_token(KEY, forged, run, "node4")


def test_the_mac_binds_the_run_and_identity_unambiguously() -> None:
    # the MAC input separates run and identity with NUL: ("a", "b-c") and ("a-b", "c") differ
    assert replica_token(KEY, "a", "b-c").rsplit("~", 1)[1] != replica_token(KEY, "a-b", "c").rsplit("~", 1)[1]
    assert replica_token(KEY, "r", "x") == replica_token(KEY, "r", "x")  # deterministic: minted offline alike


@pytest.mark.parametrize(
    ("identity", "replica", "covers"),
    [("n3", "n3", True), ("n3", "n3-0", True), ("n3", "n3-a-b", True), ("n3", "n30", False), ("n3", "n3-", False)],
)
def test_an_identity_covers_itself_and_its_dash_suffixes(identity: str, replica: str, covers: bool) -> None:
    assert token_covers(identity, replica) is covers


@pytest.mark.parametrize("text", ["", "dsr1~", "dsr1~r~x", "dsr1~r~x~y~" + "A" * 43, "dsr1~r/1~x~" + "A" * 43, "xyz"])
def test_anything_else_is_not_a_replica_token(text: str) -> None:
    assert parse_replica_token(text) is None


def test_the_key_is_the_replica_key_else_derived_from_the_publish_token() -> None:
    assert replica_key("k" * 16, PUB) == b"k" * 16
    assert replica_key(None, PUB) == KEY != PUB.encode()
    assert replica_key(None, None) is None
    with pytest.raises(SignalRejected, match="at least 16"):
        replica_key("short", PUB)
    with pytest.raises(SignalRejected, match="invalid run name"):
        replica_token(KEY, "bad/run", "x")


# ---------------------------------------------------------------------- reporters


def test_a_second_unbound_reporter_of_an_id_is_refused_logged_once_and_the_first_keeps_it(
    server: ThreadServer, trainer: SignalClient, run: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="deltasync.signal.fleet")
    with FleetReporter(server.url, run, SUB, replica="dup", heartbeat=0.05) as first:
        first.update(3)
        assert first.wait_reported(WAIT)
        gate = Counting()
        second = FleetReporter(server.url, run, SUB, replica="dup", heartbeat=0.05, retry=FAST, transport=gate)
        try:
            second.update(9, "failed", last_error="the impostor")
            assert gate.refusals(3)  # refused, retried, never raised
        finally:
            second.close()  # its goodbye is refused too: the first stays
        (r,) = trainer.fleet(run).replicas
        assert (r.replica, r.step, r.state) == ("dup", 3, "serving")
    warnings = [m.getMessage() for m in caplog.records]
    assert len(warnings) == 1 and "HTTP 409" in warnings[0] and "held by another reporter" in warnings[0]
    assert trainer.fleet(run).replicas == ()  # the first left with its own lease


def test_a_bound_reporter_keeps_its_id_from_a_shared_token_and_restarts_with_its_token(
    server: ThreadServer, trainer: SignalClient, run: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="deltasync.signal.fleet")
    token = trainer.replica_token(run, "node7")
    assert token == replica_token(KEY, run, "node7")
    with FleetReporter(server.url, run, token, replica="node7-0", heartbeat=0.05) as honest:
        honest.update(5)
        assert honest.wait_reported(WAIT)
        gate = Counting()
        fake = FleetReporter(server.url, run, SUB, replica="node7-0", heartbeat=0.05, retry=FAST, transport=gate)
        try:
            fake.update(1, "failed", last_error="framed")
            assert gate.refusals(2)
        finally:
            fake.close()
        assert [(r.replica, r.step, r.state) for r in trainer.fleet(run).replicas] == [("node7-0", 5, "serving")]
    (warning,) = [m.getMessage() for m in caplog.records]
    assert "HTTP 403" in warning and "held by its replica token" in warning
    assert "DELTASYNC_SUBSCRIBE_TOKEN" not in warning  # its token is fine: the id is another's
    with FleetReporter(server.url, run, token, replica="node7-0", heartbeat=0.05) as again:  # a restart
        again.update(6)
        assert again.wait_reported(WAIT)
        assert [(r.replica, r.step) for r in trainer.fleet(run).replicas] == [("node7-0", 6)]


def test_the_client_sends_the_lease_and_maps_the_refusals(server: ThreadServer, run: str) -> None:
    lease = new_lease()
    with SignalClient(server.url, SUB) as c:
        c.report(run, "x", step=1, state="serving", lease=lease)
        with pytest.raises(SignalConflict, match="HTTP 409"):
            c.report(run, "x", step=1, state="serving", lease=new_lease())
        with pytest.raises(SignalConflict):
            c.leave(run, "x", lease=new_lease())
        assert c.leave(run, "x", lease=lease) is True
        with pytest.raises(SignalRejected, match="HTTP 403.*publish.*DELTASYNC_PUBLISH_TOKEN"):
            c.replica_token(run, "x")  # minting is a publish action
