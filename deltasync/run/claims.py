"""Writer claims under a run prefix (SPEC.md "Single writer"): claiming an epoch, checking the fence.

Readers get claims through :class:`deltasync.run.RunReader` (cached, listed incrementally)."""

from __future__ import annotations

from deltasync.errors import AlreadyExists, ObjectNotFound, ObjectTooLarge, WriterFenced
from deltasync.protocol import WRITERS_PREFIX, WriterClaim, parse_writer_key, writer_key
from deltasync.protocol.writers import MAX_CLAIM_BYTES
from deltasync.storage.base import Store

__all__ = ["claim_epoch", "is_fenced", "newest_claim", "newest_epoch"]

MAX_CLAIM_TRIES = 8


def newest_epoch(store: Store) -> int:
    """The highest claimed writer epoch (0 for none): one listing, no reads."""
    return max((e for o in store.list(WRITERS_PREFIX) if (e := parse_writer_key(o.key)) is not None), default=0)


def newest_claim(store: Store) -> WriterClaim:
    """The claim of the highest epoch (ObjectNotFound when the run has none)."""
    epoch = newest_epoch(store)
    if not epoch:
        raise ObjectNotFound(f"{store}: no writer claim")
    return WriterClaim.from_json(store.get_bounded(writer_key(epoch), MAX_CLAIM_BYTES))


def claim_epoch(store: Store, writer: str, after_step: int | None) -> int:
    """Claim the next writer epoch for ``writer``; returns it.

    Create-only where the store supports it (exactly one claimant wins an epoch);
    elsewhere write, then read back, and take the next epoch if another writer's
    claim is what came back.
    """
    for _ in range(MAX_CLAIM_TRIES):
        epoch = newest_epoch(store) + 1
        body = WriterClaim(epoch, writer, after_step).to_json()
        try:
            store.put(writer_key(epoch), body, mode="create")
        except AlreadyExists:
            continue
        try:  # no create-only writes: read back whose claim is there (a longer one is not ours)
            ours = store.supports_conditional_put or store.get_bounded(writer_key(epoch), len(body)) == body
        except ObjectTooLarge:
            ours = False
        if ours:
            return epoch
    raise WriterFenced(
        f"{store.url}: could not claim a writer epoch after {MAX_CLAIM_TRIES} tries: "
        "other uploaders keep claiming this run prefix; run one uploader per prefix"
    )


def is_fenced(store: Store, epoch: int) -> bool:
    """True once a newer writer has claimed the epoch after ``epoch``."""
    return store.exists(writer_key(epoch + 1))
