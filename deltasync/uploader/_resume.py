"""Restarting an uploader on an existing run: prove what the trainer holds, or say what to do.

A restarted trainer holds the state of its last checkpoint. If that is the
store's newest step (proven by tensor digests), the chain goes on with patches;
otherwise the next push is an anchor. A checkpoint older than the store's head
cannot be continued: committed steps are never rewritten.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deltasync._tensors import flat_bits
from deltasync.errors import ChecksumMismatch, InventoryMismatch
from deltasync.protocol import Manifest
from deltasync.protocol.digests import xxh3_128_array
from deltasync.storage import RunReader, Store
from deltasync.uploader._diff import inventory_of

if TYPE_CHECKING:
    import torch

__all__ = ["prove_state", "pushes_since_anchor", "store_ahead_message"]


def prove_state(m: Manifest, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Flat-bit copies of ``tensors`` once they are proven equal to committed step ``m``.

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
    for name, dig in m.tensor_digests.items():
        if xxh3_128_array(base[name].cpu().numpy()) != dig:
            raise ChecksumMismatch(f"tensor {name!r} differs from committed step {m.step}")
    return base


def pushes_since_anchor(reader: RunReader, m: Manifest, limit: int) -> int:
    """Patches between committed step ``m`` and its anchor (counted up to ``limit``)."""
    chain = reader.chain(m.step)  # the manifests down to the anchor, in batches
    n, cur = 0, m
    while cur.kind == "patch" and cur.parent_step is not None and n < limit:
        n += 1
        parent = chain.get(cur.parent_step)
        if parent is None:
            break
        cur = parent.manifest
    return n


def store_ahead_message(store: Store, step: int, head: int) -> str:
    """What a restarted trainer whose checkpoint is older than the store's head should do."""
    return (
        f"step {step} is not after step {head}, the newest committed step in {store.url}: the store is ahead of "
        f"this trainer (it restarted from a checkpoint older than what it pushed before). Committed steps are "
        f"never rewritten: push only steps after {head} (the first one becomes an anchor), or push to a new run "
        "prefix to keep every re-trained step"
    )
