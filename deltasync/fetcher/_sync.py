"""One :meth:`DeltaFetcher.sync`: have -> plan -> execute -> recover, in :meth:`Sync.run`.

The steps, each one method of :class:`Sync`:

- **have** (:meth:`Sync._find_have`): fill an empty dict from the run's inventory (the one
  allocator, capped), then find which committed step the target provably holds: the very
  tensors this fetcher last wrote, unmodified, or a step whose tensor digests they match.
- **plan** (:meth:`Sync._plan`): the pure planner through the run reader, from what the target
  holds (patches forward) or from the nearest anchor.
- **execute** (:meth:`Sync._execute`): download, check, decode (``_execute.decode_plan``), prove,
  and apply with an undo log (``_execute.apply_decoded``): all or nothing.
- **recover** (:meth:`Sync._recover`): every fallback in one place, see there.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, MutableMapping
from typing import Any

from deltasync._util.tensors import allocate
from deltasync.errors import (
    ChainBroken,
    ChecksumMismatch,
    InventoryMismatch,
    ObjectNotFound,
)
from deltasync.fetcher._apply import Undo
from deltasync.fetcher._download import PlanFilesGone
from deltasync.fetcher._execute import Applied, apply_decoded, decode_plan, prove_anchor_plan
from deltasync.fetcher._identity import HeldState, HeldStates
from deltasync.fetcher._journal import SyncJournal
from deltasync.fetcher._lease import LeaseWriter, still_committed, unreachable_after_gc
from deltasync.fetcher._source import DATA_ERRORS, Source
from deltasync.fetcher._stats import SyncStats
from deltasync.fetcher._target import TargetTensor, TensorViews, live_tensors, target_tensors
from deltasync.protocol import Committed, FetchPlan, Manifest, TensorInfo, file_key, step_prefix

__all__ = ["Sync"]

log = logging.getLogger("deltasync.fetcher")


class Sync:
    """One sync of ``target`` (nn.Module or dict of tensors) to ``step`` (None: the latest), built per call.

    held: the fetcher's record of what it left in each target (read, and updated on success).
    have_step: a step the caller says the target holds (proven by digests when verifying).
    journal: receives the undo log. lease: renewed before (holding, fetching) and after (holding).
    max_alloc_bytes: the cap on filling an empty dict from the run's inventory.

    :meth:`run` is all or nothing: the target ends at the step returned, or it raises with the
    target as it was (an empty dict empty again).
    """

    def __init__(
        self,
        source: Source,
        held: HeldStates,
        target: Any,
        step: int | None,
        *,
        have_step: int | None = None,
        journal: SyncJournal | None = None,
        lease: LeaseWriter | None = None,
        max_alloc_bytes: int,
    ) -> None:
        self.source = source
        self.reader = source.reader
        self.held = held
        self.target = target
        self.step = step
        self.have_step = have_step
        self.journal = journal
        self.lease = lease
        self.max_alloc_bytes = max_alloc_bytes
        #: timings and bytes of the attempt that succeeded (the last one tried when it raised)
        self.stats = SyncStats(-1)
        self.target_step = -1
        self._relisted = False
        # one attempt's state: None means "to be found (planned) again"
        self._tensors: dict[str, TargetTensor] | None = None
        self._plan_made: FetchPlan | None = None
        self._added: list[str] = []
        self._filling = False
        self._live: dict[str, Any] = {}
        self._inventory: tuple[TensorInfo, ...] = ()
        self._have: tuple[int, str] | None = None
        self._found: tuple[int, str] | None = None
        #: the target's version counters as read when it was found unchanged (None: it was not)
        self._versions: list[int | None] | None = None
        self._before: HeldState | None = None
        self._base: Manifest | None = None
        self._keep: Undo | None = None
        self._applied: Applied | None = None
        self._t0 = 0.0

    # ------------------------------------------------------------------ the sync

    def run(self) -> int:
        """Bring the target to the step: have -> plan -> execute, recovering where it can. Returns the step."""
        try:
            self._resolve()
            while True:
                executing = False
                try:
                    if self._tensors is None:
                        self._find_have()
                    if self._plan_made is None:
                        self._plan()
                    executing = True
                    reached = self._execute()
                    break
                except BaseException as exc:
                    if not self._recover(exc, executing=executing):
                        raise
            self._record(reached)
        except BaseException:
            self._drop_allocated()  # all or nothing: an empty dict that was filled is empty again
            raise
        if self.lease is not None:
            self.lease.renew(self.target_step, None)
        return self.target_step

    def _recover(self, exc: BaseException, *, executing: bool) -> bool:
        """Decide what a failure leads to; True: run again (the state to redo is reset), False: raise it.

        In this order:

        1. a plan through spans whose data failed: the spans are never used again, the plan is made
           again from the same start (the cached manifests of a plan whose bytes failed are dropped);
        2. a checksum failure patching from a state the target does not provably hold (changed behind
           our back): planned again from the nearest anchor;
        3. files of the plan (or the latest step just resolved) deleted meanwhile, by gc: the run is
           listed afresh and the whole sync starts again, once; still gone: ChainBroken saying so.

        Anything else is raised (and :meth:`run` empties a dict target it filled).
        """
        plan = self._plan_made
        if executing and plan is not None and isinstance(exc, DATA_ERRORS):
            if self.source.drop_failed_spans(plan, exc):
                self.stats.span_fallbacks += 1
                self._plan_made = None
                return True
            if (
                isinstance(exc, ChecksumMismatch)
                and plan.base == "current"
                and self._have is not None
                and self._tensors is not None
                and self.source.holds(self._tensors, self._have[0]) is None
            ):
                self._have, self._plan_made = None, None
                self.stats = SyncStats(self.target_step, clock=self.stats.clock)
                return True
        self._drop_allocated()
        if isinstance(exc, InventoryMismatch) and isinstance(self.target, Mapping) and not self._filling:
            raise InventoryMismatch(f"{exc}; or pass an empty dict, which sync fills with the run's tensors") from exc
        if not isinstance(exc, (ObjectNotFound, ChainBroken)):
            return False
        if not self._relisted:
            if not isinstance(exc, PlanFilesGone) and self.step is not None:
                return False
            log.info("step %d: %s; re-planning from a fresh listing", self.target_step, exc)
            self._relisted = True
            self.reader.relist()
            try:
                self._resolve()
            except ChainBroken as again:  # an asked step that gc collected is not committed any more
                raise unreachable_after_gc(self.target_step, again) from again
            self._tensors, self._plan_made = None, None
            return True
        if not isinstance(exc, (PlanFilesGone, ChainBroken)):
            return False
        if isinstance(exc, PlanFilesGone) and still_committed(self.source.store, exc.steps):
            return False  # the steps are still committed: a file is missing, not collected (an incomplete store)
        raise unreachable_after_gc(self.target_step, exc) from exc

    # ------------------------------------------------------------------ the steps

    def _resolve(self) -> None:
        """The step to reach (the latest when none was asked for); the lease says so."""
        self.target_step = self.source.target_step(self.step)
        if self.lease is not None:
            self.lease.renew(self._held_step(), self.target_step)

    def _find_have(self) -> None:
        """Fill an empty dict, then find the committed step the target provably holds (or None)."""
        self.stats = SyncStats(-1)
        self._t0 = self.stats.clock()
        self._allocate()
        self._live = live_tensors(self.target)
        self._inventory, tensors = self.held.views.of(self._live)
        verify = self.source.verify
        held = self.held.get(self.target)
        have: tuple[int, str] | None = None
        self._versions = held.versions_if_same(self.target, self._live, tensors, checked=True) if held else None
        if self._versions is not None:
            assert held is not None
            have = (held.step, held.digest)
        elif held is not None:
            # another object at a reused id, or tensors changed behind our back: prove it or forget it
            have = self.source.holds(tensors, held.step) if verify else None
            if have is None:
                self.held.forget(self.target)
        if have is None and self.have_step is not None:
            if verify:
                have = self.source.holds(tensors, self.have_step)
            else:
                try:
                    have = (self.have_step, self.reader.committed(self.have_step).digest)
                except ObjectNotFound:
                    have = None
        self._have = self._found = have
        self._before = self.held.get(self.target)
        self._keep = Undo() if self.journal is not None else None
        self._applied = Applied() if self.journal is not None else None
        self._tensors = tensors

    def _allocate(self) -> None:
        """An empty dict target is filled with CPU tensors shaped as the run's inventory (capped)."""
        self._filling = isinstance(self.target, MutableMapping) and len(self.target) == 0
        if not self._filling:
            return
        inventory = self._proven_inventory()
        tensors = allocate(inventory, self.max_alloc_bytes, option="DeltaFetcher(max_alloc_bytes=...)")
        for name, t in tensors.items():
            self.target[name] = t
            self._added.append(name)

    def _proven_inventory(self) -> tuple[TensorInfo, ...]:
        """The target step's inventory, its sizes proven by the files of the plan that fills it, before
        anything is allocated (a manifest's shapes are claims): the plan from nothing walks from an anchor
        with the same inventory (a patch cannot declare tensors its anchor did not hold), every anchor
        entry is exactly its tensor's bytes within its file (checked when the manifest is read), and the
        anchor's files are as big in the store as its manifest says. So a run allocates at most the bytes
        its anchor's objects hold."""
        target = self.reader.manifest(self.target_step)
        plan = self.reader.plan(self.target_step, None)  # ChainBroken: nothing can fill the dict
        anchor = self.reader.manifest(plan.steps[0]) if plan.steps else target
        if anchor.kind != "anchor" or anchor.inventory_digest != target.inventory_digest:
            raise InventoryMismatch(
                f"step {self.target_step} declares an inventory that its anchor (step {anchor.step}) does not hold; "
                "its tensor sizes are not proven, nothing was allocated"
            )
        listed = {o.key: o.size for o in self.source.store.list(step_prefix(anchor.step))}
        for f in anchor.files:
            key = file_key(anchor.step, f.path)
            size = listed.get(key)
            if size is None:
                raise PlanFilesGone(f"step {anchor.step}: file {f.path} is missing from the store", plan.steps)
            if size != f.size:
                raise ChecksumMismatch(
                    f"step {anchor.step}: file {f.path} is {size:,} bytes in the store, its manifest says {f.size:,} "
                    "(a manifest that lies about its sizes, or a replaced file); nothing was allocated"
                )
        return target.inventory

    def _drop_allocated(self) -> None:
        """All or nothing: an empty dict that was filled is empty again."""
        for name in self._added:
            self.target.pop(name, None)
        self._added = []

    def _plan(self) -> None:
        """The plan from what the target holds (pure planner, through the run reader)."""
        plan = self.reader.plan(self.target_step, self._have)
        have = self._have
        self._base = self.reader.committed(have[0]).manifest if plan.base == "current" and have else None
        self.stats.step = self.target_step
        self.stats.base_step = have[0] if self._base is not None and have else None
        self._plan_made = plan

    def _execute(self) -> Committed:
        """Download, check, decode, prove and apply the plan, all or nothing; returns the step reached."""
        plan, tensors, stats = self._plan_made, self._tensors, self.stats
        assert plan is not None and tensors is not None
        if plan.is_noop:
            return self.reader.committed(self.target_step)
        decoded = decode_plan(self.source, plan, self._inventory, self._base, stats)
        verify = self.source.verify
        if decoded.anchor is not None:
            with stats.timing("verify"):
                prove_anchor_plan(tensors, decoded, verify, threads=self.source.threads)
        apply_decoded(
            tensors,
            decoded,
            verify=verify,
            stats=stats,
            keep=self._keep,
            threads=self.source.threads,
            applied=self._applied,
        )
        return self.reader.committed(plan.target_step)

    def _record(self, reached: Committed) -> None:
        """The target holds ``reached`` now: remember it, fill the journal, close the stats."""
        assert self._tensors is not None
        # writes through the tensors' memory bump no version counter: the ones read before them stand
        versions = self._versions if isinstance(self._tensors, TensorViews) and self._tensors.raw_writes() else None
        self.held.record(
            self.target, self.target_step, reached.digest, self._live, self._tensors, checked=True, versions=versions
        )
        if self.journal is not None and self._keep is not None:
            restore = functools.partial(self.held.restore, self.target, self._before, self._live, self._tensors)
            base_step = self._found[0] if self._found else None
            changes = {} if self._applied is None else self._applied.changes(self._tensors, set(self._keep.names))
            self.journal.record(
                self._keep, self._tensors, self.target_step, base_step, self.stats, restore, changes=changes
            )
        self.stats.total_s = self.stats.clock() - self._t0

    # ------------------------------------------------------------------ helpers

    def _held_step(self) -> int | None:
        """The step the lease says the target holds: what this fetcher left in it, still unchanged."""
        live = live_tensors(self.target)
        return self.held.current_step(self.target, live, target_tensors(live))
