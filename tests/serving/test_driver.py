"""VLLMDriver's scheduling, failure states and backoff, against a scripted HTTP stand-in.

The stand-in (:class:`ScriptedVLLM` in tests/scripted_vllm.py, an ``httpx.MockTransport``) answers the routes of a vLLM 0.32
server the way the real one does (paths, bodies, status codes), and records the calls, so that the
order of the sequence, what happens on each failure, and the retry timing (an injected clock) can
be checked exactly. The same driver runs against a real ``vllm serve`` in
tests/integrations/test_vllm_follow.py.
"""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest
from scripted_vllm import ScriptedVLLM

from deltasync.errors import ServerError
from deltasync.serving.driver import DriverOptions, FleetReporting, VLLMDriver, VLLMServer
from deltasync.serving.phase import Phase
from deltasync.signal import StepWatcher

ALL_OR_NOTHING = DriverOptions(all_or_nothing=True)


def _server(fake: ScriptedVLLM, url: str = "http://vllm-a") -> VLLMServer:
    return VLLMServer(url, transport=fake.transport())


def _driver(*fakes: ScriptedVLLM, options: DriverOptions | None = None, clock: Any = None, **kw: Any) -> VLLMDriver:
    servers = [_server(f, f"http://vllm-{i}") for i, f in enumerate(fakes)]
    return VLLMDriver(servers, "s3://bucket/run", options, clock=clock or (lambda: 0.0), **kw)


def _reporting(url: str, tok: str, run: str, **kw: Any) -> FleetReporting:
    return FleetReporting(url, run, tok, **kw)


def _seeing(*steps: int | None, driver: VLLMDriver | None = None) -> StepWatcher:
    """A watcher whose store polls answer ``steps`` in turn; between two it waits until ``driver``'s server
    jobs are done (instead of a poll interval); it stops after the last."""
    answers = list(steps)
    stop = threading.Event()

    def wait(seconds: float) -> None:
        if driver is not None:
            assert driver.settle(30)
        if not answers:
            stop.set()

    return StepWatcher(lambda: answers.pop(0) if answers else None, stop=stop, wait=wait)


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
        assert [s.phase for s in d.sessions] == [Phase.NEEDS_REPLACEMENT, Phase.READY]
        with pytest.raises(ServerError, match="every vLLM server needs replacement"):
            other.broken = {4}
            d.follow(_seeing(4, driver=d))


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
        out = d.follow(
            _seeing(1, None, 3, 4, 5, driver=d), until=4, on_update=lambda u: seen.append((u.url, u.step, u.state))
        )
    assert out == {"http://vllm-0": 4, "http://vllm-1": 4}
    assert sorted(seen) == sorted(
        [(f"http://vllm-{i}", s, "serving") for i in (0, 1) for s in (1, 3, 4)]
    )  # steps 1, 3, 4 only: never one it already serves, never past the target


def test_follow_returns_only_after_the_last_update_was_reported() -> None:
    """``follow(until=)`` returns once the update that reached ``until`` was audited and reported: its
    caller closes the driver next, which once closed the connection under that update's audit
    (CI: "Cannot send a request, as the client has been closed", and the step's report was lost)."""
    fake = ScriptedVLLM()
    go, decided = threading.Event(), threading.Event()
    order: list[str] = []

    def wait(seconds: float) -> None:
        assert go.wait(30)  # the next observation comes while the step-4 job is reporting

    watcher = StepWatcher(lambda: 4, stop=threading.Event(), wait=wait)

    def on_update(u: Any) -> None:
        go.set()
        assert decided.wait(30)  # follow either waits for this job, or returned without it
        order.append(f"reported {u.step}")

    with _driver(fake) as d:
        d.init()
        settle = d.settle

        def settling(timeout: float | None = None) -> bool:
            order.append("settle")
            decided.set()
            return settle(timeout)

        d.settle = settling  # type: ignore[method-assign]
        out = d.follow(watcher, until=4, on_update=on_update)
        order.append("returned")
        decided.set()
    assert out == {"http://vllm-0": 4}
    assert order == ["settle", "reported 4", "returned"]


