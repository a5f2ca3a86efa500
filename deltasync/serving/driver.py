"""Drive running vLLM servers over HTTP: keep each at a run's newest committed step.

One server's update sequence (pause, the backend's four phases, the prefix-cache reset, resume) and
what a failed one leaves: :mod:`deltasync.serving.vllm_server`. :class:`VLLMDriver` runs the
sequence on several servers at once, follows a run (the signal server or the store) and backs off
before retrying a step a server refused. With ``signal=``
it reports each server to the signal server's fleet view as one replica (a
:class:`~deltasync.signal.FleetReporter` per server: after init, after each update, and as a
heartbeat), so that a trainer can wait for the fleet (docs/fleet.md).

This module talks HTTP only: it imports neither vLLM nor torch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import httpx

from deltasync._util.retry import Backoff, RetryPolicy
from deltasync.errors import DeltaSyncError
from deltasync.serving.audit import AuditResult, AuditSource, ReplicaAuditor, audit_server
from deltasync.serving.vllm_server import (
    FLEET_STATES,
    PAUSE_MODES,
    PROBE_TIMEOUT,
    PauseMode,
    ServerUpdate,
    UpdateOutcome,
    VLLMServer,
    agreed_step,
    error_text,
)
from deltasync.signal import FleetReporter, ReplicaState, StepWatcher, replica_name

if TYPE_CHECKING:
    from deltasync.serving.driver_metrics import DriverMetrics

__all__ = ["PauseMode", "ServerUpdate", "UpdateOutcome", "VLLMDriver", "VLLMServer"]

log = logging.getLogger("deltasync.vllm.driver")


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
        t.up, t.initialised, t.why = False, False, f"unreachable: {error_text(exc)}"
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
            t.up, t.initialised, t.why = True, False, f"init: {error_text(exc)}"
            t.report()
            return f"{t.server.url}: {error_text(exc)}"
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
                t.why = f"GET /weight_info: {error_text(exc)}"
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
            step = t.serving if t.serving is not None else agreed_step(t.server)
            if step is None:
                return None
            result = audit_server(t.server, t.auditor, step, params=params)
        except (httpx.HTTPError, DeltaSyncError, ValueError) as exc:
            log.warning("%s: the audit of step %s could not run: %s", t.server.url, t.serving, error_text(exc))
            t.audit = None
            return None
        t.audit = result
        if not result.diverged or config.action == "report":
            return result
        if config.action == "pause":
            try:
                self._pause_diverged(t)
            except (httpx.HTTPError, DeltaSyncError) as exc:
                log.error("%s: diverged, and it could not be paused: %s", t.server.url, error_text(exc))
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
        previous = {id(t): t.serving if t.serving is not None else agreed_step(t.server) for t in todo}
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
            return ServerUpdate(
                t.server.url, step, state, None, time.perf_counter() - t0, f"prepare: {error_text(exc)}"
            )
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
        serves ``until`` (at least one) and its update was audited and reported, or the watcher's
        ``stop`` is set.

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
                    # the jobs that brought the servers there still audit and report that update:
                    # let them finish (a caller closes the driver next), bounded by a call's timeout
                    self.settle(max(t.server.timeout for t in self._servers))
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
