"""A run's fleet as the signal server reports it (``GET /v1/runs/{run}/fleet``), parsed and typed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from deltasync._util.text import escape_text
from deltasync.errors import ProtocolError, SignalUnavailable
from deltasync.protocol.audit import AuditReport

__all__ = ["REPLICA_STATES", "FleetView", "ReplicaState", "ReplicaStatus"]

#: A replica's state in a run's fleet, the one definition the server, the reporters, the vLLM driver and
#: the engine mirror share. ``starting``: serves no step yet; ``serving``: serves ``step``; ``failed``:
#: its last update failed and it still serves ``step``, bit-exact; ``needs_replacement``: its weights
#: are neither step: replace it; ``unreachable``: its reporter (a sidecar driving a server) gets no
#: answer from it: it serves nothing to anyone that cannot reach it either (``step`` is the last known);
#: ``diverged``: it holds ``step`` but its behavioural audit failed (its probe logprobs are over the
#: run's thresholds against the trainer's reference, or disagree with the other replicas' at the same
#: step): it serves outputs the trainer did not compute (docs/audit.md).
ReplicaState = Literal["starting", "serving", "failed", "needs_replacement", "unreachable", "diverged"]
#: every :data:`ReplicaState`, in that order
REPLICA_STATES: tuple[ReplicaState, ...] = get_args(ReplicaState)


def _opt_int(v: Any) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"not an integer: {v!r}")
    return v


def _opt_str(v: Any) -> str | None:
    return None if v is None else str(v)


def check_state(v: Any) -> ReplicaState:
    """``v`` as a :data:`ReplicaState` (a ValueError when it is none)."""
    for state in REPLICA_STATES:
        if v == state:
            return state
    raise ValueError(f"state must be one of {REPLICA_STATES}, got {v!r}")


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    """One live replica of a run: what it last reported, and its lag behind the run's head."""

    replica: str
    step: int | None
    lag: int | None
    state: ReplicaState
    digest: str | None = None
    #: whether ``digest`` is the digest the server recorded for ``step`` (None when either is unknown)
    digest_ok: bool | None = None
    last_error: str | None = None
    since: float = 0.0
    last_seen: float = 0.0
    #: seconds since its last report, by the server's clock
    age_s: float = 0.0
    ttl_s: float = 0.0
    #: its last behavioural audit (None: it reported none)
    audit: AuditReport | None = None
    #: whether its fingerprint disagrees with the majority of the replicas audited at the same step
    #: (the server then shows it ``diverged``; see docs/audit.md)
    odd_one_out: bool = False
    #: its group among the replicas audited at the same step (0: the largest; None: no audit)
    fingerprint_group: int | None = None
    #: why its last behavioural audit could not run (None: it ran, or it has no audit configured): a
    #: replica that should be audited and is not does not count as healthy (:meth:`serves_at_least`)
    audit_error: str | None = None

    @classmethod
    def from_json(cls, raw: Any) -> ReplicaStatus:
        """Parse one replica of a fleet reply (a KeyError / TypeError / ValueError when malformed)."""
        ok = raw.get("digest_ok")
        audit = raw.get("audit")
        try:
            parsed = None if audit is None else AuditReport.from_dict(audit)
        except ProtocolError as exc:
            raise ValueError(str(exc)) from None
        return cls(
            str(raw["replica"]),
            _opt_int(raw.get("step")),
            _opt_int(raw.get("lag")),
            check_state(raw["state"]),
            _opt_str(raw.get("digest")),
            None if ok is None else bool(ok),
            _opt_str(raw.get("last_error")),
            float(raw.get("since") or 0.0),
            float(raw.get("last_seen") or 0.0),
            float(raw.get("age_s") or 0.0),
            float(raw.get("ttl_s") or 0.0),
            parsed,
            bool(raw.get("odd_one_out") or False),
            _opt_int(raw.get("fingerprint_group")),
            _opt_str(raw.get("audit_error")),
        )

    def serves_at_least(self, step: int, *, healthy_only: bool = False) -> bool:
        """Whether this replica serves ``step`` or newer: a known step, weights not lost (a ``failed``
        replica still serves its step, bit-exact; so does a ``diverged`` one, whose outputs are wrong).
        With ``healthy_only``, only a ``serving`` replica whose last audit did not fail to run counts
        (``audit_error`` None: a replica that reports one has audits configured, and nobody knows what it
        computes; docs/fleet.md "Healthy")."""
        if self.step is None or self.step < step:
            return False
        if healthy_only:
            return self.state == "serving" and self.audit_error is None
        return self.state in ("serving", "failed", "diverged")

    @property
    def healthy(self) -> bool:
        """Whether a ``healthy_only`` gate counts this replica at its step: ``serving``, and its last audit
        ran (or it has none configured)."""
        return self.state == "serving" and self.audit_error is None


