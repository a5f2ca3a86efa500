"""The run a fetcher reads, and how it checks what it reads: :class:`Source`, shared by sync and materialize."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from deltasync.errors import ChainBroken, ChecksumMismatch, ObjectNotFound, ProtocolError
from deltasync.fetcher._target import TargetTensor, target_digests
from deltasync.protocol import FetchPlan
from deltasync.run import RunReader
from deltasync.storage import Store

__all__ = ["DATA_ERRORS", "Source", "Verify"]

log = logging.getLogger("deltasync.fetcher")

#: errors of a plan's data (files, manifests, proofs): see :meth:`Source.drop_failed_spans`
DATA_ERRORS = (ChecksumMismatch, ProtocolError, ObjectNotFound)

#: ``False``: sizes only; ``True``: file checksums, and every tensor a step changes proven by its
#: digest; ``"full"``: also every tensor of the target proven after each sync.
Verify = bool | Literal["full"]


@dataclass(frozen=True, slots=True)
class Source:
    """A run and the fetcher's settings for reading it (see :class:`~deltasync.DeltaFetcher`),
    taken when a sync or materialize starts."""

    store: Store
    reader: RunReader
    verify: Verify
    fold: bool
    threads: int
    progress: Callable[[int, int], None] | None = None

    def target_step(self, step: int | None) -> int:
        """``step`` (ChainBroken when it is not committed), or the latest committed step;
        ChainBroken (RunNotFound) when there is none."""
        if step is not None:
            self.reader.require_step(step)
            return step
        latest = self.reader.latest_step()
        if latest is None:
            if not self.reader.exists():
                self.reader.require()
            raise ChainBroken(f"{self.store.url} has no committed steps yet")
        return latest

    def holds(self, tensors: Mapping[str, TargetTensor], step: int) -> tuple[int, str] | None:
        """(step, manifest digest) when every tensor provably equals committed ``step`` (by its
        tensor digests), else None."""
        try:
            c = self.reader.committed(step)
        except ObjectNotFound:
            return None  # not (or no longer) committed: start from an anchor
        digests = c.manifest.tensor_digests
        if set(digests) != set(tensors):
            return None
        if target_digests(tensors, digests, c.manifest.format_version, threads=self.threads) != digests:
            return None
        return step, c.digest

    def drop_failed_spans(self, plan: FetchPlan, exc: BaseException) -> bool:
        """After executing ``plan`` failed with ``exc`` (one of :data:`DATA_ERRORS`): drop the cached
        manifests of the plan when bytes were bad (read corrupted, or since repaired); True when the
        plan went through spans, which are then never used again, so it can be made again without them."""
        if not isinstance(exc, ObjectNotFound):
            self.reader.forget(plan.steps)
        if not plan.spans:
            return False
        log.warning("step %d: spans %s failed (%s); going on without them", plan.target_step, plan.spans, exc)
        self.reader.distrust_spans(plan.spans)
        return True
