"""VLLMServer alone: one vLLM server's update sequence, failure states, and what it does with hostile
answers, against a scripted HTTP stand-in (:class:`ScriptedVLLM` in tests/scripted_vllm.py).

The first tests moved from tests/serving/test_driver.py (the driver's tests stay there). Then, for each
hostile answer (not JSON, a JSON list, HTTP 500, a refused or dropped connection, a hang, one byte at a
time, a 400 MB body), the exact typed error of each method and the outcome of update(), which never
raises: over ``httpx.MockTransport`` where the answer is all that matters, over a real 127.0.0.1 socket
(tests/hostile_http.py) where the socket is the point. No test measures time.
"""

from __future__ import annotations

import socket
import tracemalloc
from collections.abc import Callable, Iterator

import httpx
import pytest
from hostile_http import HUGE, HostileServer
from scripted_vllm import Hostile, ScriptedVLLM

from deltasync.errors import ChainBroken, DeltaSyncError, MalformedAnswer, ServerError, ServerUnreachable
from deltasync.serving.http_call import ERROR_DETAIL, BoundedHTTP
from deltasync.serving.vllm_server import STATUS_TRIES, VLLMServer, agreed_step, response_detail
from deltasync.serving.worker_api import WorkerStatus


def _server(fake: ScriptedVLLM, url: str = "http://vllm-a") -> VLLMServer:
    return VLLMServer(url, transport=fake.transport())


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
        "/is_paused",
        "/weight_info",
    ]
    assert not fake.paused


def test_a_refused_step_is_not_finished_and_the_server_resumes_on_its_previous_step() -> None:
    fake = ScriptedVLLM()
    fake.rolled_back = {4}
    u = _server(fake).update(4)
    assert (u.state, u.version) == ("rolled_back", "0")
    assert "UpdateRolledBack: step 4: corrupt patch" in (u.error or "")
    assert "/finish_weight_update" not in fake.calls
    assert fake.calls[3:5] == ["/collective_rpc", "/resume"]  # the workers' typed states decide: resume
    assert u.workers == [WorkerStatus(0, 0, None, "serving", None, "s3://bucket/run")]  # its own account, typed


def test_a_refused_step_whose_outcome_cannot_be_read_leaves_the_server_paused() -> None:
    fake = ScriptedVLLM()
    fake.rolled_back, fake.status_down = {4}, True
    u = _server(fake).update(4)
    assert u.state == "failed" and "stays paused" in (u.error or "")
    assert fake.paused and "/resume" not in fake.calls
    assert fake.calls.count("/collective_rpc") == 3  # STATUS_TRIES reads, then no guess


def test_the_outcome_of_a_refused_step_comes_from_the_workers_states_not_the_error_text() -> None:
    fake = ScriptedVLLM()
    fake.broken = {4}  # answers "rank 1: reload failed": no class name in the text
    u = _server(fake).update(4)
    assert u.state == "needs_replacement" and fake.paused and "/resume" not in fake.calls


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


def test_a_refused_update_is_resumed_on_a_new_connection_when_vllm_dropped_the_old_one() -> None:
    fake = ScriptedVLLM()
    fake.rolled_back, fake.resume_drops = {2}, 2  # the first two /resume are lost on the dropped connection
    u = _server(fake).update(2)
    assert u.state == "rolled_back" and u.version == "0"
    assert not fake.paused
    assert fake.calls.count("/resume") == 3 and fake.calls[-2:] == ["/is_paused", "/weight_info"]


def test_a_server_that_cannot_be_resumed_is_not_reported_as_serving_its_previous_step() -> None:
    fake = ScriptedVLLM()
    fake.rolled_back, fake.resume_drops = {2}, 10**6
    u = _server(fake).update(2)
    assert u.state == "unreachable" and "resume (5 tries)" in (u.error or "")
    assert fake.paused and fake.calls.count("/resume") == 5


# ------------------------------------------------------------------------------- hostile answers (issue 46)
#
# Each VLLMServer method against each hostile answer of the route it reads: the exact typed error
# (``type(exc) is ...``: a ServerError is not taken for its subclasses), and update() an outcome instead.


def _not_json(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, content=b"<html>502 Bad Gateway</html>")


def _a_list(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json=[{"weight_version": "3", "is_paused": False, "data": [{"id": "m"}]}])


def _http_500(request: httpx.Request) -> httpx.Response:
    return httpx.Response(500, json={"error": {"message": "Internal Server Error"}})


def _refused(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("[Errno 111] Connection refused", request=request)


def _dropped(request: httpx.Request) -> httpx.Response:
    raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)


