"""Prometheus metrics of a fetcher: staleness, bytes, sync phase times, pauses.

:class:`SyncMetrics` is a thread-safe recorder that renders the Prometheus text exposition format
(0.0.4) itself and can serve it on ``GET /metrics`` from a tiny threaded ``http.server``: no
``prometheus_client`` needed, no torch, no FastAPI. ``deltasync follow --metrics-port`` feeds one;
a live engine's weight-transfer backend feeds another (and records its pauses).

Staleness is computed when the metrics are rendered, from what was observed, by the one
definition in :mod:`deltasync.signal._staleness` (the demo's page uses it too):

- ``deltasync_staleness_steps``: the newest committed step seen (``observe_head``) minus the step
  the target holds;
- ``deltasync_staleness_seconds``: now minus the commit time of the oldest committed step the
  target does not hold yet (0 when it is current). A commit's time is the signal event's
  (``CommitEvent.time``) when known, else the time the step was first seen: a follower that only
  polls the store sees a commit up to one poll interval late, and so under-reports by as much.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from deltasync._util.prometheus import CONTENT_TYPE, LABEL_NAME, Histogram, family, sample
from deltasync._util.worker import SerialWorker
from deltasync.signal import MAX_PENDING, StalenessTracker, commit_time

if TYPE_CHECKING:
    from deltasync.fetcher._stats import SyncStats

__all__ = ["CONTENT_TYPE", "MAX_PENDING", "MetricsServer", "SyncMetrics"]

PHASES = ("download", "decode", "verify", "apply", "total")
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class SyncMetrics:
    """Counters and gauges of one fetcher (or one engine rank), rendered for Prometheus.

    labels: constant labels put on every sample, e.g. ``{"rank": "0", "run": "grpo-7"}``.
    clock: wall-clock time (seconds since the epoch, like ``CommitEvent.time``), read when a step is
        first seen without a commit time and when staleness is rendered.
    """

    def __init__(self, labels: Mapping[str, str] | None = None, *, clock: Callable[[], float] = time.time) -> None:
        self.labels = dict(labels or {})
        for name in self.labels:
            if not LABEL_NAME.match(name) or name.startswith("__") or name in ("le", "kind", "phase"):
                raise ValueError(f"invalid constant label name {name!r}")
        self.clock = clock
        self._lock = threading.Lock()
        self._staleness = StalenessTracker()  # head seen, step held, commit times not held yet
        self._applied_time: float | None = None
        self._syncs = 0
        self._steps = 0
        self._bytes = 0
        self._failures: dict[str, int] = {}
        self._phase_sum = dict.fromkeys(PHASES, 0.0)
        self._phase_count = 0
        self._last_phase: dict[str, float] | None = None
        self._last_bytes: int | None = None
        self._duration = Histogram(DURATION_BUCKETS)
        self._pause = Histogram(DURATION_BUCKETS)
        self._last_pause: float | None = None
        self._engine: dict[str, int] | None = None  # a live engine's loads (observe_load)
        self._node: dict[str, int] | None = None  # a node mirror's size and builds (observe_node)
        self._prepare = Histogram(DURATION_BUCKETS)  # a live engine's prepares: step heard of -> prepared
        self._last_prepare: float | None = None
        self._starved = 0
        self._param_audit: dict[str, int] = {"ok": 0, "mismatch": 0}
        self._updates: dict[bool, int] | None = None  # a live engine's updates, by prepared before the pause
        self._prepared_pause = Histogram(DURATION_BUCKETS)

    # ------------------------------------------------------------ observe

    def observe_head(self, step: int, committed_at: float | None = None) -> None:
        """The trainer's newest committed step as seen: from a signal event (pass its ``time``) or the
        store (``committed_at`` None: the time it is first seen). Older steps are ignored."""
        committed_at = commit_time(committed_at)
        with self._lock:
            t = committed_at if committed_at is not None else self.clock()
            self._staleness.committed(step, t, exact=committed_at is not None)

    def observe_sync(self, stats: SyncStats, *, pause_s: float | None = None) -> None:
        """A sync reached ``stats.step`` (pass :attr:`DeltaFetcher.last_stats`); ``pause_s``: how long a
        live engine paused for it, if it did."""
        with self._lock:
            self._reached(stats.step, stats.total_s)
            self._steps += stats.steps
            self._bytes += stats.nbytes
            self._last_bytes = stats.nbytes
            last = {p: float(getattr(stats, f"{p}_s")) for p in PHASES}
            for p, v in last.items():
                self._phase_sum[p] += v
            self._phase_count += 1
            self._last_phase = last
        if pause_s is not None:
            self.observe_pause(pause_s)

    def observe_applied(self, step: int, *, seconds: float | None = None) -> None:
        """A step reached without :class:`SyncStats` at hand (a materialized dir): a sync of ``seconds``
        when given; without, only the applied step moves (the step a target was found at)."""
        with self._lock:
            if seconds is None:
                self._move_applied(step)
            else:
                self._reached(step, seconds)

    def observe_failure(self, kind: str) -> None:
        """One failure of ``kind`` (e.g. ``apply``, ``signal``, ``store``, ``refused``)."""
        with self._lock:
            self._failures[kind] = self._failures.get(kind, 0) + 1

    def observe_param_audit(self, *, ok: int, mismatched: int) -> None:
        """A parameter audit (``serving.engine.params_audit``) re-hashed ``ok + mismatched`` served tensors."""
        with self._lock:
            self._param_audit["ok"] += ok
            self._param_audit["mismatch"] += mismatched

    def observe_load(self, *, loaded: int, scattered: int = 0, elements: int = 0) -> None:
        """A live engine's update: ``loaded`` tensors went through its loader (whole), ``scattered`` had
        only their ``elements`` changed elements written."""
        with self._lock:
            e = self._engine or {"loaded": 0, "scattered": 0, "elements": 0}
            e["loaded"] += loaded
            e["scattered"] += scattered
            e["elements"] += elements
            self._engine = e

    def observe_node(self, *, nbytes: int, built: bool, pinned: int | None = None) -> None:
        """The node mirror holds ``nbytes`` in shared memory; ``built``: this worker's request built a
        version; ``pinned``: bytes of it this (GPU) worker has registered with CUDA."""
        with self._lock:
            n = self._node or {"bytes": 0, "built": 0}
            n["bytes"] = nbytes
            n["built"] += int(built)
            if pinned is not None:
                n["pinned"] = pinned
            self._node = n

    def observe_prepare(self, seconds: float, *, starved: bool = False) -> None:
        """A live engine prepared a step ``seconds`` after it first heard of its commit; ``starved``: the
        prepare took far longer than its build's own work (it waited for CPU, a lock or a leader)."""
        with self._lock:
            self._prepare.observe(seconds)
            self._last_prepare = seconds
            self._starved += int(starved)

    def observe_update(self, *, prepared: bool, pause_s: float) -> None:
        """A live engine committed an update; ``prepared``: the step was prepared before the pause (the
        pause only committed it), else the pause built it too."""
        with self._lock:
            u = self._updates or {True: 0, False: 0}
            u[prepared] += 1
            self._updates = u
            if prepared:
                self._prepared_pause.observe(pause_s)

    def observe_pause(self, seconds: float) -> None:
        """A live engine paused serving ``seconds`` to load new weights."""
        with self._lock:
            self._pause.observe(seconds)
            self._last_pause = seconds

    def _reached(self, step: int, seconds: float) -> None:
        self._syncs += 1
        self._duration.observe(seconds)
        self._move_applied(step)

    def _move_applied(self, step: int) -> None:
        self._applied_time = self.clock()
        self._staleness.hold(step, self._applied_time)

    # ------------------------------------------------------------ read

    @property
    def applied_step(self) -> int | None:
        """The step the target holds, as last observed."""
        return self._staleness.held

    @property
    def head_step(self) -> int | None:
        """The newest committed step seen."""
        return self._staleness.head

    @property
    def pending_commits(self) -> int:
        """Commit times kept for steps not applied yet (at most ``MAX_PENDING``)."""
        with self._lock:
            return self._staleness.pending

    def staleness(self) -> tuple[int | None, float]:
        """(steps, seconds) behind the trainer now; steps is None until a step was applied."""
        with self._lock:
            st = self._staleness.staleness(self.clock())
        return st.steps, st.seconds

    def render(self) -> str:
        """The metrics in the Prometheus text exposition format 0.0.4."""
        with self._lock:
            return "".join(self._render(self.clock()))

    def _render(self, now: float) -> Iterator[str]:
        const = tuple(self.labels.items())

        def one(name: str, value: float, **labels: str) -> str:
            return sample(name, value, (*labels.items(), *const))

        tracker = self._staleness
        st = tracker.staleness(now)
        steps, seconds = st.steps, st.seconds
        yield family("deltasync_head_step", "gauge", "Newest committed step of the run seen (signal or store).")
        if tracker.head is not None:
            yield one("deltasync_head_step", tracker.head)
        yield family("deltasync_applied_step", "gauge", "Step the target holds.")
        if tracker.held is not None:
            yield one("deltasync_applied_step", tracker.held)
        yield family("deltasync_staleness_steps", "gauge", "Committed steps the target is behind the trainer.")
        if steps is not None:
            yield one("deltasync_staleness_steps", steps)
        yield family(
            "deltasync_staleness_seconds",
            "gauge",
            "Seconds since the oldest committed step the target does not hold was committed (0: current).",
        )
        yield one("deltasync_staleness_seconds", seconds)
        yield family("deltasync_head_commit_timestamp_seconds", "gauge", "Commit time of the newest step seen.")
        if tracker.head_time is not None:
            yield one("deltasync_head_commit_timestamp_seconds", tracker.head_time)
        yield family("deltasync_last_sync_timestamp_seconds", "gauge", "When the target last reached a step.")
        if self._applied_time is not None:
            yield one("deltasync_last_sync_timestamp_seconds", self._applied_time)
        yield family("deltasync_syncs_total", "counter", "Syncs that reached a step.")
        yield one("deltasync_syncs_total", self._syncs)
        yield family("deltasync_applied_steps_total", "counter", "Committed steps (patches, anchors) applied.")
        yield one("deltasync_applied_steps_total", self._steps)
        yield family("deltasync_sync_failures_total", "counter", "Failed syncs, signal streams and store reads.")
        for kind, n in sorted(self._failures.items()):
            yield one("deltasync_sync_failures_total", n, kind=kind)
        yield family(
            "deltasync_param_audit_tensors_total",
            "counter",
            "Served tensors re-hashed against their step's digests by the parameter audit, by result (ok, mismatch).",
        )
        for result, n in sorted(self._param_audit.items()):
            yield one("deltasync_param_audit_tensors_total", n, result=result)
        yield family("deltasync_downloaded_bytes_total", "counter", "Bytes downloaded by syncs.")
        yield one("deltasync_downloaded_bytes_total", self._bytes)
        yield family("deltasync_last_sync_bytes", "gauge", "Bytes downloaded by the last sync.")
        if self._last_bytes is not None:
            yield one("deltasync_last_sync_bytes", self._last_bytes)
        yield family(
            "deltasync_sync_phase_seconds",
            "summary",
            "Seconds syncs spent per phase: download (with checksums), decode, verify (digests), apply, total.",
        )
        for p in PHASES:
            yield one("deltasync_sync_phase_seconds_sum", self._phase_sum[p], phase=p)
            yield one("deltasync_sync_phase_seconds_count", self._phase_count, phase=p)
        yield family("deltasync_last_sync_phase_seconds", "gauge", "Seconds the last sync spent per phase.")
        if self._last_phase is not None:
            for p in PHASES:
                yield one("deltasync_last_sync_phase_seconds", self._last_phase[p], phase=p)
        yield from self._duration.render("deltasync_sync_duration_seconds", "Seconds per sync.", const)
        yield from self._pause.render(
            "deltasync_pause_seconds", "Seconds a live engine paused to load new weights.", const
        )
        yield family("deltasync_last_pause_seconds", "gauge", "Seconds of the last pause of a live engine.")
        if self._last_pause is not None:
            yield one("deltasync_last_pause_seconds", self._last_pause)
        if self._updates is not None or self._prepare.count:
            yield from self._prepare.render(
                "deltasync_prepare_seconds",
                "Seconds from a step's commit first heard of (poll, signal or request) to prepared on this worker.",
                const,
            )
            yield family(
                "deltasync_last_prepare_seconds", "gauge", "Seconds the last prepare took from commit heard of."
            )
            if self._last_prepare is not None:
                yield one("deltasync_last_prepare_seconds", self._last_prepare)
            yield family(
                "deltasync_prepare_starved_total",
                "counter",
                "Prepares that took far longer than their build's own work (CPU, lock or leader waits).",
            )
            yield one("deltasync_prepare_starved_total", self._starved)
            u = self._updates or {True: 0, False: 0}
            yield family(
                "deltasync_engine_updates_total",
                "counter",
                "Updates a live engine committed, by whether the step was prepared before the pause.",
            )
            yield one("deltasync_engine_updates_total", u[True], prepared="true")
            yield one("deltasync_engine_updates_total", u[False], prepared="false")
            yield from self._prepared_pause.render(
                "deltasync_prepared_pause_seconds", "Seconds a live engine paused for an update prepared before.", const
            )
        if self._engine is not None:
            e = self._engine
            yield family(
                "deltasync_engine_tensors_total",
                "counter",
                "Tensors a live engine updated, by how: whole or scattered.",
            )
            yield one("deltasync_engine_tensors_total", e["loaded"], how="whole")
            yield one("deltasync_engine_tensors_total", e["scattered"], how="scattered")
            yield family(
                "deltasync_engine_scattered_elements_total",
                "counter",
                "Changed elements written straight into parameters.",
            )
            yield one("deltasync_engine_scattered_elements_total", e["elements"])
        if self._node is not None:
            yield family(
                "deltasync_node_mirror_bytes", "gauge", "Bytes the node's shared mirror holds (all its versions)."
            )
            yield one("deltasync_node_mirror_bytes", self._node["bytes"])
            yield family(
                "deltasync_node_versions_built_total",
                "counter",
                "Versions the node's leader built for this worker's requests.",
            )
            yield one("deltasync_node_versions_built_total", self._node["built"])
            if "pinned" in self._node:
                yield family(
                    "deltasync_engine_pinned_bytes",
                    "gauge",
                    "Bytes of the node mirror this worker has registered with CUDA (0: its copies read pageable memory).",
                )
                yield one("deltasync_engine_pinned_bytes", self._node["pinned"])

    # ------------------------------------------------------------ serve

    def serve(self, port: int, host: str = "127.0.0.1") -> MetricsServer:
        """Serve ``GET /metrics`` on ``host:port`` from a daemon thread (port 0: a free port, see
        :attr:`MetricsServer.port`). Close the returned handle to stop."""
        return MetricsServer(self, port, host)


