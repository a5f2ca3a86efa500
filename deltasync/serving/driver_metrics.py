"""Prometheus metrics of the vLLM driver (``deltasync follow --vllm --metrics-port``): :class:`DriverMetrics`.

Per server (label ``server``, its URL): the updates by outcome, the pause of each update split by
whether its step was prepared before the pause (``prepared="true"``: the pause only committed it),
how long the prepare took, the step it serves, whether it answers, and the behavioural audits that
could not run (``deltasync_vllm_audits_unavailable_total``: a replica nobody checked, docs/fleet.md). Rendered with
:mod:`deltasync._util.prometheus`; served by :meth:`DriverMetrics.serve`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from deltasync._util.prometheus import Histogram, family, sample

if TYPE_CHECKING:
    from deltasync.fetcher.metrics import MetricsServer

__all__ = ["DriverMetrics", "Update"]

#: seconds: a pause that only commits takes tens of milliseconds, one that downloads takes seconds
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class Update(Protocol):
    """What the metrics read of an update's outcome (a :class:`~deltasync.serving.driver.ServerUpdate`)."""

    @property
    def url(self) -> str: ...
    @property
    def step(self) -> int: ...
    @property
    def state(self) -> str: ...
    @property
    def pause_s(self) -> float: ...
    @property
    def prepared(self) -> bool: ...
    @property
    def prepare_s(self) -> float | None: ...
    @property
    def ok(self) -> bool: ...


class DriverMetrics:
    """What a :class:`~deltasync.serving.driver.VLLMDriver` did to each server (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._updates: dict[tuple[str, str], int] = {}
        self._pause: dict[tuple[str, str], Histogram] = {}
        self._prepare: dict[str, Histogram] = {}
        self._serving: dict[str, int] = {}
        self._up: dict[str, bool] = {}
        self._audits_unavailable: dict[str, int] = {}

    def observe_update(self, u: Update) -> None:
        """Count one update's outcome, its pause (by prepared or not) and its prepare; a served step is the
        server's step."""
        with self._lock:
            key = (u.url, u.state)
            self._updates[key] = self._updates.get(key, 0) + 1
            self._up[u.url] = u.state != "unreachable"
            if u.ok:
                self._serving[u.url] = u.step
                pk = (u.url, "true" if u.prepared else "false")
                self._pause.setdefault(pk, Histogram(BUCKETS)).observe(u.pause_s)
                if u.prepare_s is not None:
                    self._prepare.setdefault(u.url, Histogram(BUCKETS)).observe(u.prepare_s)

    def observe_server(self, url: str, *, up: bool, serving: int | None) -> None:
        """Record whether ``url`` answers and the step it serves (None: unknown)."""
        with self._lock:
            self._up[url] = up
            if serving is None:
                self._serving.pop(url, None)
            else:
                self._serving[url] = serving

    def observe_audit_unavailable(self, url: str) -> None:
        """Count one behavioural audit of ``url`` that could not run (the driver says why on its
        ``on_audit`` callback and in the fleet's ``audit_error``)."""
        with self._lock:
            self._audits_unavailable[url] = self._audits_unavailable.get(url, 0) + 1

    def render(self) -> str:
        """The metrics in the Prometheus text exposition format 0.0.4."""
        with self._lock:
            return "".join(self._render())

    def _render(self) -> Iterator[str]:
        yield family("deltasync_vllm_updates_total", "counter", "updates run on a vLLM server, by outcome")
        for (url, state), n in sorted(self._updates.items()):
            yield sample("deltasync_vllm_updates_total", n, (("server", url), ("state", state)))
        yield family(
            "deltasync_vllm_pause_seconds",
            "histogram",
            "seconds a vLLM server did not generate for an update it took, by whether the step was prepared first",
        )
        for (url, prepared), h in sorted(self._pause.items()):
            labels = (("server", url), ("prepared", prepared))
            yield from _histogram("deltasync_vllm_pause_seconds", h, labels)
        yield family(
            "deltasync_vllm_prepare_seconds", "histogram", "seconds the prepare before an update took (still serving)"
        )
        for url, h in sorted(self._prepare.items()):
            yield from _histogram("deltasync_vllm_prepare_seconds", h, (("server", url),))
        yield family("deltasync_vllm_serving_step", "gauge", "the step a vLLM server serves, as the driver knows it")
        for url, step in sorted(self._serving.items()):
            yield sample("deltasync_vllm_serving_step", step, (("server", url),))
        yield family("deltasync_vllm_server_up", "gauge", "1 when the vLLM server answered the driver's last call")
        for url, up in sorted(self._up.items()):
            yield sample("deltasync_vllm_server_up", 1 if up else 0, (("server", url),))
        yield family(
            "deltasync_vllm_audits_unavailable_total",
            "counter",
            "behavioural audits of a vLLM server that could not run (the server failed them, or their input was damaged)",
        )
        for url, n in sorted(self._audits_unavailable.items()):
            yield sample("deltasync_vllm_audits_unavailable_total", n, (("server", url),))

    def serve(self, port: int, host: str = "127.0.0.1") -> MetricsServer:
        """Serve ``GET /metrics`` on ``host:port`` (port 0: a free one); close the handle to stop."""
        from deltasync.fetcher.metrics import MetricsServer

        return MetricsServer(self, port, host)


def _histogram(name: str, h: Histogram, labels: tuple[tuple[str, str], ...]) -> Iterator[str]:
    for le, n in h.cumulative():
        yield sample(f"{name}_bucket", n, (*labels, ("le", le)))
    yield sample(f"{name}_sum", h.sum, labels)
    yield sample(f"{name}_count", h.count, labels)
