"""Folding consecutive decoded steps into one change per tensor, so each element is written once.

A step's change to a tensor is sorted positions plus, per position, either an XOR
mask (``xor-rank``) or the new bits (``raw``). Composing steps in order, the bits
of a position after all of them are: the newest raw value it received, XORed with
every mask it received after that one; or, when no step wrote it raw, the old
bits XORed with all its masks. Positions whose masks cancel out (net XOR 0) drop
out. The result is exactly the bits the steps give one after the other.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from deltasync.protocol import DecodedEntry
from deltasync.protocol.encoding import apply_values
from deltasync.protocol.patchfile import DecodedGroup

__all__ = ["Change", "Folded", "StepChange", "fold_steps", "new_bits", "per_tensor", "touched"]

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
#: what a decoded step holds: changes to one tensor, and format 2's groups kept whole (split by
#: :func:`per_tensor` where one change per tensor is needed)
StepChange = DecodedEntry | DecodedGroup | Folded


def per_tensor(changes: Sequence[StepChange]) -> list[Change]:
    """``changes`` as one change per tensor: each group split into its members' shares."""
    out: list[Change] = []
    for c in changes:
        if isinstance(c, DecodedGroup):
            out.extend(c.split())
        else:
            out.append(c)
    return out


def touched(changes: Sequence[StepChange]) -> Iterator[str]:
    """The names of the tensors ``changes`` carry a change to (a group's every member), chained in C
    (no Python frame per name: a step of 18k tensors)."""
    return itertools.chain.from_iterable([c.members if isinstance(c, DecodedGroup) else (c.tensor,) for c in changes])


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
    """Compose one tensor's changes (oldest first); None when they cancel out entirely.

    Scratch arrays as long as the highest position touched (bounded by the tensor's numel,
    which decoding checked): each step is one scatter, no sort. A raw write sets the bits,
    a later mask XORs onto them, so the scratch ends holding the new bits where a raw write
    happened and the net mask elsewhere.
    """
    n = max(int(c.idx[-1]) + 1 for c in parts if c.idx.size) if any(c.idx.size for c in parts) else 0
    if n == 0:
        return None
    acc = np.zeros(n, dtype=parts[0].values.dtype)
    raw = np.zeros(n, dtype=bool)
    touched = np.zeros(n, dtype=bool)
    for c in parts:
        if c.coding == "raw":
            acc[c.idx] = c.values
            raw[c.idx] = True
        else:
            acc[c.idx] ^= c.values  # positions are unique within one step
        touched[c.idx] = True
    idx = np.flatnonzero(touched)
    vals, is_raw = acc[idx], raw[idx]
    keep = is_raw | (vals != 0)  # masks that cancel out leave the element as it was
    if not keep.all():
        idx, vals, is_raw = idx[keep], vals[keep], is_raw[keep]
    if not idx.size:
        return None
    return Folded(tensor, idx.astype(np.int64, copy=False), vals, is_raw if is_raw.any() else None)


def fold_steps(steps: Sequence[Sequence[DecodedEntry | DecodedGroup]]) -> list[Change]:
    """One change per tensor with the effect of ``steps`` (oldest first) applied in order (groups
    split per member).

    A tensor that only one step changes keeps that step's decoded entry as it is.
    """
    by_tensor: dict[str, list[DecodedEntry]] = {}
    for changes in steps:
        for c in changes:
            for d in c.split() if isinstance(c, DecodedGroup) else (c,):
                by_tensor.setdefault(d.tensor, []).append(d)
    out: list[Change] = []
    for name in sorted(by_tensor):
        parts = by_tensor[name]
        if len(parts) == 1:
            out.append(parts[0])
        elif (f := _fold_one(name, parts)) is not None:
            out.append(f)
    return out