class Renders(Protocol):
    """What :class:`MetricsServer` serves: anything that renders its metrics as Prometheus text."""

    def render(self) -> str: ...


class _Handler(BaseHTTPRequestHandler):
    metrics: Renders
    protocol_version = "HTTP/1.1"

    def _reply(self, head_only: bool) -> None:
        if self.path.split("?", 1)[0] != "/metrics":
            body, status, ctype = b"not found: try /metrics\n", 404, "text/plain; charset=utf-8"
        else:
            body, status, ctype = self.metrics.render().encode(), 200, CONTENT_TYPE
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head_only:
            self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._reply(False)

    def do_HEAD(self) -> None:  # noqa: N802
        self._reply(True)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class MetricsServer:
    """A running ``/metrics`` endpoint: ``host``, ``port`` (the bound one), ``url``; :meth:`close`."""

    def __init__(self, metrics: Renders, port: int, host: str = "127.0.0.1") -> None:
        handler = type("MetricsHandler", (_Handler,), {"metrics": metrics})
        server = type("MetricsHTTPServer", (_Server,), {"address_family": socket.AF_INET6}) if ":" in host else _Server
        self._httpd = server((host, port), handler)
        self.host = host
        self.port: int = self._httpd.server_address[1]
        self._serving = SerialWorker("deltasync-metrics")
        self._serving.submit(self._httpd.serve_forever)

    @property
    def url(self) -> str:
        """``http://host:port/metrics``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._serving.close(timeout=5.0)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
