"""Deterministic change streams for the kernel tests (the same bytes on every numpy version)."""

from __future__ import annotations

from typing import Any

import numpy as np

Arr = np.ndarray[Any, np.dtype[Any]]


def splitmix(seed: int, n: int) -> Arr:
    """n pseudo-random uint64 words (splitmix64 of a counter)."""
    with np.errstate(over="ignore"):
        z = np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def change_stream(seed: int, numel: int, density: float, width: int) -> tuple[Arr, Arr, Arr]:
    """(sorted int64 positions, old bits, new bits) like an optimizer step: small moves of the low
    bits, now and then a larger one (escapes), clustered and isolated positions alike."""
    mean = max(1, round(1 / density))
    g = splitmix(seed, max(1, int(numel * density * 1.2)) + 1)
    gaps = (g % np.uint64(2 * mean)).astype(np.int64)
    gaps[(g >> np.uint64(60)) < np.uint64(4)] = 0  # a quarter of the changes cluster
    idx = np.cumsum(gaps + 1) - 1
    idx = idx[idx < numel]
    if not idx.size:
        idx = np.array([numel - 1], dtype=np.int64)
    w = splitmix(seed + 1, idx.size)
    bits = np.dtype(f"<i{width}")
    old = (w & np.uint64((1 << (8 * width)) - 1)).astype(f"<u{width}").view(bits)
    small = ((w >> np.uint64(40)) % np.uint64(6)).astype(np.int64) + 1
    big = ((w >> np.uint64(48)) % np.uint64(50) == 0) * ((w >> np.uint64(20)) & np.uint64(0xFFF)).astype(np.int64)
    flip = (small | big).astype(f"<u{width}").view(bits)
    return idx, old, old ^ flip
