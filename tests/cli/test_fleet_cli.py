"""``deltasync fleet`` and the fleet reports of ``deltasync follow``, against a real signal server on
127.0.0.1: a follower reports what its dir serves, the trainer's gate (``DeltaUploader.wait_for_replicas``)
waits for it, and ``deltasync fleet`` shows the table or waits with ``--wait`` and exits 1 with the report."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from server_harness import ThreadServer

from deltasync import DeltaUploader, open_store
from deltasync.cli import main
from deltasync.server import Settings, create_app
from deltasync.signal import FleetReporter, FleetView, SignalClient

torch = pytest.importorskip("torch")
WAIT = 60.0


@pytest.fixture(scope="module")
def signal() -> Iterator[ThreadServer]:
    with ThreadServer(create_app(Settings())) as s:
        yield s


def state(step: int) -> dict[str, torch.Tensor]:
    w = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    w[step % 8, :] += step + 1
    return {"w": w, "b": torch.full((8,), float(step))}


def test_follow_reports_its_dir_and_the_uploader_gate_waits_for_it(
    tmp_path: Path, signal: ThreadServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for var in ("DELTASYNC_SUBSCRIBE_TOKEN", "DELTASYNC_PUBLISH_TOKEN", "DELTASYNC_REPORT_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    store_url = (tmp_path / "run").as_uri()
    with DeltaUploader(open_store(store_url), run_id="cli-fleet", signal_url=signal.url) as up:
        up.push(state(0), 0).result()
        argv = ["follow", "--store", store_url, "--out", "live", "--until", "3", "--signal", signal.url]
        with ThreadPoolExecutor(1) as pool:
            follower = pool.submit(main, [*argv, "--replica", "follower-1", "--poll-interval", "0.1"])
            for step in (1, 2):
                up.push(state(step), step).result()
            view = up.wait_for_replicas(timeout=WAIT, poll=0.05)  # the newest committed: step 2
            (r,) = view.replicas
            assert (r.replica, r.step, r.lag, r.state, r.digest_ok) == ("follower-1", 2, 0, "serving", True)
            assert json.loads((tmp_path / "live" / ".deltasync.json").read_text())["step"] == 2
            up.push(state(3), 3).result()
            assert follower.result(WAIT) == 0
        with SignalClient(signal.url) as c:
            assert c.fleet("cli-fleet").replicas == ()  # it left when follow returned


def test_fleet_prints_the_table_and_waits(
    signal: ThreadServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("DELTASYNC_SUBSCRIBE_TOKEN", "DELTASYNC_PUBLISH_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    run = "cli-table"
    base = ["fleet", "--signal", signal.url, "--run", run]
    with SignalClient(signal.url) as trainer:
        for step in range(4):
            trainer.publish(run, step, f"{step:032x}")
        with (
            FleetReporter(signal.url, run, replica="engine-a") as a,
            FleetReporter(signal.url, run, replica="engine-b") as b,
        ):
            a.update(3)
            b.update(1, "failed", last_error="UpdateRolledBack: step 2 refused")
            assert a.wait_reported(WAIT) and b.wait_reported(WAIT)
            assert main(base) == 0
            out = capsys.readouterr().out.splitlines()
            assert out[0] == f"run {run}: head 3, 2 live replicas"
            assert out[1].split() == ["replica", "step", "lag", "state", "last", "seen", "audit", "last", "error"]
            assert out[2].split()[:4] == ["engine-a", "3", "0", "serving"]
            assert out[3].split()[:4] == ["engine-b", "1", "2", "failed"]
            assert out[3].endswith("UpdateRolledBack: step 2 refused")
            assert main([*base, "--json"]) == 0
            assert [r["step"] for r in json.loads(capsys.readouterr().out)["replicas"]] == [3, 1]

            assert main([*base, "--wait", "head", "--max-lag", "2", "--timeout", "5", "--poll", "0.05"]) == 0
            capsys.readouterr()
            assert main([*base, "--wait", "3", "--max-lag", "1", "--timeout", "0"]) == 1
            err = capsys.readouterr().err
            assert err.startswith("error: timed out after 0 s waiting for run 'cli-table' to be served at step 2")
            assert "engine-b: step 1, lag 2, state failed" in err and "what to do:" in err
            assert main([*base, "--wait", "3", "--quorum", "1", "--timeout", "0"]) == 0  # engine-a alone

            # the slow one catches up while the CLI waits
            released = threading.Event()
            with ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(main, [*base, "--wait", "3", "--timeout", str(WAIT), "--poll", "0.05"])
                waiting.add_done_callback(lambda f: released.set())
                b.update(3)
                assert released.wait(WAIT) and waiting.result() == 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--wait", "soon"], "expected a step number or 'head'"),
        (["--wait", "-1"], "a step is >= 0"),
        (["--wait", "1", "--quorum", "0"], "a quorum is a count >= 1"),
        (["--wait", "1", "--quorum", "1.5"], "a quorum is a count >= 1"),
    ],
)
def test_fleet_refuses_bad_arguments(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["fleet", "--signal", "http://127.0.0.1:9", "--run", "r", *extra])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_fleet_wait_healthy_only_waits_for_a_diverged_replica(
    signal: ThreadServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from deltasync.protocol.audit import AuditReport, Divergence, fingerprint

    for var in ("DELTASYNC_SUBSCRIBE_TOKEN", "DELTASYNC_PUBLISH_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    run = "cli-healthy"
    base = ["fleet", "--signal", signal.url, "--run", run, "--wait", "1", "--timeout", "0"]
    fp = fingerprint("ab" * 16, [[-2.0] * 4])
    with SignalClient(signal.url) as trainer:
        trainer.publish(run, 1, "1" * 32)
        with FleetReporter(signal.url, run, replica="engine-a") as a:
            a.update(1, "diverged", audit=AuditReport(1, fp, Divergence(3.0, 9.0, 2.0)), last_error="mean_abs 3 > 0.1")
            assert a.wait_reported(WAIT)
            assert main(base) == 0  # it holds step 1
            out = capsys.readouterr().out
            assert "diverged" in out and "step 1 group 0, |d| 3/9 kl 2" in out
            assert main([*base, "--healthy-only"]) == 1
            err = capsys.readouterr().err
            assert "healthy ones only" in err and "engine-a: step 1, lag 0, state diverged" in err


HOSTILE = "boom\x1b[2J\x1b]0;owned\x07\rover\u202eevil\u2066\nnext"


def test_fleet_prints_free_text_escaped(
    signal: ThreadServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """ESC, CR, BEL, bidi overrides and newlines in a last error never reach the terminal raw: the
    server escapes them when a replica reports them, and the table escapes whatever a server sends."""
    for var in ("DELTASYNC_SUBSCRIBE_TOKEN", "DELTASYNC_PUBLISH_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    run = "cli-escape"
    with FleetReporter(signal.url, run, replica="engine-x") as rep:
        rep.update(1, "failed", last_error=HOSTILE)
        assert rep.wait_reported(WAIT)
        assert main(["fleet", "--signal", signal.url, "--run", run]) == 0
    out = capsys.readouterr().out
    assert all(line.isprintable() for line in out.split("\n"))  # split on LF only: a raw CR would show
    assert "boom\\x1b[2J\\x1b]0;owned\\x07\\rover\\u202eevil\\u2066\\nnext" in out
    # a server that sends raw text (an old or hostile one): the table escapes it too
    raw = {"replica": "x\u202ey", "step": 1, "lag": 0, "state": "failed", "last_error": HOSTILE, "age_s": 1.0}
    table = FleetView.from_json({"run": "r", "head": 1, "time": 0.0, "replicas": [raw]}).table()
    assert all(line.isprintable() for line in table.split("\n"))
    assert "x\\u202ey" in table and "\\x1b[2J" in table
