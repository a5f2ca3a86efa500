"""Restarting an uploader on an existing run: prove what the trainer holds, or say what to do.

A restarted trainer holds the state of its last checkpoint. If that is the
store's newest step (proven by tensor digests), the chain goes on with patches;
otherwise the next push is an anchor. A checkpoint older than the store's head
cannot be continued: committed steps are never rewritten.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from deltasync._util.tensors import digest_tensors, flat_bits, state_tensors
from deltasync.errors import ChainBroken, ChecksumMismatch, InventoryMismatch, ProtocolError
from deltasync.protocol import Committed, Manifest, walk_chain
from deltasync.protocol.keys import STEPS_PREFIX, file_key, step_prefix
from deltasync.run import RunReader
from deltasync.storage import Store
from deltasync.uploader._chain import ChainState
from deltasync.uploader._config import CommitInfo
from deltasync.uploader._diff import inventory_of
from deltasync.uploader._snapshot import Snapshotter
from deltasync.uploader._spans import SpanWriter
from deltasync.uploader._writer import WriterIdentity

if TYPE_CHECKING:
    import torch

__all__ = ["Resumer", "prove_state", "pushes_since_anchor", "store_ahead_message"]

log = logging.getLogger("deltasync.uploader")


def prove_state(m: Manifest, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Flat-bit copies of ``tensors`` once they are proven equal to committed step ``m`` (its digests,
    in its format, hashed on every usable CPU).

    Raises InventoryMismatch (other tensor names, dtypes or shapes) or
    ChecksumMismatch (a tensor differs, or the step records no digest for it:
    what cannot be proven is not assumed).
    """
    if inventory_of(tensors) != m.inventory:
        raise InventoryMismatch(f"the given state does not match step {m.step}'s tensor inventory")
    missing = [t.name for t in m.inventory if t.name not in m.tensor_digests]
    if missing:
        raise ChecksumMismatch(
            f"step {m.step} records no digest for {len(missing)} tensors (e.g. {missing[0]!r}; written with "
            "tensor_digests=False): the state cannot be proven equal to it"
        )
    base = {k: flat_bits(v).clone() for k, v in tensors.items()}
    got = digest_tensors({n: base[n] for n in m.tensor_digests}, m.format_version)
    for name, dig in m.tensor_digests.items():
        if got[name] != dig:
            raise ChecksumMismatch(f"tensor {name!r} differs from committed step {m.step}")
    return base


def pushes_since_anchor(reader: RunReader, m: Manifest, limit: int) -> int:
    """Patches between committed step ``m`` and its anchor (counted up to ``limit``).

    Raises ChainBroken when a reader could not rebuild ``m``: a step on its walk down to
    the anchor is not committed, or a data file of one is missing from the store (one
    listing); a manifest on the walk that does not parse raises its ProtocolError.
    """
    chain = reader.chain(m.step)  # the manifests down to the anchor, in batches
    walk = walk_chain(chain, m.step, check_links=False)
    if not walk.complete:
        raise ChainBroken(f"step {m.step} cannot be rebuilt from {reader.store.url}: {walk.reason}")
    n = walk.patches
    cur = chain[walk.steps[-1]].manifest
    listed = {o.key for o in reader.store.list_after(STEPS_PREFIX, f"{step_prefix(cur.step)[:-1]}")}
    for c in chain.values():
        gone = [f.path for f in c.manifest.files if file_key(c.manifest.step, f.path) not in listed]
        if gone:
            raise ChainBroken(
                f"step {m.step} cannot be rebuilt from {reader.store.url}: file {gone[0]} of step "
                f"{c.manifest.step} is missing"
            )
    return min(n, limit)


def store_ahead_message(store: Store, step: int, head: int) -> str:
    """What a restarted trainer whose checkpoint is older than the store's head should do."""
    return (
        f"step {step} is not after step {head}, the newest committed step in {store.url}: the store is ahead of "
        f"this trainer (it restarted from a checkpoint older than what it pushed before). Committed steps are "
        f"never rewritten: push only steps after {head} (the first one becomes an anchor), or push to a new run "
        "prefix to keep every re-trained step"
    )