@dataclass(frozen=True, slots=True)
class FleetView:
    """A run's live replicas (sorted by id) and its head, as the signal server sees them at ``time``."""

    run: str
    head: int | None
    time: float
    replicas: tuple[ReplicaStatus, ...]

    @classmethod
    def from_json(cls, raw: Any) -> FleetView:
        """Parse a fleet reply; anything malformed is a SignalUnavailable (a broken server)."""
        try:
            return cls(
                str(raw["run"]),
                _opt_int(raw.get("head")),
                float(raw.get("time") or 0.0),
                tuple(ReplicaStatus.from_json(r) for r in raw["replicas"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SignalUnavailable(f"malformed fleet from the signal server: {str(raw)[:200]}") from exc

    def behind(self, step: int, *, healthy_only: bool = False) -> list[ReplicaStatus]:
        """The replicas that do not serve ``step`` or newer (with ``healthy_only``: healthily, see
        :meth:`ReplicaStatus.serves_at_least`)."""
        return [r for r in self.replicas if not r.serves_at_least(step, healthy_only=healthy_only)]

    def diverged(self) -> list[ReplicaStatus]:
        """The replicas whose behavioural audit failed (state ``diverged``)."""
        return [r for r in self.replicas if r.state == "diverged"]

    def table(self) -> str:
        """The fleet as a fixed-width text table (one line per replica), its text escaped
        (:func:`deltasync._util.text.escape_text`: no control or bidi character is printed raw)."""
        rows = [("replica", "step", "lag", "state", "last seen", "audit", "last error")]
        for r in self.replicas:  # every cell escaped: a report's free text never reaches the terminal raw
            rows.append(
                (
                    escape_text(r.replica),
                    "-" if r.step is None else str(r.step),
                    "-" if r.lag is None else str(r.lag),
                    escape_text(r.state),
                    f"{r.age_s:.1f} s ago",
                    escape_text(_audit_cell(r)),
                    escape_text((r.last_error or "").replace("\n", " "))[:120],
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(6)]
        return "\n".join(
            "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:6])).rstrip()
            + ("  " + row[6] if row[6] else "")
            for row in rows
        )


def _audit_cell(r: ReplicaStatus) -> str:
    """``step 7 group 0, |d| 0.0016/0.0053 kl 2e-06`` (``-``: no audit; ``odd one out`` when it is;
    ``could not run: <why>`` when the last one could not run)."""
    a = r.audit
    if r.audit_error is not None:
        return "could not run: " + r.audit_error.replace("\n", " ")[:80]
    if a is None:
        return "-"
    cell = f"step {a.audited_step} group {'-' if r.fingerprint_group is None else r.fingerprint_group}"
    if r.odd_one_out:
        cell += " odd one out"
    d = a.divergence
    if d is not None:
        cell += f", |d| {d.mean_abs:.2g}/{d.max_abs:.2g} kl {d.kl:.2g}"
    return cell
