"""Spans: optional squashed patches from one committed step to a later one (SPEC.md "Spans").

A span ``spans/{from:012d}-{to:012d}/`` holds an ordinary v1 patch manifest whose
``step`` is ``to`` and whose ``parent_step`` is ``from``: applying it onto step
``from`` yields exactly step ``to``. ``extra["span_of"]`` names the digest of
step ``to``'s own manifest, so a reader that applied a span knows which
committed step it holds. Spans are a shortcut, never the truth: a reader checks
one against both committed ends (:func:`span_problem`) and ignores it when
anything is off.
"""

from __future__ import annotations

import re

from deltasync.protocol.keys import MAX_STEP, check_file_name
from deltasync.protocol.manifest import Manifest

__all__ = [
    "SPANS_PREFIX",
    "SPAN_OF",
    "parse_span_key",
    "span_file_key",
    "span_manifest_key",
    "span_prefix",
    "span_problem",
]

SPANS_PREFIX = "spans/"
#: the ``extra`` key of a span manifest naming the digest of step ``to``'s manifest
SPAN_OF = "span_of"
_SPAN_KEY = re.compile(r"spans/([0-9]{12})-([0-9]{12})/manifest\.json")


def span_prefix(start: int, end: int) -> str:
    """``spans/000000000004-000000000008/`` for the span from step 4 to step 8."""
    for s in (start, end):
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= MAX_STEP:
            raise ValueError(f"span ends must be integers in [0, {MAX_STEP}], got {start!r}, {end!r}")
    if start >= end:
        raise ValueError(f"a span goes forward: {start} -> {end}")
    return f"{SPANS_PREFIX}{start:012d}-{end:012d}/"


def span_manifest_key(start: int, end: int) -> str:
    """Key of a span's manifest (written after its data files)."""
    return span_prefix(start, end) + "manifest.json"


def span_file_key(start: int, end: int, name: str) -> str:
    """Key of a span's data file; ``name`` is checked like a step's file name."""
    return span_prefix(start, end) + check_file_name(name)


def parse_span_key(key: str) -> tuple[int, int] | None:
    """``(from, to)`` of a span manifest key, or None when ``key`` is not one (or goes backwards)."""
    m = _SPAN_KEY.fullmatch(key)
    if not m:
        return None
    start, end = int(m.group(1)), int(m.group(2))
    return (start, end) if start < end else None


def span_problem(
    span: Manifest, span_digest: str, start: Manifest, start_digest: str, end: Manifest, end_digest: str
) -> str | None:
    """Why the span manifest ``span`` (read from key ``(start.step, end.step)``) must not be used
    between committed steps ``start`` and ``end``, or None when it may.

    The span must be a patch onto ``start`` (step, parent step and parent digest), yield
    exactly ``end`` (``span_of`` is ``end``'s manifest digest; same inventory, anchor, run and
    tensor digests), and not be ``end``'s own manifest. Whether both ends are committed, on
    the target's chain and not superseded is the planner's part.
    """
    if span.kind != "patch":
        return "it is not a patch"
    if span.step != end.step or span.parent_step != start.step:
        return f"it says {span.parent_step} -> {span.step}"
    if span.parent_digest != start_digest:
        return f"its parent digest is not step {start.step}'s manifest digest"
    if span.extra.get(SPAN_OF) != end_digest or span_digest == end_digest:
        return f"it does not name step {end.step}'s manifest digest as span_of"
    if span.inventory_digest != end.inventory_digest or span.inventory_digest != start.inventory_digest:
        return "its tensor inventory differs from its ends'"
    if span.run_id != end.run_id or span.anchor_step != end.anchor_step:
        return f"its run or anchor differs from step {end.step}'s"
    if dict(span.tensor_digests) != dict(end.tensor_digests):
        return f"its tensor digests differ from step {end.step}'s"
    return None
