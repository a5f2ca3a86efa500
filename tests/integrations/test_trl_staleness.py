"""DeltaSyncWeightTransfer(max_staleness=k): a sync returns only once every replica reporting to a real
signal server (127.0.0.1) serves step N - k or newer, and raises StalenessTimeout naming the replica
behind. The replica here is a FleetReporter standing in for an engine (the engines themselves report
in test_vllm_backend.py); TRL itself is not needed: the transfer is called as TRL calls it."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from server_harness import ThreadServer

from deltasync.errors import StalenessTimeout
from deltasync.integrations.trl import DeltaSyncWeightTransfer
from deltasync.server import Settings, create_app
from deltasync.signal import FleetReporter

torch = pytest.importorskip("torch")
TOKEN = "publish-token-trl"
WAIT = 60.0


def weights(i: int) -> Iterator[tuple[str, torch.Tensor]]:
    yield "w", torch.arange(32, dtype=torch.float32) * (i + 1)


def sync(transfer: DeltaSyncWeightTransfer, i: int) -> None:
    transfer.pause()
    transfer.send_weights(weights(i))
    transfer.resume()


def test_a_sync_waits_until_the_replicas_are_at_most_max_staleness_behind(tmp_path: Path) -> None:
    with ThreadServer(create_app(Settings(publish_token=TOKEN))) as signal:
        transfer = DeltaSyncWeightTransfer(
            tmp_path / "run",
            max_staleness=1,
            staleness_timeout=0,
            signal_url=signal.url,
            signal_token=TOKEN,
            signal_run="trl",
            run_id="trl",
        )
        transfer.init_weight_transfer()
        with FleetReporter(signal.url, "trl", TOKEN, replica="engine-0") as engine:
            with pytest.raises(StalenessTimeout, match="engine-0: step -, lag -, state starting"):
                sync(transfer, 0)  # step 0 is committed; the engine serves nothing yet
            engine.update(0)
            assert engine.wait_reported(WAIT)
            sync(transfer, 1)  # step 1: step 0 is at most one behind
            with pytest.raises(StalenessTimeout, match=r"engine-0: step 0, lag 2, state serving") as info:
                sync(transfer, 2)
            assert "step 1 or newer (step 2, max lag 1" in str(info.value)
            # with time to wait, the sync returns once the engine catches up
            transfer.staleness_timeout = WAIT
            with ThreadPoolExecutor(1) as pool:
                fut = pool.submit(sync, transfer, 3)  # step 3 needs step 2
                engine.update(2)
                fut.result(WAIT)
        transfer.destroy()
    assert [r.step for r in transfer.history] == [0, 1, 2, 3]


def test_max_staleness_needs_a_signal_server(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_staleness needs signal_url="):
        DeltaSyncWeightTransfer(tmp_path / "run", max_staleness=1)
    with pytest.raises(ValueError, match="max_staleness must be None or an int >= 0"):
        DeltaSyncWeightTransfer(tmp_path / "run", max_staleness=-1, signal_url="http://127.0.0.1:9")
