"""Which state a target holds: proven from the tensors this fetcher wrote, not guessed from ``id()``."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deltasync.fetcher._target import TargetTensor, TargetViews

__all__ = ["HeldState", "HeldStates"]


def _version(t: Any) -> int | None:
    try:
        return int(t._version)
    except (AttributeError, RuntimeError):  # inference-mode tensors keep no version counter
        return None


@dataclass(slots=True)
class HeldState:
    """What this fetcher left in a target: the step, and how to recognise the same tensors unchanged."""

    step: int
    digest: str
    target: weakref.ref[Any] | None
    tensors: dict[str, tuple[weakref.ref[Any], int | None, Any]]

    @classmethod
    def record(
        cls, step: int, digest: str, target: Any, live: Mapping[str, Any], tensors: Mapping[str, TargetTensor]
    ) -> HeldState:
        """The state of ``target`` now that it holds committed ``step`` (manifest ``digest``)."""
        try:
            ref: weakref.ref[Any] | None = weakref.ref(target)
        except TypeError:  # a dict: its tensors carry the identity
            ref = None
        return cls(step, digest, ref, {n: (weakref.ref(t), _version(t), tensors[n].key) for n, t in live.items()})

    def gone(self) -> bool:
        """True once the target (or every tensor it held) was garbage-collected."""
        if self.target is not None:
            return self.target() is None
        return all(ref() is None for ref, _, _ in self.tensors.values())

    def same(self, target: Any, live: Mapping[str, Any], tensors: Mapping[str, TargetTensor]) -> bool:
        """True when ``target`` holds the very tensors this fetcher wrote, unmodified since (by torch's
        version counters) and at the same memory."""
        if self.target is not None and self.target() is not target:
            return False
        if set(live) != set(self.tensors):
            return False
        for name, t in live.items():
            ref, version, key = self.tensors[name]
            if ref() is not t or key != tensors[name].key:
                return False
            if version is not None and _version(t) != version:
                return False
        return True


class HeldStates:
    """One fetcher's record of what it left in each target (by ``id()``, checked by :meth:`HeldState.same`)."""

    def __init__(self) -> None:
        self._by_id: dict[int, HeldState] = {}
        #: the views of the last target synced (kept while its tensors are the same objects)
        self.views = TargetViews()

    def get(self, target: Any) -> HeldState | None:
        """What this fetcher last left in ``target`` (or in an object since collected that had its ``id``)."""
        for key in [k for k, h in self._by_id.items() if h.gone()]:
            del self._by_id[key]  # targets that were collected
        return self._by_id.get(id(target))

    def record(
        self, target: Any, step: int, digest: str, live: Mapping[str, Any], tensors: Mapping[str, TargetTensor]
    ) -> None:
        """``target`` now holds committed ``step`` (manifest ``digest``) in these very tensors."""
        self._by_id[id(target)] = HeldState.record(step, digest, target, live, tensors)

    def forget(self, target: Any) -> None:
        """Nothing is known any more of what ``target`` holds."""
        self._by_id.pop(id(target), None)

    def restore(
        self, target: Any, before: HeldState | None, live: Mapping[str, Any], tensors: Mapping[str, TargetTensor]
    ) -> None:
        """After a rollback: ``target`` holds ``before``'s step again (re-recorded, since the writes may
        have bumped version counters), or nothing this fetcher knows of."""
        if before is None:
            self.forget(target)
        else:
            self.record(target, before.step, before.digest, live, tensors)

    def current_step(self, target: Any, live: Mapping[str, Any], tensors: Mapping[str, TargetTensor]) -> int | None:
        """The step this fetcher last left in ``target``, if it still holds those tensors unchanged."""
        held = self._by_id.get(id(target))
        return held.step if held is not None and held.same(target, live, tensors) else None
