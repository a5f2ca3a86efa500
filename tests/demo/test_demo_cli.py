"""``deltasync demo`` as a user (and the Space's Dockerfile) runs it: a real process serving real HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx", reason="the test extra installs httpx")

from demo_process import FAST, RUN_TIMEOUT, START_TIMEOUT, Demo, deltasync_cmd, free_port  # noqa: E402


@pytest.fixture
def demo_factory(tmp_path: Path) -> Iterator[Callable[..., Demo]]:
    started: list[Demo] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Demo:
        d = Demo(list(args), tmp_path, env)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop(signal.SIGKILL)


def read_sse(demo: Demo, want: Callable[[list[dict[str, Any]]], bool], timeout: float) -> list[dict[str, Any]]:
    """Events from ``/api/events`` until ``want(events)``, bounded by ``timeout`` per read."""
    events: list[dict[str, Any]] = []
    with demo.client.stream("GET", "/api/events", timeout=httpx.Timeout(timeout)) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
                if want(events):
                    return events
    pytest.fail(f"event stream ended after {len(events)} events")


def finished_run(demo: Demo, after: int) -> dict[str, Any]:
    """The page's state (one snapshot) once a run later than episode ``after`` ended bit-exact."""
    got: list[dict[str, Any]] = []

    def done() -> bool:
        s = demo.state()
        if s["episode"] > after and s["bit_exact"] is True:
            got.append(s)
        return bool(got)

    demo.wait_until(f"a run after run {after} to finish", done, START_TIMEOUT + RUN_TIMEOUT)
    return got[0]


def check_signal_path(demo: Demo, s: dict[str, Any]) -> None:
    """In the run ``s`` shows: every commit signal accepted, and steps reached the follower through it."""
    assert s["signal_server"] == f"http://127.0.0.1:{demo.port}/signal"
    signals = s["trainer"]["signals"]
    assert signals["refused"] == 0 and signals["failed"] == 0 and signals["sent"] >= 1, signals
    # the follower listened before the first commit: the signal server announced steps to it
    assert s["paths"]["signal"] >= 1, s["paths"]
    head = demo.client.get(f"/signal/v1/runs/demo-{s['episode']}/head")
    assert head.status_code == 200 and head.json()["step"] == 25, head.text


def test_entrypoint_serves_page_state_and_live_events(demo_factory: Callable[..., Demo]) -> None:
    # as in the Space: the Dockerfile sets DELTASYNC_DEMO_LOOP, so a finished run starts over
    demo = demo_factory("--store", "store", *FAST, env={"DELTASYNC_DEMO_LOOP": "3"})
    demo.wait_until("/healthz", lambda: demo.client.get("/healthz").status_code == 200, START_TIMEOUT)
    page = demo.client.get("/")
    assert page.status_code == 200 and "deltasync" in page.text
    assert demo.client.get("/static/app.js").status_code == 200

    events = read_sse(demo, lambda evs: any(e["type"] == "applied" for e in evs), RUN_TIMEOUT)
    assert events[0]["type"] == "snapshot" and events[0]["data"]["mode"] == "self-contained"
    assert [e["seq"] for e in events[1:]] == sorted(e["seq"] for e in events[1:])
    applied = next(e for e in events if e["type"] == "applied")["data"]
    assert applied["verified"] is True and isinstance(applied["text"], str)
    assert applied["via"] in ("signal", "store")

    # each snapshot is one run's: read once, its number and its result belong together
    s = finished_run(demo, -1)
    assert s["status"] == "done" and s["error"] is None
    assert s["trainer"]["step"] == 25 and s["applied"]["step"] == 25 and s["head"] == 25
    assert s["commits"][0]["kind"] == "anchor" and s["commits"][-1]["step"] == 25
    assert s["model"]["arch"] == "Qwen3ForCausalLM" and s["model"]["name"] == "tiny"
    # the in-process signal server heard every commit and the follower listens to it
    assert s["signal"].startswith(f"signal server http://127.0.0.1:{demo.port}/signal (SSE)")
    check_signal_path(demo, s)

    # the loop emptied the store and trained again: the signal path works in the next run too
    # (it once refused every commit from the second run on: issue 26, point 8)
    s2 = finished_run(demo, s["episode"])
    assert s2["commits"][0]["step"] == 0 and s2["error"] is None
    check_signal_path(demo, s2)
    rc = demo.stop(signal.SIGINT)
    assert rc in (0, 130), demo.log()
    out = demo.log()
    assert f"open http://127.0.0.1:{demo.port}" in out
    assert "Traceback" not in out
    assert "refused" not in out.replace(" 0 refused", ""), out  # no "signal for step N refused" line
    # the terminal summarized each run, with how its steps reached the inference copy
    paths = [line for line in out.splitlines() if line.startswith("new steps via the signal server: ")]
    assert len(paths) >= 2 and all("0 refused, 0 failed" in line for line in paths), paths


