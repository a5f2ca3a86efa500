"""The vLLM backend's fleet reports (``serving/fleet.py``) without an engine: the status dicts
a backend produces become fleet rows on a real signal server (127.0.0.1), with the run's name and the
steps' digests read from a real local store. The engines themselves report in test_vllm_fleet.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from server_harness import ThreadServer

from deltasync import DeltaUploader, open_store
from deltasync.server import Settings, create_app
from deltasync.serving.fleet import EngineReporter, replica_state
from deltasync.signal import SignalClient

torch = pytest.importorskip("torch")
TOKEN = "publish-token-engine"
WAIT = 30.0


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        ({"step": None, "state": "serving", "last_error": None}, (None, "starting", None)),
        ({"step": 3, "state": "serving", "last_error": None}, (3, "serving", None)),
        ({"step": 3, "state": "serving", "last_error": "UpdateRolledBack: x"}, (3, "failed", "UpdateRolledBack: x")),
        ({"step": 3, "state": "needs_replacement", "last_error": "lost"}, (3, "needs_replacement", "lost")),
        (
            {"step": None, "state": "serving", "last_error": "EngineIncompatible: y"},
            (None, "failed", "EngineIncompatible: y"),
        ),
        ({"step": True, "state": "serving"}, (None, "starting", None)),
    ],
)
def test_an_engine_status_maps_to_a_fleet_state(
    status: dict[str, object], expected: tuple[int | None, str, str | None]
) -> None:
    assert replica_state(status) == expected


def test_the_engine_reports_under_the_store_run_id_with_each_step_digest(tmp_path: Path) -> None:
    url = (tmp_path / "run").as_uri()
    with ThreadServer(create_app(Settings(publish_token=TOKEN))) as signal, SignalClient(signal.url, TOKEN) as c:
        rep = EngineReporter(signal.url, TOKEN, run=None, replica="engine-7", heartbeat=10.0)
        try:
            rep.report({"step": None, "state": "serving", "last_error": None, "store": url})
            assert rep.flush(WAIT) and not rep.delivered(0)  # nothing committed: no run name, nothing sent
            with DeltaUploader(open_store(url), run_id="eng-run", signal_url=signal.url, signal_token=TOKEN) as up:
                digests = {s: up.push({"w": torch.full((4,), float(s))}, s).result().manifest_digest for s in (0, 1)}
            rep.report({"step": 0, "state": "serving", "last_error": None, "store": url})
            assert rep.delivered(WAIT)
            (r,) = c.fleet("eng-run").replicas
            assert (r.replica, r.step, r.lag, r.state, r.digest, r.digest_ok) == (
                "engine-7",
                0,
                1,
                "serving",
                digests[0],
                True,
            )
            rep.report({"step": 0, "state": "serving", "last_error": "UpdateRolledBack: step 1", "store": url})
            assert rep.delivered(WAIT)
            (r,) = c.fleet("eng-run").replicas
            assert (r.step, r.state, r.last_error) == (0, "failed", "UpdateRolledBack: step 1")
        finally:
            rep.close()
        assert c.fleet("eng-run").replicas == ()