def test_a_server_without_the_deltasync_backend_is_a_clear_error_at_init() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"detail": "Not Found"})

    d = VLLMDriver([VLLMServer("http://plain", transport=httpx.MockTransport(handler))], "s3://b/r")
    with pytest.raises(ServerError, match="VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config"):
        d.init()  # the only server failed: nothing can be driven
    d.close()


def test_a_server_that_cannot_be_set_up_is_failed_and_the_others_go_on() -> None:
    good, bad = ScriptedVLLM(), ScriptedVLLM()
    bad.hostile["/init_weight_transfer_engine"] = lambda r: httpx.Response(200, text="<html>not vLLM</html>")
    changes: list[tuple[str, str]] = []
    with _driver(bad, good) as d:
        d.init()  # no error: one server could be set up
        assert d.failed() == ["http://vllm-0"] and d.unreachable() == []
        assert [s.state()[0] for s in d.sessions] == ["failed", "serving"]
        out = d.follow(_seeing(1, driver=d), until=1, on_change=lambda url, what: changes.append((url, what)))
        assert out == {"http://vllm-0": None, "http://vllm-1": 1}  # until returned: the failed one does not count
        assert good.version == "1" and bad.version == "0"
        # set up again at each observation; failing the same way again is no news (said at init, by the log)
        assert changes == [] and bad.calls.count("/init_weight_transfer_engine") >= 2
        bad.hostile["/init_weight_transfer_engine"] = lambda r: httpx.Response(500, json={"error": "no backend"})
        d.follow(_seeing(1, driver=d), on_change=lambda url, what: changes.append((url, what)))
        assert [url for url, _ in changes] == ["http://vllm-0"] and changes[0][1].startswith("failed: init:")
        del bad.hostile["/init_weight_transfer_engine"]
        d.follow(_seeing(2, driver=d), until=2, on_change=lambda url, what: changes.append((url, what)))
        assert (bad.version, good.version) == ("2", "2") and d.failed() == []
        assert changes[-1] == ("http://vllm-0", "set up again (it serves step 0)")


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
        with _driver(ok, refusing, broken, reporting=_reporting(signal.url, tok, "run-d")) as d:
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
    with pytest.raises(ValueError, match="replicas names 1 replicas for 2 servers"):
        _driver(ScriptedVLLM(), ScriptedVLLM(), reporting=_reporting("http://127.0.0.1:9", tok, "r", replicas=["a"]))


# ------------------------------------------------------------------------------- all or nothing


def _fleet(n: int, version: str | None = "3") -> tuple[list[str], list[ScriptedVLLM]]:
    journal: list[str] = []
    return journal, [ScriptedVLLM(version, journal) for _ in range(n)]


def test_all_or_nothing_prepares_every_server_before_pausing_any() -> None:
    journal, fakes = _fleet(3)
    with _driver(*fakes, options=ALL_OR_NOTHING) as d:
        d.init()
        got = d.update(4)
        assert [u.state for u in got] == ["serving"] * 3 and [u.version for u in got] == ["4"] * 3
        assert d.serving() == {f"http://vllm-{i}": 4 for i in range(3)}
    assert [f.version for f in fakes] == ["4"] * 3 and all(f.prepared == [4] for f in fakes)
    first_pause = next(i for i, c in enumerate(journal) if c.endswith("/pause"))
    assert sum(c.endswith("/collective_rpc") for c in journal[:first_pause]) == 3


def test_all_or_nothing_a_failed_prepare_touches_no_server() -> None:
    journal, fakes = _fleet(3)
    fakes[1].unpreparable = {4}
    with _driver(*fakes, options=ALL_OR_NOTHING) as d:
        d.init()
        got = d.update(4)
        assert [u.state for u in got] == ["held_back", "failed", "held_back"]
        assert "could not be prepared: HTTP 500: UpdateRolledBack: step 4: checksum" in (got[1].error or "")
        assert "http://vllm-1 could not prepare it" in (got[0].error or "")
        assert [u.version for u in got] == ["3", None, "3"]
        assert d.serving() == {f"http://vllm-{i}": 3 for i in range(3)}
    assert not any(c.endswith(("/pause", "/update_weights")) for c in journal)
    assert [f.version for f in fakes] == ["3"] * 3