HOSTILE: dict[str, Hostile] = {
    "not JSON": _not_json,
    "a JSON list": _a_list,
    "HTTP 500": _http_500,
    "refused": _refused,
    "dropped": _dropped,
}
EXPECTED: dict[str, type[DeltaSyncError]] = {
    "not JSON": MalformedAnswer,
    "a JSON list": MalformedAnswer,
    "HTTP 500": ServerError,
    "refused": ServerUnreachable,
    "dropped": ServerUnreachable,
}
#: each method and the route whose answer it reads
METHODS: dict[str, tuple[str, Callable[[VLLMServer], object]]] = {
    "weight_version": ("/weight_info", lambda s: s.weight_version()),
    "model": ("/v1/models", lambda s: s.model()),
    "is_paused": ("/is_paused", lambda s: s.is_paused()),
    "prepare": ("/collective_rpc deltasync_prepare", lambda s: s.prepare(3)),
    "rpc": ("/collective_rpc deltasync_audit_params", lambda s: s.rpc("deltasync_audit_params", {"start": 0})),
    "resume": ("/resume", lambda s: s.resume(tries=1)),
    "pause": ("/pause", lambda s: s.pause("abort")),
    "init": ("/init_weight_transfer_engine", lambda s: s.init("s3://bucket/run")),
}
#: routes whose answer's body is not read: any JSON is taken
BODY_UNREAD = {"/resume", "/pause", "/init_weight_transfer_engine"}


@pytest.mark.parametrize("hostile", list(HOSTILE))
@pytest.mark.parametrize("method", list(METHODS))
def test_each_method_raises_the_typed_error_of_each_hostile_answer(method: str, hostile: str) -> None:
    route, call = METHODS[method]
    fake = ScriptedVLLM()
    fake.hostile[route] = HOSTILE[hostile]
    server = _server(fake)
    if hostile == "a JSON list" and (route in BODY_UNREAD or method == "rpc"):
        # JSON whose content is not used, or handed as is to the worker API's parsers (run_params_audit)
        assert call(server) in (None, _a_list(httpx.Request("GET", "http://x")).json())
        return
    with pytest.raises(DeltaSyncError) as caught:
        call(server)
    assert type(caught.value) is EXPECTED[hostile], caught.value
    assert server.url in str(caught.value)


@pytest.mark.parametrize("hostile", list(HOSTILE))
def test_the_workers_status_is_none_when_the_server_cannot_say_and_typed_otherwise(hostile: str) -> None:
    fake = ScriptedVLLM()
    fake.hostile["/collective_rpc deltasync_status"] = HOSTILE[hostile]
    server = _server(fake)
    if hostile == "HTTP 500":
        assert server.workers() is None
        assert agreed_step(server) is None
        return
    with pytest.raises(DeltaSyncError) as caught:
        server.workers()
    assert type(caught.value) is EXPECTED[hostile]
    assert agreed_step(server) is None  # never raises


@pytest.mark.parametrize(
    ("route", "answer", "why"),
    [
        ("/weight_info", {"weight_version": [3]}, "weight_version"),
        ("/weight_info", {"weight_version": True}, "weight_version"),
        ("/v1/models", {"data": []}, "data"),
        ("/v1/models", {"data": [{"id": 7}]}, "data"),
        ("/v1/models", {"object": "list"}, "data"),
        ("/is_paused", {"is_paused": "no"}, "is_paused"),
        ("/collective_rpc deltasync_status", {"results": []}, "results"),
        ("/collective_rpc deltasync_status", {"results": [{"rank": 0, "state": "fine"}]}, "state"),
        ("/collective_rpc deltasync_status", {"results": [{"rank": -1, "state": "serving"}]}, "rank"),
        ("/collective_rpc deltasync_status", {"results": [{"rank": 0, "state": "serving", "step": "0"}]}, "step"),
    ],
)
def test_json_of_the_wrong_shape_is_a_malformed_answer(route: str, answer: object, why: str) -> None:
    fake = ScriptedVLLM()
    fake.hostile[route] = lambda request: httpx.Response(200, json=answer)
    server = _server(fake)
    call = {
        "/weight_info": server.weight_version,
        "/v1/models": server.model,
        "/is_paused": server.is_paused,
        "/collective_rpc deltasync_status": server.workers,
    }[route]
    with pytest.raises(MalformedAnswer, match=why):
        call()


