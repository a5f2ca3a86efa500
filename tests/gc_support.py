"""Helpers of the gc tests: deterministic per-step states and a store that runs a hook before a data read."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from deltasync.storage import Store
from deltasync.storage.wrapper import WrapperStore

__all__ = ["HookStore", "bits_equal_state", "make_states", "zeros_like"]


def make_states(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` states of a tiny model; each step changes a few percent of the bf16 elements."""
    import torch

    g = torch.Generator().manual_seed(seed)
    cur = {
        "layer.weight": torch.randn(48, 64, generator=g).to(torch.bfloat16),
        "layer.bias": torch.randn(64, generator=g).to(torch.bfloat16),
        "emb": torch.randn(4000, generator=g).to(torch.bfloat16),
        "count": torch.arange(10, dtype=torch.int32),
    }
    out = [cur]
    for _ in range(1, n):
        cur = {k: v.clone() for k, v in cur.items()}
        for name in ("layer.weight", "emb"):
            flat = cur[name].view(-1)
            idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 40),), generator=g)
            flat[idx] = torch.randn(idx.numel(), generator=g).to(torch.bfloat16)
        cur["count"] += 1
        out.append(cur)
    return out


def zeros_like(state: Mapping[str, Any]) -> dict[str, Any]:
    import torch

    return {k: torch.zeros_like(v) for k, v in state.items()}


def bits_equal_state(got: Mapping[str, Any], want: Mapping[str, Any]) -> bool:
    """Bit-exact equality of two states (same names, dtypes, shapes and bits)."""
    import torch

    if set(got) != set(want):
        return False
    for k, v in want.items():
        a = got[k]
        if a.dtype != v.dtype or a.shape != v.shape:
            return False
        if v.dtype.itemsize == 2:
            a, v = a.view(torch.int16), v.view(torch.int16)
        if not torch.equal(a, v):
            return False
    return True


class HookStore(WrapperStore[Store]):
    """Forwards to ``inner``; ``hook`` runs once, right before the first read of a step's data file."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.hook: Callable[[], None] | None = None
        self._lock = threading.Lock()

    def _before_read(self, keys: Sequence[str]) -> None:
        if any(k.startswith("steps/") and not k.endswith("/manifest.json") for k in keys):
            with self._lock:
                hook, self.hook = self.hook, None
            if hook is not None:
                hook()

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        # docstring inherited
        self._before_read(keys)
        return self.inner.get_many(keys)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        # docstring inherited (a range read is a read too: the base Store read it through get_many)
        self._before_read([key])
        return self.inner.get_range(key, start, end)
