"""Bearer-token scopes: ``publish`` (write; grants every scope), ``subscribe`` (read) and ``report``
(a receiver reporting to the fleet view).

``report`` takes the ``report_token`` when the server has one, else the ``subscribe`` scope's
tokens: a receiver holds a subscribe token already, and a report changes nothing but the fleet
view. Set a report token where readers must not be able to speak for replicas.

A *replica token* (:func:`deltasync.signal.replica_token`, made with the server's replica key)
grants ``report`` for its own replica id(s) of its own run only: :data:`ReportAuth` tells the fleet
routes which credential a report came with (:class:`ReportCredential`): a replica token or the
publish token make it *bound*, the shared report/subscribe tokens (or none, on an open server)
*unbound* (docs/fleet.md).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from deltasync.errors import SignalRejected
from deltasync.server._deps import MetricsDep, SettingsDep
from deltasync.server._input import no_unknown_query
from deltasync.server._models import Problem
from deltasync.server._settings import Settings
from deltasync.signal import REPLICA_TOKEN_PREFIX, verify_replica_token

__all__ = [
    "AUTH_RESPONSES",
    "Publish",
    "Report",
    "ReportAuth",
    "ReportCheck",
    "ReportCredential",
    "ReportRefusal",
    "Subscribe",
    "report_grant",
    "require",
]

_bearer = HTTPBearer(auto_error=False, description="publish, subscribe or report token")


def _same(given: str, expected: str) -> bool:
    # hash first: compare_digest is constant-time only for equal lengths
    return hmac.compare_digest(hashlib.sha256(given.encode()).digest(), _digest(expected))


@functools.lru_cache(maxsize=16)
def _digest(token: str) -> bytes:
    """SHA-256 of one of the server's own tokens (hashed once, not at each request)."""
    return hashlib.sha256(token.encode()).digest()


def _auth_error(status: int, detail: str) -> HTTPException:
    return HTTPException(status, detail, headers={"WWW-Authenticate": 'Bearer realm="deltasync"'})


def _wanted(settings: Settings, scope: str) -> list[str | None]:
    """The tokens that grant ``scope``; the first one None means the scope is open."""
    if scope == "publish":
        return [settings.publish_token]
    if scope == "report" and settings.report_token is not None:
        return [settings.report_token, settings.publish_token]
    return [settings.subscribe_token, settings.publish_token]


def require(scope: Literal["publish", "subscribe", "report"]) -> Callable[..., Awaitable[None]]:
    """A dependency that refuses requests without a token of ``scope`` (401 none, 403 wrong).

    It authenticates first, and only then refuses query parameters the route does
    not declare (422): a request without a valid token learns nothing about its input.
    """

    async def check(
        request: Request,
        settings: SettingsDep,
        metrics: MetricsDep,
        cred: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    ) -> None:
        wanted = _wanted(settings, scope)
        if wanted[0] is None:  # the scope is open
            no_unknown_query(request)
            return
        if cred is None:
            metrics.inc("deltasync_auth_failures_total", reason="missing")
            raise _auth_error(401, f"this route needs a bearer token of scope {scope!r}")
        ok = False
        for tok in wanted:
            if tok is not None:
                ok |= _same(cred.credentials, tok)  # no short-circuit: same work for every token
        if not ok:
            metrics.inc("deltasync_auth_failures_total", reason="wrong")
            raise _auth_error(403, f"the bearer token does not grant scope {scope!r}")
        no_unknown_query(request)

    return check


@dataclass(frozen=True, slots=True)
class ReportCredential:
    """What a fleet report (or goodbye) was authenticated with.

    ``kind``: ``"replica"`` (a replica token of ``identity``: it covers the URL's replica id),
    ``"publish"`` (the operator: may report or remove any replica) or ``"shared"`` (the report
    token, a subscribe token, or nothing on a server whose report scope is open).
    """

    kind: Literal["replica", "publish", "shared"]
    identity: str | None = None

    @property
    def bound(self) -> bool:
        """Whether the report speaks for its replica with a credential of that replica (or the operator's)."""
        return self.kind != "shared"


@dataclass(frozen=True, slots=True)
class ReportRefusal:
    """Why :func:`report_grant` refused a credential: the status (401/403), the reason counted in
    ``deltasync_auth_failures_total`` and the detail of the reply."""

    status: int
    reason: Literal["missing", "wrong"]
    detail: str


def report_grant(settings: Settings, given: str | None, run: str, replica: str) -> ReportCredential | ReportRefusal:
    """The credential that grants ``report`` on ``run``'s ``replica`` to the bearer token ``given``
    (None: no token), or why it does not: :func:`report_credential` without its side effects (it
    counts nothing and raises nothing), so that the report route's fast path may ask it too."""
    if given is not None and given.startswith(REPLICA_TOKEN_PREFIX):
        key = settings.replica_token_key
        if key is None:
            return ReportRefusal(
                403,
                "wrong",
                "this server takes no replica tokens: start it with DELTASYNC_REPLICA_KEY (or a publish token)",
            )
        try:
            identity = verify_replica_token(key, given, run, replica)
        except SignalRejected as exc:
            return ReportRefusal(403, "wrong", str(exc))
        return ReportCredential("replica", identity)
    wanted = _wanted(settings, "report")
    is_publish = given is not None and settings.publish_token is not None and _same(given, settings.publish_token)
    if wanted[0] is None:  # the scope is open
        return ReportCredential("publish" if is_publish else "shared")
    if given is None:
        return ReportRefusal(
            401, "missing", "this route needs a bearer token of scope 'report' (or this replica's replica token)"
        )
    ok = is_publish
    for tok in wanted:
        if tok is not None:
            ok |= _same(given, tok)  # no short-circuit: same work for every token
    if not ok:
        return ReportRefusal(403, "wrong", "the bearer token does not grant scope 'report' (nor is it a replica token)")
    return ReportCredential("publish" if is_publish else "shared")


async def report_credential(
    request: Request,
    settings: SettingsDep,
    metrics: MetricsDep,
    cred: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> ReportCredential:
    """The ``report`` scope of ``/v1/runs/{run}/replicas/{replica}``, and which credential granted it
    (401 none, 403 wrong: a replica token of another run or replica, or not made with this server's key)."""
    run, replica = str(request.path_params.get("run", "")), str(request.path_params.get("replica", ""))
    grant = report_grant(settings, None if cred is None else cred.credentials, run, replica)
    if isinstance(grant, ReportRefusal):
        metrics.inc("deltasync_auth_failures_total", reason=grant.reason)
        raise _auth_error(grant.status, grant.detail)
    no_unknown_query(request)
    return grant


#: the ``report`` scope of a replica's route, with the credential that granted it
ReportAuth = Annotated[ReportCredential, Depends(report_credential)]
#: the same as a route's dependency (``dependencies=[ReportCheck]``): solved before the body is looked
#: at (auth first); a ``ReportAuth`` parameter of the route gets its cached credential
ReportCheck = Depends(report_credential)

Publish = Depends(require("publish"))
Subscribe = Depends(require("subscribe"))
Report = Depends(require("report"))

AUTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": Problem, "description": "the body is not parseable JSON"},
    401: {"model": Problem, "description": "no bearer token"},
    403: {"model": Problem, "description": "the token lacks this scope"},
    413: {"model": Problem, "description": "request body too large"},
}
