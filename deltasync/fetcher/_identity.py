"""Which state a target holds: proven from the tensors this fetcher wrote, not guessed from ``id()``."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deltasync._tensors import flat_bits, numpy_bits, require_torch, state_tensors
from deltasync.fetcher._apply import NumpySlot, Slot, TorchSlot

__all__ = ["Held", "live_tensors", "slots_of"]


def slots_of(live: Mapping[str, Any]) -> dict[str, Slot]:
    """A flat-bits slot per tensor: a numpy view on the CPU, the tensor itself on an accelerator."""
    return {
        n: NumpySlot(numpy_bits(t)) if t.device.type == "cpu" else TorchSlot(flat_bits(t, copy_if_needed=False))
        for n, t in live.items()
    }


def live_tensors(target: Any) -> dict[str, Any]:
    """The target's tensors as the objects it holds (Parameters for a module), so identity holds."""
    torch = require_torch()
    if isinstance(target, torch.nn.Module):
        return dict(target.state_dict(keep_vars=True))
    return state_tensors(target)


def _version(t: Any) -> int | None:
    try:
        return int(t._version)
    except (AttributeError, RuntimeError):  # inference-mode tensors keep no version counter
        return None


@dataclass(slots=True)
class Held:
    """What this fetcher left in a target: the step, and how to recognise the same tensors unchanged."""

    step: int
    digest: str
    target: weakref.ref[Any] | None
    tensors: dict[str, tuple[weakref.ref[Any], int | None, Any]]

    @classmethod
    def record(cls, step: int, digest: str, target: Any, live: Mapping[str, Any], slots: Mapping[str, Slot]) -> Held:
        try:
            ref: weakref.ref[Any] | None = weakref.ref(target)
        except TypeError:  # a dict: its tensors carry the identity
            ref = None
        return cls(step, digest, ref, {n: (weakref.ref(t), _version(t), slots[n].key) for n, t in live.items()})

    def gone(self) -> bool:
        """True once the target (or every tensor it held) was garbage-collected."""
        if self.target is not None:
            return self.target() is None
        return all(ref() is None for ref, _, _ in self.tensors.values())

    def same(self, target: Any, live: Mapping[str, Any], slots: Mapping[str, Slot]) -> bool:
        """True when ``target`` holds the very tensors this fetcher wrote, unmodified since (by torch's
        version counters) and at the same memory."""
        if self.target is not None and self.target() is not target:
            return False
        if set(live) != set(self.tensors):
            return False
        for name, t in live.items():
            ref, version, key = self.tensors[name]
            if ref() is not t or key != slots[name].key:
                return False
            if version is not None and _version(t) != version:
                return False
        return True
