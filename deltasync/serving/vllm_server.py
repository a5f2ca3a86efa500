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

This module talks HTTP only: it imports neither vLLM nor torch.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Literal

import httpx

from deltasync.errors import DeltaSyncError
from deltasync.serving.audit import AuditResult
from deltasync.signal import ReplicaState

__all__ = [
    "FLEET_STATES",
    "PAUSE_MODES",
    "PROBE_TIMEOUT",
    "RESUME_TRIES",
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
#: seconds the driver waits for a quick answer (``/weight_info``, ``/is_paused``, ``/resume``): a server
#: that does not answer one within this is unreachable (stopped, hung or gone)
PROBE_TIMEOUT = 10.0
#: What one update sequence did to one server (see :attr:`ServerUpdate.state`). An outcome, not the
#: server's state in the fleet view: :data:`FLEET_STATES` maps one to the other.
UpdateOutcome = Literal["serving", "rolled_back", "held_back", "needs_replacement", "unreachable", "failed"]
#: The fleet view's state of a server after the outcome of its own update: one that kept its previous
#: step after its update failed is ``failed`` (it still serves that step, bit-exact; the driver retries);
#: one an all-or-nothing rollout held back was never touched: ``serving``. (A server that took the step
#: and was brought back because another one refused it is healthy too: ``serving``, see ``_Tracked.report``.)
FLEET_STATES: dict[UpdateOutcome, ReplicaState] = {
    "serving": "serving",
    "rolled_back": "failed",
    "held_back": "serving",
    "needs_replacement": "needs_replacement",
    "unreachable": "unreachable",
    "failed": "failed",
}


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
    #: ``deltasync_status`` of each worker after a failure (None without the worker extension)
    workers: list[dict[str, Any]] | None = None
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


class VLLMServer:
    """One vLLM server's HTTP API, as deltasync uses it. ``api_key``: vLLM's ``--api-key``, if set."""

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
        #: seconds of each call of an update (the pause waits for in-flight requests; ``update_weights``
        #: and the prepare download a step): sized for one update
        self.timeout = timeout
        #: seconds of each quick call (``/weight_info``, ``/is_paused``, ``/resume``)
        self.probe_timeout = min(probe_timeout, timeout)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, timeout=timeout, headers=headers, transport=transport)
        self._model: str | None = None

    @property
    def http(self) -> httpx.Client:
        """The HTTP client of this server (its base URL and API key)."""
        return self._http

    def model(self) -> str:
        """The served model's id (``GET /v1/models``, read once)."""
        if self._model is None:
            self._model = str(self._ok(self._http.get("/v1/models"), "GET /v1/models").json()["data"][0]["id"])
        return self._model

    def __repr__(self) -> str:
        return f"VLLMServer({self.url!r})"

    def close(self) -> None:
        """Close the HTTP connections."""
        self._http.close()

    def _post(self, path: str, **kw: Any) -> httpx.Response:
        return self._http.post(path, **kw)

    def _ok(self, r: httpx.Response, what: str) -> httpx.Response:
        if r.status_code == 404:
            raise DeltaSyncError(
                f"{self.url}{r.request.url.path}: not found (HTTP 404). {what} needs a vLLM >= 0.22 server started "
                'with VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config \'{"backend": "deltasync"}\''
            )
        if r.status_code >= 400:
            raise DeltaSyncError(f"{self.url}: {what} failed: HTTP {r.status_code}: {response_detail(r)}")
        return r

    def weight_version(self) -> str | None:
        """The weight version the server reports (deltasync sets it to the step); a quick call (raises
        ``httpx.HTTPError`` when the server does not answer within ``probe_timeout``)."""
        r = self._ok(self._http.get("/weight_info", timeout=self.probe_timeout), "GET /weight_info")
        v = r.json().get("weight_version")
        return None if v is None else str(v)

    def init(self, store: str, *, prefetch: bool = True, **init_info: Any) -> None:
        """Point every worker's deltasync backend at ``store`` (once); ``prefetch``: each worker prepares new
        steps in the background while the server generates, so an update only pauses to load them."""
        info = {"store": store, "prefetch": prefetch, **init_info}
        self._ok(self._post("/init_weight_transfer_engine", json={"init_info": info}), "init_weight_transfer_engine")

    def workers(self) -> list[dict[str, Any]] | None:
        """Each worker's ``deltasync_status`` (step, state, last error); None when the server cannot say
        (no worker extension: start it with ``--worker-extension-cls
        deltasync.integrations.vllm.backend.DeltasyncWorkerExtension``)."""
        try:
            r = self._post("/collective_rpc", json={"method": "deltasync_status"}, headers=CLOSE)
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        body = r.json()
        results = body.get("results") if isinstance(body, dict) else body
        return [x for x in results if isinstance(x, dict)] if isinstance(results, list) else None

    def is_paused(self) -> bool | None:
        """Whether the server is paused (``GET /is_paused``; None when it has no such route)."""
        r = self._http.get("/is_paused", timeout=self.probe_timeout)
        if r.status_code == 404:
            return None
        return bool(self._ok(r, "GET /is_paused").json().get("is_paused"))

    def resume(self, tries: int = RESUME_TRIES) -> None:
        """``POST /resume`` until the server says it is not paused: each try on a new connection (vLLM
        drops the connection of a refused ``update_weights``, and a request sent on it is lost), with a
        short backoff. Raises the last error after ``tries``."""
        last: Exception | None = None
        for attempt in range(tries):
            if attempt:
                threading.Event().wait(min(0.1 * 2 ** (attempt - 1), 2.0))
            try:
                self._ok(self._post("/resume", timeout=self.probe_timeout), "resume")
                if self.is_paused() is not True:
                    return
                last = DeltaSyncError(f"{self.url}: still paused after POST /resume")
            except (httpx.HTTPError, DeltaSyncError) as exc:
                last = exc  # httpx discards a broken connection: the next try opens a new one
        assert last is not None
        raise last

    def prepare(self, step: int) -> None:
        """Bring every worker's mirror to ``step`` (download, verify, decode) without touching the weights
        or pausing; returns once every worker has it. Raises :class:`DeltaSyncError` naming the failure
        (``httpx.HTTPError`` when the server does not answer). Needs ``/collective_rpc`` (dev mode) and
        deltasync's worker methods (the plugin, or ``--worker-extension-cls``). Bounded by ``timeout``."""
        # the engine bounds its own wait a little inside ours, so that it answers with its error first
        kwargs = {"step": step, "wait": True, "timeout": max(1.0, self.timeout - 5.0)}
        r = self._post("/collective_rpc", json={"method": "deltasync_prepare", "kwargs": kwargs}, headers=CLOSE)
        if r.status_code == 404:
            self._ok(r, "collective_rpc deltasync_prepare")
        if r.status_code != 200:
            raise DeltaSyncError(
                f"{self.url}: step {step} could not be prepared: HTTP {r.status_code}: {response_detail(r)}"
            )
        body = r.json()
        results = body.get("results") if isinstance(body, dict) else None
        if not isinstance(results, list):
            raise DeltaSyncError(
                f"{self.url}: deltasync_prepare answered {str(body)[:300]!r}: not deltasync's worker API"
            )
        errors = [
            f"rank {w.get('rank', i)}: {w['error']}"
            for i, w in enumerate(results)
            if isinstance(w, dict) and w.get("error")
        ]
        if errors:
            raise DeltaSyncError(f"{self.url}: step {step} could not be prepared: {'; '.join(errors)}")

    def update(
        self, step: int, *, pause_mode: PauseMode = "wait", cache_retries: int = 20, prepare: bool = False
    ) -> ServerUpdate:
        """Run the whole update sequence for ``step`` (see the module doc); never raises. ``prepare``: first
        have every worker prepare the step (:meth:`prepare`, the server keeps generating), so that the
        pause only commits it; a prepare that fails or times out is logged and the update goes on (the
        backend then downloads in the pause, or refuses the step)."""
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
        prepared, prepare_s = False, None
        if prepare:
            t_prep = time.perf_counter()
            try:
                self.prepare(step)
                prepared = True
            except (httpx.HTTPError, DeltaSyncError) as exc:
                log.warning("%s: step %d not prepared before the pause: %s", self.url, step, error_text(exc))
            prepare_s = time.perf_counter() - t_prep
        u = self._update(step, pause_mode, cache_retries)
        return replace(u, prepared=prepared, prepare_s=prepare_s)

    def _update(self, step: int, pause_mode: PauseMode, cache_retries: int) -> ServerUpdate:
        t0 = time.perf_counter()
        try:
            self._ok(
                self._post("/pause", params={"mode": pause_mode, "clear_cache": "true"}), f"pause (mode={pause_mode})"
            )
        except (httpx.HTTPError, DeltaSyncError) as exc:
            state: UpdateOutcome = "unreachable" if isinstance(exc, httpx.HTTPError) else "failed"
            return ServerUpdate(self.url, step, state, None, time.perf_counter() - t0, f"pause: {error_text(exc)}")
        resume = True
        state, error = "serving", None
        workers: list[dict[str, Any]] | None = None
        asked = False  # the workers' states were read already
        try:
            self._ok(self._post("/start_weight_update"), "start_weight_update")
            r = self._post("/update_weights", json={"update_info": {"step": step}}, headers=CLOSE)
            if r.status_code != 200:
                # the backend closed the update itself: no finish_weight_update. Whether the engine's
                # weights were put back is read from its workers' states, never from the error's text
                error = f"update_weights: HTTP {r.status_code}: {response_detail(r)}"
                asked = True
                for _ in range(STATUS_TRIES):  # vLLM may drop the connection of a failed request
                    workers = self.workers()
                    if workers is not None:
                        break
                if workers is None:  # its weights may be neither step: it must not serve
                    state, resume = "failed", False
                    error += (
                        "; its workers' states cannot be read after the refused update, so it stays paused: check "
                        "deltasync_status, then POST /resume (or restart it)"
                    )
                else:
                    lost = any(w.get("state") == "needs_replacement" for w in workers)
                    state = "needs_replacement" if lost else "rolled_back"
                    resume = not lost
            else:
                self._ok(
                    self._post("/finish_weight_update", json={"weight_version": str(step)}), "finish_weight_update"
                )
                self._reset_prefix_cache(pause_mode, cache_retries)
        except (httpx.HTTPError, DeltaSyncError) as exc:
            state, error = "failed", error_text(exc)
            if isinstance(exc, DeltaSyncError) and "prefix cache" in str(exc):
                resume = False  # serving would answer from KV of the old weights: stay paused, say so
        finally:
            if resume:
                try:
                    self.resume()
                except (httpx.HTTPError, DeltaSyncError) as exc:
                    # no answer: it is gone (set up again if it comes back); an answer that leaves it paused:
                    # it cannot be brought back to serving, out of the rotation until it is restarted
                    state = "unreachable" if isinstance(exc, httpx.TransportError) else "needs_replacement"
                    error = f"{error + '; ' if error else ''}resume ({RESUME_TRIES} tries): {error_text(exc)}"
        pause_s = time.perf_counter() - t0
        version = None
        try:
            version = self.weight_version()
        except (httpx.HTTPError, DeltaSyncError) as exc:
            error = f"{error + '; ' if error else ''}weight_info: {error_text(exc)}"
        if state == "serving" and version != str(step):
            state, error = "failed", f"the server reports weight version {version!r} after updating to step {step}"
        if state != "serving" and not asked:
            workers = self.workers()
        if workers and any(w.get("state") == "needs_replacement" for w in workers):
            state = "needs_replacement"
        return ServerUpdate(self.url, step, state, version, pause_s, error, workers)

    def _reset_prefix_cache(self, pause_mode: str, retries: int) -> None:
        params = {"reset_running_requests": "true"} if pause_mode == "keep" else {}
        for attempt in range(retries + 1):
            r = self._ok(self._post("/reset_prefix_cache", params=params), "reset_prefix_cache")
            if r.json().get("success", True):
                return
            if attempt < retries:  # blocks still held (async KV transfers): vLLM says to retry
                threading.Event().wait(min(0.05 * 2**attempt, 1.0))
        raise DeltaSyncError(
            f"{self.url}: the prefix cache could not be reset after the update ({retries + 1} tries); the server stays "
            "paused rather than answer from KV computed with the previous weights. POST /reset_prefix_cache, then "
            "/resume, once it succeeds"
        )


