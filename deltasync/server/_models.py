"""Request and response bodies of the signal server (pydantic models)."""

from __future__ import annotations

from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from deltasync._util.text import escape_text
from deltasync.errors import ProtocolError
from deltasync.protocol.audit import (
    MAX_DIVERGENCE,
    MAX_FINGERPRINT,
    MAX_TOLERANCE,
    AuditReport,
    Divergence,
    check_fingerprint,
)
from deltasync.protocol.keys import MAX_STEP
from deltasync.server._db import Commit, Webhook
from deltasync.server._settings import DIGEST_PATTERN
from deltasync.signal import ReplicaState

__all__ = [
    "AuditBody",
    "CommitIn",
    "CommitOut",
    "FleetOut",
    "Problem",
    "ReplicaIn",
    "ReplicaOut",
    "ReplicaTokenOut",
    "StepNo",
    "WebhookIn",
    "WebhookOut",
    "commit_out",
    "webhook_out",
]


def _json_integer(v: Any) -> Any:
    # JSON Schema counts 7.0 as an integer; strings and fractions stay rejected (strict models)
    return int(v) if isinstance(v, float) and v.is_integer() else v


#: A step number in a JSON body (``7.0`` counts as ``7``; the range is checked by each field).
StepNo = Annotated[int, BeforeValidator(_json_integer)]


class CommitIn(BaseModel):
    """Body of ``POST /v1/runs/{run}/commits``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    step: StepNo = Field(ge=0, le=MAX_STEP)
    manifest_digest: str = Field(pattern=DIGEST_PATTERN, description="xxh3-128 of the step's manifest.json")
    run_id: str | None = Field(default=None, max_length=128, pattern=r"^[\x21-\x7e]+$")
    kind: Literal["anchor", "patch"] | None = None


class CommitOut(BaseModel):
    """A signalled commit; its SSE event id is ``step``."""

    run: str
    step: int
    manifest_digest: str
    run_id: str | None
    kind: str | None
    time: float


#: 1 to 65535, no leading zero (the JSON Schema says what the validator checks)
_PORT = r"(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3})"


class WebhookIn(BaseModel):
    """Body of ``POST /v1/runs/{run}/webhooks``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    url: str = Field(
        max_length=2048,
        pattern=rf"^https?://[A-Za-z0-9._~-]+(:{_PORT})?(/[\x21-\x7e]*)?$",
        description="http(s) URL that receives signed POSTs",
    )
    secret: str = Field(min_length=16, max_length=256, description="HMAC-SHA256 key of the signatures")

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname or not v.isprintable() or " " in v:
            raise ValueError("url must be an absolute http:// or https:// URL")
        return v


class WebhookOut(BaseModel):
    """A registered webhook (its secret is never sent back)."""

    id: str
    run: str
    url: str
    created: float


class DivergenceBody(BaseModel):
    """An engine's probe logprobs against the trainer's reference (nats; docs/audit.md)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    mean_abs: float = Field(
        ge=0, le=MAX_DIVERGENCE, allow_inf_nan=False, description="mean |reference - engine| over the probe tokens"
    )
    max_abs: float = Field(ge=0, le=MAX_DIVERGENCE, allow_inf_nan=False, description="largest |reference - engine|")
    kl: float = Field(
        ge=0,
        le=MAX_DIVERGENCE,
        allow_inf_nan=False,
        description="k3 estimate mean(exp(r) - 1 - r), r = reference - engine (saturates at the bound)",
    )


class AuditBody(BaseModel):
    """A replica's last behavioural audit (``deltasync.protocol.audit.AuditReport``)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    audited_step: StepNo = Field(ge=0, le=MAX_STEP, description="the step whose weights were probed")
    fingerprint: str = Field(
        max_length=MAX_FINGERPRINT,
        pattern=r"^fp1-[0-9a-f]{8}-(?:[0-9a-f]{24})+$",
        description="the engine's probe-logprob fingerprint",
    )
    divergence: DivergenceBody | None = Field(
        default=None, description="against the trainer's reference of audited_step (null: none)"
    )
    tolerance: float | None = Field(
        default=None,
        ge=0,
        le=MAX_TOLERANCE,
        allow_inf_nan=False,
        description="fingerprint tolerance (nats) of the receiver's policy: accepted and shown, never used to "
        "group (the fleet groups with the run's own policy, its probes.json)",
    )

    @field_validator("fingerprint")
    @classmethod
    def _fingerprint(cls, v: str) -> str:
        try:
            return check_fingerprint(v)
        except ProtocolError as exc:
            raise ValueError(str(exc)) from None

    def report(self) -> AuditReport:
        """The typed report."""
        d = self.divergence
        return AuditReport.from_dict(
            {
                "audited_step": self.audited_step,
                "fingerprint": self.fingerprint,
                "divergence": None if d is None else Divergence(d.mean_abs, d.max_abs, d.kl).to_dict(),
                "tolerance": self.tolerance,
            }
        )

    @classmethod
    def of(cls, a: AuditReport) -> AuditBody:
        """The body of a typed report."""
        d = a.divergence
        return cls(
            audited_step=a.audited_step,
            fingerprint=a.fingerprint,
            divergence=None if d is None else DivergenceBody(mean_abs=d.mean_abs, max_abs=d.max_abs, kl=d.kl),
            tolerance=a.tolerance,
        )


