"""VLLMDriver's update sequence, failure states and backoff, against a scripted HTTP stand-in.

The stand-in (:class:`ScriptedVLLM`, an ``httpx.MockTransport``) answers the routes of a vLLM 0.32
server the way the real one does (paths, bodies, status codes), and records the calls, so that the
order of the sequence, what happens on each failure, and the retry timing (an injected clock) can
be checked exactly. The same driver runs against a real ``vllm serve`` in
tests/integrations/test_vllm_follow.py.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from deltasync.errors import DeltaSyncError
from deltasync.integrations.vllm.driver import VLLMDriver, VLLMServer


class ScriptedVLLM:
    """A vLLM server's weight-transfer routes: refuses ``rolled_back`` steps (HTTP 500, engine kept at its
    step), breaks on ``broken`` steps (needs replacement), fails ``cache_failures`` prefix-cache resets."""

    def __init__(self, version: str | None = "0") -> None:
        self.version = version
        self.paused = False
        self.calls: list[str] = []
        self.rolled_back: set[int] = set()
        self.broken: set[int] = set()
        self.cache_failures = 0
        self.down = False
        self._pending: int | None = None

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def handle(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        path = request.url.path
        body = json.loads(request.content) if request.content else {}
        q = dict(request.url.params)
        self.calls.append(path + (f"?{request.url.query.decode()}" if request.url.query else ""))
        if path == "/init_weight_transfer_engine":
            return httpx.Response(200, json={"message": "Weight transfer initialized"})
        if path == "/weight_info":
            return httpx.Response(200, json={"weight_version": self.version})
        if path == "/pause":
            assert q.get("mode") in ("wait", "abort", "keep")
            self.paused = True
            return httpx.Response(200, json={"status": "paused"})
        if path == "/resume":
            self.paused = False
            return httpx.Response(200, json={"status": "resumed"})
        if path == "/start_weight_update":
            assert self.paused, "updates run paused"
            return httpx.Response(200, json={"message": "Weight update started"})
        if path == "/update_weights":
            step = body["update_info"]["step"]
            if step in self.broken:
                return httpx.Response(500, json={"error": {"message": "WorkerNeedsReplacement: rank 1: reload failed"}})
            if step in self.rolled_back:
                return httpx.Response(500, json={"error": {"message": f"UpdateRolledBack: step {step}: corrupt patch"}})
            self._pending = step
            return httpx.Response(200, json={"message": "Weights updated"})
        if path == "/finish_weight_update":
            assert self._pending is not None
            self.version, self._pending = body["weight_version"], None
            return httpx.Response(200, json={"message": "Weight update finished"})
        if path == "/reset_prefix_cache":
            if self.cache_failures:
                self.cache_failures -= 1
                return httpx.Response(200, json={"success": False})
            return httpx.Response(200, json={"success": True})
        if path == "/collective_rpc":
            state = "needs_replacement" if self.broken else "serving"
            return httpx.Response(200, json={"results": [{"rank": 0, "state": state, "step": self.version}]})
        return httpx.Response(404, json={"detail": "Not Found"})


def _server(fake: ScriptedVLLM, url: str = "http://vllm-a") -> VLLMServer:
    return VLLMServer(url, transport=fake.transport())


def _driver(*fakes: ScriptedVLLM, clock: Any = None, **kw: Any) -> VLLMDriver:
    servers = [_server(f, f"http://vllm-{i}") for i, f in enumerate(fakes)]
    return VLLMDriver(servers, "s3://bucket/run", clock=clock or (lambda: 0.0), **kw)


def test_an_update_pauses_runs_the_four_phases_resets_the_prefix_cache_then_resumes() -> None:
    fake = ScriptedVLLM()
    u = _server(fake).update(3)
    assert u.ok and u.version == "3" and u.state == "serving"
    assert fake.calls == [
        "/pause?mode=wait&clear_cache=true",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/reset_prefix_cache",
        "/resume",
        "/weight_info",
    ]
    assert not fake.paused


def test_a_refused_step_is_not_finished_and_the_server_resumes_on_its_previous_step() -> None:
    fake = ScriptedVLLM()
    fake.rolled_back = {4}
    u = _server(fake).update(4)
    assert (u.state, u.version) == ("rolled_back", "0")
    assert "UpdateRolledBack: step 4: corrupt patch" in (u.error or "")
    assert "/finish_weight_update" not in fake.calls and fake.calls[3] == "/resume"
    assert u.workers == [{"rank": 0, "state": "serving", "step": "0"}]  # the backend's own account


def test_a_server_needing_replacement_stays_paused_and_is_never_updated_again() -> None:
    fake, other = ScriptedVLLM(), ScriptedVLLM()
    fake.broken = {2}
    with _driver(fake, other) as d:
        d.init()
        first = d.update(2)
        assert [u.state for u in first] == ["needs_replacement", "serving"]
        assert fake.paused  # its weights are neither step: it must not serve
        assert "/resume" not in fake.calls
        calls = len(fake.calls)
        again = d.catch_up(3)
        assert [u.url for u in again] == ["http://vllm-1"]
        assert len(fake.calls) == calls
        with pytest.raises(DeltaSyncError, match="every vLLM server needs replacement"):
            other.broken = {4}
            d.follow([4])


def test_a_prefix_cache_that_will_not_reset_leaves_the_server_paused_rather_than_stale() -> None:
    flaky = ScriptedVLLM()
    flaky.cache_failures = 2  # blocks still held twice: retried, then fine
    assert _server(flaky).update(1).ok
    stuck = ScriptedVLLM()
    stuck.cache_failures = 10**6
    u = VLLMServer("http://stuck", transport=stuck.transport()).update(1, cache_retries=3)
    assert u.state == "failed" and "prefix cache could not be reset" in (u.error or "")
    assert stuck.paused and "/resume" not in stuck.calls
    assert stuck.calls.count("/reset_prefix_cache") == 4


def test_keep_mode_resets_the_kv_of_the_requests_it_froze() -> None:
    fake = ScriptedVLLM()
    assert _server(fake).update(1, pause_mode="keep").ok
    assert "/pause?mode=keep&clear_cache=true" in fake.calls
    assert "/reset_prefix_cache?reset_running_requests=true" in fake.calls


def test_a_refused_step_is_retried_only_after_its_backoff_and_a_newer_step_at_once() -> None:
    now = [0.0]
    fake = ScriptedVLLM()
    fake.rolled_back = {5}
    with _driver(fake, clock=lambda: now[0]) as d:
        d.init()
        assert [u.state for u in d.catch_up(5)] == ["rolled_back"]
        assert d.catch_up(5) == []  # inside the backoff: no new attempt, no request
        now[0] = 1.99
        assert d.catch_up(5) == []
        now[0] = 2.0  # the first backoff (2 s) is over
        assert [u.state for u in d.catch_up(5)] == ["rolled_back"]
        now[0] = 5.9  # the next one doubled (4 s from 2.0)
        assert d.catch_up(5) == []
        assert [u.state for u in d.catch_up(6)] == ["serving"]  # a newer step: at once
        assert d.serving() == {"http://vllm-0": 6}


def test_an_unreachable_server_does_not_hold_the_others_back() -> None:
    down, up = ScriptedVLLM(), ScriptedVLLM()
    with _driver(down, up) as d:
        d.init()
        down.down = True
        got = d.update(1)
        assert [u.state for u in got] == ["unreachable", "serving"]
        assert d.serving() == {"http://vllm-0": 0, "http://vllm-1": 1}


def test_follow_returns_once_every_server_serves_the_target_step() -> None:
    a, b = ScriptedVLLM(), ScriptedVLLM()
    seen: list[tuple[str, int, str]] = []
    with _driver(a, b) as d:
        d.init()
        out = d.follow(iter([1, None, 3, 4, 5]), until=4, on_update=lambda u: seen.append((u.url, u.step, u.state)))
    assert out == {"http://vllm-0": 4, "http://vllm-1": 4}
    assert sorted(seen) == sorted(
        [(f"http://vllm-{i}", s, "serving") for i in (0, 1) for s in (1, 3, 4)]
    )  # steps 1, 3, 4 only: never one it already serves, never past the target


def test_a_server_without_the_deltasync_backend_is_a_clear_error_at_init() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"detail": "Not Found"})

    d = VLLMDriver([VLLMServer("http://plain", transport=httpx.MockTransport(handler))], "s3://b/r")
    with pytest.raises(DeltaSyncError, match="VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config"):
        d.init()
    d.close()


def test_each_server_reports_to_the_fleet_view_as_one_replica() -> None:
    from server_harness import ThreadServer

    from deltasync.server import Settings, create_app
    from deltasync.signal import SignalClient

    ok, refusing, broken = ScriptedVLLM(), ScriptedVLLM(), ScriptedVLLM()
    refusing.rolled_back, broken.broken = {2}, {2}
    tok = "publish-token-driver"
    with ThreadServer(create_app(Settings(publish_token=tok))) as signal, SignalClient(signal.url, tok) as trainer:
        for step in (0, 1, 2):
            trainer.publish("run-d", step, f"{step:032x}")
        with _driver(ok, refusing, broken, signal=signal.url, signal_token=tok, run="run-d") as d:
            d.init()
            assert d.reports_delivered(30)
            assert {r.replica: (r.step, r.state) for r in trainer.fleet("run-d").replicas} == {
                "vllm-0": (0, "serving"),
                "vllm-1": (0, "serving"),
                "vllm-2": (0, "serving"),
            }
            d.update(2)
            assert d.reports_delivered(30)
            rows = {r.replica: r for r in trainer.fleet("run-d").replicas}
            assert (rows["vllm-0"].step, rows["vllm-0"].lag, rows["vllm-0"].state) == (2, 0, "serving")
            assert (rows["vllm-1"].step, rows["vllm-1"].lag, rows["vllm-1"].state) == (0, 2, "failed")
            assert "UpdateRolledBack: step 2: corrupt patch" in (rows["vllm-1"].last_error or "")
            assert (rows["vllm-2"].state, rows["vllm-2"].step) == ("needs_replacement", 0)
        assert trainer.fleet("run-d").replicas == ()  # closing the driver left the fleet
    with pytest.raises(ValueError, match="needs run="):
        _driver(ScriptedVLLM(), signal="http://127.0.0.1:9")
