"""The one writer of the Prometheus text exposition format 0.0.4 (no ``prometheus_client`` needed).

The signal server's registry (:mod:`deltasync.server._metrics`) and a fetcher's
:class:`~deltasync.fetcher.metrics.SyncMetrics` keep their own values and write them with
these functions: a family is :func:`family` (its ``# HELP`` and ``# TYPE`` lines) followed by
:func:`sample` lines; a :class:`Histogram` writes its buckets, sum and count. Every line ends
with a newline, so a rendering is ``"".join(lines)``.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Iterable, Iterator, Sequence

__all__ = ["CONTENT_TYPE", "LABEL_NAME", "Histogram", "escape", "family", "format_value", "sample"]

#: The Content-Type of a rendering.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: What a label name must match.
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")


def escape(value: str) -> str:
    """A label value as it goes between double quotes (backslash, newline and quote escaped)."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def format_value(v: float) -> str:
    """A sample value, exactly: integers as integers, floats by ``repr``, ``NaN``, ``+Inf``, ``-Inf``."""
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def family(name: str, kind: str, help_text: str) -> str:
    """The ``# HELP`` and ``# TYPE`` lines that open a metric family."""
    return f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n"


def sample(name: str, value: float, labels: Iterable[tuple[str, str]] = ()) -> str:
    """One sample line; ``labels`` in the order given (none: no braces)."""
    inner = ",".join(f'{k}="{escape(v)}"' for k, v in labels)
    return f"{name}{{{inner}}} {format_value(value)}\n" if inner else f"{name} {format_value(value)}\n"


class Histogram:
    """Observations counted into fixed buckets (upper bounds, ascending), with their sum and count.

    Not thread-safe: its owner observes and renders under its own lock.
    """

    __slots__ = ("buckets", "count", "counts", "sum")

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.count = 0
        self.sum = 0.0

    def observe(self, v: float) -> None:
        """Count one observation."""
        i = bisect.bisect_left(self.buckets, v)
        if i < len(self.counts):
            self.counts[i] += 1
        self.count += 1
        self.sum += v

    def cumulative(self) -> Iterator[tuple[str, int]]:
        """``(le, observations <= le)`` per bucket, then ``("+Inf", count)``."""
        acc = 0
        for le, n in zip(self.buckets, self.counts, strict=True):
            acc += n
            yield format_value(le), acc
        yield "+Inf", self.count

    def render(self, name: str, help_text: str, labels: Sequence[tuple[str, str]] = ()) -> Iterator[str]:
        """The family: its header, a ``_bucket`` line per bound (``le`` first, then ``labels``), ``_sum``, ``_count``."""
        yield family(name, "histogram", help_text)
        for le, n in self.cumulative():
            yield sample(f"{name}_bucket", n, (("le", le), *labels))
        yield sample(f"{name}_sum", self.sum, labels)
        yield sample(f"{name}_count", self.count, labels)
