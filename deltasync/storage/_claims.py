"""Writer claims under a run prefix (SPEC.md "Single writer"): reading them and claiming an epoch."""

from __future__ import annotations

from deltasync.errors import AlreadyExists, ObjectNotFound, WriterFenced
from deltasync.protocol import WRITERS_PREFIX, WriterClaim, parse_writer_key, writer_key
from deltasync.storage.base import Store

__all__ = ["claim_epoch", "is_fenced", "read_claims"]

MAX_CLAIM_TRIES = 8


def read_claims(store: Store) -> list[WriterClaim]:
    """Every writer claim of the run, newest epoch first."""
    keys = sorted((e, o.key) for o in store.list(WRITERS_PREFIX) if (e := parse_writer_key(o.key)) is not None)
    out: list[WriterClaim] = []
    for epoch, key in reversed(keys):
        try:
            claim = WriterClaim.from_json(store.get(key))
        except ObjectNotFound:
            continue
        if claim.epoch == epoch:
            out.append(claim)
    return out


def claim_epoch(store: Store, writer: str, after_step: int | None) -> int:
    """Claim the next writer epoch for ``writer``; returns it.

    Create-only where the store supports it (exactly one claimant wins an epoch);
    elsewhere write, then read back, and take the next epoch if another writer's
    claim is what came back.
    """
    for _ in range(MAX_CLAIM_TRIES):
        claims = read_claims(store)
        epoch = (claims[0].epoch if claims else 0) + 1
        body = WriterClaim(epoch, writer, after_step).to_json()
        try:
            store.put(writer_key(epoch), body, mode="create")
        except AlreadyExists:
            continue
        if store.supports_conditional_put or store.get(writer_key(epoch)) == body:
            return epoch
    raise WriterFenced(
        f"{store}: could not claim a writer epoch after {MAX_CLAIM_TRIES} tries: "
        "other uploaders keep claiming this run prefix; run one uploader per prefix"
    )


def is_fenced(store: Store, epoch: int) -> bool:
    """True once a newer writer has claimed the epoch after ``epoch``."""
    return store.exists(writer_key(epoch + 1))