def test_all_or_nothing_a_refused_step_brings_the_others_back_to_their_previous_step() -> None:
    _, fakes = _fleet(3)
    fakes[2].rolled_back = {4}
    with _driver(*fakes, options=ALL_OR_NOTHING) as d:
        d.init()
        got = d.update(4)
        assert [u.state for u in got] == ["rolled_back"] * 3
        assert [u.version for u in got] == ["3"] * 3
        assert "step 4 was not taken by http://vllm-2; brought back to step 3" in (got[0].error or "")
        assert "UpdateRolledBack: step 4: corrupt patch" in (got[2].error or "")
        assert d.serving() == {f"http://vllm-{i}": 3 for i in range(3)}
        assert [(u.url, u.step, u.state) for u in d.history] == [
            ("http://vllm-0", 4, "serving"),
            ("http://vllm-1", 4, "serving"),
            ("http://vllm-2", 4, "rolled_back"),
            ("http://vllm-0", 3, "serving"),
            ("http://vllm-1", 3, "serving"),
        ]
    assert [f.version for f in fakes] == ["3"] * 3 and not any(f.paused for f in fakes)


def test_all_or_nothing_a_failed_way_back_is_reported_as_what_the_server_serves() -> None:
    _, fakes = _fleet(2)
    fakes[1].rolled_back = {4}
    fakes[0].rolled_back = {3}  # it takes 4, then refuses to go back to 3: it serves 4
    with _driver(*fakes, options=ALL_OR_NOTHING) as d:
        d.init()
        got = d.update(4)
        assert [(u.state, u.version) for u in got] == [("serving", "4"), ("rolled_back", "3")]
        assert "bringing this server back to step 3 failed" in (got[0].error or "")
        assert d.serving() == {"http://vllm-0": 4, "http://vllm-1": 3}


def test_all_or_nothing_is_refused_with_a_server_that_needs_replacement_or_of_unknown_step() -> None:
    _, fakes = _fleet(2)
    fakes[0].broken = {4}
    with _driver(*fakes, options=ALL_OR_NOTHING) as d:
        d.init()
        assert [u.state for u in d.update(4)] == ["needs_replacement", "rolled_back"]
        calls = [len(f.calls) for f in fakes]
        got = d.update(5)
        assert [u.state for u in got] == ["needs_replacement", "held_back"]
        assert "http://vllm-0 needs replacement" in (got[1].error or "")
        assert [len(f.calls) for f in fakes] == calls  # nothing touched
    unknown = ScriptedVLLM(version=None)
    with _driver(unknown, ScriptedVLLM(), options=ALL_OR_NOTHING) as d:
        d.init()
        got = d.update(1)
        assert [u.state for u in got] == ["held_back", "held_back"]
        assert "http://vllm-0 serves no known step" in (got[0].error or "")


def test_all_or_nothing_retries_the_whole_rollout_after_the_backoff() -> None:
    now = [0.0]
    _, fakes = _fleet(2)
    fakes[1].rolled_back = {4}
    with _driver(*fakes, clock=lambda: now[0], options=ALL_OR_NOTHING) as d:
        d.init()
        assert [u.state for u in d.catch_up(4)] == ["rolled_back", "rolled_back"]
        assert d.catch_up(4) == []  # the fleet waits out the backoff
        fakes[1].rolled_back = set()
        now[0] = 2.0
        assert [u.state for u in d.catch_up(4)] == ["serving", "serving"]
        assert d.serving() == {"http://vllm-0": 4, "http://vllm-1": 4}


