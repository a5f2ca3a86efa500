"""Start a real multi-process torch.distributed group of worker scripts (gloo on loopback) and collect
each rank's ``rank{R}.json``.

    ranks = run_ranks(WORKER, world, scenario, run_dir)

Each worker is started as ``python WORKER RANK WORLD RUN_DIR SCENARIO`` and must write
``RUN_DIR/rank{R}.json``. ``killed``: ranks the scenario kills with SIGKILL (their exit status
must be -9 and they write no result).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_ranks(
    worker: Path, world: int, scenario: str, run_dir: Path, *, killed: tuple[int, ...] = (), timeout: float = 400
) -> list[dict[str, Any]]:
    """Run ``world`` ranks of ``worker`` to the end; the results of the ranks not in ``killed``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env["GLOO_SOCKET_IFNAME"] = "lo"  # the ranks talk over the loopback interface only
    env.setdefault("OMP_NUM_THREADS", "1")
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(r), str(world), str(run_dir), scenario],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    logs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            logs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, p in enumerate(procs):
        want = -9 if r in killed else 0
        assert p.returncode == want, f"rank {r} exited with {p.returncode}:\n{logs[r][-6000:]}"
    return [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(world) if r not in killed]
