"""The signal server on a real uvicorn on 127.0.0.1: SSE resume, restart, webhooks over HTTP,
and a follower that reaches the trainer's step while the server is killed midway."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import ProcServer, ThreadServer, free_port

import deltasync as ds
from deltasync.cli import main
from deltasync.errors import SignalUnavailable
from deltasync.fetcher._follow import FollowStats
from deltasync.server import Notifier, Settings, SignalClient, WebhookVerifier, create_app

PUB = "publish-token-live"
SUB = "subscribe-token-live"
ENV = {"DELTASYNC_PUBLISH_TOKEN": PUB, "DELTASYNC_SUBSCRIBE_TOKEN": SUB}
D = [f"{i:032x}" for i in range(20)]
WAIT = 60.0


def until(cond: Any, timeout: float = WAIT, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        pause.wait(0.02)


def take(events: Iterator[Any], n: int) -> list[Any]:
    out = []
    for ev in events:
        if ev is not None:
            out.append(ev)
            if len(out) == n:
                break
    return out


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ThreadServer]:
    app = create_app(Settings(publish_token=PUB, subscribe_token=SUB, db_path=str(tmp_path / "s.db")))
    with ThreadServer(app) as srv:
        yield srv


def test_sse_resumes_after_a_dropped_connection(server: ThreadServer) -> None:
    pub = SignalClient(server.url, PUB)
    sub = SignalClient(server.url, SUB)
    pub.publish("r", 1, D[1])
    pub.publish("r", 2, D[2])
    stream = sub.events("r", last_event_id=0, heartbeat=0.5)
    got = take(stream, 2)
    assert [(e.step, e.manifest_digest) for e in got] == [(1, D[1]), (2, D[2])]
    stream.close()  # drop the connection
    # the server notices the drop and frees the subscriber
    until(lambda: 'deltasync_sse_subscribers{run="r"} 0' in httpx.get(f"{server.url}/metrics").text, what="unsubscribe")
    for s in (3, 4, 5):
        pub.publish("r", s, D[s])
    resumed = sub.events("r", last_event_id=got[-1].step, heartbeat=0.5)
    assert [e.step for e in take(resumed, 3)] == [3, 4, 5]
    # live events arrive on an open stream
    threading.Timer(0.2, lambda: pub.publish("r", 6, D[6])).start()
    assert [e.step for e in take(resumed, 1)] == [6]
    resumed.close()
    # heartbeats flow while nothing happens
    idle = sub.events("r", heartbeat=0.2)
    first = next(idle)  # the current head
    assert first is not None and first.step == 6
    assert next(idle) is None
    idle.close()
    pub.close()
    sub.close()


def test_restart_keeps_state_and_streams_resume(tmp_path: Path) -> None:
    db = tmp_path / "signal.db"
    port = free_port()
    with ProcServer(tmp_path, "--db", str(db), env=ENV, port=port) as srv:
        pub = SignalClient(srv.url, PUB)
        for s in (1, 2, 3):
            pub.publish("r", s, D[s])
        hook = pub.register_webhook("r", "http://127.0.0.1:9/hook", "a-secret-of-16-chars")
        with SignalClient(srv.url, SUB) as sub:
            stream = sub.events("r", last_event_id=0, heartbeat=0.5)
            assert [e.step for e in take(stream, 3)] == [1, 2, 3]
            srv.kill()  # SIGKILL: no graceful shutdown
            with pytest.raises(SignalUnavailable):
                take(stream, 1)
        with pytest.raises(SignalUnavailable):
            pub.publish("r", 4, D[4])
        pub.close()
    with ProcServer(tmp_path, "--db", str(db), env=ENV, port=port) as srv, SignalClient(srv.url, PUB) as pub:
        head = pub.head("r")
        assert head is not None and (head.step, head.manifest_digest) == (3, D[3])
        hooks = httpx.get(f"{srv.url}/v1/runs/r/webhooks", headers={"Authorization": f"Bearer {PUB}"}).json()
        assert [h["id"] for h in hooks] == [hook["id"]]
        pub.publish("r", 4, D[4])
        with SignalClient(srv.url, SUB) as sub:
            stream = sub.events("r", last_event_id=1)
            assert [e.step for e in take(stream, 3)] == [2, 3, 4]
            stream.close()
        r = httpx.post(
            f"{srv.url}/v1/runs/r/commits",
            json={"step": 3, "manifest_digest": D[9]},
            headers={"Authorization": f"Bearer {PUB}"},
        )
        assert r.status_code == 409


class _Receiver(http.server.ThreadingHTTPServer):
    verifier: WebhookVerifier
    events: list[dict[str, Any]]
    statuses: list[int]
    fail_first: int


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Receiver

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.server.fail_first > 0:
            self.server.fail_first -= 1
            code = 500
        else:
            try:
                self.server.events.append(self.server.verifier.verify(dict(self.headers), body))
                code = 204
            except ValueError:
                code = 400
        self.server.statuses.append(code)
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_webhooks_over_http(tmp_path: Path) -> None:
    secret = "receiver-secret-0123456789"
    recv = _Receiver(("127.0.0.1", 0), _Handler)
    recv.verifier, recv.events, recv.statuses, recv.fail_first = WebhookVerifier(secret), [], [], 1
    t = threading.Thread(target=recv.serve_forever, daemon=True)
    t.start()
    try:
        settings = Settings(publish_token=PUB, db_path=str(tmp_path / "s.db"), webhook_backoff_s=0.05)
        with ThreadServer(create_app(settings)) as srv:
            pub = SignalClient(srv.url, PUB)
            pub.register_webhook("r", f"http://127.0.0.1:{recv.server_address[1]}/in", secret)
            pub.publish("r", 7, D[7])
            until(lambda: len(recv.events) == 1, what="webhook delivery")
            assert recv.statuses == [500, 204]  # retried after a 5xx
            assert (recv.events[0]["step"], recv.events[0]["manifest_digest"]) == (7, D[7])
            # a copy of the delivery replayed by an attacker is refused by the receiver's verifier
            event = recv.events[0]
            body = json.dumps(event, separators=(",", ":")).encode()
            from deltasync.server import sign_webhook

            forged = httpx.post(
                f"http://127.0.0.1:{recv.server_address[1]}/in",
                content=body,
                headers=sign_webhook("wrong-secret", body),
            )
            assert forged.status_code == 400
            pub.close()
    finally:
        recv.shutdown()
        recv.server_close()


def test_notifier_never_blocks_or_raises_when_the_server_is_down() -> None:
    n = Notifier(f"http://127.0.0.1:{free_port()}", "r", PUB, timeout=0.5, attempts=2, backoff=0.01)
    for s in range(20):
        n.notify(s, D[s % 20])
    assert n.flush(WAIT)
    n.close()
    assert n.sent == 0 and n.failed >= 1
    assert n.failed + n.superseded + n.rejected <= 20


def test_notify_only_records_while_a_post_hangs() -> None:
    """notify() returns while the server holds the first post: it never waits for the network."""
    on_wire, answer = threading.Event(), threading.Event()

    def hanging_server_then_down(request: httpx.Request) -> httpx.Response:
        on_wire.set()
        assert answer.wait(WAIT)
        raise httpx.ConnectError("connection refused", request=request)

    n = Notifier(
        "http://signal.test",
        "r",
        PUB,
        attempts=2,
        backoff=0.01,
        transport=httpx.MockTransport(hanging_server_then_down),
    )
    try:
        n.notify(0, D[0])
        assert on_wire.wait(WAIT)
        for s in range(1, 20):
            n.notify(s, D[s])  # each returns although the post of step 0 still hangs
        assert not answer.is_set() and n.sent == n.failed == 0
        assert n.superseded == 18  # only the newest pending step is kept
    finally:
        answer.set()
    assert n.flush(WAIT)
    n.close()
    assert n.sent == 0 and n.failed >= 1


def _state(seed: int = 0) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(128, generator=g).to(torch.bfloat16),
        "c.bias": torch.randn(16, generator=g),
    }


def _step(state: dict[str, Any], step: int) -> None:
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    for t in state.values():
        flat = t.view(-1)
        idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=g)
        flat[idx] += torch.randn(idx.numel(), generator=g).to(t.dtype)


def test_follower_reaches_the_trainer_step_with_the_server_killed_midway(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from tensors import assert_state_equal, snapshot

    store = ds.LocalStore(tmp_path / "store")
    srv = ProcServer(tmp_path, "--db", str(tmp_path / "s.db"), "--store", str(tmp_path / "store"), env=ENV).start()
    try:
        train = _state()
        replica = {k: v.clone().zero_() for k, v in train.items()}
        stats = FollowStats()
        reached: list[int] = []
        stop = threading.Event()
        result: list[int | None] = []
        errors: list[BaseException] = []

        def follower() -> None:
            try:
                result.append(
                    ds.DeltaFetcher(store).follow(
                        replica,
                        signal_url=srv.url,
                        token=SUB,
                        run="r",
                        until_step=11,
                        stop=stop,
                        poll_interval=0.2,
                        heartbeat=0.5,
                        reconnect_backoff=(0.2, 1.0),
                        on_step=reached.append,
                        stats=stats,
                    )
                )
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        ft = threading.Thread(target=follower, daemon=True)
        with ds.DeltaUploader(
            store, anchor_every=4, on_backlog="block", signal_url=srv.url, signal_token=PUB, signal_run="r"
        ) as up:
            up.push(train, step=0).result(WAIT)
            ft.start()
            until(lambda: stats.connected, what="follower to subscribe")
            for s in range(1, 6):
                _step(train, s)
                up.push(train, step=s).result(WAIT)
                until(lambda s=s: bool(reached) and reached[-1] >= s, what=f"signal of step {s}")
            assert stats.signals >= 5 and stats.polls <= 2  # phase one ran on signals, not polling
            srv.kill()
            t0 = time.monotonic()
            for s in range(6, 12):
                _step(train, s)
                info = up.push(train, step=s).result(WAIT)  # training never stalls on the dead server
                assert info.step == s
            push_time = time.monotonic() - t0
            want = snapshot(train)
            ft.join(WAIT)
            notifier = up.notifier
        assert not errors, errors
        assert not ft.is_alive()
        assert result == [11]
        assert_state_equal(replica, want, "follower after the server died")
        assert stats.signal_failures >= 1 and stats.polls >= 2
        assert notifier is not None and notifier.failed >= 1 and notifier.sent >= 6
        assert push_time < WAIT
    finally:
        stop.set()
        srv.kill()


def test_follow_polls_without_a_signal_server_and_materializes(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from safetensors.torch import load_file

    store = ds.LocalStore(tmp_path / "store")
    train = _state(1)
    with ds.DeltaUploader(store, anchor_every=3, on_backlog="block") as up:
        for s in range(4):
            _step(train, s)
            up.push(train, step=s).result(WAIT)
    out = tmp_path / "ckpt"
    assert main(["follow", "--store", str(tmp_path / "store"), "--out", str(out), "--until", "3"]) == 0
    assert json.loads((out / ".deltasync.json").read_text())["step"] == 3
    got: dict[str, Any] = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(f))
    from tensors import assert_state_equal

    assert_state_equal(got, train, "materialized by follow")


def test_serve_refuses_a_public_address_without_a_token(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("DELTASYNC_PUBLISH_TOKEN", raising=False)
    assert main(["serve", "--host", "0.0.0.0", "--port", str(free_port())]) == 1
    assert "refusing to serve on 0.0.0.0" in capsys.readouterr().err


def test_default_run_name_is_the_run_id(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from tensors import assert_state_equal, snapshot

    store = ds.LocalStore(tmp_path / "store")
    app = create_app(Settings(publish_token=PUB, subscribe_token=SUB, db_path=str(tmp_path / "s.db")), store=store)
    with ThreadServer(app) as srv:
        train = _state(2)
        replica = {k: v.clone().zero_() for k, v in train.items()}
        stats = FollowStats()
        with ds.DeltaUploader(store, on_backlog="block", signal_url=srv.url, signal_token=PUB) as up:
            up.push(train, step=0).result(WAIT)
            stop = threading.Event()
            ft = threading.Thread(
                target=lambda: ds.DeltaFetcher(store).follow(
                    replica, signal_url=srv.url, token=SUB, until_step=3, stop=stop, heartbeat=0.3, stats=stats
                ),
                daemon=True,
            )
            ft.start()
            until(lambda: stats.connected, what="follower to subscribe under the run id")
            for s in (1, 2, 3):
                _step(train, s)
                up.push(train, step=s).result(WAIT)
            ft.join(WAIT)
            stop.set()
            assert not ft.is_alive()
            with SignalClient(srv.url, SUB) as sub:
                head = sub.head(up.run_id)
        assert head is not None and head.step == 3 and head.run_id == up.run_id
        assert stats.signals >= 1 and stats.polls == 1  # one store read at start; the rest came by signal
        assert_state_equal(replica, snapshot(train), "follower by run id")


def test_follower_resubscribes_when_the_server_comes_back(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from tensors import assert_state_equal, snapshot

    store = ds.LocalStore(tmp_path / "store")
    db, port = str(tmp_path / "s.db"), free_port()
    srv = ProcServer(tmp_path, "--db", db, env=ENV, port=port).start()
    stop = threading.Event()
    try:
        train = _state(3)
        replica = {k: v.clone().zero_() for k, v in train.items()}
        stats = FollowStats()
        reached: list[int] = []
        ft = threading.Thread(
            target=lambda: ds.DeltaFetcher(store).follow(
                replica,
                signal_url=srv.url,
                token=SUB,
                run="r",
                stop=stop,
                poll_interval=0.2,
                heartbeat=0.3,
                reconnect_backoff=(0.1, 0.3),
                on_step=reached.append,
                stats=stats,
            ),
            daemon=True,
        )
        with ds.DeltaUploader(store, on_backlog="block", signal_url=srv.url, signal_token=PUB, signal_run="r") as up:
            up.push(train, step=0).result(WAIT)
            ft.start()
            until(lambda: stats.connected, what="first subscription")
            srv.kill()
            until(lambda: stats.signal_failures >= 1, what="the follower to notice the dead server")
            _step(train, 1)
            up.push(train, step=1).result(WAIT)  # reaches the follower by polling
            until(lambda: bool(reached) and reached[-1] == 1, what="step 1 by polling")
            srv = ProcServer(tmp_path, "--db", db, env=ENV, port=port).start()
            until(lambda: stats.connected, what="the follower to resubscribe")
            before = stats.signals
            for s in (2, 3):
                _step(train, s)
                up.push(train, step=s).result(WAIT)
            until(lambda: bool(reached) and reached[-1] == 3, what="steps 2-3 after the restart")
            want = snapshot(train)
        until(lambda: stats.signals > before, what="signals after the restart")
        assert_state_equal(replica, want, "follower across a server restart")
    finally:
        stop.set()
        srv.kill()
    ft.join(WAIT)
    assert not ft.is_alive()
