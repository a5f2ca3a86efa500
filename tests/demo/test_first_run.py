"""The demo's first run on a cold kernel cache: the kernels are built before the clock starts.

deltasync's codec kernels are compiled at first use and cached on disk (``$NUMBA_CACHE_DIR`` moves
the cache). The demo builds them first (``spaces_demo.warmup.warm_kernels``, one line says so), so
its follower's first sync is not a compile: no step is folded and the first applied step is not
behind. Checked by what the demo prints and counts (lags in steps, folds, commits), never by time.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the demo extra is part of the test extra")

from demo_process import deltasync_cmd, free_port  # noqa: E402

from spaces_demo.figures import measure  # noqa: E402
from spaces_demo.warmup import compiled_signatures, warm_kernels  # noqa: E402

STEPS = 20


def test_after_the_warm_up_a_demo_run_compiles_no_kernel() -> None:
    warm_kernels()
    before = compiled_signatures()
    assert sum(before.values()) > 0  # the warm-up built (or loaded) kernels
    figures = measure(steps=60)  # the demo's trainer and follower: dense early patches, sparser later
    assert figures.bit_exact
    after = compiled_signatures()
    assert after == before, {k: (before.get(k), v) for k, v in after.items() if before.get(k) != v}


@pytest.mark.slow
def test_a_cold_first_run_folds_nothing_and_its_first_step_is_not_behind(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DELTASYNC_", "DISPLAY", "WAYLAND"))}
    env.update(NUMBA_CACHE_DIR=str(tmp_path / "cold-cache"), PYTHONUNBUFFERED="1", HOME=str(tmp_path / "home"))
    cmd = [*deltasync_cmd(), "demo", "--no-browser", "--exit-when-done", "--host", "127.0.0.1"]
    cmd += ["--port", str(free_port()), "--store", str(tmp_path / "store"), "--steps", str(STEPS)]
    cmd += ["--step-interval", "0"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert any((tmp_path / "cold-cache").rglob("*.nbi")), "the kernels were not built into the cold cache"
    lines = out.splitlines()
    building = next(i for i, s in enumerate(lines) if s.startswith("building the codec's compiled kernels"))
    ready = next(i for i, s in enumerate(lines) if re.match(r"kernels ready in [\d.]+ s$", s))
    applied = [(i, m) for i, s in enumerate(lines) if (m := re.match(r"step +(\d+) .*\(lag (\d+) steps\)", s))]
    assert applied, out
    first_line, first = applied[0]
    assert building < ready < first_line, out
    assert int(first.group(2)) <= 5, f"the first applied step lags {first.group(2)} steps:\n{out}"
    assert "folded" not in out, out
    assert f"run finished: {STEPS} training steps (+ initial weights at step 0), {STEPS + 1} commits;" in out, out
    assert "bit-exact with the trainer's" in out