class ReplicaIn(BaseModel):
    """Body of ``PUT /v1/runs/{run}/replicas/{replica}``: what the replica serves now."""

    model_config = ConfigDict(extra="forbid", strict=True)
    # the range before the validator: after it, the JSON Schema of the union member says "ge"/"le"
    step: Annotated[int, Field(ge=0, le=MAX_STEP), BeforeValidator(_json_integer)] | None = Field(
        default=None, description="the step it serves (null: none yet)"
    )
    digest: str | None = Field(
        default=None, pattern=DIGEST_PATTERN, description="xxh3-128 of the served step's manifest.json, when known"
    )
    state: ReplicaState
    last_error: str | None = Field(
        default=None,
        max_length=2000,
        description="the error of its last failed update (kept with control, bidi and other non-printable "
        "characters escaped: \\x1b, \\u202e; cut to 2000 characters)",
    )
    ttl_s: float | None = Field(
        default=None, ge=1, le=86400, description="seconds it stays in the fleet without a report (default: server's)"
    )
    audit: AuditBody | None = Field(default=None, description="its last behavioural audit (docs/audit.md)")
    audit_error: str | None = Field(
        default=None,
        max_length=2000,
        description="why its last behavioural audit could not run (escaped and cut as last_error); a serving "
        "replica with one is not healthy (docs/fleet.md)",
    )

    @field_validator("last_error", "audit_error")
    @classmethod
    def _printable(cls, v: str | None) -> str | None:
        # escaped, not refused: a traceback's newline must not cost the replica its report
        if v is None:
            return v
        out = escape_text(v)
        return out if len(out) <= 2000 else out[:1997] + "..."


class ReplicaOut(BaseModel):
    """One live replica in a run's fleet."""

    replica: str
    step: int | None
    #: ``head - step`` (null when the head or the step is unknown)
    lag: int | None
    state: ReplicaState
    digest: str | None
    #: whether ``digest`` is the digest the server recorded for ``step`` (null when either is unknown)
    digest_ok: bool | None
    last_error: str | None
    since: float
    last_seen: float
    #: seconds since its last report, by the server's clock
    age_s: float
    ttl_s: float
    #: its last behavioural audit (null: none reported)
    audit: AuditBody | None = None
    #: its group among the replicas audited at the same step (0: the largest; null: no audit)
    fingerprint_group: int | None = None
    #: a strict majority of the replicas audited at its step agree on another fingerprint (then a
    #: ``serving`` replica is shown ``diverged``)
    odd_one_out: bool = False
    #: why its last behavioural audit could not run (null: it ran, or none is configured)
    audit_error: str | None = None


class ReplicaTokenOut(BaseModel):
    """Reply of ``POST /v1/runs/{run}/replicas/{replica}/token``: the replica token of that identity."""

    token: str = Field(description="dsr1~<run>~<identity>~<mac>: send it as the replica's bearer token")
    run: str
    replica: str = Field(description="the identity: it covers this replica id and every <replica>-<suffix>")


class FleetOut(BaseModel):
    """Reply of ``GET /v1/runs/{run}/fleet``: the run's head and its live replicas, sorted by id."""

    run: str
    head: int | None
    time: float
    replicas: list[ReplicaOut]


class Problem(BaseModel):
    """An error reply."""

    detail: str


def commit_out(c: Commit) -> CommitOut:
    """The reply body of a recorded commit."""
    return CommitOut(**c.to_dict())  # type: ignore[arg-type]


def webhook_out(w: Webhook) -> WebhookOut:
    """The reply body of a registered webhook (without its secret)."""
    return WebhookOut(id=w.id, run=w.run, url=w.url, created=w.created)