def test_exit_when_done_then_a_follower_on_the_same_store(demo_factory: Callable[..., Demo], tmp_path: Path) -> None:
    trainer = demo_factory("--store", "shared", "--exit-when-done", *FAST)
    assert trainer.proc.wait(timeout=START_TIMEOUT + RUN_TIMEOUT) == 0, trainer.log()
    assert "bit-exact with the trainer's" in trainer.log()
    assert (tmp_path / "shared" / "demo.json").exists()

    # the Space's configuration: its variables name the store and the signal server, no flags
    space_env = {"DELTASYNC_DEMO_FOLLOW": str(tmp_path / "shared"), "DELTASYNC_SIGNAL_URL": "http://127.0.0.1:9/unused"}
    follower = demo_factory(env=space_env)
    follower.wait_until(
        "the follower to apply step 25", lambda: (follower.state()["applied"] or {}).get("step") == 25, START_TIMEOUT
    )
    s = follower.state()
    assert s["mode"] == "follower" and s["trainer"] is None and s["error"] is None
    assert s["store"] == (tmp_path / "shared").as_uri()
    # the named signal server is unreachable: the follower keeps going by polling the store
    assert s["signal"] == "signal server http://127.0.0.1:9/unused (SSE) + store polling"
    assert s["model"]["name"] == "tiny"  # read from the store, not from --model
    committed = sorted(int(p.name) for p in (tmp_path / "shared" / "steps").iterdir())
    assert committed[0] == 0 and committed[-1] == 25  # (steps may be coalesced while the store is busy)
    assert [c["step"] for c in s["commits"]] == committed
    assert (tmp_path / "shared" / "steps").is_dir()  # a follower never wipes the store
    follower.stop()
    assert not (tmp_path / "deltasync-demo").exists()  # nothing trained in the default store


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_run_the_demo_did_not_create_is_refused_and_left_untouched(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import deltasync as ds

    run = tmp_path / "run"
    with ds.DeltaUploader(ds.open_store(run)) as up:
        up.push({"w": torch.arange(8, dtype=torch.float32)}, 7).result()
    before = _files(run)
    r = subprocess.run(
        [*deltasync_cmd(), "demo", "--port", str(free_port()), "--no-browser", "--store", str(run), *FAST[:2]],
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith(f"error: {run.as_uri()} is not empty and was not created by the demo"), r.stderr
    assert r.stderr.rstrip().endswith("pass --store with a new path or an empty directory")
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1
    assert _files(run) == before  # not a byte deleted, added or changed


def test_the_demo_trains_in_an_empty_dir_and_resets_its_own_store(
    demo_factory: Callable[..., Demo], tmp_path: Path
) -> None:
    (tmp_path / "own").mkdir()
    short = [
        "--store",
        "own",
        "--exit-when-done",
        "--model",
        "tiny",
        "--steps",
        "3",
        "--step-interval",
        "0",
        "--no-browser",
    ]
    first = demo_factory(*short)
    assert first.proc.wait(timeout=START_TIMEOUT + RUN_TIMEOUT) == 0, first.log()
    assert (tmp_path / "own" / ".deltasync-demo").is_file()
    (tmp_path / "own" / "steps" / "000000000099").mkdir()
    (tmp_path / "own" / "steps" / "000000000099" / "manifest.json").write_bytes(b"left by the first run")
    second = demo_factory(*short)  # the store is the demo's own: emptied, then trained again
    assert second.proc.wait(timeout=START_TIMEOUT + RUN_TIMEOUT) == 0, second.log()
    assert "bit-exact with the trainer's" in second.log()
    assert not (tmp_path / "own" / "steps" / "000000000099" / "manifest.json").exists()
    assert (tmp_path / "own" / ".deltasync-demo").is_file()


def test_a_taken_port_is_a_one_line_error(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = subprocess.run(
            [*deltasync_cmd(), "demo", "--port", str(port), "--no-browser", "--store", str(tmp_path / "st")],
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT,
            stdin=subprocess.DEVNULL,
        )
    assert r.returncode == 1
    assert r.stderr.strip() == f"error: 127.0.0.1:{port} is already in use; pass --port to pick another"
    assert not (tmp_path / "st").exists()  # nothing was created or wiped


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "0"], "error: --steps must be >= 1"),
        (["--store", "ftp://host/x"], "unsupported store scheme 'ftp'"),
    ],
)
def test_bad_options_are_one_line_errors(args: list[str], message: str, tmp_path: Path) -> None:
    r = subprocess.run(
        [*deltasync_cmd(), "demo", "--port", str(free_port()), "--no-browser", *args],
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT,
        stdin=subprocess.DEVNULL,
        cwd=tmp_path,
    )
    assert r.returncode == 1 and message in r.stderr and "Traceback" not in r.stderr


