"""A tiny run for the driver's and sidecar's tests (test support, not deltasync).

:func:`push_tiny_run` commits steps ``0..last`` of a three-tensor bf16 state (an embedding, one
projection, the head: 2-D, so that the audit's default probes come from its inventory), each step
changing a few elements of the projection.
"""

from __future__ import annotations

from typing import Any

NAMES = ("model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "lm_head.weight")


def push_tiny_run(store: Any, last: int, seed: int) -> None:
    """Commit steps ``0..last`` to ``store`` (a :class:`deltasync.storage.Store`)."""
    import torch

    import deltasync as ds

    g = torch.Generator().manual_seed(seed)
    state = {name: torch.randn(64, 8, generator=g).to(torch.bfloat16) for name in NAMES}
    with ds.DeltaUploader(store, anchor_every=100, anchor_bytes_fraction=0) as up:
        for s in range(last + 1):
            state[NAMES[1]][s, :2] += 0.5
            up.push(state, s).result()
