"""Retention: the pure planner of ``deltasync gc`` and the fetcher lease record (SPEC.md "Retention and leases").

:func:`plan_retention` decides, from one listing of the run prefix, the parsed manifests,
the writer claims, the leases and a clock value, which keys to delete and why everything
else stays. It does no I/O; :mod:`deltasync.run.gc` executes its plan.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

from deltasync.errors import ProtocolError
from deltasync.protocol.canonical import FORMAT_VERSION, canonical_json, check_version, json_int, json_object, load_json
from deltasync.protocol.chain import Committed, superseded_by, walk_chain
from deltasync.protocol.keys import MANIFEST_NAME, check_file_name
from deltasync.protocol.probes import PROBES_KEY, parse_reference_key
from deltasync.protocol.writers import WriterClaim

__all__ = [
    "MAX_LEASE_BYTES",
    "LEASES_PREFIX",
    "SPANS_PREFIX",
    "Lease",
    "Listed",
    "RetentionPlan",
    "lease_key",
    "parse_lease_key",
    "describe_kept",
    "plan_retention",
    "step_ranges",
]

#: the most bytes a lease may hold (SPEC.md "Manifest")
MAX_LEASE_BYTES = 4096

LEASES_PREFIX = "leases/"
SPANS_PREFIX = "spans/"
_ID = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
_LEASE_KEY = re.compile(rf"leases/({_ID})\.json")
# the name after the folder is checked by check_file_name: plain, or in a writer's subfolder
_STEP_KEY = re.compile(r"steps/([0-9]{12})/(.+)")
_SPAN_KEY = re.compile(r"spans/([0-9]{12})-([0-9]{12})/(.+)")
_MANIFEST = re.compile(rf"(steps/[0-9]{{12}}|spans/[0-9]{{12}}-[0-9]{{12}})/{re.escape(MANIFEST_NAME)}")
MAX_TIME = 2**53


class Listed(Protocol):
    """A listed object (:class:`deltasync.storage.ObjectInfo` is one)."""

    @property
    def key(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def mtime(self) -> float | None: ...


def lease_key(lease_id: str) -> str:
    """``leases/{id}.json``; ids are 1-128 characters of ``[A-Za-z0-9._-]``, not starting with ``.``/``-``/``_``."""
    key = f"{LEASES_PREFIX}{lease_id}.json"
    if not isinstance(lease_id, str) or not _LEASE_KEY.fullmatch(key):
        raise ProtocolError(f"invalid lease id {lease_id!r}: use 1-128 characters of A-Z a-z 0-9 . _ -")
    return key


def parse_lease_key(key: str) -> str | None:
    """The lease id of a lease key, or None."""
    m = _LEASE_KEY.fullmatch(key)
    return m.group(1) if m else None


@dataclass(frozen=True, slots=True)
class Lease:
    """``leases/{id}.json``: a fetcher holds ``step`` and is fetching ``target`` until ``expires``.

    Either step may be None (holds nothing yet / nothing in flight). ``expires`` is unix
    seconds (an integer). gc keeps what an unexpired lease needs (see :func:`plan_retention`).
    """

    id: str
    step: int | None
    target: int | None
    expires: int

    def __post_init__(self) -> None:
        lease_key(self.id)
        for what, v in (("step", self.step), ("target", self.target)):
            if v is not None:
                json_int(v, f"lease {what}", 0, 10**12 - 1)
        json_int(self.expires, "lease expires", 0, MAX_TIME)

    def to_json(self) -> bytes:
        """Canonical JSON bytes."""
        return canonical_json(
            {
                "format_version": FORMAT_VERSION,
                "id": self.id,
                "step": self.step,
                "target": self.target,
                "expires": self.expires,
            }
        )

    @classmethod
    def from_json(cls, data: bytes | bytearray | memoryview) -> Lease:
        """Parse and validate (ProtocolError / UnsupportedVersion on bad bytes)."""
        raw = load_json(data, "lease", MAX_LEASE_BYTES)
        check_version(raw, "lease")
        o: dict[str, Any] = json_object(raw, "lease", ("format_version", "id", "step", "target", "expires"))
        if not isinstance(o["id"], str):
            raise ProtocolError("lease: id must be a string")
        return cls(o["id"], o["step"], o["target"], o["expires"])

    @staticmethod
    def expiring(lease_id: str, step: int | None, target: int | None, now: float, ttl: float) -> Lease:
        """A lease valid for ``ttl`` seconds from ``now`` (rounded up to whole seconds)."""
        return Lease(lease_id, step, target, math.ceil(now + ttl))


@dataclass(frozen=True, slots=True)
class RetentionPlan:
    """What gc deletes, in order, and why the rest stays.

    ``first``: manifests (of steps and spans), deleted before anything else so that no
    committed step or span ever misses a file; ``then``: their data files, orphan files and
    expired leases. ``kept``: step -> the reason it stays (every listed committed step that is
    not deleted). ``notes``: other things left alone, and why.
    """

    keep_anchors: int
    floor: int | None
    anchors: tuple[int, ...]
    kept: Mapping[int, str]
    deleted_steps: tuple[int, ...]
    deleted_spans: tuple[tuple[int, int], ...]
    orphans: tuple[str, ...]
    expired_leases: tuple[str, ...]
    first: tuple[str, ...]
    then: tuple[str, ...]
    sizes: Mapping[str, int]
    keep_bytes: int
    notes: tuple[str, ...]

    @property
    def keys(self) -> frozenset[str]:
        """Every key the plan deletes."""
        return frozenset(self.first) | frozenset(self.then)

    @property
    def delete_bytes(self) -> int:
        """Bytes the plan deletes (listed sizes)."""
        return sum(self.sizes[k] for k in self.keys)

    def restricted_to(self, allowed: frozenset[str]) -> RetentionPlan:
        """The same plan deleting only the keys that are in ``allowed`` too (gc intersects two plans).

        A step or span stays in the plan's lists only while its manifest is still deleted.
        """

        def gone(prefix: str) -> bool:
            return prefix + MANIFEST_NAME in allowed

        return replace(
            self,
            deleted_steps=tuple(s for s in self.deleted_steps if gone(f"steps/{s:012d}/")),
            deleted_spans=tuple(sp for sp in self.deleted_spans if gone(f"{SPANS_PREFIX}{sp[0]:012d}-{sp[1]:012d}/")),
            orphans=tuple(k for k in self.orphans if k in allowed),
            expired_leases=tuple(k for k in self.expired_leases if k in allowed),
            first=tuple(k for k in self.first if k in allowed),
            then=tuple(k for k in self.then if k in allowed),
        )


def _is_manifest(key: str) -> bool:
    """Whether ``key`` is a step's or span's own manifest (not a file of that name in a subfolder)."""
    return _MANIFEST.fullmatch(key) is not None


def _valid_name(name: str) -> bool:
    try:
        check_file_name(name)
    except ProtocolError:
        return False
    return True


def step_ranges(steps: Iterable[int]) -> str:
    """``0-4, 7, 9-10``: runs of consecutive step numbers."""
    s = sorted(steps)
    parts: list[str] = []
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[j] + 1:
            j += 1
        parts.append(str(s[i]) if i == j else f"{s[i]}-{s[j]}")
        i = j + 1
    return ", ".join(parts)


def plan_retention(
    listing: Iterable[Listed],
    committed: Mapping[int, Committed],
    claims: Iterable[WriterClaim],
    leases: Mapping[str, Lease | None],
    *,
    now: float,
    keep_anchors: int,
    grace: float = 3600.0,
) -> RetentionPlan:
    """Plan a gc of the run whose prefix listed ``listing``.

    committed: the parsed manifests (and digests) of listed steps; a listed manifest missing
        here (unreadable, invalid, badly signed) keeps its whole step, whatever its number.
    leases: lease key -> parsed lease, or None for one that does not parse (left alone).

    The rule: the newest ``keep_anchors`` anchors that are not superseded are kept; the
    oldest of them is the floor. Every committed step at or above the floor stays, and so
    does whatever an unexpired lease needs: every step from the held one on (the holder may
    go forward one step at a time, across anchors), and the in-flight target with its chain
    down to its anchor. The newest committed step
    always stays. Other committed steps below the floor (superseded ones included) go.
    A span stays while both its ends stay. Step and span folders without a manifest go when
    every file in them is older than ``grace`` seconds and they lie below the newest anchor.
    Expired leases go. A step's reference (``references/{step}.json``) goes with its step, or as an
    orphan when the step has no manifest, lies below the newest anchor and the reference is older
    than ``grace``. HEAD, ``writers/``, ``probes.json`` and keys outside this layout are never touched.
    """
    if isinstance(keep_anchors, bool) or not isinstance(keep_anchors, int) or keep_anchors < 1:
        raise ValueError(f"keep_anchors must be an integer >= 1, got {keep_anchors!r}")
    if not grace >= 0:
        raise ValueError(f"grace must be >= 0 seconds, got {grace!r}")
    claims = list(claims)
    steps: dict[int, list[Listed]] = {}
    spans: dict[tuple[int, int], list[Listed]] = {}
    notes: list[str] = []
    unknown = 0
    listed_leases: list[Listed] = []
    references: dict[int, Listed] = {}
    for o in listing:
        if parse_lease_key(o.key) is not None:
            listed_leases.append(o)
            continue
        if (ref := parse_reference_key(o.key)) is not None:
            references[ref] = o
            continue
        if m := _STEP_KEY.fullmatch(o.key):
            name = m.group(2)
            if name == MANIFEST_NAME or _valid_name(name):
                steps.setdefault(int(m.group(1)), []).append(o)
                continue
        elif m := _SPAN_KEY.fullmatch(o.key):
            name = m.group(3)
            if int(m.group(1)) < int(m.group(2)) and (name == MANIFEST_NAME or _valid_name(name)):
                spans.setdefault((int(m.group(1)), int(m.group(2))), []).append(o)
                continue
        if o.key not in ("HEAD.json", PROBES_KEY) and not o.key.startswith(("writers/", LEASES_PREFIX)):
            unknown += 1
    if unknown:
        notes.append(f"{unknown} key(s) outside the run's layout: left alone")

    def has_manifest(objs: list[Listed]) -> bool:
        return any(_is_manifest(o.key) for o in objs)

    listed = {s for s, objs in steps.items() if has_manifest(objs)}
    parsed = {s: c for s, c in committed.items() if s in listed}
    live = {s: c for s, c in parsed.items() if superseded_by(c.manifest, claims) is None}
    anchors = sorted(s for s, c in live.items() if c.manifest.kind == "anchor")
    kept_anchors = anchors[-keep_anchors:]
    floor = kept_anchors[0] if kept_anchors else None
    newest = max(listed, default=None)
    newest_anchor = anchors[-1] if anchors else None

    kept: dict[int, str] = {}
    for s in sorted(listed, reverse=True):
        if s not in parsed:
            kept[s] = "its manifest could not be read or is not valid: left alone"
        elif floor is None:
            kept[s] = "no anchor in the run: nothing is reclaimed"
        elif s == newest:
            kept[s] = "newest committed step"
        elif s in kept_anchors:
            kept[s] = f"one of the last {keep_anchors} anchor(s)"
        elif s >= floor:
            kept[s] = f"at or after the oldest kept anchor {floor}"
    for key, lease in sorted(leases.items()):
        if lease is None:
            notes.append(f"{key} does not parse: left alone, protects nothing")
            continue
        if lease.expires <= now:
            continue
        left = f"expires in {lease.expires - now:.0f} s"
        if lease.step is not None and lease.step in live:
            # the holder moves forward from its step: through patches, across anchors, one step at a time
            for s in listed:
                if s >= lease.step:
                    kept.setdefault(s, f"lease {lease.id} holds step {lease.step} ({left})")
        if lease.target is not None and lease.target in live:
            for s in walk_chain(live, lease.target, check_links=False).steps:
                kept.setdefault(s, f"lease {lease.id} is fetching step {lease.target} ({left})")
    deleted_steps = sorted(listed - set(kept))

    def old(objs: list[Listed]) -> bool | None:
        times = [o.mtime for o in objs]
        if any(t is None for t in times):
            return None
        return all(now - t > grace for t in times if t is not None)

    orphans: list[int] = []
    young = unknown_age = 0
    for s, objs in steps.items():
        if s in listed or newest_anchor is None or s >= newest_anchor:
            continue
        age = old(objs)
        if age:
            orphans.append(s)
        elif age is None:
            unknown_age += 1
        else:
            young += 1

    deleted_spans: list[tuple[int, int]] = []
    orphan_spans: list[tuple[int, int]] = []
    for (a, b), objs in spans.items():
        if floor is None:
            continue
        if has_manifest(objs):
            gone = a in deleted_steps or b in deleted_steps
            unusable = (a not in listed or b not in listed) and a < floor
            if gone or unusable:
                deleted_spans.append((a, b))
        elif newest_anchor is not None and b < newest_anchor:
            age = old(objs)
            if age:
                orphan_spans.append((a, b))
            elif age is None:
                unknown_age += 1
            else:
                young += 1
    if young:
        notes.append(f"{young} folder(s) without a manifest are younger than the {grace:.0f} s grace: left alone")
    if unknown_age:
        notes.append(f"{unknown_age} folder(s) without a manifest have no modification time in the listing: left alone")

    first: list[str] = []
    then: list[str] = []
    orphan_keys: list[str] = []
    sizes: dict[str, int] = {}
    for objs in [steps[s] for s in deleted_steps] + [spans[sp] for sp in sorted(deleted_spans)]:
        for o in objs:
            (first if _is_manifest(o.key) else then).append(o.key)
            sizes[o.key] = o.size
    for objs in [steps[s] for s in sorted(orphans)] + [spans[sp] for sp in sorted(orphan_spans)]:
        for o in objs:
            orphan_keys.append(o.key)
            sizes[o.key] = o.size
    for ref_step, o in sorted(references.items()):
        if ref_step in deleted_steps:
            then.append(o.key)
        elif ref_step not in listed and newest_anchor is not None and ref_step < newest_anchor and old([o]):
            orphan_keys.append(o.key)
        else:
            continue
        sizes[o.key] = o.size
    expired = [k for k, lease in sorted(leases.items()) if lease is not None and lease.expires <= now]
    lease_sizes = {o.key: o.size for o in listed_leases}
    sizes.update((k, lease_sizes.get(k, 0)) for k in expired)
    keep_bytes = sum(o.size for s in kept for o in steps.get(s, ()))
    keep_bytes += sum(o.size for sp, objs in spans.items() if sp not in deleted_spans for o in objs)
    return RetentionPlan(
        keep_anchors=keep_anchors,
        floor=floor,
        anchors=tuple(anchors),
        kept=dict(sorted(kept.items())),
        deleted_steps=tuple(deleted_steps),
        deleted_spans=tuple(sorted(deleted_spans)),
        orphans=tuple(orphan_keys),
        expired_leases=tuple(expired),
        first=tuple(sorted(first)),
        then=tuple(sorted(then) + orphan_keys + expired),
        sizes=sizes,
        keep_bytes=keep_bytes,
        notes=tuple(notes),
    )


def describe_kept(plan: RetentionPlan) -> list[str]:
    """One line per reason: ``steps 150-249: at or after the oldest kept anchor 150``."""
    by_reason: dict[str, list[int]] = {}
    for s, why in plan.kept.items():
        by_reason.setdefault(why, []).append(s)
    lines = []
    for why, ss in sorted(by_reason.items(), key=lambda kv: min(kv[1])):
        lines.append(f"{'step' if len(ss) == 1 else 'steps'} {step_ranges(ss)}: {why}")
    return lines
