"""One driven server's session: its phase after each kind of answer (a table, against the scripted
stand-in), the moves the phase allows, and the fleet state derived from phase, last outcome and audit
(a table, no server)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
from scripted_vllm import ScriptedVLLM

from deltasync.protocol.audit import Divergence
from deltasync.serving.audit import AuditResult
from deltasync.serving.driver_options import DriverOptions
from deltasync.serving.fleet import ServerFacts, outcome_state, server_state
from deltasync.serving.phase import TRANSITIONS, Phase
from deltasync.serving.session import Listeners, ServerSession
from deltasync.serving.vllm_server import ServerUpdate, VLLMServer

URL = "http://vllm-0"


def _session(fake: ScriptedVLLM, now: list[float] | None = None) -> tuple[ServerSession, list[tuple[str, str]]]:
    said: list[tuple[str, str]] = []
    clock = now or [0.0]
    listeners = Listeners(lambda u: None, on_change=lambda url, what: said.append((url, what)))
    server = VLLMServer(URL, transport=fake.transport())
    return ServerSession(server, "s3://bucket/run", DriverOptions(), listeners, clock=lambda: clock[0]), said


def _garbage(r: httpx.Request) -> httpx.Response:
    return httpx.Response(200, text="<html>")


def _down(fake: ScriptedVLLM) -> None:
    fake.down = True


def _restarted(fake: ScriptedVLLM) -> None:
    fake.version, fake.initialised = "7", False


def _garbage_probe(fake: ScriptedVLLM) -> None:
    fake.hostile["/weight_info"] = _garbage


def _refuses(fake: ScriptedVLLM) -> None:
    fake.rolled_back = {1}


def _breaks(fake: ScriptedVLLM) -> None:
    fake.broken = {1}


def _nothing(fake: ScriptedVLLM) -> None:
    pass


# (what happens to a set-up server, then: a probe or an update to step 1) -> its phase and fleet state
CASES: list[tuple[str, Callable[[ScriptedVLLM], None], str, Phase, str]] = [
    ("healthy probe", _nothing, "probe", Phase.READY, "serving"),
    ("no answer", _down, "probe", Phase.UNREACHABLE, "unreachable"),
    ("garbage answer", _garbage_probe, "probe", Phase.FAILED, "failed"),
    ("restarted", _restarted, "probe", Phase.READY, "serving"),
    ("update taken", _nothing, "update", Phase.READY, "serving"),
    ("update refused", _refuses, "update", Phase.BACKING_OFF, "failed"),
    ("update lost the weights", _breaks, "update", Phase.NEEDS_REPLACEMENT, "needs_replacement"),
    ("update without an answer", _down, "update", Phase.UNREACHABLE, "unreachable"),
]


@pytest.mark.parametrize(("name", "fault", "call", "phase", "state"), CASES, ids=[c[0] for c in CASES])
def test_each_answer_moves_the_session_to_its_phase(
    name: str, fault: Callable[[ScriptedVLLM], None], call: str, phase: Phase, state: str
) -> None:
    fake = ScriptedVLLM()
    s, said = _session(fake)
    assert s.phase is Phase.UNINITIALISED and s.state() == ("starting", None)
    assert s.setup() and s.phase is Phase.READY and s.serving == 0
    fault(fake)
    if call == "probe":
        s.ensure_ready()
    else:
        s.record(s.run_update(1, prepare=False))
    assert s.phase is phase and s.state()[0] == state
    assert s.counted() == (state not in ("failed", "unreachable", "needs_replacement"))
    if phase in (Phase.UNREACHABLE, Phase.FAILED):
        assert [url for url, _ in said] == [URL] and s.why is not None
    if name == "restarted":
        assert s.serving == 7 and fake.initialised and s.setups == 2  # set up again: a new process


def test_a_refused_step_backs_off_by_the_clock_and_a_set_up_starts_afresh() -> None:
    now = [0.0]
    fake = ScriptedVLLM()
    fake.rolled_back = {1}
    s, _ = _session(fake, now)
    s.setup()
    s.record(s.run_update(1, prepare=False))
    assert (s.phase, s.refused, s.waiting(1), s.waiting(2)) == (Phase.BACKING_OFF, 1, True, False)
    now[0] = 2.0
    assert not s.waiting(1)
    s.record(s.run_update(1, prepare=False))
    now[0] = 5.9
    assert s.waiting(1)  # the second backoff: 4 s from 2.0
    fake.down = True
    s.ensure_ready()
    fake.down = False
    assert s.ensure_ready() and s.refused is None and not s.waiting(1) and s.phase is Phase.READY


def test_a_session_needing_replacement_comes_back_only_as_a_new_process() -> None:
    fake = ScriptedVLLM()
    fake.broken = {1}
    s, _ = _session(fake)
    s.setup()
    s.record(s.run_update(1, prepare=False))
    assert s.phase is Phase.NEEDS_REPLACEMENT and not s.behind(5)
    fake.hostile["/weight_info"] = _garbage
    assert not s.ensure_ready() and s.phase is Phase.NEEDS_REPLACEMENT  # an error answer changes nothing
    del fake.hostile["/weight_info"]
    assert not s.ensure_ready() and s.phase is Phase.NEEDS_REPLACEMENT  # the same process
    fake.version, fake.lost = "1", False  # restarted from a step 1 dir
    assert s.ensure_ready() and s.phase is Phase.READY and s.serving == 1


def test_the_moves_a_phase_allows() -> None:
    assert set(TRANSITIONS) == set(Phase)
    # only a new process (or losing it) takes a server out of needs_replacement; back-off follows a live one
    assert TRANSITIONS[Phase.NEEDS_REPLACEMENT] == {Phase.NEEDS_REPLACEMENT, Phase.UNINITIALISED, Phase.UNREACHABLE}
    assert {p for p, to in TRANSITIONS.items() if Phase.BACKING_OFF in to} == {Phase.READY, Phase.BACKING_OFF}
    s, _ = _session(ScriptedVLLM())
    with pytest.raises(ValueError, match="no move from uninitialised to backing_off"):
        s.transition(Phase.BACKING_OFF)


def _audit(step: int, *problems: str, divergence: Divergence | None = None) -> AuditResult:
    return AuditResult(step, "f" * 32, divergence, None, None, tuple(problems), 0.0, 0.01)


def _u(step: int, state: Any, error: str | None = None) -> ServerUpdate:
    return ServerUpdate(URL, step, state, str(step), 0.0, error)


# ServerFacts -> (fleet state, last error)
FACTS: list[tuple[ServerFacts, tuple[str, str | None]]] = [
    (ServerFacts(Phase.UNINITIALISED, None), ("starting", None)),
    (ServerFacts(Phase.READY, 3), ("serving", None)),
    (ServerFacts(Phase.READY, 3, last=_u(3, "serving")), ("serving", None)),
    (ServerFacts(Phase.UNREACHABLE, 3, "unreachable: gone"), ("unreachable", "unreachable: gone")),
    (ServerFacts(Phase.FAILED, None, "init: not JSON"), ("failed", "init: not JSON")),
    (ServerFacts(Phase.NEEDS_REPLACEMENT, 3, "step 4: lost"), ("needs_replacement", "step 4: lost")),
    (ServerFacts(Phase.BACKING_OFF, 3, last=_u(4, "rolled_back", "bad")), ("failed", "step 4: rolled_back: bad")),
    (ServerFacts(Phase.BACKING_OFF, 3, last=_u(4, "held_back", "x")), ("serving", "step 4: held_back: x")),
    (
        ServerFacts(Phase.BACKING_OFF, 3, last=_u(4, "rolled_back", "back"), brought_back=True),
        ("serving", "step 4: rolled_back: back"),
    ),
    (ServerFacts(Phase.READY, 3, audit=_audit(3, "kl too high")), ("diverged", "step 3: kl too high")),
    (ServerFacts(Phase.READY, 4, audit=_audit(3, "kl too high")), ("serving", None)),  # an older step's audit
    (ServerFacts(Phase.NEEDS_REPLACEMENT, 3, "paused", audit=_audit(3, "p")), ("diverged", "step 3: p")),
    (ServerFacts(Phase.UNREACHABLE, 3, "gone", audit=_audit(3, "p")), ("unreachable", "gone")),
    (ServerFacts(Phase.READY, 3, audit=_audit(3)), ("serving", None)),
]


@pytest.mark.parametrize(("facts", "expected"), FACTS)
def test_the_fleet_state_is_derived_from_phase_outcome_and_audit(
    facts: ServerFacts, expected: tuple[str, str | None]
) -> None:
    assert server_state(facts) == expected


def test_every_outcome_has_a_fleet_state() -> None:
    assert [outcome_state(o) for o in ("serving", "rolled_back", "held_back", "needs_replacement")] == [
        "serving",
        "failed",
        "serving",
        "needs_replacement",
    ]
    assert (outcome_state("unreachable"), outcome_state("failed")) == ("unreachable", "failed")
