"""Every bound of the audit's numbers, the same in the protocol and the signal server: a policy's
tolerance and thresholds, a report's tolerance and a divergence's values are finite and bounded by
``MAX_TOLERANCE`` / ``MAX_DIVERGENCE``, refused at parse with a ProtocolError naming the field and the
range, and the server's models (what a fleet report may carry) take exactly the same ranges."""

from __future__ import annotations

import math
from typing import Any

import pytest
from pydantic import ValidationError

from deltasync.errors import ProtocolError
from deltasync.protocol.audit import (
    MAX_DIVERGENCE,
    MAX_TOLERANCE,
    AuditPolicy,
    AuditReport,
    Divergence,
    divergence,
    fingerprint,
)
from deltasync.protocol.probes import ProbeSet
from deltasync.server._models import AuditBody, DivergenceBody

FP = fingerprint("ab" * 16, [[-1.0, -2.0, -3.0, -4.0]])


def policy(**kw: Any) -> dict[str, Any]:
    return {"max_mean_abs": 0.1, "max_max_abs": 2.0, "max_kl": 0.05, "fingerprint_tolerance": 0.02, **kw}


def test_a_policy_with_a_tolerance_over_the_bound_is_refused_at_parse() -> None:
    assert AuditPolicy.from_dict(policy(fingerprint_tolerance=MAX_TOLERANCE)).fingerprint_tolerance == 100
    with pytest.raises(ProtocolError, match=r"fingerprint_tolerance.*\[0, 100\].*101"):
        AuditPolicy.from_dict(policy(fingerprint_tolerance=101))
    with pytest.raises(ProtocolError, match="fingerprint_tolerance"):
        AuditPolicy(fingerprint_tolerance=101)
    body = (
        ProbeSet(((1, 2, 3, 4, 5),), 8)
        .to_json()
        .replace(b'"fingerprint_tolerance":0.02', b'"fingerprint_tolerance":101')
    )
    assert b"101" in body
    with pytest.raises(ProtocolError, match="fingerprint_tolerance"):
        ProbeSet.from_json(body)  # probes.json: refused where it is read, not at every report


@pytest.mark.parametrize("field", ["max_mean_abs", "max_max_abs", "max_kl"])
@pytest.mark.parametrize("value", [1e308, MAX_DIVERGENCE * 2, -1.0, math.inf])
def test_policy_thresholds_are_finite_and_bounded(field: str, value: float) -> None:
    with pytest.raises(ProtocolError, match=field):
        AuditPolicy.from_dict(policy(**{field: value}))


@pytest.mark.parametrize("field", ["mean_abs", "max_abs", "kl"])
def test_a_divergence_of_1e308_is_refused_everywhere(field: str) -> None:
    raw = {"mean_abs": 0.1, "max_abs": 0.2, "kl": 0.01, field: 1e308}
    with pytest.raises(ProtocolError, match=rf"divergence {field}.*1e\+06"):
        Divergence.from_dict(raw)
    with pytest.raises(ProtocolError, match=field):
        Divergence(**raw)
    with pytest.raises(ProtocolError, match=field):
        AuditReport.from_dict({"audited_step": 1, "fingerprint": FP, "divergence": raw})
    with pytest.raises(ValidationError, match=field):
        DivergenceBody(**raw)


def test_divergence_saturates_at_the_bound_so_a_wild_engine_can_still_report() -> None:
    d = divergence([[5e6, -1.0, -1.0, -1.0]], [[-1e4, -1.0, -1.0, -1.0]])  # a broken engine's logprob
    assert d.max_abs == MAX_DIVERGENCE and d.kl <= MAX_DIVERGENCE
    assert Divergence.from_dict(d.to_dict()) == d
    DivergenceBody(mean_abs=d.mean_abs, max_abs=d.max_abs, kl=d.kl)  # the server takes it too


@pytest.mark.parametrize("tol", [MAX_TOLERANCE + 0.5, 1e308, -0.1])
def test_a_reported_tolerance_has_the_same_bound_on_both_sides(tol: float) -> None:
    raw = {"audited_step": 1, "fingerprint": FP, "tolerance": tol}
    with pytest.raises(ProtocolError, match="tolerance"):
        AuditReport.from_dict(raw)
    with pytest.raises(ValidationError, match="tolerance"):
        AuditBody.model_validate(raw)


def test_the_edges_are_accepted_on_both_sides() -> None:
    edge = {"mean_abs": MAX_DIVERGENCE, "max_abs": 0, "kl": MAX_DIVERGENCE}
    report = AuditReport.from_dict({"audited_step": 1, "fingerprint": FP, "divergence": edge, "tolerance": 100})
    body = AuditBody(audited_step=1, fingerprint=FP, divergence=DivergenceBody(**edge), tolerance=MAX_TOLERANCE)
    assert body.report() == report and AuditBody.of(report) == body