def test_a_route_that_is_not_there_says_how_to_start_the_server() -> None:
    fake = ScriptedVLLM()
    fake.hostile["/init_weight_transfer_engine"] = lambda r: httpx.Response(404, json={"detail": "Not Found"})
    with pytest.raises(ServerError, match="VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config"):
        _server(fake).init("s3://bucket/run")


def test_a_worker_s_prepare_error_is_raised_as_its_own_class() -> None:
    fake = ScriptedVLLM()
    answer = {"rank": 0, "state": "serving", "error": "step 3 is not in the chain", "error_code": ChainBroken.code}
    fake.hostile["/collective_rpc deltasync_prepare"] = lambda r: httpx.Response(200, json={"results": [answer]})
    with pytest.raises(ChainBroken, match="rank 0: step 3 is not in the chain"):
        _server(fake).prepare(3)


#: routes of the update sequence, in order
UPDATE_ROUTES = [
    "/pause",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/reset_prefix_cache",
    "/resume",
    "/is_paused",
    "/weight_info",
]


@pytest.mark.parametrize("hostile", list(HOSTILE))
@pytest.mark.parametrize("route", UPDATE_ROUTES)
def test_update_turns_every_hostile_answer_into_its_outcome(route: str, hostile: str) -> None:
    fake = ScriptedVLLM()
    fake.hostile[route] = HOSTILE[hostile]
    u = _server(fake).update(3, cache_retries=1)
    assert u.state in ("serving", "failed", "unreachable", "needs_replacement", "rolled_back")
    if u.ok:  # only when the answer was not read (any JSON is taken): the server does serve step 3
        assert fake.version == "3" and not fake.paused and route in BODY_UNREAD | {"/start_weight_update"}
    else:
        assert u.error
    if route == "/pause" and hostile != "a JSON list":  # (a list is taken: the update goes on)
        assert u.state == ("unreachable" if EXPECTED[hostile] is ServerUnreachable else "failed")
        assert fake.calls == [fake.calls[0]]  # nothing else asked of a server that was not paused
    if route == "/reset_prefix_cache":  # the cache may hold KV of the old weights: it stays paused
        assert u.state == "failed" and "prefix cache could not be reset" in (u.error or "")
        assert fake.paused and "/resume" not in fake.calls
    if route == "/weight_info":
        assert u.state == "failed" and "weight_info" in (u.error or "")


@pytest.mark.parametrize("hostile", list(HOSTILE))
def test_a_refused_update_whose_workers_answer_garbage_stays_paused(hostile: str) -> None:
    fake = ScriptedVLLM()
    fake.rolled_back = {4}
    fake.hostile["/collective_rpc deltasync_status"] = HOSTILE[hostile]
    u = _server(fake).update(4)
    assert u.state == "failed" and "stays paused" in (u.error or "") and u.workers is None
    assert fake.paused and "/resume" not in fake.calls
    assert fake.calls.count("/collective_rpc") == STATUS_TRIES


@pytest.mark.parametrize("hostile", list(HOSTILE))
def test_a_failed_prepare_does_not_stop_the_update(hostile: str) -> None:
    fake = ScriptedVLLM()
    fake.hostile["/collective_rpc deltasync_prepare"] = HOSTILE[hostile]
    u = _server(fake).update(3, prepare=True)
    assert u.ok and not u.prepared and u.prepare_s is not None


def test_an_unknown_pause_mode_is_an_outcome_of_update_and_a_value_error_of_pause() -> None:
    fake = ScriptedVLLM()
    u = _server(fake).update(3, pause_mode="sleep")  # type: ignore[arg-type]
    assert u.state == "failed" and "pause_mode" in (u.error or "") and fake.calls == []
    with pytest.raises(ValueError, match="pause mode"):
        _server(fake).pause("sleep")  # type: ignore[arg-type]


def test_pause_is_public_and_asks_the_mode_given() -> None:
    fake = ScriptedVLLM()
    _server(fake).pause("abort")
    assert fake.calls == ["/pause?mode=abort&clear_cache=true"] and fake.paused


# ------------------------------------------------------------------------------- the bounded call


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0


class _Trickle(httpx.SyncByteStream):
    """A body of ``n`` one-byte chunks, the clock moving ``step`` seconds before each."""

    def __init__(self, clock: _Clock, n: int, step: float) -> None:
        self.clock, self.n, self.step, self.given = clock, n, step, 0

    def __iter__(self) -> Iterator[bytes]:
        for _ in range(self.n):
            self.clock.now += self.step
            self.given += 1
            yield b" "


