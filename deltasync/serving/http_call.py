"""One HTTP call to an engine server, bounded: a total deadline and a body-size cap.

httpx's timeouts bound each socket operation, not a call: a server that sends one byte a second
(of its status line, its headers or its body) holds a call with a 3 s read timeout for as long as it
likes, and a 400 MB answer is read whole. :class:`BoundedHTTP` makes every call of the vLLM client
(:class:`~deltasync.serving.vllm_server.VLLMServer`) and of the receiver's audit
(:mod:`deltasync.serving.audit`) whole-or-nothing within bounds:

- a **total deadline** per call (connect, send, the status line, the headers and the whole body):
  every socket operation of the call is given only the time left until the deadline
  (:class:`DeadlineTransport`, through httpcore's public network-backend interface), and the body is
  streamed with the deadline checked between chunks (for any transport);
- a **body cap** per call: a ``Content-Length`` over it is refused before the body is read, and a
  body streamed past it is cut there and the connection closed, so memory stays bounded;
- JSON parsed only from that bounded body.

Outcomes, all from :mod:`deltasync.errors`: no whole answer within the deadline, a refused or dropped
connection or any other transport error: :class:`~deltasync.errors.ServerUnreachable`; a success
answer that is not JSON, or over the cap: :class:`~deltasync.errors.MalformedAnswer`. An HTTP error
status is returned as an :class:`Answer` (its ``detail`` bounded), for the caller to name what failed
(:meth:`Answer.error`). Nothing else escapes: no httpx or httpcore error, no JSONDecodeError.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import httpcore
import httpx

from deltasync.errors import MalformedAnswer, ServerError, ServerUnreachable

__all__ = [
    "ERROR_DETAIL",
    "SMALL_BODY",
    "Answer",
    "BoundedHTTP",
    "DeadlineTransport",
    "error_detail",
]

#: the cap of a quick call's body (``/weight_info``, ``/is_paused``, ``/v1/models``, ``/pause``, ...)
SMALL_BODY = 1 << 20
#: the most of an error answer's text kept in its :class:`Answer` (the rest is read, up to the cap, and dropped)
ERROR_DETAIL = 1000

#: the absolute ``time.monotonic()`` deadline of the call running in this thread (None: none)
_DEADLINE: ContextVar[float | None] = ContextVar("deltasync_http_deadline", default=None)

#: how vLLM wraps a worker's error in a ``/collective_rpc`` or weight-transfer answer
_VLLM_WRAPPED = re.compile(
    r"^Call to collective_rpc method failed: Worker failed with error '(?P<inner>.*)', please check the stack trace "
    r"above for the root cause\.?$",
    re.DOTALL,
)


def _left(timeout: float | None) -> float | None:
    """``timeout`` cut to what is left of this thread's call deadline; past it: a read timeout."""
    deadline = _DEADLINE.get()
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise httpcore.ReadTimeout("the call's deadline passed")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    """A socket stream whose every read and write gets at most the time left of the call's deadline."""

    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self.inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self.inner.read(max_bytes, _left(timeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.inner.write(buffer, _left(timeout))

    def close(self) -> None:
        self.inner.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None) -> Any:
        return _DeadlineStream(self.inner.start_tls(ssl_context, server_hostname, _left(timeout)))

    def get_extra_info(self, info: str) -> Any:
        return self.inner.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    """httpcore's socket backend, its connects and streams bounded by the call's deadline."""

    def __init__(self) -> None:
        self.inner = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        return _DeadlineStream(self.inner.connect_tcp(host, port, _left(timeout), local_address, socket_options))

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.NetworkStream:
        return _DeadlineStream(self.inner.connect_unix_socket(path, _left(timeout), socket_options))

    def sleep(self, seconds: float) -> None:
        self.inner.sleep(seconds)


#: httpcore's errors as httpx's (the most specific first)
_ERRORS: tuple[tuple[type[Exception], type[httpx.TransportError]], ...] = (
    (httpcore.ConnectTimeout, httpx.ConnectTimeout),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.ProtocolError, httpx.ProtocolError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
)

_CORE_ERRORS = (httpcore.TimeoutException, httpcore.NetworkError, httpcore.ProtocolError, httpcore.UnsupportedProtocol)


def _as_httpx(exc: Exception) -> Exception:
    for theirs, ours in _ERRORS:
        if isinstance(exc, theirs):
            return ours(str(exc) or type(exc).__name__)
    return exc


class _Body(httpx.SyncByteStream):
    def __init__(self, parts: Iterable[bytes]) -> None:
        self.parts = parts

    def __iter__(self) -> Iterator[bytes]:
        try:
            yield from self.parts
        except _CORE_ERRORS as exc:
            raise _as_httpx(exc) from exc

    def close(self) -> None:
        close = getattr(self.parts, "close", None)
        if close is not None:
            close()


class DeadlineTransport(httpx.BaseTransport):
    """An HTTP/1.1 transport (httpcore's connection pool, TLS verified) whose socket operations never
    outlive the deadline of the :class:`BoundedHTTP` call they serve."""

    def __init__(self, *, max_connections: int = 16, keepalive_expiry: float = 5.0) -> None:
        self.pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(),
            max_connections=max_connections,
            max_keepalive_connections=max_connections,
            keepalive_expiry=keepalive_expiry,
            network_backend=_DeadlineBackend(),
        )

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        assert isinstance(request.stream, httpx.SyncByteStream)
        req = httpcore.Request(
            method=request.method,
            url=httpcore.URL(
                scheme=request.url.raw_scheme,
                host=request.url.raw_host,
                port=request.url.port,
                target=request.url.raw_path,
            ),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        try:
            resp = self.pool.handle_request(req)
        except _CORE_ERRORS as exc:
            raise _as_httpx(exc) from exc
        assert isinstance(resp.stream, Iterable)
        return httpx.Response(resp.status, headers=resp.headers, stream=_Body(resp.stream), extensions=resp.extensions)

    def close(self) -> None:
        self.pool.close()


@dataclass(frozen=True, slots=True)
class Answer:
    """A whole answer: its status, its JSON body (a success; None when empty) or its error's text."""

    url: str
    status: int
    body: Any = None
    #: an error answer's text (the worker's own error unwrapped from vLLM's), at most :data:`ERROR_DETAIL`
    detail: str = ""

    @property
    def ok(self) -> bool:
        """Whether the status is a success (2xx)."""
        return 200 <= self.status < 300

    def error(self, what: str) -> ServerError:
        """The error of an answer that is not a success, naming ``what`` failed."""
        return ServerError(f"{self.url}: {what} failed: HTTP {self.status}: {self.detail}")


class BoundedHTTP:
    """An engine server's HTTP client whose every call is bounded (see the module doc).

    ``transport``: an httpx transport to use instead of :class:`DeadlineTransport` (tests); the
    deadline is then checked between body chunks only. ``clock``: the clock of those checks.
    """

    def __init__(
        self,
        base_url: str,
        *,
        headers: Mapping[str, str] | None = None,
        transport: httpx.BaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.clock = clock
        # identity: a compressed body would be decoded past the cap in one chunk
        sent = {"Accept-Encoding": "identity", **(headers or {})}
        try:
            self.client = httpx.Client(base_url=self.base_url, headers=sent, transport=transport or DeadlineTransport())
        except httpx.InvalidURL as exc:
            raise ValueError(f"{base_url!r} is not a server's URL (http://HOST:PORT): {exc}") from None

    def call(
        self,
        method: str,
        path: str,
        *,
        deadline: float,
        cap: int = SMALL_BODY,
        json_body: object = None,
        params: Mapping[str, str] | None = None,
        close: bool = False,
    ) -> Answer:
        """``method path`` with the whole answer within ``deadline`` seconds and at most ``cap`` bytes.
        ``close``: not kept alive (vLLM drops the connection of a call that answers an error).
        Raises :class:`ServerUnreachable` or :class:`MalformedAnswer` only."""
        if not (deadline > 0 and math.isfinite(deadline)):
            raise ValueError(f"deadline must be a finite number of seconds > 0, got {deadline!r}")
        where = f"{self.base_url}{path}"
        until = self.clock() + deadline
        token = _DEADLINE.set(time.monotonic() + deadline)
        try:
            request = self.client.build_request(
                method,
                path,
                json=json_body,
                params=params,
                headers={"Connection": "close"} if close else None,
                timeout=httpx.Timeout(deadline),
            )
            r = self.client.send(request, stream=True)
            try:
                status = r.status_code
                data = _read(r, cap, until, self.clock, where, status >= 300)
            finally:
                r.close()  # a body cut short closes its connection
        except httpx.TimeoutException as exc:
            raise ServerUnreachable(f"{where}: no whole answer within {deadline:g} s ({_why(exc)})") from None
        except (httpx.HTTPError, httpx.StreamError, OSError) as exc:
            raise ServerUnreachable(f"{where}: no answer: {_why(exc)}") from None
        finally:
            _DEADLINE.reset(token)
        if status >= 300:
            return Answer(self.base_url, status, None, error_detail(data))
        return Answer(self.base_url, status, parse_json(data, where))

    def close(self) -> None:
        """Close the connections."""
        self.client.close()


class _Late(httpx.TimeoutException):
    """The deadline passed between two chunks of the body."""


def _read(r: httpx.Response, cap: int, until: float, clock: Callable[[], float], where: str, error: bool) -> bytearray:
    """The body, at most ``cap`` bytes by ``until`` (an error answer's is cut at the cap instead)."""
    declared = r.headers.get("content-length", "")
    if not error and declared.isdigit() and int(declared) > cap:
        raise MalformedAnswer(f"{where}: an answer of {int(declared):,} bytes, over the {cap:,} this call takes")
    data = bytearray()  # grown in place: the body is held once, never more than the cap and a chunk
    for chunk in r.iter_bytes():
        if len(data) + len(chunk) > cap:
            if error:
                data += chunk[: cap - len(data)]
                break
            raise MalformedAnswer(f"{where}: an answer of over {cap:,} bytes, the most this call takes: cut there")
        data += chunk
        if clock() > until:
            raise _Late("the deadline passed while the body was read")
    return data


def _why(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def parse_json(data: bytes | bytearray, where: str) -> Any:
    """``data`` as JSON (None when empty); anything else: :class:`MalformedAnswer`."""
    if not data.strip():
        return None
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        head = data[:120].decode("utf-8", "replace")
        raise MalformedAnswer(f"{where}: the answer is not JSON ({type(exc).__name__}): {head!r}") from None


def error_detail(data: bytes | bytearray) -> str:
    """An error answer's text: the worker's own error, unwrapped from vLLM's text around it (bounded)."""
    try:
        body = json.loads(data) if data.strip() else ""
    except (ValueError, RecursionError):
        return data[:ERROR_DETAIL].decode("utf-8", "replace")
    text = _error_field(body)
    m = _VLLM_WRAPPED.match(text)
    return (m.group("inner") if m else text)[:ERROR_DETAIL]


def _error_field(body: object) -> str:
    if isinstance(body, dict):
        for k in ("error", "detail", "message"):
            if k in body:
                v = body[k]
                inner = v.get("message") if isinstance(v, dict) else None
                return str(inner if inner is not None else v)[: ERROR_DETAIL * 4]
    return str(body)[: ERROR_DETAIL * 4]
