"""One vLLM server driven over HTTP: the update sequence and the calls around it.

A :class:`VLLMServer` is one ``vllm serve`` process started with the deltasync weight-transfer
backend (``--weight-transfer-config '{"backend": "deltasync"}'``, ``VLLM_SERVER_DEV_MODE=1``).
:meth:`VLLMServer.update` runs the whole update sequence, so that nothing the server answers after
it returns depends on the previous weights:

1. ``POST /pause?mode=wait`` (default): let in-flight requests finish, hold new ones, clear the
   caches. ``abort`` drops in-flight requests instead; ``keep`` freezes them and they continue on
   the new weights after the update (their earlier tokens came from the old ones: a mixed sample,
   which an RL loop must accept knowingly).
2. ``POST /start_weight_update``, ``POST /update_weights {"update_info": {"step": N}}``,
   ``POST /finish_weight_update {"weight_version": "N"}``: the backend's four phases (every worker
   downloads, verifies and applies the step, or none does).
3. ``POST /reset_prefix_cache``: KV blocks computed with the old weights are dropped (vLLM's
   prefix cache outlives a weight update otherwise), then ``POST /resume``.

A failed update leaves the server at its previous step (``rolled_back``: it is resumed) or, when
the backend could not restore it either, ``needs_replacement`` (it stays paused: its weights are
neither step). Many servers, a run to follow and the fleet view: :mod:`deltasync.serving.driver`.

Every call is bounded (:mod:`deltasync.serving.http_call`: a total deadline, a body cap) and every
answer is read through a typed parse (the worker API's types for ``/collective_rpc``): a server that
answers anything else, too much or too late raises a :class:`~deltasync.errors.ServerError`
(:class:`~deltasync.errors.ServerUnreachable`: no whole answer in time; :class:`~deltasync.errors.MalformedAnswer`:
not the API's answer), never an httpx or parsing error; :meth:`VLLMServer.update` turns each into its outcome.

This module talks HTTP only: it imports neither vLLM nor torch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import httpx

from deltasync.errors import DeltaSyncError, MalformedAnswer, PrefixCacheNotReset, ServerError, ServerUnreachable
from deltasync.serving.audit import AuditResult
from deltasync.serving.http_call import SMALL_BODY, Answer, BoundedHTTP, error_detail
from deltasync.serving.worker_api import MAX_TEXT, PREPARE, STATUS, PrepareRequest, WorkerStatus, statuses

__all__ = [
    "PAUSE_MODES",
    "PROBE_TIMEOUT",
    "RESUME_TRIES",
    "RPC_BODY_MAX",
    "RPC_BODY_PER_WORKER",
    "STATUS_BODY_MAX",
    "STATUS_BODY_PER_WORKER",
    "STATUS_TRIES",
    "PauseMode",
    "ServerUpdate",
    "UpdateOutcome",
    "VLLMServer",
    "agreed_step",
    "error_text",
    "response_detail",
]

log = logging.getLogger("deltasync.vllm.driver")

PauseMode = Literal["wait", "abort", "keep"]
PAUSE_MODES: tuple[str, ...] = ("wait", "abort", "keep")
#: reads of the workers' states after a refused update before the server is left paused as unknown
STATUS_TRIES = 3
#: tries of ``POST /resume`` (each on a new connection: vLLM drops the connection of a refused update)
#: before a server that cannot be resumed is reported ``needs_replacement``
RESUME_TRIES = 5
#: seconds the driver waits for a quick answer (``/weight_info``, ``/is_paused``, ``/resume``, the workers'
#: status): a server that does not answer one whole within this is unreachable (stopped, hung or gone)
PROBE_TIMEOUT = 10.0
#: the most bytes one worker's answer to a ``/collective_rpc`` call may take: a parameter-audit chunk (it
#: names tensors) and a status (deltasync_status, deltasync_prepare); a call's cap is this times the workers
#: the server last said it has (8 before it said), at most :data:`RPC_BODY_MAX` / :data:`STATUS_BODY_MAX`
RPC_BODY_PER_WORKER, STATUS_BODY_PER_WORKER = 4 << 20, 64 << 10
#: the most bytes of any one ``/collective_rpc`` answer: the driver's memory stays bounded whatever a server claims
RPC_BODY_MAX, STATUS_BODY_MAX = 32 << 20, 4 << 20
_RANKS_ASSUMED, _RANKS_MAX = 8, 64
#: What one update sequence did to one server (see :attr:`ServerUpdate.state`). An outcome, not the
#: server's state in the fleet view: :func:`deltasync.serving.fleet.server_state` derives that.
UpdateOutcome = Literal["serving", "rolled_back", "held_back", "needs_replacement", "unreachable", "failed"]
_NOT_FOUND_HINT = (
    "needs a vLLM >= 0.22 server started with VLLM_SERVER_DEV_MODE=1 and "
    '--weight-transfer-config \'{"backend": "deltasync"}\''
)


@dataclass(frozen=True, slots=True)
class ServerUpdate:
    """What one server did with one step."""

    url: str
    step: int
    #: "serving": the server serves ``step``; "rolled_back": it refused the step and serves its previous
    #: weights, bit-exact; "needs_replacement": its weights are neither step, it stays paused (restart it);
    #: "unreachable": no answer (it keeps whatever it had); "failed": any other error (see ``error``);
    #: "held_back": an all-or-nothing rollout of ``step`` failed elsewhere before this server was updated:
    #: it was not touched and serves its previous step ("rolled_back" there: it took the step and was
    #: brought back to its previous one, bit-exact)
    state: UpdateOutcome
    #: the server's weight version after the sequence (``str(step)`` when serving), None when unknown
    version: str | None
    #: seconds from the pause to the resume: how long the server did not generate
    pause_s: float
    error: str | None = None
    #: each worker's status after a failure (None: the server could not say, or no worker extension)
    workers: list[WorkerStatus] | None = None
    #: whether every worker had the step prepared (downloaded, verified, decoded) before the pause, so
    #: that the pause only committed it (False: not asked, or the prepare failed or timed out)
    prepared: bool = False
    #: seconds the prepare before the pause took (None: not asked): the server kept generating meanwhile
    prepare_s: float | None = None
    #: the behavioural audit after the update (``VLLMDriver(audit=...)``; None: not audited)
    audit: AuditResult | None = None

    @property
    def ok(self) -> bool:
        """Whether the server now serves ``step``."""
        return self.state == "serving"


@dataclass(frozen=True, slots=True)
class _Applied:
    """What the paused part of an update left: the outcome so far, and whether to resume."""

    state: UpdateOutcome
    error: str | None
    resume: bool
    workers: list[WorkerStatus] | None = None
    #: the workers' states were read already (after a refused update)
    asked: bool = False


class VLLMServer:
    """One vLLM server's HTTP API, as deltasync uses it. ``api_key``: vLLM's ``--api-key``, if set.

    Every method but :meth:`update` raises only :class:`~deltasync.errors.DeltaSyncError`:
    :class:`~deltasync.errors.ServerUnreachable` when no whole answer came within the call's deadline,
    another :class:`~deltasync.errors.ServerError` (:class:`~deltasync.errors.MalformedAnswer`, ...) for
    an answer that is an error or not the API's.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 600.0,
        probe_timeout: float = PROBE_TIMEOUT,
        api_key: str | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        #: seconds of each call of an update, whole (the pause waits for in-flight requests; ``update_weights``
        #: and the prepare download a step): sized for one update
        self.timeout = timeout
        #: seconds of each quick call, whole (``/weight_info``, ``/is_paused``, ``/resume``, ``/v1/models``)
        self.probe_timeout = min(probe_timeout, timeout)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._api = BoundedHTTP(self.url, headers=headers, transport=transport)
        self._model: str | None = None
        self._ranks = _RANKS_ASSUMED

    @property
    def api(self) -> BoundedHTTP:
        """The bounded HTTP client of this server (its base URL and API key): what the audit calls through."""
        return self._api

    @property
    def rpc_cap(self) -> int:
        """The most bytes a :meth:`rpc` answer of this server may take (see :data:`RPC_BODY_PER_WORKER`)."""
        return min(RPC_BODY_PER_WORKER * self._ranks, RPC_BODY_MAX)

    @property
    def status_cap(self) -> int:
        """The most bytes a status answer (:meth:`workers`, :meth:`prepare`) of this server may take."""
        return min(STATUS_BODY_PER_WORKER * self._ranks, STATUS_BODY_MAX)

    def __repr__(self) -> str:
        return f"VLLMServer({self.url!r})"

    def close(self) -> None:
        """Close the HTTP connections."""
        self._api.close()

    def _call(
        self,
        method: str,
        path: str,
        *,
        quick: bool = False,
        cap: int = SMALL_BODY,
        body: object = None,
        params: Mapping[str, str] | None = None,
        close: bool = False,
        deadline: float | None = None,
    ) -> Answer:
        if deadline is None:
            deadline = self.probe_timeout if quick else self.timeout
        return self._api.call(method, path, deadline=deadline, cap=cap, json_body=body, params=params, close=close)

    def _checked(self, a: Answer, path: str, what: str) -> Any:
        """A success's JSON body; an error answer raised as :class:`ServerError` naming ``what``."""
        if a.status == 404:
            raise ServerError(f"{self.url}{path}: not found (HTTP 404). {what} {_NOT_FOUND_HINT}")
        if not a.ok:
            raise a.error(what)
        return a.body

    def _send(self, path: str, what: str, *, quick: bool = False, **kw: Any) -> Any:
        return self._checked(self._call("POST", path, quick=quick, **kw), path, what)

    def rpc(self, method: str, kwargs: Mapping[str, object] | None = None, *, deadline: float | None = None) -> Any:
        """``POST /collective_rpc`` of the workers' ``method`` within ``deadline`` s (default :attr:`timeout`) and
        :attr:`rpc_cap` bytes: its JSON, for the worker API's parsers; an error answer raised as ServerError."""
        body = {"method": method, "kwargs": dict(kwargs or {})}
        limit = None if deadline is None else min(deadline, self.timeout)
        what = f"collective_rpc {method}"
        return self._send("/collective_rpc", what, body=body, cap=self.rpc_cap, close=True, deadline=limit)

    def model(self) -> str:
        """The served model's id (``GET /v1/models``: ``{"data": [{"id": ...}, ...]}``, read once)."""
        if self._model is None:
            body = self._checked(self._call("GET", "/v1/models", quick=True), "/v1/models", "GET /v1/models")
            data = body.get("data") if isinstance(body, dict) else None
            first = data[0] if isinstance(data, list) and data else None
            name = first.get("id") if isinstance(first, dict) else None
            if not isinstance(name, str) or not 0 < len(name) <= MAX_TEXT:
                raise MalformedAnswer(
                    f"{self.url}/v1/models: expected {{'data': [{{'id': MODEL}}]}}, got {_short(body)}"
                )
            self._model = name
        return self._model

    def weight_version(self) -> str | None:
        """The weight version the server reports (deltasync sets it to the step); a quick call."""
        body = self._checked(self._call("GET", "/weight_info", quick=True), "/weight_info", "GET /weight_info")
        v = body.get("weight_version", _MISSING) if isinstance(body, dict) else _MISSING
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, str | int) or len(str(v)) > MAX_TEXT:
            raise MalformedAnswer(f"{self.url}/weight_info: expected {{'weight_version': str}}, got {_short(body)}")
        return str(v)

    def init(self, store: str, *, prefetch: bool = True, **init_info: Any) -> None:
        """Point every worker's deltasync backend at ``store`` (once); ``prefetch``: each worker prepares new
        steps in the background while the server generates, so an update only pauses to load them."""
        info = {"store": store, "prefetch": prefetch, **init_info}
        self._send("/init_weight_transfer_engine", "init_weight_transfer_engine", body={"init_info": info})

    def workers(self) -> list[WorkerStatus] | None:
        """Each worker's status (``deltasync_status``: step, state, last error); None when the server cannot
        say (an error answer: no worker extension, start it with ``--worker-extension-cls
        deltasync.integrations.vllm.backend.DeltasyncWorkerExtension``, or its engine is dead). A quick call."""
        body = {"method": STATUS, "kwargs": {}}
        a = self._call("POST", "/collective_rpc", quick=True, body=body, cap=self.status_cap, close=True)
        if not a.ok:
            return None
        found = statuses(a.body, f"{self.url}: {STATUS}")
        self._ranks = min(len(found), _RANKS_MAX)
        return found

    def is_paused(self) -> bool | None:
        """Whether the server is paused (``GET /is_paused``; None when it has no such route)."""
        if (a := self._call("GET", "/is_paused", quick=True)).status == 404:
            return None
        body = self._checked(a, "/is_paused", "GET /is_paused")
        paused = body.get("is_paused") if isinstance(body, dict) else None
        if not isinstance(paused, bool):
            raise MalformedAnswer(f"{self.url}/is_paused: expected {{'is_paused': true|false}}, got {_short(body)}")
        return paused

    def pause(self, mode: PauseMode = "abort", clear_cache: bool = True) -> None:
        """``POST /pause``: ``abort`` drops the requests in flight, ``wait`` lets them finish (bounded by
        :attr:`timeout`), ``keep`` freezes them until :meth:`resume`. Raises ValueError for another mode."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        params = {"mode": mode, "clear_cache": "true" if clear_cache else "false"}
        self._send("/pause", f"pause (mode={mode})", params=params)

    def resume(self, tries: int = RESUME_TRIES) -> None:
        """``POST /resume`` until the server says it is not paused: each try on a new connection (vLLM
        drops the connection of a refused ``update_weights``, and a request sent on it is lost), with a
        short backoff. Raises the last error after ``tries``."""
        last: DeltaSyncError | None = None
        for attempt in range(tries):
            if attempt:
                threading.Event().wait(min(0.1 * 2 ** (attempt - 1), 2.0))
            try:
                self._send("/resume", "resume", quick=True, close=True)
                if self.is_paused() is not True:
                    return
                last = ServerError(f"{self.url}: still paused after POST /resume")
            except DeltaSyncError as exc:
                last = exc  # a broken connection is not kept: the next try opens a new one
        raise last if last is not None else ValueError(f"tries must be >= 1, got {tries}")

    def prepare(self, step: int) -> None:
        """Bring every worker's mirror to ``step`` (download, verify, decode) without touching the weights
        or pausing; returns once every worker has it. A worker's error is raised as its own class
        (:meth:`~deltasync.serving.worker_api.WorkerStatus.raise_error`); needs ``/collective_rpc`` (dev
        mode) and deltasync's worker methods. Bounded by :attr:`timeout`."""
        # the engine bounds its own wait a little inside ours, so that it answers with its error first
        kwargs = PrepareRequest(step=step, wait=True, timeout=max(1.0, self.timeout - 5.0)).to_kwargs()
        a = self._call(
            "POST", "/collective_rpc", body={"method": PREPARE, "kwargs": kwargs}, cap=self.status_cap, close=True
        )
        if a.status == 404:
            self._checked(a, "/collective_rpc", f"collective_rpc {PREPARE}")
        if not a.ok:
            raise ServerError(f"{self.url}: step {step} could not be prepared: HTTP {a.status}: {a.detail}")
        for w in statuses(a.body, f"{self.url}: {PREPARE}"):
            try:
                w.raise_error()
            except DeltaSyncError as exc:
                raise type(exc)(f"{self.url}: step {step} could not be prepared: rank {w.rank}: {exc}") from None

    def update(
        self, step: int, *, pause_mode: PauseMode = "wait", cache_retries: int = 20, prepare: bool = False
    ) -> ServerUpdate:
        """Run the whole update sequence for ``step`` (see the module doc); never raises: every error is
        its outcome. ``prepare``: first have every worker prepare the step (:meth:`prepare`, the server
        keeps generating), so that the pause only commits it; a prepare that fails or times out is logged
        and the update goes on (the backend then downloads in the pause, or refuses the step)."""
        if pause_mode not in PAUSE_MODES:
            return ServerUpdate(self.url, step, "failed", None, 0.0, f"pause_mode must be one of {PAUSE_MODES}")
        prepared, prepare_s = False, None
        if prepare:
            t_prep = time.perf_counter()
            try:
                self.prepare(step)
                prepared = True
            except DeltaSyncError as exc:
                log.warning("%s: step %d not prepared before the pause: %s", self.url, step, error_text(exc))
            prepare_s = time.perf_counter() - t_prep
        try:
            u = self._update(step, pause_mode, cache_retries)
        except Exception as exc:  # the contract: an outcome, whatever happened (logged with its traceback)
            log.exception("%s: the update to step %d stopped on an unexpected error", self.url, step)
            u = ServerUpdate(self.url, step, "failed", None, 0.0, f"unexpected error: {error_text(exc)}")
        return replace(u, prepared=prepared, prepare_s=prepare_s)

    def _update(self, step: int, pause_mode: PauseMode, cache_retries: int) -> ServerUpdate:
        t0 = time.perf_counter()
        try:
            self.pause(pause_mode)
        except DeltaSyncError as exc:
            state: UpdateOutcome = "unreachable" if isinstance(exc, ServerUnreachable) else "failed"
            return ServerUpdate(self.url, step, state, None, time.perf_counter() - t0, f"pause: {error_text(exc)}")
        done = self._apply(step, pause_mode, cache_retries)
        state, error = done.state, done.error
        if done.resume:
            try:
                self.resume()
            except DeltaSyncError as exc:
                # no answer: it is gone (set up again if it comes back); an answer that leaves it paused:
                # it cannot be brought back to serving, out of the rotation until it is restarted
                state = "unreachable" if isinstance(exc, ServerUnreachable) else "needs_replacement"
                error = _join(error, f"resume ({RESUME_TRIES} tries): {error_text(exc)}")
        pause_s = time.perf_counter() - t0
        version = None
        try:
            version = self.weight_version()
        except DeltaSyncError as exc:
            error = _join(error, f"weight_info: {error_text(exc)}")
        if state == "serving" and version != str(step):
            state = "failed"
            if error is None:  # else: the weight version could not be read, and ``error`` says why
                error = f"the server reports weight version {version!r} after updating to step {step}"
        workers = done.workers if done.asked or state == "serving" else self._states()
        if workers and any(w.state == "needs_replacement" for w in workers):
            state = "needs_replacement"
        return ServerUpdate(self.url, step, state, version, pause_s, error, workers)

    def _apply(self, step: int, pause_mode: PauseMode, cache_retries: int) -> _Applied:
        """The paused part: the backend's phases, then the prefix-cache reset."""
        try:
            self._send("/start_weight_update", "start_weight_update")
            a = self._call("POST", "/update_weights", body={"update_info": {"step": step}}, close=True)
            if not a.ok:
                # the backend closed the update itself: no finish_weight_update. Whether the engine's
                # weights were put back is read from its workers' states, never from the error's text
                return self._refused(f"update_weights: HTTP {a.status}: {a.detail}")
            self._send("/finish_weight_update", "finish_weight_update", body={"weight_version": str(step)})
            self._reset_prefix_cache(pause_mode, cache_retries)
        except PrefixCacheNotReset as exc:  # serving would answer from KV of the old weights: stay paused
            return _Applied("failed", error_text(exc), resume=False)
        except DeltaSyncError as exc:
            return _Applied("failed", error_text(exc), resume=True)
        return _Applied("serving", None, resume=True)

    def _refused(self, error: str) -> _Applied:
        workers = None
        for _ in range(STATUS_TRIES):  # vLLM may drop the connection of a failed request
            workers = self._states()
            if workers is not None:
                break
        if workers is None:  # its weights may be neither step: it must not serve
            return _Applied("failed", error + _UNREAD_STATES, resume=False, asked=True)
        lost = any(w.state == "needs_replacement" for w in workers)
        return _Applied("needs_replacement" if lost else "rolled_back", error, not lost, workers, asked=True)

    def _states(self) -> list[WorkerStatus] | None:
        """:meth:`workers`, None on any error (a status read that is not needed to go on)."""
        try:
            return self.workers()
        except DeltaSyncError as exc:
            log.debug("%s: the workers' states cannot be read: %s", self.url, error_text(exc))
            return None

    def _reset_prefix_cache(self, pause_mode: str, retries: int) -> None:
        """Drop the KV computed with the old weights; any failure (no answer, an error, an answer that is
        not ``{"success": bool}``, still held after ``retries``) is :class:`PrefixCacheNotReset`."""
        params = {"reset_running_requests": "true"} if pause_mode == "keep" else None
        why = f"{retries + 1} tries"
        for attempt in range(retries + 1):
            try:
                body = self._send("/reset_prefix_cache", "reset_prefix_cache", params=params)
            except DeltaSyncError as exc:
                why = error_text(exc)
                break
            success = body.get("success", True) if isinstance(body, dict) else body
            if body is None or success is True:
                return
            if success is not False:
                why = f"it answered {_short(body)}, not {{'success': true|false}}"
                break
            if attempt < retries:  # blocks still held (async KV transfers): vLLM says to retry
                threading.Event().wait(min(0.05 * 2**attempt, 1.0))
        raise PrefixCacheNotReset(
            f"{self.url}: the prefix cache could not be reset after the update ({why}); the server stays paused "
            "rather than answer from KV computed with the previous weights. POST /reset_prefix_cache, then /resume, "
            "once it succeeds"
        )


