"""The page's timeline rows: one committed step, and the per-layer change the follower measured."""

from __future__ import annotations

from typing import Any

from deltasync.protocol import Manifest

__all__ = ["bit_snapshot", "layer_change", "manifest_row"]


def manifest_row(m: Manifest) -> dict[str, Any]:
    """One committed step as the page's timeline row: kind, parent, bytes and density."""
    return {
        "step": m.step,
        "kind": m.kind,
        "parent": m.parent_step,
        "anchor": m.anchor_step,
        "nbytes": m.stats.nbytes,
        "changed": m.stats.changed,
        "total": m.stats.total,
        "full_bytes": sum(t.nbytes for t in m.inventory),
    }


def bit_snapshot(model: Any) -> dict[str, Any]:
    """Copies of a bf16 model's raw bits (int16), to diff against after a sync."""
    import torch

    return {k: v.detach().view(torch.int16).clone() for k, v in model.state_dict().items()}


def layer_change(before: dict[str, Any], model: Any, groups: list[tuple[str, list[str]]]) -> tuple[list[float], int]:
    """Fraction of each group's elements whose bits differ from ``before``, and the changed count."""
    import torch

    after = model.state_dict()
    fractions: list[float] = []
    changed = 0
    for _, names in groups:
        n = sum(int((before[k] != after[k].detach().view(torch.int16)).sum()) for k in names)
        total = sum(before[k].numel() for k in names)
        fractions.append(n / total if total else 0.0)
        changed += n
    return fractions, changed
