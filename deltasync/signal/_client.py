"""httpx client of the signal server, and the uploader's background :class:`Notifier`.

Needs only httpx (no FastAPI): the uploader and fetcher import it, never
``deltasync.server``. Every failure is a :class:`~deltasync.errors.SignalError`:
``SignalUnavailable`` (network, timeout, 5xx: worth retrying or polling the
store instead), ``SignalConflict`` (409) or ``SignalRejected`` (other 4xx).
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpx

from deltasync._util.retry import RetryPolicy
from deltasync._util.worker import SerialWorker, WorkerClosed
from deltasync.errors import SignalConflict, SignalError, SignalRejected, SignalUnavailable
from deltasync.protocol.audit import AuditReport
from deltasync.signal._fleet import FleetView, ReplicaStatus
from deltasync.signal._names import check_replica, check_run

__all__ = ["LEASE_HEADER", "CommitEvent", "Notifier", "SignalClient", "new_lease"]

log = logging.getLogger("deltasync.signal")

#: the header of a replica report's lease: a secret the reporter draws at start, so that the server
#: refuses (409) a report or goodbye for the same replica id from another reporter (docs/fleet.md)
LEASE_HEADER = "Deltasync-Lease"


def new_lease() -> str:
    """A fresh lease secret for :data:`LEASE_HEADER` (43 base64url characters, 256 random bits)."""
    return secrets.token_urlsafe(32)


@dataclass(frozen=True, slots=True)
class CommitEvent:
    """A commit as the server reports it (``GET head``, ``wait``, SSE ``commit`` events)."""

    run: str
    step: int
    manifest_digest: str
    run_id: str | None = None
    kind: str | None = None
    time: float = 0.0

    @classmethod
    def from_json(cls, raw: Any) -> CommitEvent:
        """Parse a server reply; anything malformed is a SignalUnavailable (a broken server)."""
        try:
            step = raw["step"]
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise TypeError("step")
            return cls(
                str(raw["run"]),
                step,
                str(raw["manifest_digest"]),
                None if raw.get("run_id") is None else str(raw["run_id"]),
                None if raw.get("kind") is None else str(raw["kind"]),
                float(raw.get("time") or 0.0),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise SignalUnavailable(f"malformed commit from the signal server: {str(raw)[:200]}") from exc


def _token_hint(method: str, path: str, status: int, sent: bool) -> str:
    """What to set after a 401/403: the subscribe token for reads, the publish token for writes."""
    if "/replicas/" in path and not path.endswith("/token"):
        # a receiver's report: its subscribe token, unless the server has a report token or it holds a replica token
        scope, env = "subscribe", "DELTASYNC_SUBSCRIBE_TOKEN"
        who = (
            "or DELTASYNC_REPORT_TOKEN to its report token or to this replica's replica token "
            "(`deltasync replica-token`); or pass token= / signal_token="
        )
    elif method == "GET" and not path.rstrip("/").endswith("/webhooks"):
        scope, env = "subscribe", "DELTASYNC_SUBSCRIBE_TOKEN"
        who = "`deltasync fetch`/`follow` read it; or pass token= (the publish token works too)"
    else:
        scope, env = "publish", "DELTASYNC_PUBLISH_TOKEN"
        who = "`delta-upload --signal` reads it; or UploaderConfig(signal_token=...) / SignalClient(token=...)"
    why = "no token was sent" if not sent or status == 401 else "the token sent was refused"
    return f" ({why}: set {env} to the server's {scope} token; {who})"


def _check(r: httpx.Response) -> httpx.Response:
    if r.status_code < 400:
        return r
    try:
        r.read()
        detail = r.json().get("detail", r.text)
        if isinstance(detail, list):  # validation errors: [{"loc": [...], "msg": ...}, ...]
            detail = "; ".join(f"{'.'.join(map(str, d.get('loc', [])))}: {d.get('msg')}" for d in detail)
    except (ValueError, AttributeError, httpx.HTTPError):
        detail = r.text if r.is_stream_consumed else ""
    msg = f"signal server: {r.request.method} {r.request.url.path} -> HTTP {r.status_code}: {detail}"
    if r.status_code in (401, 403) and "is held by" not in str(detail):  # not an id another credential holds
        msg += _token_hint(r.request.method, r.request.url.path, r.status_code, "authorization" in r.request.headers)
    if r.status_code >= 500:
        raise SignalUnavailable(msg)
    if r.status_code == 409:
        raise SignalConflict(msg)
    raise SignalRejected(msg)


def _lease(lease: str | None) -> dict[str, str]:
    return {} if lease is None else {LEASE_HEADER: lease}


class SignalClient:
    """Synchronous client of one signal server.

    ``token`` is sent as ``Authorization: Bearer``; ``transport`` replaces the
    network (``httpx.MockTransport`` in tests).
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout: float = 5.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise SignalRejected(f"signal URL must start with http:// or https://, got {url!r}")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, transport=transport)

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return _check(self._client.request(method, path, **kwargs))
        except httpx.HTTPError as exc:
            raise SignalUnavailable(f"signal server {self.url} unreachable: {type(exc).__name__}: {exc}") from exc

    def publish(
        self, run: str, step: int, manifest_digest: str, *, run_id: str | None = None, kind: str | None = None
    ) -> CommitEvent:
        """Signal that ``step`` of ``run`` is committed (idempotent for the same digest)."""
        body: dict[str, Any] = {"step": step, "manifest_digest": manifest_digest}
        if run_id is not None:
            body["run_id"] = run_id
        if kind is not None:
            body["kind"] = kind
        return CommitEvent.from_json(self._request("POST", f"/v1/runs/{check_run(run)}/commits", json=body).json())

    def head(self, run: str) -> CommitEvent | None:
        """The newest signalled step of ``run``, or None when there is none yet."""
        try:
            r = self._request("GET", f"/v1/runs/{check_run(run)}/head")
        except SignalRejected as exc:
            if "HTTP 404" in str(exc):
                return None
            raise
        return CommitEvent.from_json(r.json())

    def wait(self, run: str, after: int, timeout: float = 30.0) -> CommitEvent | None:
        """Long-poll: the head once it is newer than ``after``; None when ``timeout`` passes first."""
        r = self._request(
            "GET",
            f"/v1/runs/{check_run(run)}/wait",
            params={"after": after, "timeout": timeout},
            timeout=httpx.Timeout(self.timeout, read=timeout + self.timeout),
        )
        return None if r.status_code == 204 else CommitEvent.from_json(r.json())

    def events(
        self, run: str, *, last_event_id: int | None = None, heartbeat: float | None = None
    ) -> Iterator[CommitEvent | None]:
        """Follow the run's SSE stream: yields each commit, and None at every heartbeat.

        Resumes after ``last_event_id`` (a step) when given. A silent connection
        (no byte for three heartbeats) or a dropped one raises SignalUnavailable.
        """
        headers = {"Accept": "text/event-stream"}
        if last_event_id is not None:
            headers["Last-Event-ID"] = str(last_event_id)
        params = {"heartbeat": heartbeat} if heartbeat is not None else {}
        beat = heartbeat if heartbeat is not None else 15.0
        timeout = httpx.Timeout(self.timeout, read=3 * beat + self.timeout)
        try:
            with self._client.stream(
                "GET", f"/v1/runs/{check_run(run)}/events", headers=headers, params=params, timeout=timeout
            ) as r:
                _check(r)
                data: list[str] = []
                kind = "message"
                for line in r.iter_lines():
                    if line.startswith(":"):
                        yield None
                    elif line == "":
                        if data and kind == "commit":
                            try:
                                raw = json.loads("\n".join(data))
                            except ValueError as exc:
                                raise SignalUnavailable(f"malformed SSE data from {self.url}") from exc
                            yield CommitEvent.from_json(raw)
                        data, kind = [], "message"
                    else:
                        field, _, value = line.partition(":")
                        value = value[1:] if value.startswith(" ") else value
                        if field == "data":
                            data.append(value)
                        elif field == "event":
                            kind = value
        except httpx.HTTPError as exc:
            raise SignalUnavailable(f"signal stream from {self.url} broke: {type(exc).__name__}: {exc}") from exc
        raise SignalUnavailable(f"signal stream from {self.url} ended")

    def register_webhook(self, run: str, url: str, secret: str) -> dict[str, Any]:
        """Register a webhook for ``run``; returns ``{"id", "run", "url", "created"}``."""
        r = self._request("POST", f"/v1/runs/{check_run(run)}/webhooks", json={"url": url, "secret": secret})
        out: dict[str, Any] = r.json()
        return out

    def report(
        self,
        run: str,
        replica: str,
        *,
        step: int | None,
        state: str,
        digest: str | None = None,
        last_error: str | None = None,
        ttl_s: float | None = None,
        audit: AuditReport | None = None,
        lease: str | None = None,
        audit_error: str | None = None,
    ) -> ReplicaStatus:
        """Tell the server what ``replica`` of ``run`` serves now (scope ``report``), with its last
        behavioural ``audit`` if any, or why its last audit could not run (``audit_error``, sent only
        when set: a server older than the field refuses it); returns its entry.

        ``lease``: this reporter's lease secret (:func:`new_lease`), sent in :data:`LEASE_HEADER`: the
        server then refuses the same replica id to a reporter with another lease (409,
        SignalConflict), until this one leaves or ages out. A replica id held by a replica token is
        refused to a shared token (403, SignalRejected)."""
        body: dict[str, Any] = {"step": step, "state": state, "digest": digest, "last_error": last_error}
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        if audit is not None:
            body["audit"] = audit.to_dict()
        if audit_error is not None:
            body["audit_error"] = audit_error
        r = self._request(
            "PUT", f"/v1/runs/{check_run(run)}/replicas/{check_replica(replica)}", json=body, headers=_lease(lease)
        )
        try:
            return ReplicaStatus.from_json(r.json())
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SignalUnavailable(f"malformed replica from the signal server: {r.text[:200]}") from exc

    def leave(self, run: str, replica: str, *, lease: str | None = None) -> bool:
        """Remove ``replica`` from the run's fleet (with the ``lease`` it reported with); whether it was there."""
        try:
            self._request(
                "DELETE", f"/v1/runs/{check_run(run)}/replicas/{check_replica(replica)}", headers=_lease(lease)
            )
        except SignalRejected as exc:
            if "HTTP 404" in str(exc):
                return False
            raise
        return True

    def replica_token(self, run: str, replica: str) -> str:
        """Mint the replica token of identity ``replica`` of ``run`` at the server (scope ``publish``);
        :func:`deltasync.signal.replica_token` mints the same offline with the server's key."""
        r = self._request("POST", f"/v1/runs/{check_run(run)}/replicas/{check_replica(replica)}/token")
        try:
            tok = r.json()["token"]
            if not isinstance(tok, str):
                raise TypeError("token")
            return tok
        except (KeyError, TypeError, ValueError) as exc:
            raise SignalUnavailable(f"malformed replica token from the signal server: {r.text[:200]}") from exc

    def fleet(self, run: str) -> FleetView:
        """The run's live replicas, each with its step, lag behind the head, state and last error."""
        return FleetView.from_json(self._request("GET", f"/v1/runs/{check_run(run)}/fleet").json())

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()

    def __enter__(self) -> SignalClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Notifier:
    """Posts commits to the signal server from its own worker; never raises into the caller.

    :meth:`notify` only queues the newest commit and returns. A
    :class:`~deltasync._util.worker.SerialWorker` posts it with short timeouts, making ``attempts``
    attempts with the shared :class:`~deltasync._util.retry.RetryPolicy` (exponential backoff from
    ``backoff`` seconds); a newer commit supersedes a queued or retrying older one (the server
    only needs the head). Failures are logged and counted in ``failed`` / ``rejected``; ``sent``
    counts successes, ``superseded`` the commits replaced before they were posted.
    """

    def __init__(
        self,
        url: str,
        run: str,
        token: str | None = None,
        *,
        timeout: float = 2.0,
        attempts: int = 3,
        backoff: float = 0.2,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.run = check_run(run)
        self.attempts = max(1, attempts)
        self.backoff = backoff
        self.policy = RetryPolicy(retries=self.attempts - 1, backoff=backoff, max_backoff=max(30.0, backoff))
        self.sent = 0
        self.failed = 0
        self.rejected = 0
        self.superseded = 0
        self._client = SignalClient(url, token, timeout=timeout, transport=transport)
        self._worker = SerialWorker("deltasync-notify")

    def notify(self, step: int, manifest_digest: str, *, run_id: str | None = None, kind: str | None = None) -> None:
        """Queue a commit signal (returns at once)."""
        commit = _Commit(step, manifest_digest, run_id, kind)
        try:
            fut = self._worker.submit(lambda: self._send(commit), coalesce="head")
        except WorkerClosed:
            return
        fut.add_done_callback(self._count_superseded)

    def _count_superseded(self, fut: Future[None]) -> None:
        if fut.cancelled():  # a newer commit took its place in the queue
            self.superseded += 1

    def _newer_pending(self) -> bool:
        return self._worker.pending() > 1  # the running job and at least one queued behind it

    def _send(self, c: _Commit) -> None:
        stop = self._worker.stop
        for attempt in range(self.attempts):
            try:
                self._client.publish(self.run, c.step, c.manifest_digest, run_id=c.run_id, kind=c.kind)
                self.sent += 1
                return
            except SignalRejected as exc:
                self.rejected += 1
                log.warning("signal for step %d refused: %s", c.step, exc)
                return
            except SignalError as exc:
                if attempt + 1 == self.attempts or stop.is_set():
                    self.failed += 1
                    log.warning("signal for step %d not delivered after %d attempts: %s", c.step, attempt + 1, exc)
                    return
                log.debug("signal for step %d failed (attempt %d): %s", c.step, attempt + 1, exc)
            if stop.wait(self.policy.delay(attempt)) or self._newer_pending():
                if self._newer_pending():
                    return  # a newer step will be sent instead; it implies this one
                self.failed += 1
                return

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until nothing is pending or in flight; whether that happened within ``timeout``."""
        return self._worker.flush(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is pending (up to ``timeout`` seconds), then stop the worker (cutting a backoff short)."""
        self._worker.flush(timeout)
        self._worker.close(timeout=timeout)
        self._client.close()


@dataclass(frozen=True, slots=True)
class _Commit:
    step: int
    manifest_digest: str
    run_id: str | None
    kind: str | None