def test_all_or_nothing_reports_the_truth_to_the_fleet_view() -> None:
    from server_harness import ThreadServer

    from deltasync.server import Settings, create_app
    from deltasync.signal import SignalClient

    _, fakes = _fleet(2)
    fakes[1].rolled_back = {4}
    tok = "publish-token-rollout"
    with ThreadServer(create_app(Settings(publish_token=tok))) as signal, SignalClient(signal.url, tok) as trainer:
        for step in (3, 4):
            trainer.publish("run-r", step, f"{step:032x}")
        with _driver(*fakes, reporting=_reporting(signal.url, tok, "run-r"), options=ALL_OR_NOTHING) as d:
            d.init()
            d.update(4)
            assert d.reports_delivered(30)
            rows = {r.replica: r for r in trainer.fleet("run-r").replicas}
            assert (rows["vllm-0"].step, rows["vllm-0"].state) == (3, "serving")
            assert "brought back to step 3" in (rows["vllm-0"].last_error or "")
            assert (rows["vllm-1"].step, rows["vllm-1"].state) == (3, "failed")


def test_follow_all_or_nothing_reaches_the_driver(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``deltasync follow --vllm ... --all-or-nothing`` builds its driver in that mode (and not without it)."""
    import deltasync.serving.driver as driver_module
    from deltasync.cli.main import main

    class Built(Exception):
        pass

    seen: list[dict[str, Any]] = []

    def recording_driver(servers: list[str], store: str, options: DriverOptions, **kw: Any) -> VLLMDriver:
        seen.append({"servers": servers, "all_or_nothing": options.all_or_nothing, **kw})
        raise Built

    monkeypatch.setattr(driver_module, "VLLMDriver", recording_driver)
    (tmp_path / "store").mkdir()
    for extra in (["--all-or-nothing"], []):
        with pytest.raises(Built):
            main(["follow", "--store", str(tmp_path / "store"), "--vllm", "http://a:8000", "http://b:8000", *extra])
    assert [(s["servers"], s["all_or_nothing"]) for s in seen] == [
        (["http://a:8000", "http://b:8000"], True),
        (["http://a:8000", "http://b:8000"], False),
    ]


# ------------------------------------------------------------------------------- faults (issue 34)


class HangingVLLM(ScriptedVLLM):
    """A server whose ``/pause`` does not answer until ``release`` is set (a SIGSTOPped server)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/pause":
            assert self.release.wait(60), "never released"
        return super().handle(request)


def test_the_driver_prepares_each_step_before_it_pauses() -> None:
    fake, unpreparable = ScriptedVLLM(), ScriptedVLLM()
    unpreparable.unpreparable = {1}
    with _driver(fake, unpreparable) as d:
        d.init()
        ok, late = d.update(1)
    assert fake.prepared == [1]
    i = fake.calls.index("/collective_rpc")
    assert fake.calls[i + 1] == "/pause?mode=wait&clear_cache=true"
    assert ok.ok and ok.prepared and ok.prepare_s is not None
    assert late.ok and not late.prepared and late.prepare_s is not None  # updated anyway, downloading in the pause
    with _driver(ScriptedVLLM(), options=DriverOptions(prepare=False)) as d:
        d.init()
        (u,) = d.update(1)
    assert u.ok and not u.prepared and u.prepare_s is None


def test_a_hung_server_holds_back_none_of_the_others() -> None:
    hung, ok = HangingVLLM(), ScriptedVLLM()
    answers = [1, 2]
    stop = threading.Event()

    def wait(seconds: float) -> None:  # the next poll once the healthy server serves the last step seen
        # an event, not a time: the bound only keeps a broken driver from hanging the suite
        for _ in range(6000):
            if ok.version == str(seen[-1]):
                break
            threading.Event().wait(0.01)
        else:
            raise AssertionError(f"the healthy server never served step {seen[-1]} while the other hung")
        if not answers:
            stop.set()

    seen: list[int] = []

    def poll() -> int | None:
        if answers:
            seen.append(answers.pop(0))
        return seen[-1] if seen else None

    with _driver(hung, ok) as d:
        d.init()
        d.follow(StepWatcher(poll, stop=stop, wait=wait))
        assert ok.version == "2" and hung.version == "0"  # server 1 took steps 1 and 2 while server 0 hung
        hung.release.set()
        assert d.settle(30)
        d.follow(_seeing(2, driver=d))
        assert hung.version == "2" and d.serving() == {"http://vllm-0": 2, "http://vllm-1": 2}


def test_a_restarted_server_is_set_up_again_and_brought_to_the_newest_step() -> None:
    a, b = ScriptedVLLM(), ScriptedVLLM()
    changes: list[tuple[str, str]] = []
    with _driver(a, b) as d:
        d.init()
        d.follow(_seeing(1, driver=d))
        assert (a.version, b.version) == ("1", "1")
        # b dies: unreachable until it answers again
        b.down = True
        d.follow(_seeing(2, driver=d), on_change=lambda url, what: changes.append((url, what)))
        assert d.unreachable() == ["http://vllm-1"] and a.version == "2"
        assert changes[0][0] == "http://vllm-1" and changes[0][1].startswith("unreachable: ")
        assert changes[0][1].endswith("set up again once it answers")
        # ... and a new process answers on its URL: booted from a step 0 dir, its backend never set up
        b.down, b.initialised, b.version = False, False, "0"
        d.follow(_seeing(2, driver=d), on_change=lambda url, what: changes.append((url, what)))
        assert b.version == "2" and d.unreachable() == []
        assert changes[-1] == ("http://vllm-1", "set up again (it serves step 0)")  # its weight version "0"
        # restarted between two polls, with the version the old process had: its refusal says it is new
        b.initialised, b.version = False, "2"
        d.follow(_seeing(3, driver=d))
        assert b.version == "3"
        i = b.calls.index("/update_weights", len(b.calls) - 30)
        assert "/init_weight_transfer_engine" in b.calls[i:]  # set up again after the refusal, then updated
        assert [u.state for u in d.history if u.url == "http://vllm-1" and u.step == 3] == ["rolled_back", "serving"]


def test_the_sidecar_starts_with_the_servers_it_can_reach_and_sets_up_the_others_when_they_answer() -> None:
    late, up = ScriptedVLLM(), ScriptedVLLM()
    late.down = True
    with _driver(late, up) as d:
        d.init()  # no error: the sidecar starts with what it can reach
        assert d.unreachable() == ["http://vllm-0"]
        assert d.follow(_seeing(1, driver=d), until=1) == {"http://vllm-0": None, "http://vllm-1": 1}
        late.down = False
        d.follow(_seeing(1, driver=d))
        assert late.version == "1" and d.unreachable() == []


def test_the_fleet_view_shows_an_unreachable_server_and_the_digest_of_each_step() -> None:
    from server_harness import ThreadServer

    from deltasync.server import Settings, create_app
    from deltasync.signal import SignalClient

    dead, ok = ScriptedVLLM(), ScriptedVLLM()
    dead.down = True
    tok = "publish-token-driver"
    with ThreadServer(create_app(Settings(publish_token=tok))) as signal, SignalClient(signal.url, tok) as trainer:
        for step in (0, 1):
            trainer.publish("run-u", step, f"{step:032x}")
        reporting = _reporting(signal.url, tok, "run-u", digest=lambda s: f"{s:032x}")
        with _driver(dead, ok, reporting=reporting) as d:
            d.init()
            d.update(1)
            assert d.reports_delivered(30)
            rows = {r.replica: r for r in trainer.fleet("run-u").replicas}
    assert rows["vllm-0"].state == "unreachable" and "unreachable" in (rows["vllm-0"].last_error or "")
    assert (rows["vllm-1"].state, rows["vllm-1"].step, rows["vllm-1"].digest) == ("serving", 1, f"{1:032x}")
    assert rows["vllm-1"].digest_ok is True


def test_a_signal_server_restart_while_following_loses_no_step_and_the_fleet_view_comes_back() -> None:
    """The signal server dies and a new one starts on its URL while the driver follows: the steps committed
    meanwhile are found by polling the store, the stream is picked up again, and the new server's fleet
    view is rebuilt by the driver's heartbeats."""
    from server_harness import ThreadServer, free_port

    from deltasync.server import Settings, create_app
    from deltasync.signal import SignalClient

    tok, port = "publish-token-restart", free_port()
    fake = ScriptedVLLM()
    store = [0]  # the newest committed step, as the store's poll sees it
    stop = threading.Event()
    pause = threading.Event()

    def until(pred: Any) -> None:
        for _ in range(600):  # bounded
            if pred():
                return
            pause.wait(0.05)
        raise AssertionError("not reached")

    first = ThreadServer(create_app(Settings(publish_token=tok)), port=port).__enter__()
    d = _driver(fake, reporting=_reporting(first.url, tok, "run-s", heartbeat=0.2))
    watcher = StepWatcher(
        lambda: store[-1], signal_url=first.url, token=tok, run="run-s", heartbeat=0.2, poll_interval=0.2, stop=stop
    )
    follower = threading.Thread(target=d.follow, args=(watcher,), kwargs={"until": 3})
    try:
        d.init()
        follower.start()
        with SignalClient(first.url, tok) as trainer:
            store.append(1)
            trainer.publish("run-s", 1, f"{1:032x}")
        until(lambda: fake.version == "1")
        first.__exit__(None, None, None)  # the signal server goes away
        store.append(2)  # a commit while it is down: found by polling the store
        until(lambda: fake.version == "2")
        with (
            ThreadServer(create_app(Settings(publish_token=tok)), port=port) as second,
            SignalClient(second.url, tok) as trainer,
        ):
            until(lambda: [r.replica for r in trainer.fleet("run-s").replicas] == ["vllm-0"])  # rebuilt
            store.append(3)
            trainer.publish("run-s", 3, f"{3:032x}")
            follower.join(30)
            assert not follower.is_alive() and fake.version == "3"
            until(lambda: [(r.step, r.state) for r in trainer.fleet("run-s").replicas] == [(3, "serving")])
    finally:
        stop.set()
        follower.join(30)
        d.close()


def test_the_driver_s_metrics_say_the_pause_of_prepared_updates_and_the_prepare_latency() -> None:
    from deltasync.serving.driver_metrics import DriverMetrics

    metrics = DriverMetrics()
    ok, unpreparable, dead = ScriptedVLLM(), ScriptedVLLM(), ScriptedVLLM()
    unpreparable.unpreparable, dead.down = {1}, True
    with _driver(ok, unpreparable, dead, metrics=metrics) as d:
        d.init()
        d.update(1)
        with metrics.serve(0) as endpoint:
            text = httpx.get(endpoint.url, timeout=10).text
    assert text == metrics.render()
    lines = text.splitlines()
    assert 'deltasync_vllm_updates_total{server="http://vllm-0",state="serving"} 1' in lines
    assert 'deltasync_vllm_pause_seconds_count{server="http://vllm-0",prepared="true"} 1' in lines
    assert 'deltasync_vllm_pause_seconds_count{server="http://vllm-1",prepared="false"} 1' in lines
    assert 'deltasync_vllm_prepare_seconds_count{server="http://vllm-0"} 1' in lines
    assert 'deltasync_vllm_serving_step{server="http://vllm-1"} 1' in lines
    assert 'deltasync_vllm_server_up{server="http://vllm-2"} 0' in lines
    assert "# TYPE deltasync_vllm_pause_seconds histogram" in lines


def test_update_sets_a_restarted_server_up_again_before_updating_it() -> None:
    """``driver.update(step)`` (TRL's transfer) checks each server first, as ``follow`` does."""
    fake, same = ScriptedVLLM(), ScriptedVLLM()
    with _driver(fake, same) as d:
        d.init()
        assert all(u.ok for u in d.update(1))
        fake.initialised, fake.version = False, "0"  # restarted from a step 0 dir: a new weight version
        same.initialised = False  # restarted between two updates, with the version the old one had
        got = d.update(2)
    assert [u.state for u in got] == ["serving", "serving"] and (fake.version, same.version) == ("2", "2")
    assert (
        fake.calls.count("/init_weight_transfer_engine") == 2 and same.calls.count("/init_weight_transfer_engine") == 2
    )
