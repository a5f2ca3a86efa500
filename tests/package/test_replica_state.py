"""A replica's state is defined once, in :mod:`deltasync.signal` (the lowest layer the server and the
serving side share): the server's book and bodies, the reporters, the engine mirror and the vLLM
driver all use that one type, and an update's outcome maps onto it in one place."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args, get_type_hints

import deltasync
from deltasync.server import _fleet, _models
from deltasync.serving import driver, fleet
from deltasync.serving.engine.mirror import EngineStatus
from deltasync.signal import REPLICA_STATES, ReplicaState, ReplicaStatus, Served

PACKAGE = Path(deltasync.__file__).parent


def test_the_states_are_the_four_the_fleet_view_documents() -> None:
    states = ("starting", "serving", "failed", "needs_replacement", "unreachable", "diverged")
    assert REPLICA_STATES == get_args(ReplicaState) == states


def test_the_server_the_reporters_and_the_mirror_hold_the_signal_type() -> None:
    holders = [_fleet.Replica, ReplicaStatus, Served, EngineStatus]
    assert all(get_type_hints(cls)["state"] is ReplicaState for cls in holders)
    assert _models.ReplicaIn.model_fields["state"].annotation is ReplicaState
    assert _models.ReplicaOut.model_fields["state"].annotation is ReplicaState


def test_every_update_outcome_maps_to_one_replica_state() -> None:
    assert {fleet.outcome_state(o) for o in get_args(driver.UpdateOutcome)} <= set(REPLICA_STATES)
    assert get_type_hints(driver.ServerUpdate)["state"] is driver.UpdateOutcome


def test_no_module_spells_the_states_out_again() -> None:
    """The only ``Literal`` types naming ``needs_replacement`` are the replica state and the driver's
    update outcome (a different concept: what one update did to one server)."""
    literal = re.compile(r"Literal\[([^\]]*)\]")
    found = {
        (str(p.relative_to(PACKAGE)), tuple(re.findall(r'"([^"]*)"', m.group(1))))
        for p in PACKAGE.rglob("*.py")
        for m in literal.finditer(p.read_text(encoding="utf-8"))
        if '"needs_replacement"' in m.group(1)
    }
    assert found == {
        ("signal/_fleet.py", REPLICA_STATES),
        ("serving/vllm_server.py", get_args(driver.UpdateOutcome)),
    }
