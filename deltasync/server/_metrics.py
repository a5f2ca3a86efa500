"""The signal server's metrics: a tiny registry of counters and gauges with labels.

Rendered by the one Prometheus writer, :mod:`deltasync._util.prometheus`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from deltasync._util.prometheus import family, sample

__all__ = ["Metrics"]

Labels = tuple[tuple[str, str], ...]


class Metrics:
    """Counters and gauges rendered in the Prometheus text exposition format 0.0.4.

    Values stay integers while only integers are added or set (counts, steps), so they render
    exactly.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._help: dict[str, tuple[str, str]] = {}
        self._values: dict[str, dict[Labels, float]] = {}
        self._callbacks: dict[str, Callable[[], dict[Labels, float]]] = {}
        self._text: dict[str, Callable[[], str]] = {}
        #: whether every callback would only read caches now (then a scrape may render on the
        #: event loop, cheaper than a worker-thread hop); the app sets it
        self.cached: Callable[[], bool] = lambda: False

    def declare(self, name: str, kind: str, help_text: str) -> None:
        """Register a metric family (``kind`` is "counter" or "gauge")."""
        self._help[name] = (kind, help_text)
        self._values.setdefault(name, {})

    def gauge_callback(self, name: str, help_text: str, fn: Callable[[], dict[Labels, float]]) -> None:
        """A gauge whose samples are computed when scraped."""
        self._help[name] = ("gauge", help_text)
        self._callbacks[name] = fn

    def text_callback(self, name: str, kind: str, help_text: str, fn: Callable[[], str]) -> None:
        """A family whose sample lines ``fn`` renders itself when scraped (one per line, each ending
        in a newline): for a family too large to format sample by sample at every scrape, which
        ``fn`` can cache."""
        self._help[name] = (kind, help_text)
        self._text[name] = fn

    def inc(self, name: str, amount: float = 1, **labels: str) -> None:
        """Add to a counter (or gauge)."""
        key = tuple(sorted(labels.items())) if labels else ()
        with self._lock:
            family = self._values[name]
            family[key] = family.get(key, 0) + amount

    def set(self, name: str, value: float, **labels: str) -> None:
        """Set a gauge."""
        with self._lock:
            self._values[name][tuple(sorted(labels.items()))] = value

    def value(self, name: str, **labels: str) -> float:
        """Current value of one sample (0 when never touched)."""
        with self._lock:
            return self._values.get(name, {}).get(tuple(sorted(labels.items())), 0)

    def render(self) -> str:
        """The exposition text."""
        with self._lock:
            snapshot = {n: dict(v) for n, v in self._values.items()}
        for name, fn in self._callbacks.items():
            snapshot[name] = fn()
        lines: list[str] = []
        for name in sorted(self._help):
            kind, help_text = self._help[name]
            lines.append(family(name, kind, help_text))
            if name in self._text:
                lines.append(self._text[name]())
                continue
            samples = snapshot.get(name, {})
            if not samples and kind == "counter":
                samples = {(): 0}
            lines.extend(sample(name, v, labels) for labels, v in sorted(samples.items()))
        return "".join(lines)