def test_a_body_trickled_past_the_deadline_is_no_answer_and_is_not_read_further() -> None:
    clock = _Clock()
    body = _Trickle(clock, 10_000, 1.0)  # one byte a second
    transport = httpx.MockTransport(lambda r: httpx.Response(200, stream=body))
    api = BoundedHTTP("http://slow", transport=transport, clock=lambda: clock.now)
    with pytest.raises(ServerUnreachable, match="no whole answer within 3 s"):
        api.call("GET", "/weight_info", deadline=3.0)
    assert body.given == 4  # cut at the first chunk past the deadline, not read on


def test_a_body_over_the_cap_is_cut_there() -> None:
    body = _Trickle(_Clock(), 10_000, 0.0)
    api = BoundedHTTP("http://big", transport=httpx.MockTransport(lambda r: httpx.Response(200, stream=body)))
    with pytest.raises(MalformedAnswer, match="over 100 bytes"):
        api.call("GET", "/v1/models", deadline=3.0, cap=100)
    assert body.given == 101
    declared = httpx.MockTransport(lambda r: httpx.Response(200, headers={"Content-Length": str(400 << 20)}))
    with pytest.raises(MalformedAnswer, match="419,430,400 bytes"):
        BoundedHTTP("http://big", transport=declared).call("GET", "/v1/models", deadline=3.0, cap=100)


def test_an_error_answer_s_text_is_kept_bounded_and_unwrapped() -> None:
    wrapped = (
        "Call to collective_rpc method failed: Worker failed with error 'step 3: corrupt patch', please check the "
        "stack trace above for the root cause"
    )
    transport = httpx.MockTransport(lambda r: httpx.Response(500, json={"error": {"message": wrapped}}))
    a = BoundedHTTP("http://x", transport=transport).call("POST", "/update_weights", deadline=3.0)
    assert (a.status, a.detail, a.ok) == (500, "step 3: corrupt patch", False)
    huge = httpx.MockTransport(lambda r: httpx.Response(503, content=b"x" * (5 << 20)))
    a = BoundedHTTP("http://x", transport=huge).call("GET", "/weight_info", deadline=3.0)
    assert a.status == 503 and len(a.detail) == ERROR_DETAIL
    assert response_detail(httpx.Response(500, json={"detail": "Not Found"})) == "Not Found"


# ------------------------------------------------------------------------------- on a real socket


@pytest.fixture
def hostile(request: pytest.FixtureRequest) -> Iterator[HostileServer]:
    server = HostileServer(request.param)
    yield server
    server.close()


@pytest.mark.parametrize("hostile", ["hang", "trickle-status", "trickle-body"], indirect=True)
def test_a_server_that_hangs_or_trickles_is_unreachable_within_the_call_s_deadline(hostile: HostileServer) -> None:
    """httpx bounds each socket read; a byte every 20 ms would hold a call forever. The deadline is
    the whole call's: several ticks, far from the trickle's end (which would take minutes)."""
    server = VLLMServer(hostile.url, timeout=2.0, probe_timeout=0.3)
    with pytest.raises(ServerUnreachable, match="no whole answer within 0.3 s"):
        server.weight_version()
    u = server.update(3)
    assert u.state == "unreachable" and "no whole answer within 2 s" in (u.error or "")
    server.close()


@pytest.mark.parametrize("hostile", ["huge-declared", "huge-streamed"], indirect=True)
def test_a_400_mb_answer_is_cut_at_the_cap_with_memory_bounded(hostile: HostileServer) -> None:
    server = VLLMServer(hostile.url, timeout=60.0, probe_timeout=60.0)
    tracemalloc.start()
    try:
        with pytest.raises(MalformedAnswer, match="the most this call takes|over the 1,048,576"):
            server.weight_version()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    server.close()
    assert peak < 16 << 20  # the 1 MiB cap and one chunk, not 400 MB
    assert hostile.sent < HUGE  # the connection was closed: the server could not send it all


def test_a_refused_connection_is_unreachable() -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    server = VLLMServer(f"http://127.0.0.1:{port}", timeout=2.0, probe_timeout=2.0)
    with pytest.raises(ServerUnreachable, match="no answer"):
        server.is_paused()
    assert server.update(1).state == "unreachable"
    server.close()


def test_a_url_that_is_not_one_is_a_value_error_and_a_scheme_without_http_is_unreachable() -> None:
    with pytest.raises(ValueError, match="is not a server's URL"):
        VLLMServer("http://[::1")
    with pytest.raises(ServerUnreachable, match="unsupported protocol"):
        VLLMServer("localhost:8000").weight_version()  # read as a scheme: no request can be sent
