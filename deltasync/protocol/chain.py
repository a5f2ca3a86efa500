"""The pure chain planner: which committed steps to apply to reach a target step."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from deltasync.errors import ChainBroken
from deltasync.protocol.manifest import Manifest, WriterClaim

__all__ = ["Committed", "FetchPlan", "plan_fetch", "superseded_by"]


@dataclass(frozen=True, slots=True)
class Committed:
    """A committed step: its parsed manifest and the xxh3-128 of the manifest's bytes."""

    manifest: Manifest
    digest: str


@dataclass(frozen=True, slots=True)
class FetchPlan:
    """What to apply, in order. ``base`` says whether ``steps`` start from the target's current
    state (all patches) or from an anchor (``steps[0]`` is the anchor)."""

    target_step: int
    base: Literal["current", "anchor"]
    steps: tuple[int, ...]
    nbytes: int

    @property
    def is_noop(self) -> bool:
        """True when the target already is at ``target_step``."""
        return not self.steps


def _nbytes(committed: Mapping[int, Committed], steps: tuple[int, ...]) -> int:
    return sum(committed[s].manifest.total_bytes for s in steps)


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
) -> FetchPlan:
    """Plan the cheapest way to ``target_step``.

    Walks parent links down from the target (each link must match the parent
    manifest's digest, and a patch must have its parent's inventory) until the
    first anchor, so every step of a plan has the inventory of its anchor, whose
    sizes its bytes bound. If the current state
    ``(have_step, have_digest)`` lies on that walk, patching forward from it is
    one option; loading the nearest anchor at or below the target plus its
    patches is the other. The smaller download wins (ties favour patching).
    Raises ChainBroken when neither works.
    """
    top = committed.get(target_step)
    if top is None:
        raise ChainBroken(f"step {target_step} is not committed in this run")
    newer = superseded_by(top.manifest, claims)
    if newer is not None:
        raise ChainBroken(
            f"step {target_step} was written by writer epoch {top.manifest.epoch} after epoch {newer.epoch} "
            f"had taken over the run at step {newer.after_step}; it is not part of the run (pick another step)"
        )
    if have_step == target_step and have_digest in (None, top.digest):
        return FetchPlan(target_step, "current", (), 0)
    path: list[int] = [target_step]
    options: list[FetchPlan] = []
    reason = ""
    cur = top
    while True:
        m = cur.manifest
        if m.kind == "anchor":
            steps = tuple(reversed(path))
            options.append(FetchPlan(target_step, "anchor", steps, _nbytes(committed, steps)))
            break
        parent = committed.get(m.parent_step) if m.parent_step is not None else None
        if parent is None or parent.manifest.step != m.parent_step or m.parent_step >= m.step:
            reason = f"step {m.step}'s parent step {m.parent_step} is not committed"
            break
        if parent.digest != m.parent_digest:
            reason = f"step {m.step}'s parent digest does not match the manifest of step {m.parent_step}"
            break
        if parent.manifest.inventory_digest != m.inventory_digest:
            # a patch changes values only; its inventory (hence every size it declares) is its parent's
            reason = f"step {m.step}'s tensor inventory differs from its parent step {m.parent_step}'s"
            break
        if parent.manifest.step == have_step and have_digest in (None, parent.digest):
            steps = tuple(reversed(path))
            options.append(FetchPlan(target_step, "current", steps, _nbytes(committed, steps)))
        path.append(parent.manifest.step)
        cur = parent
    if not options:
        raise ChainBroken(
            f"cannot reach step {target_step}: {reason}, and no anchor is reachable from it "
            "(the store may be incomplete or garbage-collected; pick another step)"
        )
    return min(options, key=lambda p: (p.nbytes, p.base != "current"))
