"""Tensor helpers of the tests: raw-bit views, bit-exact comparisons, snapshots, the trainer's bf16 view.

torch is imported inside each function, so importing this module costs nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def bits_of(t: Any) -> Any:
    """Flat integer view of a tensor's raw bits (a contiguous copy; works for 0-d and empty tensors)."""
    import torch

    t = t.detach().contiguous().reshape(-1)
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(width)


def bits_equal(a: Any, b: Any) -> bool:
    """True when two tensors have the same dtype and shape and bit-identical contents (NaNs, -0.0 included)."""
    import torch

    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    return bool(torch.equal(bits_of(a), bits_of(b)))


def snapshot(state: Any) -> dict[str, Any]:
    """Independent copies of every tensor of an nn.Module or a dict of tensors."""
    import torch

    tensors = state.state_dict() if isinstance(state, torch.nn.Module) else state
    return {k: v.detach().clone() for k, v in tensors.items()}


def assert_state_equal(got: Any, want: Mapping[str, Any], what: str = "") -> None:
    """Same names, and every tensor bit-identical (dtype and shape included)."""
    import torch

    got_t = got.state_dict() if isinstance(got, torch.nn.Module) else got
    assert sorted(got_t) == sorted(want), f"{what}: names differ"
    bad = [k for k in sorted(want) if not bits_equal(got_t[k], want[k])]
    assert not bad, f"{what}: tensors not bit-identical: {bad[:5]}"


def bf16_view(model: Any) -> dict[str, Any]:
    """What a trainer pushes: the bf16 view of fp32 master weights."""
    import torch

    return {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
