"""Drive running vLLM servers over HTTP: keep each at a run's newest committed step.

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
neither step). :class:`VLLMDriver` runs the sequence on several servers at once, follows a run (the
signal server or the store) and backs off before retrying a step a server refused. With ``signal=``
it reports each server to the signal server's fleet view as one replica (a
:class:`~deltasync.signal.FleetReporter` per server: after init, after each update, and as a
heartbeat), so that a trainer can wait for the fleet (docs/fleet.md).

This module talks HTTP only: it imports neither vLLM nor torch.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

import httpx

from deltasync._util.retry import Backoff, RetryPolicy
from deltasync.errors import DeltaSyncError
from deltasync.serving.audit import AuditResult, AuditSource, ReplicaAuditor, audit_server
from deltasync.signal import FleetReporter, ReplicaState, StepWatcher, replica_name

if TYPE_CHECKING:
    from deltasync.serving.driver_metrics import DriverMetrics

__all__ = ["PauseMode", "ServerUpdate", "UpdateOutcome", "VLLMDriver", "VLLMServer"]

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
            raise DeltaSyncError(f"{self.url}: {what} failed: HTTP {r.status_code}: {_detail(r)}")
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
            r = self._post("/collective_rpc", json={"method": "deltasync_status"}, headers=_CLOSE)
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
        r = self._post("/collective_rpc", json={"method": "deltasync_prepare", "kwargs": kwargs}, headers=_CLOSE)
        if r.status_code == 404:
            self._ok(r, "collective_rpc deltasync_prepare")
        if r.status_code != 200:
            raise DeltaSyncError(f"{self.url}: step {step} could not be prepared: HTTP {r.status_code}: {_detail(r)}")
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
                log.warning("%s: step %d not prepared before the pause: %s", self.url, step, _text(exc))
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
            return ServerUpdate(self.url, step, state, None, time.perf_counter() - t0, f"pause: {_text(exc)}")
        resume = True
        state, error = "serving", None
        workers: list[dict[str, Any]] | None = None
        asked = False  # the workers' states were read already
        try:
            self._ok(self._post("/start_weight_update"), "start_weight_update")
            r = self._post("/update_weights", json={"update_info": {"step": step}}, headers=_CLOSE)
            if r.status_code != 200:
                # the backend closed the update itself: no finish_weight_update. Whether the engine's
                # weights were put back is read from its workers' states, never from the error's text
                error = f"update_weights: HTTP {r.status_code}: {_detail(r)}"
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
            state, error = "failed", _text(exc)
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
                    error = f"{error + '; ' if error else ''}resume ({RESUME_TRIES} tries): {_text(exc)}"
        pause_s = time.perf_counter() - t0
        version = None
        try:
            version = self.weight_version()
        except (httpx.HTTPError, DeltaSyncError) as exc:
            error = f"{error + '; ' if error else ''}weight_info: {_text(exc)}"
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


@dataclass(slots=True)
class _Tracked:
    server: VLLMServer
    serving: int | None = None
    refused: int | None = None  # the step it refused last
    retry_at: float = 0.0
    backoff: Backoff = field(default_factory=lambda: Backoff(RetryPolicy(retries=0, backoff=2.0, max_backoff=60.0)))
    replace: bool = False  # needs replacement: not updated again until it is restarted
    reporter: FleetReporter | None = None
    digest: Callable[[int], str | None] | None = None  # the manifest digest of a step, for the fleet view
    #: whether the last call reached it (None: not tried yet); an unreachable server is set up again
    #: (``init``) once it answers: it may be a new process on the same URL
    up: bool | None = None
    #: whether this process of the server was pointed at the store (``init``)
    initialised: bool = False
    #: the weight version it reported last: another one means another process (or another driver)
    version: str | None = None
    #: the background job driving it (:meth:`VLLMDriver.follow`), one at a time
    job: Future[None] | None = None
    #: why it is unreachable, or why its set-up failed (None: neither)
    why: str | None = None
    auditor: ReplicaAuditor | None = None
    #: its last behavioural audit, and the updates it took (for ``AuditConfig.params_every``)
    audit: AuditResult | None = None
    updates: int = 0

    def report(self, u: ServerUpdate | None = None, *, brought_back: bool = False) -> None:
        """Tell the fleet view what this server serves now: after init, or after update ``u``
        (:data:`FLEET_STATES`), with why it did not take ``u.step``. ``brought_back``: it took the step
        and an all-or-nothing rollout brought it back to its previous one, where it is healthy."""
        if self.reporter is None:
            return
        digest = None
        if self.serving is not None and self.digest is not None:
            digest = self.digest(self.serving)
        a = self.audit if self.audit is not None and self.audit.step == self.serving else None
        if a is not None and a.diverged and self.up is not False and (u is None or u.ok or brought_back):
            why = f"step {a.step}: " + "; ".join(a.problems)
            self.reporter.update(self.serving, "diverged", digest=digest, last_error=why, audit=a.report())
        elif u is None and self.up is False:
            self.reporter.update(self.serving, "unreachable", digest=digest, last_error=self.why)
        elif u is None and self.why is not None:
            self.reporter.update(self.serving, "failed", digest=digest, last_error=self.why)
        elif u is None or u.ok:
            now: ReplicaState = "serving" if self.serving is not None else "starting"
            self.reporter.update(self.serving, now, digest=digest, audit=None if a is None else a.report())
        else:
            state: ReplicaState = "serving" if brought_back else FLEET_STATES[u.state]
            self.reporter.update(self.serving, state, digest=digest, last_error=f"step {u.step}: {u.state}: {u.error}")


class VLLMDriver:
    """Keep several vLLM servers at a run's newest committed step (see the module doc).

    ``store``: the run's store URL as the servers reach it (they download the steps themselves;
    updates carry only a step number). ``clock``: for the retry backoff (tests inject one).
    ``timeout``: seconds of each call of an update (sized for one: the pause waits for in-flight
    requests, the prepare and ``update_weights`` download a step); ``probe_timeout``: seconds of the
    quick calls (``/weight_info``, ``/is_paused``, ``/resume``); a server that does not answer one is
    ``unreachable``. ``prepare``: have each server prepare a step before pausing for it (see
    :meth:`VLLMServer.update`).
    ``signal`` / ``signal_token`` / ``run``: report each server to this signal server's fleet view of
    ``run`` (a report, subscribe or publish token), as replica ``replicas[i]`` (default: the server
    URL's ``host:port``), every ``heartbeat`` seconds and at each change, with the step's manifest
    digest from ``digest(step)`` when given.
    ``all_or_nothing``: roll each step out to every server or to none (see :meth:`rollout`).

    Servers are driven independently (:meth:`follow`): each by a job of its own, so that one that
    hangs or is gone never holds back the others.
    """

    def __init__(
        self,
        servers: Sequence[str | VLLMServer],
        store: str,
        *,
        pause_mode: PauseMode = "wait",
        timeout: float = 600.0,
        probe_timeout: float = PROBE_TIMEOUT,
        api_key: str | None = None,
        prefetch: bool = True,
        prepare: bool = True,
        clock: Callable[[], float] = time.monotonic,
        signal: str | None = None,
        signal_token: str | None = None,
        run: str | None = None,
        replicas: Sequence[str] | None = None,
        heartbeat: float = 10.0,
        all_or_nothing: bool = False,
        digest: Callable[[int], str | None] | None = None,
        audit: AuditSource | None = None,
        metrics: DriverMetrics | None = None,
    ) -> None:
        if not servers:
            raise ValueError("VLLMDriver needs at least one server URL")
        if signal is not None and run is None:
            raise ValueError("VLLMDriver(signal=...) needs run=: the run's name at the signal server")
        if replicas is not None and len(replicas) != len(servers):
            raise ValueError(f"replicas names {len(replicas)} replicas for {len(servers)} servers")
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
        self.store, self.pause_mode, self.prefetch, self.prepare = store, pause_mode, prefetch, prepare
        self.all_or_nothing = all_or_nothing
        self._clock = clock
        self._servers = [
            _Tracked(
                s
                if isinstance(s, VLLMServer)
                else VLLMServer(s, timeout=timeout, probe_timeout=probe_timeout, api_key=api_key),
                digest=digest,
            )
            for s in servers
        ]
        if audit is not None:
            for t in self._servers:
                t.auditor = ReplicaAuditor(audit)
        if signal is not None and run is not None:
            for i, t in enumerate(self._servers):
                name = replicas[i] if replicas is not None else replica_name(httpx.URL(t.server.url).netloc.decode())
                t.reporter = FleetReporter(signal, run, signal_token, replica=name, heartbeat=heartbeat)
        self._pool = ThreadPoolExecutor(len(self._servers), thread_name_prefix="deltasync-vllm")
        self._lock = threading.Lock()
        self._newest: int | None = None  # the newest step :meth:`follow` has seen
        self._on_update: Callable[[ServerUpdate], None] | None = None
        self._on_change: Callable[[str, str], None] | None = None
        self._until: int | None = None
        #: Prometheus metrics of the updates (``follow --vllm --metrics-port``), when given
        self.metrics = metrics
        self._closing = False
        #: every update run, in order
        self.history: list[ServerUpdate] = []

    @property
    def servers(self) -> list[VLLMServer]:
        """The servers driven."""
        return [t.server for t in self._servers]

    def reports_delivered(self, timeout: float | None = None) -> bool:
        """Wait until every server's current state reached the signal server (True without ``signal``)."""
        return all(t.reporter.wait_reported(timeout) for t in self._servers if t.reporter is not None)

    def close(self) -> None:
        """Close the HTTP connections (the servers keep running) and leave the fleet view. A server job
        still waiting on a hung server is not waited for: its connection is closed under it."""
        self._closing = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        for t in self._servers:
            t.server.close()
            if t.reporter is not None:
                t.reporter.close()

    def __enter__(self) -> VLLMDriver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def init(self) -> None:
        """Point every server's backend at the store. A server that does not answer is reported
        ``unreachable`` and set up once it answers (:meth:`follow`); one that answers with an error
        (no deltasync backend, no dev routes) raises DeltaSyncError naming each such server."""
        errors = [e for e in self._pool.map(self._setup, self._servers) if e]
        if errors:
            raise DeltaSyncError("could not set up deltasync on every vLLM server: " + "; ".join(errors))

    def unreachable(self) -> list[str]:
        """The servers whose last call got no answer (they are set up again once they answer)."""
        return [t.server.url for t in self._servers if t.up is False]

    def _say(self, t: _Tracked, what: str) -> None:
        if self._on_change is not None:
            self._on_change(t.server.url, what)

    def _lost(self, t: _Tracked, exc: BaseException) -> None:
        """``t`` did not answer: unreachable, to be set up again (a new process) once it answers."""
        if self._closing:
            return  # its connection was closed under it by close()
        was = t.up
        t.up, t.initialised, t.why = False, False, f"unreachable: {_text(exc)}"
        if self.metrics is not None:
            self.metrics.observe_server(t.server.url, up=False, serving=t.serving)
        if was is not False:
            log.warning("%s: %s; set up again once it answers", t.server.url, t.why)
            self._say(t, f"{t.why}; set up again once it answers")
        t.report()

    def _setup(self, t: _Tracked) -> str | None:
        """Point ``t`` at the store (init) and read its weight version; None, or the error of a server that
        answered with one (one that does not answer is marked unreachable: None)."""
        try:
            t.server.init(self.store, prefetch=self.prefetch)
            v = t.server.weight_version()
        except httpx.TransportError as exc:
            self._lost(t, exc)
            return None
        except (httpx.HTTPError, DeltaSyncError) as exc:
            t.up, t.initialised, t.why = True, False, f"init: {_text(exc)}"
            t.report()
            return f"{t.server.url}: {_text(exc)}"
        back = t.up is False or t.version is not None
        t.up, t.initialised, t.why, t.version = True, True, None, v
        t.serving = int(v) if v is not None and v.isdigit() else None
        if self.metrics is not None:
            self.metrics.observe_server(t.server.url, up=True, serving=t.serving)
        # a new process: whatever the old one refused or lost is history
        t.replace, t.refused = False, None
        t.backoff.reset()
        if back:
            self._say(t, f"set up again (it serves {'no step yet' if t.serving is None else f'step {t.serving}'})")
        self._audit(t)
        t.report()
        return None

    def _check(self, t: _Tracked) -> bool:
        """Whether ``t`` answers and is set up (setting it up when it is a new process: it was unreachable,
        or its weight version is not the one it had)."""
        if t.initialised:
            try:
                v = t.server.weight_version()
            except httpx.TransportError as exc:
                self._lost(t, exc)
                return False
            except (httpx.HTTPError, DeltaSyncError) as exc:
                t.why = f"GET /weight_info: {_text(exc)}"
                t.report()
                return False
            if v == t.version:
                return True
            log.warning(
                "%s: weight version %r where it served %r: a new process (or another driver); setting it up again",
                t.server.url,
                v,
                t.version,
            )
            t.initialised = False
        return self._setup(t) is None and t.initialised

    def update(self, step: int) -> list[ServerUpdate]:
        """Update every server to ``step`` now, in parallel (servers already at it are left alone); one
        outcome per server, in the order given. Each server is checked first, as :meth:`follow` does: one
        that is a new process (restarted) is set up again, one that does not answer is ``unreachable``.
        With ``all_or_nothing``: :meth:`rollout`."""
        if self.all_or_nothing:
            return self.rollout(step)
        futs = [self._pool.submit(self._update_checked, t, step) for t in self._servers]
        return [f.result() for f in futs]

    def _update_checked(self, t: _Tracked, step: int) -> ServerUpdate:
        """:meth:`_check`, then :meth:`_update_one`; once more when the refusal said it was a new process."""
        u: ServerUpdate | None = None
        for _ in range(2):
            if not self._check(t):
                state: UpdateOutcome = "unreachable" if t.up is False else "failed"
                version = None if t.serving is None else str(t.serving)
                return ServerUpdate(t.server.url, step, state, version, 0.0, t.why)
            u = self._update_one(t, step)
            if u.ok or t.initialised:
                return u
        assert u is not None
        return u

    def _update_one(self, t: _Tracked, step: int) -> ServerUpdate:
        if t.replace:
            return ServerUpdate(t.server.url, step, "needs_replacement", None, 0.0, "restart this server")
        if t.serving == step:
            return ServerUpdate(t.server.url, step, "serving", str(step), 0.0)
        before = t.serving
        u = t.server.update(step, pause_mode=self.pause_mode, prepare=self.prepare)
        self.history.append(u)
        if self.metrics is not None:
            self.metrics.observe_update(u)
        if u.ok:
            t.serving, t.refused, t.version, t.why = step, None, u.version, None
            t.backoff.reset()
            t.updates += 1
            u = _with_audit(u, self._audit(t, before=before))
        else:
            t.refused = step
            t.retry_at = self._clock() + t.backoff.next_delay()
            t.replace = u.state == "needs_replacement"
            if u.state == "unreachable":
                t.up, t.initialised = False, False
            elif u.workers and all(w.get("store") is None for w in u.workers):
                t.initialised = False  # its backend was never pointed at the store: a new process
            log.warning("%s: step %d not served (%s): %s", t.server.url, step, u.state, u.error)
        t.report(u)
        return u

    # ---------------------------------------------------------------- the audit

    def audit(self, *, params: bool = False) -> list[AuditResult | None]:
        """Audit every server at the step it serves now (on demand; ``params``: with the workers'
        parameter audit), report each, and take the policy's action on a diverged one; one result per
        server, in the order given (None: not audited: no ``audit=`` source, no known step, or it failed)."""
        futs = [self._pool.submit(self._audit_and_report, t, params) for t in self._servers]
        return [f.result() for f in futs]

    def _audit_and_report(self, t: _Tracked, params: bool) -> AuditResult | None:
        result = self._audit(t, params=params)
        t.report()
        return result

    def _audit(self, t: _Tracked, *, before: int | None = None, params: bool | None = None) -> AuditResult | None:
        """Audit ``t`` at the step it serves (``serving.audit``), keep the result for its reports, and
        act on a diverged one (``AuditConfig.action``; ``before``: the step it served before this update,
        where ``rollback`` brings it back). An audit that cannot run is logged, never raised."""
        if t.auditor is None:
            return None
        config = t.auditor.source.config
        if params is None:
            params = config.params_every > 0 and t.updates % config.params_every == 0
        try:
            # a server booted from a step's checkpoint dir reports no weight version before its first
            # update; its workers know the step
            step = t.serving if t.serving is not None else _agreed_step(t.server)
            if step is None:
                return None
            result = audit_server(t.server, t.auditor, step, params=params)
        except (httpx.HTTPError, DeltaSyncError, ValueError) as exc:
            log.warning("%s: the audit of step %s could not run: %s", t.server.url, t.serving, _text(exc))
            t.audit = None
            return None
        t.audit = result
        if not result.diverged or config.action == "report":
            return result
        if config.action == "pause":
            try:
                self._pause_diverged(t)
            except (httpx.HTTPError, DeltaSyncError) as exc:
                log.error("%s: diverged, and it could not be paused: %s", t.server.url, _text(exc))
        elif config.action == "rollback" and before is not None and before != t.serving:
            step = t.serving
            b = t.server.update(before, pause_mode=self.pause_mode, prepare=self.prepare)
            self.history.append(b)
            if b.ok:
                log.warning("%s: diverged at step %s: rolled back to step %d", t.server.url, step, before)
                t.serving, t.version, t.refused = before, b.version, step
                t.retry_at = self._clock() + t.backoff.next_delay()
                self._audit(t)
            else:
                log.error("%s: diverged at step %s; rolling back to %d failed: %s", t.server.url, step, before, b.error)
        return result

    def _pause_diverged(self, t: _Tracked) -> None:
        """Take a diverged server out of the rotation: paused, and not updated again until it is restarted."""
        self._ok_pause(t.server)
        t.replace = True
        log.error("%s: diverged: paused and left out of the rotation until it is restarted", t.server.url)

    @staticmethod
    def _ok_pause(server: VLLMServer) -> None:
        server._ok(server._post("/pause", params={"mode": "abort", "clear_cache": "true"}), "pause (diverged)")

    def catch_up(self, newest: int) -> list[ServerUpdate]:
        """Update each server that is behind ``newest`` and not waiting out a backoff on that very step,
        and wait for them (:meth:`follow` does not wait: it drives each server on its own)."""
        now = self._clock()
        due = [
            t
            for t in self._servers
            if not t.replace
            and (t.serving is None or t.serving < newest)
            and not (t.refused == newest and now < t.retry_at)
        ]
        if self.all_or_nothing:
            return self.rollout(newest) if due else []
        futs = [self._pool.submit(self._update_one, t, newest) for t in due]
        return [f.result() for f in futs]

    def _drive(self, t: _Tracked) -> None:
        """One server's job: check that it answers and is set up (setting up a new process), then bring it
        to the newest step, and again while a newer one came meanwhile."""
        try:
            for _ in range(8):  # bounded: a newer step, or a re-init after a refusal of a new process
                if not self._check(t):
                    return
                step = self._newest
                if step is not None and self._until is not None:
                    step = min(step, self._until)  # the caller stops there
                if step is None or t.replace or (t.serving is not None and t.serving >= step):
                    return
                if t.refused == step and self._clock() < t.retry_at:
                    return
                u = self._update_one(t, step)
                if self._on_update is not None:
                    self._on_update(u)
                if not u.ok and t.initialised:
                    return  # refused: retried after its backoff
        except Exception:  # a job must not die silently: the next tick starts another
            log.exception("%s: driving this server failed", t.server.url)

    # ---------------------------------------------------------------- all or nothing

    def rollout(self, step: int) -> list[ServerUpdate]:
        """Make every server serve ``step``, or none: one outcome per server, in the order given.

        1. Every server that does not serve ``step`` yet prepares it (:meth:`VLLMServer.prepare`: each
           worker downloads, verifies and decodes it while the server keeps generating). If one
           cannot, no server is updated: each is ``held_back`` (the one that failed: ``failed`` or
           ``unreachable``).
        2. Every one of them is updated (the whole pause sequence, in parallel). If one does not take
           the step, each server that took it is updated back to the step it served before (the node
           mirror keeps the newest two versions: nothing is downloaded) and is reported
           ``rolled_back``, at that step.

        Refused up front (every server ``held_back``, nothing touched): a server that needs replacement,
        or one whose previous step is not known (it could not be brought back). Only if bringing a
        server back fails too do the servers end at different steps: that server's outcome says what
        it serves (``state`` and ``version``), with the error; the driver logs it as an error.
        A failed rollout is retried by :meth:`catch_up` after the backoff, as a whole.
        """
        todo = [t for t in self._servers if t.serving != step]
        if not todo:
            return [ServerUpdate(t.server.url, step, "serving", str(step), 0.0) for t in self._servers]
        previous = {id(t): t.serving if t.serving is not None else _agreed_step(t.server) for t in todo}
        why = [f"{t.server.url} needs replacement" for t in self._servers if t.replace] + [
            f"{t.server.url} serves no known step (it could not be brought back)"
            for t in todo
            if previous[id(t)] is None
        ]
        if why:
            replace = {
                id(t): ServerUpdate(t.server.url, step, "needs_replacement", None, 0.0, "restart this server")
                for t in todo
                if t.replace
            }
            return self._held(step, todo, replace, f"step {step} not rolled out: {'; '.join(why)}")
        # 1. prepare everywhere (nothing paused)
        failed: dict[int, ServerUpdate] = {}
        for t, err in zip(todo, self._pool.map(lambda t: self._prepare_one(t, step), todo), strict=True):
            if err is not None:
                failed[id(t)] = err
        if failed:
            names = ", ".join(u.url for u in failed.values())
            return self._held(step, todo, failed, f"step {step} not rolled out: {names} could not prepare it")
        # 2. update everywhere
        futs = [self._pool.submit(t.server.update, step, pause_mode=self.pause_mode) for t in todo]
        took = {id(t): u for t, u in zip(todo, (f.result() for f in futs), strict=True)}
        self.history.extend(took.values())
        refused = [t for t in todo if not took[id(t)].ok]
        if not refused:
            for t in todo:
                before = t.serving
                t.serving, t.refused = step, None
                t.backoff.reset()
                t.updates += 1
                took[id(t)] = _with_audit(took[id(t)], self._audit(t, before=before))
                t.report(took[id(t)])
            return self._in_order(step, took)
        # 3. bring back every server that took it
        names = ", ".join(t.server.url for t in refused)
        back_futs = {
            id(t): self._pool.submit(t.server.update, previous[id(t)], pause_mode=self.pause_mode)  # type: ignore[arg-type]
            for t in todo
            if took[id(t)].ok
        }
        out: dict[int, ServerUpdate] = {}
        for t in todo:
            u = took[id(t)]
            if not u.ok:
                out[id(t)] = u
                t.replace = u.state == "needs_replacement"
                t.report(u)
                continue
            prev = previous[id(t)]
            b = back_futs[id(t)].result()
            self.history.append(b)
            pause = u.pause_s + b.pause_s
            if b.ok:
                t.serving = prev
                why_back = f"step {step} was not taken by {names}; brought back to step {prev}"
                out[id(t)] = ServerUpdate(t.server.url, step, "rolled_back", b.version, pause, why_back, b.workers)
                t.report(out[id(t)], brought_back=True)
                continue
            else:
                # it still serves ``step`` when the way back was refused (rolled back to ``step``)
                still = b.state == "rolled_back" and b.version == str(step)
                t.serving = step if still else (int(b.version) if b.version and b.version.isdigit() else None)
                t.replace = b.state == "needs_replacement"
                state: UpdateOutcome = "serving" if still else b.state
                broken = f"step {step} was not taken by {names}, and bringing this server back to step {prev} failed"
                log.error("all-or-nothing rollout of step %d: %s: %s (%s)", step, t.server.url, broken, b.error)
                out[id(t)] = ServerUpdate(
                    t.server.url, step, state, b.version, pause, f"{broken}: {b.error}", b.workers
                )
            t.report(out[id(t)])
        self._back_off(todo, step)
        return self._in_order(step, out)

    def _prepare_one(self, t: _Tracked, step: int) -> ServerUpdate | None:
        t0 = time.perf_counter()
        try:
            t.server.prepare(step)
        except (httpx.HTTPError, DeltaSyncError) as exc:
            state: UpdateOutcome = "unreachable" if isinstance(exc, httpx.HTTPError) else "failed"
            return ServerUpdate(t.server.url, step, state, None, time.perf_counter() - t0, f"prepare: {_text(exc)}")
        return None

    def _held(self, step: int, todo: list[_Tracked], failed: dict[int, ServerUpdate], why: str) -> list[ServerUpdate]:
        """Outcomes of a rollout stopped before any server was updated: every server keeps its step."""
        out: dict[int, ServerUpdate] = {}
        for t in todo:
            u = failed.get(id(t))
            if u is None:
                version = None if t.serving is None else str(t.serving)
                u = ServerUpdate(t.server.url, step, "held_back", version, 0.0, why)
            t.report(u)
            out[id(t)] = u
        log.warning("%s", why)
        self._back_off(todo, step)
        return self._in_order(step, out)

    def _back_off(self, todo: list[_Tracked], step: int) -> None:
        now = self._clock()
        for t in todo:
            t.refused = step
            t.retry_at = now + t.backoff.next_delay()

    def _in_order(self, step: int, out: dict[int, ServerUpdate]) -> list[ServerUpdate]:
        return [out.get(id(t)) or ServerUpdate(t.server.url, step, "serving", str(step), 0.0) for t in self._servers]

    def serving(self) -> dict[str, int | None]:
        """The step each server serves, as far as this driver knows."""
        return {t.server.url: t.serving for t in self._servers}

    def follow(
        self,
        watcher: StepWatcher,
        *,
        until: int | None = None,
        on_update: Callable[[ServerUpdate], None] | None = None,
        on_change: Callable[[str, str], None] | None = None,
    ) -> dict[str, int | None]:
        """Keep the servers at the newest step ``watcher`` sees; returns once every server that answers
        serves ``until`` (at least one), or the watcher's ``stop`` is set.

        At each observation (a commit, a heartbeat of the signal stream, a store poll) every server
        whose job is idle gets a new one (:meth:`_drive`): check that it answers (``GET /weight_info``),
        set it up when it is a new process (it was unreachable, or its weight version changed: a
        restarted server), then update it to the newest step, and again while a newer one came
        meanwhile. A server that hangs holds only its own job; one that does not answer is reported
        ``unreachable`` and set up again once it does. A server that refused a step is retried after
        its own backoff. With ``all_or_nothing`` one job drives the whole fleet (:meth:`rollout`).
        ``on_update``: each update's outcome (from the server's job); ``on_change(url, what)``: a server
        became unreachable or was set up again. Raises :class:`DeltaSyncError` once every server needs
        replacement."""
        self._on_update, self._on_change, self._until = on_update, on_change, until
        fleet_job: Future[None] | None = None
        try:
            for seen in watcher.watch(resume=self._oldest_served):
                self._check_replaceable()
                if watcher.stop.is_set():
                    break
                if seen.step is not None and (self._newest is None or seen.step > self._newest):
                    self._newest = seen.step
                if self.all_or_nothing:
                    if fleet_job is None or fleet_job.done():
                        fleet_job = self._pool.submit(self._drive_fleet)
                else:
                    with self._lock:
                        for t in self._servers:
                            if t.job is None or t.job.done():
                                t.job = self._pool.submit(self._drive, t)
                if until is not None and self._reached(until):
                    break
        finally:
            watcher.close()
        self._check_replaceable()
        return self.serving()

    def _check_replaceable(self) -> None:
        if all(t.replace for t in self._servers):
            raise DeltaSyncError("every vLLM server needs replacement; restart them")

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until no server job of :meth:`follow` is running; whether that happened within ``timeout``."""
        with self._lock:
            jobs = [t.job for t in self._servers if t.job is not None]
        done, pending = wait(jobs, timeout)
        return not pending

    def _drive_fleet(self) -> None:
        """The all-or-nothing job: set up the servers that are new processes, then roll the newest step out."""
        try:
            for t in self._servers:
                self._check(t)
            if self._newest is not None:
                for u in self.catch_up(self._newest):
                    if self._on_update is not None:
                        self._on_update(u)
        except Exception:
            log.exception("driving the fleet failed")

    def _reached(self, until: int) -> bool:
        """Whether every server that answers serves ``until`` or newer, and at least one does."""
        live = [t for t in self._servers if t.up is not False]
        return bool(live) and all(t.serving is not None and t.serving >= until for t in live)

    def _oldest_served(self) -> int | None:
        """The step every server that answers serves at least (None while one serves no known step)."""
        steps = [t.serving for t in self._servers if t.up is not False]
        return None if not steps or any(s is None for s in steps) else min(s for s in steps if s is not None)


def _with_audit(u: ServerUpdate, audit: AuditResult | None) -> ServerUpdate:
    return replace(u, audit=audit)


def _agreed_step(server: VLLMServer) -> int | None:
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
_CLOSE = {"Connection": "close"}
#: how vLLM wraps a worker's error in a ``/collective_rpc`` or weight-transfer answer
_VLLM_WRAPPED = re.compile(
    r"^Call to collective_rpc method failed: Worker failed with error '(?P<inner>.*)', please check the stack trace "
    r"above for the root cause\.?$",
    re.DOTALL,
)


def _detail(r: httpx.Response) -> str:
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


def _text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if isinstance(exc, httpx.HTTPError) else str(exc)