def agreed_step(server: VLLMServer) -> int | None:
    """The deltasync step every worker of ``server`` says it serves (a server started from a checkpoint
    dir written by ``materialize`` knows it before its first update), else None."""
    workers = server.workers()
    steps = {w.get("step") for w in workers or []}
    if len(steps) != 1:
        return None
    (step,) = steps
    return step if isinstance(step, int) and not isinstance(step, bool) else None


#: calls that may answer an error, after which vLLM drops the connection: not kept alive, so that the
#: next request (the pause after a failed prepare, the status read and resume after a refused update)
#: goes out on a new connection instead of being lost on the dropped one
CLOSE = {"Connection": "close"}
#: how vLLM wraps a worker's error in a ``/collective_rpc`` or weight-transfer answer
_VLLM_WRAPPED = re.compile(
    r"^Call to collective_rpc method failed: Worker failed with error '(?P<inner>.*)', please check the stack trace "
    r"above for the root cause\.?$",
    re.DOTALL,
)


def response_detail(r: httpx.Response) -> str:
    """The error an HTTP answer carries: the worker's own error, unwrapped from vLLM's text around it."""
    try:
        body = r.json()
    except ValueError:
        return r.text[:500]
    text = str(body)
    if isinstance(body, dict):
        for k in ("error", "detail", "message"):
            if k in body:
                v = body[k]
                text = str(v["message"] if isinstance(v, dict) and "message" in v else v)
                break
    m = _VLLM_WRAPPED.match(text)
    return (m.group("inner") if m else text)[:1000]


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if isinstance(exc, httpx.HTTPError) else str(exc)
