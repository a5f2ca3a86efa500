"""The pure chain planner: which committed steps to apply to reach a target step."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from deltasync.errors import ChainBroken
from deltasync.protocol.manifest import Manifest
from deltasync.protocol.spans import span_problem
from deltasync.protocol.writers import WriterClaim

__all__ = [
    "ChainWalk",
    "Committed",
    "FetchPlan",
    "LinkProblem",
    "PlanStep",
    "plan_fetch",
    "superseded_by",
    "walk_chain",
]


@dataclass(frozen=True, slots=True)
class Committed:
    """A committed step: its parsed manifest and the xxh3-128 of the manifest's bytes."""

    manifest: Manifest
    digest: str


@dataclass(frozen=True, slots=True)
class PlanStep:
    """One element of a plan: the committed ``step`` it reaches, and how.

    ``span`` is None when the step's own files are applied (an anchor, or a patch
    onto its parent); otherwise the step is reached through the span from step
    ``span`` (SPEC.md "Spans"), whose files replace the steps in between.
    """

    step: int
    span: int | None = None

    @property
    def is_span(self) -> bool:
        """True when this element is applied from a span's files."""
        return self.span is not None


@dataclass(frozen=True, slots=True)
class FetchPlan:
    """What to apply, in order. ``base`` says whether ``steps`` start from the target's current
    state (all patches) or from an anchor (``steps[0]`` is the anchor).

    ``steps`` are the committed steps the plan reaches, one per element; ``spans`` lists
    ``(from, to)`` for the elements reached through a span instead of their own patch
    (empty when the plan uses no span), see :attr:`elements`.
    """

    target_step: int
    base: Literal["current", "anchor"]
    steps: tuple[int, ...]
    nbytes: int
    spans: tuple[tuple[int, int], ...] = ()

    @property
    def is_noop(self) -> bool:
        """True when the target already is at ``target_step``."""
        return not self.steps

    @property
    def elements(self) -> tuple[PlanStep, ...]:
        """The plan's elements in order, each saying whether it is a step's own files or a span."""
        via = {end: start for start, end in self.spans}
        return tuple(PlanStep(s, via.get(s)) for s in self.steps)


def superseded_by(m: Manifest, claims: Iterable[WriterClaim]) -> WriterClaim | None:
    """The newer writer claim that fences ``m`` off, or None when ``m`` is part of the run.

    A step written with epoch ``e`` is superseded by a claim of a higher epoch made
    when the run's newest step was below it: the newer uploader had taken over,
    so the older one's later commit (a race it lost) does not belong to the run.
    """
    for c in claims:
        if c.epoch > m.epoch and (c.after_step is None or c.after_step < m.step):
            return c
    return None


def plan_fetch(
    committed: Mapping[int, Committed],
    target_step: int,
    have_step: int | None = None,
    have_digest: str | None = None,
    claims: Iterable[WriterClaim] = (),
    spans: Mapping[tuple[int, int], Committed] | None = None,
) -> FetchPlan:
    """Plan the cheapest way to ``target_step``.

    Walks parent links down from the target (each link must match the parent
    manifest's digest, and a patch must have its parent's inventory) until the
    first anchor, so every step of a plan has the inventory of its anchor, whose
    sizes its bytes bound. The steps of that walk are the nodes of a DAG whose
    edges are the patches (parent -> step) and the usable ``spans``
    (``(from, to)`` -> span manifest; see :func:`~deltasync.protocol.spans.span_problem`;
    both ends on the walk, neither superseded; anything else is ignored). A route
    starts at the current state ``(have_step, have_digest)`` when it lies on the
    walk, or at the walk's anchor (paying for the anchor). The route with the
    fewest bytes wins; ties favour fewer elements, then patching from the
    current state. Raises ChainBroken when there is no route.
    """
    claims = tuple(claims)
    chain = walk_chain(committed, target_step)
    top = committed.get(target_step)
    if top is None:
        raise chain.error()
    newer = superseded_by(top.manifest, claims)
    if newer is not None:
        raise ChainBroken(
            f"step {target_step} was written by writer epoch {top.manifest.epoch} after epoch {newer.epoch} "
            f"had taken over the run at step {newer.after_step}; it is not part of the run (pick another step)"
        )
    if have_step == target_step and have_digest in (None, top.digest):
        return FetchPlan(target_step, "current", (), 0)
    walk, anchor = chain.steps, chain.anchor
    # cheapest route to each node: (bytes, elements, 0 current / 1 anchor), and how it got there
    best: dict[int, tuple[int, int, int]] = {}
    came: dict[int, tuple[int | None, int | None]] = {}  # node -> (previous node, span start or None)

    def offer(node: int, cost: tuple[int, int, int], prev: int | None, span: int | None) -> None:
        if node not in best or cost < best[node]:
            best[node] = cost
            came[node] = (prev, span)

    on_walk = set(walk)
    if have_step is not None and have_step in on_walk and have_digest in (None, committed[have_step].digest):
        offer(have_step, (0, 0, 0), None, None)
    if anchor is not None:
        offer(anchor, (committed[anchor].manifest.total_bytes, 1, 1), None, None)
    usable = _usable_spans(committed, spans or {}, on_walk, claims)
    into: dict[int, list[tuple[int, int | None, int]]] = {}  # to -> (from, span start or None, bytes)
    for node in walk:
        m = committed[node].manifest
        if m.kind == "patch" and m.parent_step in on_walk:
            into.setdefault(node, []).append((m.parent_step, None, m.total_bytes))
    for (start, end), nbytes in usable.items():
        into.setdefault(end, []).append((start, start, nbytes))
    for node in sorted(walk):  # a DAG: every edge goes to a higher step
        for prev, span, nbytes in into.get(node, ()):
            if prev in best:
                b, n, base = best[prev]
                offer(node, (b + nbytes, n + 1, base), prev, span)
    if target_step not in best:
        raise chain.error()
    steps: list[int] = []
    used: list[tuple[int, int]] = []
    at: int | None = target_step
    while at is not None:
        back, via = came[at]
        if back is None and best[at][2] == 0:
            break  # the held state: nothing to apply for it
        steps.append(at)
        if via is not None:
            used.append((via, at))
        at = back
    total, _, base = best[target_step]
    return FetchPlan(target_step, "anchor" if base else "current", tuple(reversed(steps)), total, tuple(reversed(used)))


