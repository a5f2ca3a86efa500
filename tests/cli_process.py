"""Running deltasync's console scripts in subprocesses, as a user does: the helpers the CLI tests share."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO

import pytest

from deltasync._util.checkpoint_io import save_checkpoint

TIMEOUT = 120.0  # a process that imports torch on a busy 2-core machine


def _script(name: str) -> list[str]:
    script = Path(sys.executable).with_name(name)
    if script.exists():
        return [str(script)]
    module = "deltasync.cli"
    entry = "main" if name == "deltasync" else "upload_main"
    return [sys.executable, "-c", f"import sys; from {module} import {entry}; sys.exit({entry}())"]


def run(name: str, *args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*_script(name), *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )


PUMPS: dict[int, list[threading.Thread]] = {}


def _lines(proc: subprocess.Popen[str], stream: IO[str] | None) -> queue.Queue[str]:
    """A queue fed with the stream's lines by a thread ('' at EOF), so reads can time out."""
    assert stream is not None
    q: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for line in stream:
            q.put(line)
        q.put("")

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    PUMPS.setdefault(proc.pid, []).append(t)
    return q


def _finish(proc: subprocess.Popen[str]) -> None:
    """Kill the process if it still runs, then wait for it and its pipes."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(TIMEOUT)
    for t in PUMPS.pop(proc.pid, []):
        t.join(TIMEOUT)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def read_until(q: queue.Queue[str], needle: str, proc: subprocess.Popen[str]) -> str:
    """Lines from ``q`` up to the first holding ``needle``; fails if the stream ends first."""
    seen = []
    while True:
        try:
            line = q.get(timeout=TIMEOUT)
        except queue.Empty:
            pytest.fail(f"no {needle!r} after {TIMEOUT} s; got {seen}")
        if not line:
            proc.wait(TIMEOUT)
            pytest.fail(f"the process exited ({proc.returncode}) without printing {needle!r}; got {seen}")
        seen.append(line)
        if needle in line:
            return line


def checkpoints(tmp: Path, n: int) -> list[Path]:
    """``n`` checkpoints of a small state, each a few elements away from the previous one."""
    import torch

    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(64, 64, generator=g).to(torch.bfloat16), "b": torch.randn(64, generator=g)}
    out = []
    for i in range(n):
        if i:
            state = {k: v.clone() for k, v in state.items()}
            state["w"].view(-1)[i * 7 : i * 7 + 5] += 1
        out.append(save_checkpoint(state, tmp / f"ckpt-{i}.safetensors"))
    return out


def claims(store_dir: Path) -> list[str]:
    return sorted(p.name for p in (store_dir / "writers").iterdir())


# ------------------------------------------------------------ a run that is not there