_MISSING = object()
_UNREAD_STATES = (
    "; its workers' states cannot be read after the refused update, so it stays paused: check deltasync_status, "
    "then POST /resume (or restart it)"
)


def _short(v: object) -> str:
    text = repr(v)
    return text if len(text) <= 200 else text[:197] + "..."


def _join(error: str | None, more: str) -> str:
    return f"{error}; {more}" if error else more


def agreed_step(server: VLLMServer) -> int | None:
    """The deltasync step every worker of ``server`` says it serves (a server started from a checkpoint
    dir written by ``materialize`` knows it before its first update), else None (also when the server
    cannot say or does not answer)."""
    try:
        workers = server.workers()
    except DeltaSyncError:
        return None
    steps = {w.step for w in workers or []}
    if len(steps) != 1:
        return None
    (step,) = steps
    return step


def response_detail(r: httpx.Response) -> str:
    """The error an HTTP answer carries: the worker's own error, unwrapped from vLLM's text around it
    (at most the first :data:`~deltasync.serving.http_call.SMALL_BODY` bytes of the body are read)."""
    try:
        data = r.content[:SMALL_BODY]
    except httpx.ResponseNotRead:  # a streamed answer: read no more than the cap
        data = b""
        for chunk in r.iter_bytes():
            data += chunk
            if len(data) >= SMALL_BODY:
                break
    return error_detail(data[:SMALL_BODY])


def error_text(exc: BaseException) -> str:
    """An error as a line: deltasync's own by their message, any other with its class's name."""
    return str(exc) if isinstance(exc, DeltaSyncError) else f"{type(exc).__name__}: {exc}"
