"""The signal server's quickstart (docs/signal-server.md, "Quickstart: three terminals") runs as printed.

The three terminals' commands are read from the page's code blocks, so the page and this test cannot
drift: ``deltasync serve``, ``deltasync follow`` and the trainer's ``python - <<'PY'`` script each run
in their own ``bash`` process, from one directory, with ``deltasync`` and ``python`` of this
environment first on ``PATH``. The one change: the page's port 8000 becomes a free port, so that the
test never collides with whatever listens on 8000. Everything binds 127.0.0.1 (the page's
``--host 127.0.0.1``); every wait is bounded.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from cli_process import TIMEOUT, _finish, _lines, read_until
from server_harness import free_port, wait_healthy

import deltasync as ds
from deltasync._util.checkpoint_io import load_checkpoint

PAGE = Path(__file__).resolve().parents[2] / "docs" / "signal-server.md"
ROOT = Path(__file__).resolve().parents[2]


def quickstart_blocks() -> list[str]:
    """The three ``bash`` blocks of the quickstart section, in page order (server, follower, trainer)."""
    text = PAGE.read_text()
    start = text.index("## Quickstart: three terminals")
    end = text.index("\n## ", start + 1)
    blocks = re.findall(r"```bash\n(.*?)```", text[start:end], re.S)
    assert len(blocks) == 3, f"the quickstart should show three terminals' commands, found {len(blocks)}"
    return blocks


def test_the_quickstart_blocks_are_the_three_processes() -> None:
    server, follower, trainer = quickstart_blocks()
    assert "deltasync serve --host 127.0.0.1 --port 8000" in server
    assert "deltasync follow" in follower and "--signal http://127.0.0.1:8000" in follower
    assert "python - <<'PY'" in trainer and "ds.DeltaUploader(" in trainer


def _start(block: str, cwd: Path, port: int) -> subprocess.Popen[str]:
    script = block.replace("--port 8000", f"--port {port}").replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    assert "8000" not in script, script
    bindir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", ""), "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    for var in ("DELTASYNC_PUBLISH_TOKEN", "DELTASYNC_SUBSCRIBE_TOKEN"):
        env.pop(var, None)  # the page's own exports set them
    return subprocess.Popen(
        ["bash", "-ec", script],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: the processes bash starts end with it
    )


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    _finish(proc)


@pytest.mark.slow
def test_the_signal_server_quickstart_runs_as_printed(tmp_path: Path) -> None:
    server_sh, follower_sh, trainer_sh = quickstart_blocks()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs: list[subprocess.Popen[str]] = []
    try:
        server = _start(server_sh, tmp_path, port)
        procs.append(server)
        _lines(server, server.stdout)
        wait_healthy(url, proc=server)  # type: ignore[arg-type]

        follower = _start(follower_sh, tmp_path, port)
        procs.append(follower)
        follower_out = _lines(follower, follower.stdout)

        trainer = _start(trainer_sh, tmp_path, port)
        procs.append(trainer)
        out, _ = trainer.communicate(timeout=4 * TIMEOUT)
        assert trainer.returncode == 0, out
        printed = re.findall(r"^step (\d+): (anchor|patch|skipped), \d+ bytes$", out, re.M)
        assert [int(s) for s, _ in printed] == list(range(10)), out
        assert printed[0][1] == "anchor"

        # the page: "Terminal 2 prints `step 0 -> weights/ ...` to `step 9` as they are committed"
        read_until(follower_out, "step 9 -> weights/", follower)

        # the server heard every commit from the trainer (the subscribe token the page exports)
        head = httpx.get(
            f"{url}/v1/runs/r1/head", headers={"Authorization": "Bearer dev-subscribe-token"}, timeout=10.0
        )
        assert head.status_code == 200 and head.json()["step"] == 9, head.text

        # weights/ holds step 9 bit for bit, as the store has it
        expected: dict[str, torch.Tensor] = {}
        assert ds.DeltaFetcher(ds.open_store(str(tmp_path / "runs" / "r1"))).sync(expected) == 9
        got = load_checkpoint(tmp_path / "weights")
        assert got.keys() == expected.keys()
        for name, t in expected.items():
            assert torch.equal(got[name].view(torch.int16), t.view(torch.int16)), name
    finally:
        for p in reversed(procs):
            _stop(p)
