"""The driver's audits beside its updates: an update never waits for the audit of the step before (that
audit is dropped), a step whose reference arrives late is compared at the next observation, and an
audit that cannot run is said (callback, metric, fleet field). Against a scripted server that also
answers the audit's completions (no engine); the actions on a diverged server are in
test_replica_audit.py."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest
from scripted_vllm import ScriptedVLLM

pytest.importorskip("torch")

import torch  # noqa: E402

import deltasync as ds  # noqa: E402
from deltasync.protocol.audit import AuditPolicy  # noqa: E402
from deltasync.protocol.probes import ProbeSet, Reference  # noqa: E402
from deltasync.run.probes import write_probes, write_reference  # noqa: E402
from deltasync.serving.audit import AuditConfig, AuditResult, AuditSource  # noqa: E402
from deltasync.serving.driver import VLLMDriver, VLLMServer  # noqa: E402
from deltasync.serving.driver_metrics import DriverMetrics  # noqa: E402
from deltasync.signal import StepWatcher  # noqa: E402

PROBES = ProbeSet(
    ((1, 2, 3, 4, 5, 6), (7, 8, 9, 10, 11, 12)), 16, AuditPolicy(max_mean_abs=0.01, max_max_abs=0.1, max_kl=None)
)
WAIT = 30.0


def _rows(shift: float = 0.0) -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(-2.0 - 0.1 * j - shift for j in range(len(p) - 1)) for p in PROBES.tokens)


def _run() -> ds.MemoryStore:
    """Steps 0..3 (each changes the weights), the run's probes, references of steps 1 and 2 (not 3)."""
    store = ds.MemoryStore("driver-audit")
    g = torch.Generator().manual_seed(5)
    state = {n: torch.randn(16, 8, generator=g).to(torch.bfloat16) for n in ("a.w", "b.w")}
    with ds.DeltaUploader(store, anchor_every=100, anchor_bytes_fraction=0) as up:
        for s in range(4):
            state["a.w"][s, :4] += 0.25
            up.push(state, s).result()
    write_probes(store, PROBES)
    for s in (1, 2):
        write_reference(store, Reference(s, PROBES.digest, _rows(), "float32"))
    return store


class AuditedVLLM(ScriptedVLLM):
    """Also answers the audit (``/v1/models``, ``/v1/completions`` with prompt logprobs): the references'
    rows shifted a little per version, or 0.5 off at the versions in ``wrong``. A completion asked while it
    serves a version in ``gate`` sets ``entered[version]`` and waits for ``gate[version]``."""

    def __init__(self) -> None:
        super().__init__()
        self.wrong: set[str] = set()
        self.gate: dict[str, threading.Event] = {}
        self.entered: dict[str, threading.Event] = {}
        #: weight versions set while an audit was held at the gate
        self.updated_while_audited: list[str] = []
        self.completions = 0
        self._finished: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def finished(self, version: str) -> threading.Event:
        """Set once an update to ``version`` finished."""
        with self._lock:
            return self._finished.setdefault(version, threading.Event())

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}]})
        if path == "/v1/completions" and "/v1/completions" not in self.hostile:
            version = self.version or "0"
            self.completions += 1
            if version in self.gate:
                self.entered[version].set()
                assert self.gate[version].wait(WAIT), "the gate was never opened"
            shift = 0.5 if version in self.wrong else 0.001 + 1e-4 * int(version)
            rows = dict(zip(PROBES.tokens, _rows(shift), strict=True))
            prompts = json.loads(request.content)["prompt"]
            choices = [
                {
                    "index": i,
                    "prompt_logprobs": [None]
                    + [{str(t): {"logprob": v}} for t, v in zip(p[1:], rows[tuple(p)], strict=True)],
                }
                for i, p in enumerate(prompts)
            ]
            return httpx.Response(200, json={"choices": choices})
        answer = super().handle(request)
        if path == "/finish_weight_update":
            self.finished(str(self.version)).set()
            held = [v for v, g in self.gate.items() if self.entered[v].is_set() and not g.is_set()]
            if held:
                self.updated_while_audited.append(str(self.version))
        return answer


def _driver(fake: AuditedVLLM, store: ds.MemoryStore, **kw: Any) -> VLLMDriver:
    source = AuditSource(store, AuditConfig(canary=False, reference_every=0))
    server = VLLMServer("http://vllm-0", transport=fake.transport())
    return VLLMDriver([server], "s3://bucket/run", audit=source, clock=lambda: 0.0, **kw)