LinkProblem = Literal["no-parent", "missing", "digest", "inventory"]


@dataclass(frozen=True, slots=True)
class ChainWalk:
    """The parent walk down from one committed step: what :func:`walk_chain` found.

    ``steps`` runs from the top step down: to the anchor (included) when the walk reached one,
    else to the last step whose parent link holds. When it stopped short, ``broken_at`` is that
    step, ``problem`` says what is wrong with its link (``no-parent``: it names no earlier parent
    step; ``missing``: the parent is not committed; ``digest``: the parent's manifest is not the
    one it recorded; ``inventory``: its tensors differ from the parent's) and ``reason`` says it
    in words. A top step that is not committed gives an empty walk with problem ``missing``.
    """

    top: int
    steps: tuple[int, ...]
    anchor: int | None
    broken_at: int | None = None
    problem: LinkProblem | None = None
    reason: str = ""
    #: the parent step that is not committed (problem ``missing``), so a reader can fetch it and walk again
    missing: int | None = None

    @property
    def complete(self) -> bool:
        """True when the walk reached an anchor."""
        return self.anchor is not None

    @property
    def patches(self) -> int:
        """Patches on the walk above its anchor (or all of it, when it reached none)."""
        return len(self.steps) - (self.anchor is not None)

    def error(self) -> ChainBroken:
        """Why the top step cannot be fetched from an anchor (a walk that reached none), in the planner's words."""
        if not self.steps:
            return ChainBroken(f"step {self.top} is not committed in this run")
        return ChainBroken(
            f"cannot reach step {self.top}: {self.reason}, and no anchor is reachable from it "
            "(the store may be incomplete or garbage-collected; pick another step)"
        )


def walk_chain(committed: Mapping[int, Committed], top: int, *, check_links: bool = True) -> ChainWalk:
    """Follow parent links down from step ``top`` through ``committed`` to the first anchor.

    Pure: the one walk that planning, retention, the run reader, ``inspect --verify`` and resume
    share. With ``check_links`` each link must also carry the parent's manifest digest and
    inventory (what a fetcher relies on); without, only parent step numbers are followed (what
    retention keeps: never less than a strict walk). Never raises; see :class:`ChainWalk`.
    """
    cur = committed.get(top)
    if cur is None:
        return ChainWalk(top, (), None, top, "missing", f"step {top} is not committed", top)
    walk = [top]
    while True:
        m = cur.manifest
        if m.kind == "anchor":
            return ChainWalk(top, tuple(walk), m.step)
        p = m.parent_step
        if p is None or p >= m.step:
            # the message a fetcher has always printed for it
            return ChainWalk(
                top, tuple(walk), None, m.step, "no-parent", f"step {m.step}'s parent step {p} is not committed"
            )
        parent = committed.get(p)
        if parent is None or parent.manifest.step != p:
            return ChainWalk(
                top, tuple(walk), None, m.step, "missing", f"step {m.step}'s parent step {p} is not committed", p
            )
        if check_links and parent.digest != m.parent_digest:
            return ChainWalk(
                top,
                tuple(walk),
                None,
                m.step,
                "digest",
                f"step {m.step}'s parent digest does not match the manifest of step {p}",
            )
        if check_links and parent.manifest.inventory_digest != m.inventory_digest:
            # a patch changes values only; its inventory (hence every size it declares) is its parent's
            return ChainWalk(
                top,
                tuple(walk),
                None,
                m.step,
                "inventory",
                f"step {m.step}'s tensor inventory differs from its parent step {p}'s",
            )
        walk.append(p)
        cur = parent


def _usable_spans(
    committed: Mapping[int, Committed],
    spans: Mapping[tuple[int, int], Committed],
    on_walk: set[int],
    claims: tuple[WriterClaim, ...],
) -> dict[tuple[int, int], int]:
    """Bytes of every span that may be used: both ends on the walk and not superseded, and
    the span checked against them (anything else is ignored, never an error)."""
    out: dict[tuple[int, int], int] = {}
    for (start, end), c in spans.items():
        if start >= end or start not in on_walk or end not in on_walk:
            continue
        lo, hi = committed[start], committed[end]
        if superseded_by(lo.manifest, claims) is not None or superseded_by(hi.manifest, claims) is not None:
            continue
        if span_problem(c.manifest, c.digest, lo.manifest, lo.digest, hi.manifest, hi.digest) is None:
            out[(start, end)] = c.manifest.total_bytes
    return out
