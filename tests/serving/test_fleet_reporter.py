"""The vLLM backend's fleet reports (``serving/fleet.py``) without an engine: the engine statuses
a backend produces become fleet rows on a real signal server (127.0.0.1), with the run's name and the
steps' digests read from a real local store. The engines themselves report in test_vllm_fleet.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from server_harness import ThreadServer

from deltasync import DeltaUploader, open_store
from deltasync.server import Settings, create_app
from deltasync.serving.engine.mirror import EngineStatus
from deltasync.serving.fleet import EngineReporter, replica_state
from deltasync.signal import ReplicaState, SignalClient

torch = pytest.importorskip("torch")
TOKEN = "publish-token-engine"
WAIT = 30.0


def _status(step: int | None, state: ReplicaState = "serving", last_error: str | None = None) -> EngineStatus:
    return EngineStatus(step, None, state, last_error, "file:///run")


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (_status(None), (None, "starting", None)),
        (_status(3), (3, "serving", None)),
        (_status(3, last_error="UpdateRolledBack: x"), (3, "failed", "UpdateRolledBack: x")),
        (_status(3, "needs_replacement", "lost"), (3, "needs_replacement", "lost")),
        (_status(None, last_error="EngineIncompatible: y"), (None, "failed", "EngineIncompatible: y")),
    ],
)
def test_an_engine_status_maps_to_a_fleet_state(
    status: EngineStatus, expected: tuple[int | None, ReplicaState, str | None]
) -> None:
    assert replica_state(status) == expected


def test_the_engine_reports_under_the_store_run_id_with_each_step_digest(tmp_path: Path) -> None:
    url = (tmp_path / "run").as_uri()
    with ThreadServer(create_app(Settings(publish_token=TOKEN))) as signal, SignalClient(signal.url, TOKEN) as c:
        rep = EngineReporter(signal.url, TOKEN, run=None, replica="engine-7", heartbeat=10.0)
        try:
            rep.report(EngineStatus(None, None, "serving", None, url))
            assert rep.flush(WAIT) and not rep.delivered(0)  # nothing committed: no run name, nothing sent
            with DeltaUploader(open_store(url), run_id="eng-run", signal_url=signal.url, signal_token=TOKEN) as up:
                digests = {s: up.push({"w": torch.full((4,), float(s))}, s).result().manifest_digest for s in (0, 1)}
            rep.report(EngineStatus(0, None, "serving", None, url))
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
            rep.report(EngineStatus(0, None, "serving", "UpdateRolledBack: step 1", url))
            assert rep.delivered(WAIT)
            (r,) = c.fleet("eng-run").replicas
            assert (r.step, r.state, r.last_error) == (0, "failed", "UpdateRolledBack: step 1")
        finally:
            rep.close()
        assert c.fleet("eng-run").replicas == ()
