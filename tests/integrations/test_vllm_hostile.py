"""``deltasync follow --vllm REAL FAKE --until N``: a real ``vllm serve`` beside a fake server that answers
garbage (tests/hostile_vllm.py: an HTML page where JSON is due, on ``/weight_info``). The sidecar starts,
keeps the real server current to the run's last step (bit-exact: the engine's own weight checksums),
reports the fake one failed with the reason, prints no traceback and exits 0. The fake-server suite
(tests/serving/test_hostile_servers.py) covers every hostility; this is the one a real engine shows
beside it end to end.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from hostile_vllm import HostileVLLM
from vllm_harness import REPO, SUPPORT, TrainedRun, checkpoint_dir, publish_step, vllm_server

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def test_follow_keeps_a_real_server_current_beside_one_that_answers_garbage(
    vllm_python: Path, trained_run: TrainedRun, tmp_path: Path
) -> None:
    sys.path.insert(0, str(SUPPORT))
    import engine_checks

    run = trained_run
    live = tmp_path / "store"
    for step in run.steps:
        publish_step(run.store_dir, live, step)
    model = checkpoint_dir(run, 0, tmp_path / "model")
    last = run.steps[-1]
    with (
        vllm_server(vllm_python, model, tmp_path / "serve.log") as real,
        HostileVLLM() as fake,
        httpx.Client(base_url=real, timeout=120) as http,
    ):
        fake.hostile["/weight_info"] = "non_json"
        p = subprocess.run(
            [sys.executable, "-m", "deltasync.cli", "follow", "--store", str(live), "--vllm", real, fake.url,
             "--until", str(last), "--poll-interval", "0.2", "--probe-timeout", "5"],
            cwd=REPO, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
        assert http.get("/weight_info").json()["weight_version"] == str(last)
        got = http.post("/weight_checker", json={"action": "checksum"}).json()["checksums"]
        assert got == engine_checks.expected_checksums(str(run.expected(last)))
    assert "Traceback" not in p.stderr
    assert (
        f"{fake.url}: failed (serving step (none yet)): init: /weight_info: the answer is not JSON"
        in p.stderr
    )
    assert f"stopped; serving: {real} step {last}, {fake.url} failed (last step None)" in p.stdout
    assert f"step {last} -> {real}: serving" in p.stdout
