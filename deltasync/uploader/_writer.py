"""Who writes a run: the uploader's run id, writer id and claimed epoch (single writer per prefix).

The first push (or resume) claims the next writer epoch of the run prefix; from then on an
older uploader of the run is fenced off. An uploader that never pushes leaves no claim.
:class:`WriterIdentity` owns these three values and the fence check made before each manifest.
"""

from __future__ import annotations

import logging
import uuid

from deltasync.errors import WriterFenced
from deltasync.protocol import Writer
from deltasync.run import RunReader
from deltasync.run.claims import claim_epoch, is_fenced, newest_claim
from deltasync.storage import Store
from deltasync.uploader._chain import ChainState

__all__ = ["WriterIdentity"]

log = logging.getLogger("deltasync.uploader")


class WriterIdentity:
    """The run id this uploader writes, its writer id, and its epoch (0 until claimed)."""

    def __init__(self, store: Store, run_id: str | None, committed_run_id: str | None) -> None:
        self.store = store
        #: the run id written into manifests (the store's, when it holds a run already)
        self.run_id = run_id or committed_run_id or uuid.uuid4().hex[:16]
        #: this uploader's writer id (in its claim and every manifest)
        self.writer_id = uuid.uuid4().hex[:16]
        #: the claimed writer epoch; 0 until the first push or resume
        self.epoch = 0

    @property
    def writer(self) -> Writer:
        """The writer record of this uploader's manifests."""
        return Writer(self.writer_id, self.epoch)

    def adopt(self, run_id: str, writer_id: str, epoch: int) -> None:
        """Write as another rank's identity (every rank of a sharded push writes as rank 0)."""
        self.run_id, self.writer_id, self.epoch = run_id, writer_id, epoch

    def claim(self, reader: RunReader, chain: ChainState) -> None:
        """Claim the next writer epoch (once): from now on an older uploader of this run is fenced off.

        A step that such an uploader committed between our read of the head and our claim
        is superseded (readers skip it) but its number is taken: the next push must come
        after it (``chain`` is told).
        """
        if self.epoch:
            return
        head = chain.last_step
        self.epoch = claim_epoch(self.store, self.writer_id, head)
        taken = [s for s in reader.refresh() if head is None or s > head]
        if taken:
            log.warning(
                "steps %s were committed by a previous uploader of %s after step %s and are now superseded; "
                "pushes must come after step %d",
                taken,
                self.store.url,
                head,
                max(taken),
            )
            chain.skip_to(max(taken))

    def claim_after(self, after_step: int | None) -> None:
        """Claim the next epoch now, recording ``after_step`` (rank 0 of a sharded push)."""
        self.epoch = claim_epoch(self.store, self.writer_id, after_step)

    def check_fence(self) -> None:
        """Raise WriterFenced once a newer uploader has claimed the run prefix."""
        if is_fenced(self.store, self.epoch):
            newer = newest_claim(self.store)
            raise WriterFenced(
                f"another uploader (writer {newer.writer}, epoch {newer.epoch}) took over run prefix "
                f"{self.store.url} after step {newer.after_step}; this uploader (epoch {self.epoch}) stops committing. "
                "Run one uploader per run prefix."
            )