def _seeing(step: int, driver: VLLMDriver) -> StepWatcher:
    """A watcher that sees ``step`` and stops at its first pause, once ``driver``'s jobs and audits are done."""
    stop = threading.Event()

    def wait(seconds: float) -> None:
        assert driver.settle(WAIT)
        stop.set()

    return StepWatcher(lambda: step, stop=stop, wait=wait)


Audits = list[tuple[str, "AuditResult | None", "str | None"]]


def test_an_update_runs_beside_the_audit_of_the_step_before_which_is_dropped() -> None:
    store = _run()
    fake = AuditedVLLM()
    gate, entered = threading.Event(), threading.Event()
    fake.gate["1"], fake.entered["1"] = gate, entered
    audits: Audits = []

    def poll() -> int:  # step 2 is committed once the audit of step 1 runs (held at the gate)
        return 2 if entered.is_set() else 1

    def wait(seconds: float) -> None:
        if not entered.is_set():
            assert entered.wait(WAIT)
        elif not gate.is_set():
            assert fake.finished("2").wait(WAIT)  # step 2 is served while the audit of step 1 is held ...
            gate.set()  # ... which then ends

    with _driver(fake, store) as d:
        d.init()
        assert d.settle(WAIT)  # its audit at set-up (step 0) ran
        out = d.follow(
            StepWatcher(poll, stop=threading.Event(), wait=wait), until=2, on_audit=lambda *a: audits.append(a)
        )
        session = d.sessions[0]
    assert out == {"http://vllm-0": 2}
    assert fake.updated_while_audited == ["2"]  # step 2 was taken while the audit of step 1 was held
    steps = [r.step for _, r, _ in audits if r is not None]
    assert steps == [2]  # the audit of step 1 was overtaken: dropped, never reported
    assert all(why is None for _, _, why in audits)
    assert session.audit is not None and session.audit.step == 2 and not session.audit.diverged


def test_a_reference_that_arrives_after_the_audit_is_compared_at_the_next_observation() -> None:
    store = _run()
    fake = AuditedVLLM()
    fake.wrong = {"3"}  # what it computes at step 3 is off: only the reference can tell
    audits: Audits = []
    with _driver(fake, store) as d:
        d.init()
        assert d.settle(WAIT)  # its audit at set-up (step 0) ran
        d.follow(_seeing(3, d), until=3, on_audit=lambda *a: audits.append(a))
        session = d.sessions[0]
        first = session.audit
        assert first is not None and first.step == 3 and first.divergence is None and not first.diverged
        assert session.state()[0] == "serving"
        write_reference(store, Reference(3, PROBES.digest, _rows(), "float32"))  # the trainer attaches it late
        stop = threading.Event()

        def heartbeat(seconds: float) -> None:
            assert d.settle(WAIT)
            stop.set()

        d.follow(StepWatcher(lambda: 3, stop=stop, wait=heartbeat), on_audit=lambda *a: audits.append(a))
        assert d.settle(WAIT)
        again = session.audit
        assert again is not None and again.step == 3 and again.divergence is not None and again.diverged
        assert session.state() == ("diverged", "step 3: " + "; ".join(again.problems))
    assert [(r.step, r.diverged) for _, r, _ in audits if r is not None][-2:] == [(3, False), (3, True)]
    assert fake.completions == 2  # step 0 and step 3: the late comparison asked nothing


def test_an_audit_that_cannot_run_is_a_callback_a_metric_and_a_fleet_field() -> None:
    store = _run()
    fake = AuditedVLLM()
    fake.hostile["/v1/completions"] = lambda r: httpx.Response(200, text="<html>busy</html>")
    audits: Audits = []
    metrics = DriverMetrics()
    with _driver(fake, store, metrics=metrics) as d:
        d.init()
        assert d.settle(WAIT)  # its audit at set-up (step 0) ran
        d.follow(_seeing(1, d), until=1, on_audit=lambda *a: audits.append(a))
        session = d.sessions[0]
        assert session.serving == 1 and session.audit is None
        assert session.audit_error is not None and "not JSON" in session.audit_error
        assert session.state()[0] == "serving"  # it serves the step; nobody could check what it computes
    assert audits and all(r is None and why for _, r, why in audits)
    assert audits[-1][2] == session.audit_error
    lines = metrics.render().splitlines()
    assert 'deltasync_vllm_audits_unavailable_total{server="http://vllm-0"} 2' in lines  # at set-up and step 1
