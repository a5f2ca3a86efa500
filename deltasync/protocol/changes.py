"""What a step changed in one tensor: :class:`TensorChange`, the one form that crosses packages.

The fetcher decodes a patch into coded changes (XOR masks or new bits at positions, folded across
steps: ``fetcher/_fold.py``), applies them, and reports what it applied as one :class:`TensorChange`
per tensor (:attr:`deltasync.fetcher.SyncJournal.changes`); the node mirror's build writes those
positions into a version's positions files (``serving/node/_build.py``), a version reads them back
as the same type (:meth:`deltasync.serving.node.versions.Version.changes`) and the engine's scatter
consumes it (``serving/engine/scatter.py``). Nothing downstream recomputes the positions by
comparing tensors. Pure data: no I/O, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["TensorChange", "union_positions"]

Ints = np.ndarray[Any, np.dtype[Any]]


@dataclass(frozen=True, slots=True)
class TensorChange:
    """What a step (or several, folded) changed in one tensor.

    ``tensor``: its name. ``positions``: the flat (row-major) positions written, sorted and unique
    (int64, or int32 where a reader kept them compact); every element whose bits changed is among
    them (a position may also be written with the bits it had, e.g. two raw writes that return an
    element to its old bits); None: the whole tensor was written and which elements changed is not
    known (a whole-tensor load, such as an anchor). ``values``: the new bits at ``positions``
    (unsigned or signed ints of the tensor dtype's width), when the producer has them; None: read them
    from the tensor, which holds them after the change.
    """

    tensor: str
    positions: Ints | None = None
    values: Ints | None = None

    @property
    def whole(self) -> bool:
        """Whether the whole tensor was written (its changed positions are not known)."""
        return self.positions is None

    @property
    def count(self) -> int | None:
        """Positions written (None: the whole tensor)."""
        return None if self.positions is None else int(self.positions.size)


def union_positions(parts: Iterable[Ints]) -> Ints:
    """Sorted unique int64 positions of several sorted position arrays (one step's are returned as they are)."""
    arrays = [p for p in parts]
    if not arrays:
        return np.empty(0, dtype=np.int64)
    if len(arrays) == 1:
        return arrays[0].astype(np.int64, copy=False)
    out: Ints = np.unique(np.concatenate([a.astype(np.int64, copy=False) for a in arrays]))
    return out