def test_the_terminal_prints_a_summary_when_the_run_ends_and_keeps_serving(
    demo_factory: Callable[..., Demo],
) -> None:
    demo = demo_factory("--store", "store", *FAST)
    demo.wait_until(
        "the end-of-run summary",
        lambda: "run finished:" in demo.log() and "Ctrl-C to stop)" in demo.log().split("run finished:")[-1],
        START_TIMEOUT + RUN_TIMEOUT,
    )
    out = demo.log()
    summary = out[out.index("run finished:") :].splitlines()
    s = demo.state()
    n = len(s["commits"])  # 26 (steps 0..25) unless the uploader folded some while the store was busy
    folded = "" if n == 26 else f" ({26 - n} step{'s' if 26 - n > 1 else ''} folded into later commits)"
    assert summary[0] == (
        f"run finished: 25 training steps (+ initial weights at step 0), {n} commits{folded}; "
        "inference copy at step 25, bit-exact with the trainer's"
    ), out
    anchors = [c for c in s["commits"] if c["kind"] == "anchor"]
    assert summary[1].startswith("shipped ") and f": {len(anchors)} anchors " in summary[1], out
    assert f" + {n - len(anchors)} patches " in summary[1] and "as full checkpoints" in summary[1]
    # how the steps reached the inference copy, and what became of the trainer's signals
    assert summary[2].startswith("new steps via the signal server: ") and summary[2].endswith(
        f"the trainer's signals: {s['trainer']['signals']['sent']} sent, 0 refused, 0 failed"
    ), out
    assert summary[3] == f"still serving http://127.0.0.1:{demo.port} (Ctrl-C to stop)"
    assert out.count("run finished:") == 1
    # printed after the run ended, while the page is still served
    assert demo.proc.poll() is None and demo.client.get("/healthz").json()["status"] == "done"
    assert demo.stop(signal.SIGINT) in (0, 130)
    assert "Traceback" not in demo.log()
