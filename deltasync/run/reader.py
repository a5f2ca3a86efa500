"""RunReader: the one read-only view of a run (committed steps, manifests, writer claims).

Every reader of a run goes through it: the fetcher, ``follow``, ``inspect``, the
demo, the signal server's store check and ``DeltaUploader.resume``. Manifests
and writer claims are immutable, so both are cached for the reader's life, and
a refresh lists only keys that sort after the newest one already seen. A store
that is emptied and written again under a long-lived reader (the demo's
``--loop``) breaks that promise: :meth:`RunReader.revalidate` notices it for a
step (one read) and starts the reader over. What it
costs, in store round trips (a ``get_many`` batch counts once):

* a reader that already knows the run, seeing one new step: one listing of
  ``steps/``, one of ``writers/``, one batch holding the new manifest (and any
  new claims); a fetcher then downloads the plan's files in one more batch;
* a fresh reader: ``HEAD.json``, the manifest it names, a listing of the steps
  from that manifest's anchor on, a listing of the claims newer than its
  writer epoch, one batch for the chain's manifests.

Neither grows with the run's history or its number of uploader sessions (only
the size of a listing of a backend that cannot start at a key does). HEAD is a
hint: it only chooses where the listing starts, every step at or above it is
seen, and without a usable HEAD the reader lists the whole run.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping

from deltasync.errors import ChainBroken, DeltaSyncError, ObjectNotFound, ObjectTooLarge, RunNotFound
from deltasync.protocol import (
    HEAD_KEY,
    SPANS_PREFIX,
    WRITERS_PREFIX,
    Committed,
    FetchPlan,
    Head,
    Manifest,
    WriterClaim,
    manifest_key,
    parse_manifest_key,
    parse_span_key,
    parse_writer_key,
    plan_fetch,
    span_manifest_key,
    superseded_by,
    walk_chain,
    writer_key,
)
from deltasync.protocol.head import MAX_HEAD_BYTES
from deltasync.protocol.keys import STEPS_PREFIX
from deltasync.protocol.manifest import MAX_MANIFEST_BYTES
from deltasync.protocol.writers import MAX_CLAIM_BYTES
from deltasync.run.manifests import parse_committed
from deltasync.storage.base import Store

__all__ = ["RunReader", "get_present"]

#: The most manifests fetched in one prefetch batch of a chain walk.
MAX_PREFETCH = 1024


def get_present(
    store: Store, limits: Mapping[str, int], too_large: dict[str, ObjectTooLarge] | None = None
) -> dict[str, bytes]:
    """The objects ``limits`` names (key -> the most bytes it may hold) that exist, in one bounded
    batch unless one is missing or over its limit; missing keys are left out.

    An object over its limit raises ObjectTooLarge (before it is read), or, with ``too_large``,
    is left out and its error put there (a damaged object the caller reports in its own time).
    """
    if not limits:
        return {}
    try:
        return store.get_many_bounded(dict(limits))
    except (ObjectNotFound, ObjectTooLarge):
        out: dict[str, bytes] = {}
        for key, limit in limits.items():
            try:
                out[key] = store.get_bounded(key, limit)
            except ObjectNotFound:
                continue
            except ObjectTooLarge as exc:
                if too_large is None:
                    raise
                too_large[key] = exc
        return out


def _manifests(keys: Iterable[str]) -> dict[str, int]:
    return dict.fromkeys(keys, MAX_MANIFEST_BYTES)


def _claims(keys: Iterable[str]) -> dict[str, int]:
    return dict.fromkeys(keys, MAX_CLAIM_BYTES)


class RunReader:
    """A cached, read-only view of the run under ``store``.

    signing_key: when set, every manifest must carry a valid HMAC signature.
    max_cached: manifests kept in memory (least recently used go first; a manifest of a
        large model is tens of KB, and chains are as long as ``anchor_every``).
    spans: let plans use the run's spans (SPEC.md "Spans"); they are listed only when a
        plan would apply two or more patches.

    Thread-safe. Nothing here writes to the store.
    """

    def __init__(
        self, store: Store, *, signing_key: bytes | None = None, max_cached: int = 4096, spans: bool = True
    ) -> None:
        self.store = store
        self.signing_key = signing_key
        self.use_spans = spans
        self._lock = threading.RLock()
        self.max_cached = max_cached
        self._forget_all()

    def _forget_all(self) -> None:
        # span manifests read so far, by (from, to); None: unreadable or distrusted (never used again)
        self._spans: dict[tuple[int, int], Committed | None] = {}
        self._manifests: OrderedDict[int, Committed] = OrderedDict()
        self._steps: set[int] = set()
        # the listing is complete for steps >= _floor (None: never listed)
        self._floor: int | None = None
        self._claims: dict[int, WriterClaim] = {}
        # every claim with an epoch above _claims_above is known (None: never listed)
        self._claims_above: int | None = None
        # steps whose manifest exists but did not parse (or verify), with the error
        self._broken: dict[int, DeltaSyncError] = {}

    def __repr__(self) -> str:
        return f"RunReader({self.store.url!r})"

    # ------------------------------------------------------------ manifests

    def _parse(self, step: int, body: bytes, key: str | None = None) -> Committed:
        """Parse the manifest of ``step`` stored under ``key`` (see :func:`~deltasync.run.manifests.parse_committed`)."""
        return parse_committed(step, body, key=key, signing_key=self.signing_key, where=self.store.url)

    def committed(self, step: int) -> Committed:
        """The parsed manifest of committed ``step`` and its digest (cached).

        Raises ObjectNotFound when the step is not committed, ProtocolError (or
        SignatureMismatch) when its manifest is not valid.
        """
        with self._lock:
            hit = self._manifests.get(step)
            if hit is None:
                body = self.store.get_bounded(manifest_key(step), MAX_MANIFEST_BYTES)
                hit = self._remember(step, self._parse(step, body))
                self._steps.add(step)
            else:
                self._manifests.move_to_end(step)
            return hit

    def require_step(self, step: int) -> Committed:
        """:meth:`committed`, or ChainBroken saying that the step is not committed and which is the newest."""
        try:
            return self.committed(step)
        except ObjectNotFound:
            pass
        latest = self.latest_step()
        if latest is None:
            why = "nothing is committed there yet"
        elif step > latest:
            why = f"not yet: the newest committed step is {latest}"
        else:
            why = f"never pushed, or deleted by gc; the newest committed step is {latest}"
        raise ChainBroken(f"step {step} is not committed in {self.store.url} ({why})")

    def manifest(self, step: int) -> Manifest:
        """The parsed manifest of committed ``step``."""
        return self.committed(step).manifest

    def committed_many(self, steps: Iterable[int], *, also_keys: dict[str, int] | None = None) -> dict[int, Committed]:
        """Manifests of ``steps`` that are committed, fetched in one batch (missing ones left out).

        A manifest that does not parse is left out too (its step is reported
        broken by whoever needs it, through :meth:`committed`). ``also_keys``:
        listed writer claims (key -> epoch) to read in the same batch.
        """
        with self._lock:
            steps = list(steps)
            want = sorted({s for s in steps if s not in self._manifests})
            claim_keys = also_keys or {}
            refused: dict[str, ObjectTooLarge] = {}
            limits = {**_manifests(manifest_key(s) for s in want), **_claims(sorted(claim_keys))}
            bodies = get_present(self.store, limits, refused)
            for key in claim_keys:
                if key in refused:
                    raise refused[key]  # as a claim that does not parse
            self._take_claims(claim_keys, bodies)
            for s in want:
                if manifest_key(s) in refused:
                    self._broken[s] = refused[manifest_key(s)]  # raised by chain() when a walk needs this step
                    continue
                body = bodies.get(manifest_key(s))
                if body is None:
                    continue
                try:
                    self._remember(s, self._parse(s, body))
                except DeltaSyncError as exc:
                    self._broken[s] = exc  # raised by chain() when a walk needs this step
                    continue
                self._steps.add(s)
            return {s: c for s in steps if (c := self._manifests.get(s)) is not None}

    def _remember(self, step: int, c: Committed) -> Committed:
        self._manifests[step] = c
        self._manifests.move_to_end(step)
        while len(self._manifests) > self.max_cached:
            self._manifests.popitem(last=False)  # least recently used; read again if needed
        return c

    def revalidate(self, step: int) -> bool:
        """Whether the manifest cached for ``step`` is still the one the store holds.

        Manifests are written once, so a cached one stays true, unless the store was emptied
        and written again under this reader (``deltasync demo --loop`` does that: the same
        steps with other content). This reads ``step``'s manifest again (one read; none when
        nothing is cached for it, which is then True). When the store's manifest has another
        digest, no longer parses, or is gone, the store was rewritten: everything this reader
        cached is dropped, as if it were new (keeping the manifest just read), and the answer
        is False. An unreadable store raises its StorageError and drops nothing.
        """
        with self._lock:
            cached = self._manifests.get(step)
            if cached is None:
                return True
            fresh: Committed | None = None
            try:
                body: bytes | None = self.store.get_bounded(manifest_key(step), MAX_MANIFEST_BYTES)
            except (ObjectNotFound, ObjectTooLarge):
                body = None
            if body is not None:
                try:
                    fresh = self._parse(step, body)
                except DeltaSyncError:
                    fresh = None  # not valid any more: committed() raises why, once asked
            if fresh is not None and fresh.digest == cached.digest:
                return True
            self._forget_all()
            if fresh is not None:
                self._remember(step, fresh)
                self._steps.add(step)
            return False

    def reset(self) -> None:
        """Forget everything cached (steps, manifests, claims, spans): the next call reads the store afresh."""
        with self._lock:
            self._forget_all()

    def forget(self, steps: Iterable[int]) -> None:
        """Drop cached manifests (after a failure they may be the bad bytes)."""
        with self._lock:
            for step in steps:
                self._manifests.pop(step, None)
                self._broken.pop(step, None)

    # -------------------------------------------------------------- listing

    def _list_steps(self, start_after: str | None) -> set[int]:
        found = self.store.list_after(STEPS_PREFIX, start_after)
        return {s for o in found if (s := parse_manifest_key(o.key)) is not None}

    def _head_floor(self) -> int | None:
        """Where a first listing may start: the anchor of the step HEAD names (a hint), or None."""
        try:
            head = Head.from_json(self.store.get_bounded(HEAD_KEY, MAX_HEAD_BYTES))
            top = self.committed(head.step)
        except DeltaSyncError:
            return None  # no HEAD, a bad one, or it names nothing committed: list everything
        return min(top.manifest.anchor_step, head.step)

    def refresh(self, *, full: bool = False) -> list[int]:
        """List what is new and return every known committed step, ascending.

        The first call starts at the anchor of the step ``HEAD.json`` names
        (or lists the whole run when HEAD is unusable); ``full=True`` makes
        sure the whole run is listed once. Later calls list only keys after
        the newest step known.
        """
        with self._lock:
            if self._floor is None or (full and self._floor > 0):
                floor = None if full else self._head_floor()
                start = None if floor is None else f"{STEPS_PREFIX}{floor:012d}"
                self._steps |= self._list_steps(start)
                self._floor = floor or 0
                if not full and self._floor > 0 and not any(s >= self._floor for s in self._steps):
                    self._steps |= self._list_steps(None)  # HEAD pointed past everything: list it all
                    self._floor = 0
            else:
                known = [s for s in self._steps if s >= self._floor]
                start = manifest_key(max(known)) if known else None
                if start is None and self._floor > 0:
                    start = f"{STEPS_PREFIX}{self._floor:012d}"
                self._steps |= self._list_steps(start)
            return sorted(s for s in self._steps if s >= self._floor)

    def relist(self) -> list[int]:
        """List the whole run afresh and forget cached manifests of steps no longer listed.

        For a reader that found a step gone (garbage collection): its plans must come from
        what the store holds now. Returns every committed step, ascending.
        """
        with self._lock:
            self._steps = set()
            self._floor = None
            steps = self.refresh(full=True)
            self.forget([s for s in self._manifests if s not in self._steps])
            return steps

    def steps(self) -> list[int]:
        """Every committed step of the run, ascending (the whole run is listed once)."""
        return self.refresh(full=True)

    # --------------------------------------------------------------- claims

    def _list_claims(self, start_after: str | None) -> dict[str, int]:
        """Keys (and epochs) of listed claims not yet known."""
        found = self.store.list_after(WRITERS_PREFIX, start_after)
        return {o.key: e for o in found if (e := parse_writer_key(o.key)) is not None and e not in self._claims}

    def _take_claims(self, keys: dict[str, int], bodies: dict[str, bytes]) -> None:
        for key, epoch in keys.items():
            body = bodies.get(key)
            if body is None:
                continue
            claim = WriterClaim.from_json(body)
            if claim.epoch == epoch:
                self._claims[epoch] = claim

    def _fetch_claims(self, start_after: str | None) -> None:
        keys = self._list_claims(start_after)
        self._take_claims(keys, get_present(self.store, _claims(sorted(keys))))

    def _ensure_claims_above(self, epoch: int) -> None:
        if self._claims_above is None or epoch < self._claims_above:
            self._fetch_claims(writer_key(epoch) if epoch >= 1 else None)
            self._claims_above = epoch

    def _new_claim_keys(self) -> dict[str, int]:
        """Claims listed since the last refresh (not fetched yet); nothing before the first listing."""
        if self._claims_above is None:
            return {}
        newest = max([self._claims_above, *self._claims])
        return self._list_claims(writer_key(newest) if newest >= 1 else None)

    def _refresh_claims(self) -> None:
        keys = self._new_claim_keys()
        self._take_claims(keys, get_present(self.store, _claims(sorted(keys))))

    def claims(self) -> list[WriterClaim]:
        """Every writer claim of the run, newest epoch first (listed in full)."""
        with self._lock:
            self._ensure_claims_above(0)
            self._refresh_claims()
            return [self._claims[e] for e in sorted(self._claims, reverse=True)]

    def superseded_by(self, step: int) -> WriterClaim | None:
        """The newer writer claim that fences ``step`` off (SPEC.md "Single writer"), or None."""
        with self._lock:
            m = self.committed(step).manifest
            self._ensure_claims_above(m.epoch)
            return superseded_by(m, (c for e, c in self._claims.items() if e > m.epoch))

    # ---------------------------------------------------------------- heads

    def latest_step(self) -> int | None:
        """Newest committed step that belongs to the run (not superseded), or None."""
        with self._lock:
            steps = self.refresh()
            claim_keys = self._new_claim_keys()  # listed after the steps (SPEC.md "Single writer")
            for full in (False, True):
                # the newest few manifests in one batch (with any new claims); older ones only if
                # those are all superseded
                candidates = sorted(steps, reverse=True)
                for i in range(0, len(candidates), 8):
                    batch = candidates[i : i + 8]
                    self.committed_many(batch, also_keys=claim_keys)
                    claim_keys = {}
                    for s in batch:
                        try:
                            if self.superseded_by(s) is None:
                                return s
                        except ObjectNotFound:
                            continue  # deleted since it was listed
                if full or self._floor == 0:
                    return None
                steps = self.refresh(full=True)
            return None

    def exists(self) -> bool:
        """Whether the store holds a run here: a committed step or a writer claim."""
        with self._lock:
            return bool(self.refresh()) or bool(self.store.list_after(WRITERS_PREFIX, None))

    def require(self) -> None:
        """Raise RunNotFound unless :meth:`exists`."""
        if not self.exists():
            raise RunNotFound(
                f"{self.store.url}: no deltasync run here (no committed step and no writer claim); "
                "check the URL or path, or wait for the trainer's first commit"
            )

    def run_id(self) -> str | None:
        """The run id of the newest committed step, or None for an empty run."""
        latest = self.latest_step()
        return None if latest is None else self.committed(latest).manifest.run_id

    # ----------------------------------------------------------------- plans

    def chain(self, target: int, also: int | None = None) -> dict[int, Committed]:
        """Manifests along the parent walk from ``target`` down to its anchor (plus ``also``).

        Fetched in batches: the target first, then every known step between
        its declared anchor and it, then (only if a link is still missing)
        one manifest per round trip. Steps that are not committed are left out
        (the planner reports the missing link); a manifest on the walk that does
        not parse or verify raises its error (ProtocolError, SignatureMismatch)
        naming its step and key.
        """
        with self._lock:
            extra = [] if also is None else [also]
            top = self.committed_many([target, *extra]).get(target)
            if top is None:
                try:
                    top = self.committed(target)  # raises what is wrong with it, unless it is simply missing
                except ObjectNotFound:
                    return {}
            lo = min(top.manifest.anchor_step, target)
            known = sorted(s for s in self._steps if lo <= s < target)[-MAX_PREFETCH:]
            have: dict[int, Committed] = {target: top, **self.committed_many(known)}
            while True:  # the one pure walk; fetch the parent it stops at, one round trip each
                walk = walk_chain(have, target, check_links=False)
                if walk.missing is None:
                    break
                got = self.committed_many([walk.missing]).get(walk.missing)
                if got is None:
                    bad = self._broken.get(walk.missing)
                    if bad is not None:  # say what breaks the chain, not only that a link is missing
                        raise type(bad)(f"cannot reach step {target}: {bad}")
                    break
                have[walk.missing] = got
            out: dict[int, Committed] = {s: have[s] for s in walk.steps}
            if also is not None and also in self._manifests:
                out[also] = self._manifests[also]
            return out

    def plan(self, target: int, have: tuple[int, str] | None = None) -> FetchPlan:
        """The cheapest plan to ``target`` from ``have`` = (step, manifest digest) (pure planner).

        When the plan applies two or more patches, the run's spans from the plan's
        start on are listed (one listing, one batch of span manifests) and the plan
        is made again with them (SPEC.md "Reading cost"). Raises ChainBroken when
        the target cannot be reached; the manifests read for it are then dropped
        from the cache (they may be what breaks it).
        """
        from deltasync.errors import ChainBroken

        with self._lock:
            committed = self.chain(target, also=have[0] if have else None)
            top = committed.get(target)
            if top is not None:
                self._ensure_claims_above(top.manifest.epoch)
            claims = [c for e, c in self._claims.items() if top is not None and e > top.manifest.epoch]
            hs, hd = (have[0], have[1]) if have else (None, None)
            try:
                plan = plan_fetch(committed, target, hs, hd, claims)
            except ChainBroken:
                self.forget(committed)
                raise
            patches = len(plan.steps) - (plan.base == "anchor")
            if not self.use_spans or patches < 2:
                return plan
            start = hs if plan.base == "current" and hs is not None else plan.steps[0]
            spans = self.spans_between(start, target, set(committed))
            return plan_fetch(committed, target, hs, hd, claims, spans) if spans else plan

    # ---------------------------------------------------------------- spans

    def spans_between(self, start: int, end: int, steps: set[int]) -> dict[tuple[int, int], Committed]:
        """Readable span manifests from ``start`` (or later) up to ``end``, both ends in ``steps``.

        One listing of ``spans/`` after ``start``'s prefix, one batch for the manifests not
        read yet. A span manifest that does not parse (or is not signed when a key is
        configured) is left out for good; whether a span fits its ends is the planner's check.
        """
        with self._lock:
            found = self.store.list_after(SPANS_PREFIX, f"{SPANS_PREFIX}{start:012d}")
            keys = [k for o in found if (k := parse_span_key(o.key)) is not None]
            want = [k for k in keys if start <= k[0] and k[1] <= end and k[0] in steps and k[1] in steps]
            new = [k for k in want if k not in self._spans]
            refused: dict[str, ObjectTooLarge] = {}
            bodies = get_present(self.store, _manifests(span_manifest_key(a, b) for a, b in new), refused)
            for a, b in new:
                if span_manifest_key(a, b) in refused:
                    self._spans[(a, b)] = None
                    continue
                body = bodies.get(span_manifest_key(a, b))
                if body is None:
                    continue  # deleted since listed
                try:
                    self._spans[(a, b)] = self._parse(b, body, span_manifest_key(a, b))
                except DeltaSyncError:
                    self._spans[(a, b)] = None
            return {k: c for k in want if (c := self._spans.get(k)) is not None}

    def span(self, start: int, end: int) -> Committed:
        """The span manifest from ``start`` to ``end`` that a plan named (read by :meth:`plan`)."""
        with self._lock:
            c = self._spans.get((start, end))
            if c is None:
                raise ObjectNotFound(f"{span_manifest_key(start, end)}: no usable span from step {start} to {end}")
            return c

    def distrust_spans(self, spans: Iterable[tuple[int, int]]) -> None:
        """Never plan with these spans again (their files were bad or their content lied)."""
        with self._lock:
            for key in spans:
                self._spans[key] = None
