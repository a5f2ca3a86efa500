"""Folding consecutive decoded steps into one change per tensor, so each element is written once.

A step's change to a tensor is sorted positions plus, per position, either an XOR
mask (``xor-rank``) or the new bits (``raw``). Composing steps in order, the bits
of a position after all of them are: the newest raw value it received, XORed with
every mask it received after that one; or, when no step wrote it raw, the old
bits XORed with all its masks. Positions whose masks cancel out (net XOR 0) drop
out. The result is exactly the bits the steps give one after the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from deltasync.protocol import DecodedEntry
from deltasync.protocol.encoding import apply_values

__all__ = ["Change", "Folded", "fold_steps", "new_bits"]

Bits = np.ndarray[Any, np.dtype[Any]]


@dataclass(frozen=True, slots=True)
class Folded:
    """Several steps' changes to one tensor: sorted unique positions and, per position, the
    new bits where ``is_raw`` is set, an XOR mask elsewhere (``is_raw`` None: masks only)."""

    tensor: str
    idx: Bits
    values: Bits
    is_raw: Bits | None

    @property
    def coding(self) -> str:
        """``xor-rank`` (masks only), ``raw`` (new bits only) or ``mixed``."""
        if self.is_raw is None:
            return "xor-rank"
        return "raw" if bool(self.is_raw.all()) else "mixed"


#: a change to one tensor: one step's decoded entry or several steps folded
Change = DecodedEntry | Folded


def new_bits(c: Change, old: Bits) -> Bits:
    """The bits at ``c.idx`` after applying ``c`` onto ``old`` (the bits there before)."""
    if isinstance(c, Folded):
        if c.is_raw is None:
            out: Bits = old ^ c.values
            return out
        mixed: Bits = np.where(c.is_raw, c.values, old ^ c.values)
        return mixed
    return apply_values(c.coding, old, c.values)


def _fold_one(tensor: str, parts: Sequence[DecodedEntry]) -> Folded | None:
    """Compose one tensor's changes (oldest first); None when they cancel out entirely."""
    idx = np.concatenate([c.idx for c in parts])
    seq = np.concatenate([np.full(c.idx.size, i, dtype=np.int32) for i, c in enumerate(parts)])
    raw = np.concatenate([np.full(c.idx.size, c.coding == "raw", dtype=bool) for c in parts])
    vals = np.concatenate([c.values for c in parts])
    order = np.lexsort((seq, idx))  # by position, then step order
    idx, raw, vals = idx[order], raw[order], vals[order]
    n = idx.size
    if n == 0:
        return None
    first = np.ones(n, dtype=bool)
    first[1:] = idx[1:] != idx[:-1]
    starts = np.flatnonzero(first)
    ends = np.append(starts[1:], n) - 1
    group = np.cumsum(first) - 1
    at = np.arange(n)
    # index of the newest raw write at or before each element (across groups; checked below)
    last_raw = np.maximum.accumulate(np.where(raw, at, -1))[ends]
    has_raw = last_raw >= starts
    lr = last_raw[group]
    # what counts: that raw write, and every mask after it (all masks where there is none)
    take = (at == lr) | (~raw & (at > lr))
    acc = np.bitwise_xor.reduceat(np.where(take, vals, np.zeros(1, dtype=vals.dtype)), starts)
    keep = has_raw | (acc != 0)  # masks that cancel out leave the element as it was
    if not keep.any():
        return None
    kept_raw = has_raw[keep]
    return Folded(tensor, idx[starts][keep], acc[keep], kept_raw if kept_raw.any() else None)


def fold_steps(steps: Sequence[Sequence[DecodedEntry]]) -> list[Change]:
    """One change per tensor with the effect of ``steps`` (oldest first) applied in order.

    A tensor that only one step changes keeps that step's decoded entry as it is.
    """
    by_tensor: dict[str, list[DecodedEntry]] = {}
    for changes in steps:
        for c in changes:
            by_tensor.setdefault(c.tensor, []).append(c)
    out: list[Change] = []
    for name in sorted(by_tensor):
        parts = by_tensor[name]
        if len(parts) == 1:
            out.append(parts[0])
        elif (f := _fold_one(name, parts)) is not None:
            out.append(f)
    return out