# ------------------------------------------------------------------ the uploader's resume


class Resumer:
    """:meth:`DeltaUploader.resume` and a restarted trainer's re-push of the store's head.

    Works on the uploader's parts through their methods: the chain state, the snapshotter
    (the proven state becomes its baseline), the writer identity (resuming claims the
    epoch) and the span writer (spans continue from the resumed step).
    """

    def __init__(
        self,
        store: Store,
        reader: RunReader,
        *,
        anchor_every: int,
        chain: ChainState,
        snapshots: Snapshotter,
        writer: WriterIdentity,
        spans: SpanWriter | None,
    ) -> None:
        self.store = store
        self.reader = reader
        self.anchor_every = anchor_every
        self.chain = chain
        self.snapshots = snapshots
        self.writer = writer
        self.spans = spans

    def resume(self, state: Any, step: int, *, strict: bool = False) -> bool:
        """:meth:`DeltaUploader.resume` (see there) of a single-process uploader."""
        chain = self.chain
        if chain.inflight or self.snapshots.last_job is not None:
            raise RuntimeError("resume() must be called before the first push")
        chain.load_head(self.reader)
        last = chain.last_committed
        head = last.manifest.step if last else None
        if head is not None and step < head:
            raise ProtocolError(f"resume: {store_ahead_message(self.store, step, head)}")
        chain.mark_resumed()
        try:
            if head is None or step > head:
                raise ProtocolError(f"step {step} is not committed in {self.store.url} (newest committed step: {head})")
            self.adopt(state, step)
        except (ProtocolError, InventoryMismatch, ChecksumMismatch, ChainBroken) as exc:
            if strict:
                raise
            chain.require_anchor()
            log.warning("resume from step %d: %s; the next push will be an anchor", step, exc)
            self.writer.claim(self.reader, chain)
            return False
        self.writer.claim(self.reader, chain)
        return True

    def adopt(self, state: Any, step: int) -> Committed:
        """Make committed ``step`` the baseline once ``state`` is proven equal to it (raises otherwise)."""
        committed = self.reader.committed(step)
        m = committed.manifest
        base = prove_state(m, self.snapshots.cast(state_tensors(state)))
        pushes = pushes_since_anchor(self.reader, m, self.anchor_every)
        self.snapshots.adopt(base, m.inventory, m.tensor_digests, m.format_version)
        self.chain.adopt(committed, pushes)
        if self.spans is not None:
            self.spans.submit(committed, None)  # spans continue from the resumed step
        return committed

    def push_committed_head(self, state: Any, step: int) -> Future[CommitInfo]:
        """A new uploader's first push of a step the store already holds (a restarted trainer
        re-pushing its checkpoint): prove and adopt the store's newest step, write nothing."""
        head = self.chain.last_step
        assert head is not None and self.chain.last_committed is not None
        if step != head:
            raise ProtocolError(store_ahead_message(self.store, step, head))
        try:
            committed = self.adopt(state, step)
        except (InventoryMismatch, ChecksumMismatch) as exc:
            raise ProtocolError(
                f"step {step} is already committed in {self.store.url} and the pushed state differs from it "
                f"({exc}). Committed steps are never rewritten: push the next step (it becomes an anchor), "
                "or push to a new run prefix"
            ) from exc
        self.chain.mark_resumed()
        self.writer.claim(self.reader, self.chain)
        m = committed.manifest
        fut: Future[CommitInfo] = Future()
        fut.set_running_or_notify_cancel()
        total = sum(t.numel for t in m.inventory)
        fut.set_result(CommitInfo(step, "skipped", 0, 0, total, m.anchor_step, committed.digest, step, 0.0))
        return fut
