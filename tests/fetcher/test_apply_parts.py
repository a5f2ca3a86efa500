"""A large change is applied in parts on several threads: the same bits, and all or nothing."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from deltasync.errors import ProtocolError
from deltasync.fetcher import _apply
from deltasync.fetcher._apply import Undo, apply_changes
from deltasync.fetcher._fold import Folded
from deltasync.fetcher._target import HostTensor


def _change(name: str, size: int, idx: Any, seed: int) -> Folded:
    rng = np.random.default_rng(seed)
    idx = np.asarray(idx, dtype=np.int64)
    return Folded(name, idx, rng.integers(-(2**15), 2**15, idx.size, dtype=np.int16), None)


@pytest.mark.parametrize("threads", [1, 3])
def test_parts_give_the_same_bits(monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    monkeypatch.setattr(_apply, "APPLY_CHUNK", 5)
    rng = np.random.default_rng(0)
    big = rng.integers(-(2**15), 2**15, 100, dtype=np.int16)
    small = rng.integers(-(2**15), 2**15, 10, dtype=np.int16)
    changes = [_change("big", 100, np.arange(0, 100, 3), 1), _change("small", 10, [1, 4], 2)]
    want = {"big": big.copy(), "small": small.copy()}
    for c in changes:
        want[c.tensor][c.idx] ^= c.values
    tensors = {"big": HostTensor(big), "small": HostTensor(small)}
    undo = Undo()
    apply_changes(tensors, changes, undo, threads=threads)
    assert np.array_equal(big, want["big"]) and np.array_equal(small, want["small"])
    assert undo.names == {"big", "small"}


def test_a_failing_part_rolls_back_every_part(monkeypatch: pytest.MonkeyPatch) -> None:
    """A part whose positions fall outside the tensor fails; the parts written before it are in the
    undo log, so the rollback restores the tensor exactly."""
    monkeypatch.setattr(_apply, "APPLY_CHUNK", 4)
    arr = np.arange(20, dtype=np.int16)
    before = arr.copy()
    bad = _change("t", 20, [0, 2, 4, 6, 8, 10, 12, 14, 16, 25], 3)  # the last part points past the end
    other = _change("u", 5, [0, 1], 4)
    u = np.zeros(5, dtype=np.int16)
    undo = Undo()
    with pytest.raises(ProtocolError, match="positions outside"):
        apply_changes({"t": HostTensor(arr), "u": HostTensor(u)}, [bad, other], undo, threads=2)
    assert not np.array_equal(arr, before)  # the good parts were written...
    undo.rollback()
    assert np.array_equal(arr, before) and not u.any()  # ...and are undone
