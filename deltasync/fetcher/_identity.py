"""Which state a target holds: proven from the tensors this fetcher wrote, not guessed from ``id()``."""

from __future__ import annotations

import operator
import weakref
from collections.abc import Mapping
from typing import Any

from deltasync.fetcher._target import TargetTensor, TensorViews
from deltasync.fetcher._views import TargetViews

__all__ = ["HeldState", "HeldStates"]


_get_version = operator.attrgetter("_version")


def _version(t: Any) -> int | None:
    try:
        return int(t._version)
    except (AttributeError, RuntimeError):  # inference-mode tensors keep no version counter
        return None


def _versions(objs: list[Any]) -> list[int | None]:
    """Each tensor's version counter (None where it keeps none), in one pass when all keep one."""
    try:
        return list(map(_get_version, objs))
    except (AttributeError, RuntimeError):
        return [_version(t) for t in objs]


class HeldState:
    """What this fetcher left in a target: the step, and how to recognise the same tensors unchanged:
    the names, the tensor objects (weakly: by ``id()`` while none of them was collected), their
    version counters and the keys (memory) of their views, as lists compared in one pass each."""

    __slots__ = ("_dead", "digest", "ids", "keys", "names", "refs", "step", "target", "versions", "views")

    def __init__(
        self,
        step: int,
        digest: str,
        target: weakref.ref[Any] | None,
        names: list[str],
        ids: list[int],
        refs: list[weakref.ref[Any]],
        dead: list[bool],
        versions: list[int | None],
        keys: list[Any],
        views: weakref.ref[Any] | None,
    ) -> None:
        self.step, self.digest, self.target = step, digest, target
        self.names, self.ids, self.refs, self._dead = names, ids, refs, dead
        self.versions, self.keys, self.views = versions, keys, views

    @classmethod
    def record(
        cls,
        step: int,
        digest: str,
        target: Any,
        live: Mapping[str, Any],
        tensors: Mapping[str, TargetTensor],
        *,
        previous: HeldState | None = None,
        checked: bool = False,
        versions: list[int | None] | None = None,
    ) -> HeldState:
        """The state of ``target`` now that it holds committed ``step`` (manifest ``digest``).
        ``previous``: what was recorded of it before, whose weak references are taken over when
        it names the very same tensor objects. ``checked``: ``tensors`` came from
        :meth:`TargetViews.of` of this very ``live`` (then, when they are the views ``previous``
        recorded, its names, ids and keys are these: only the version counters are read again).
        ``versions``: the counters of ``live``'s tensors as :meth:`same` read them before this sync's
        writes, which bumped none (written through their memory: :meth:`TensorViews.raw_writes`);
        taken instead of reading 18k counters again, on a cache the writes have since emptied."""
        try:
            ref: weakref.ref[Any] | None = weakref.ref(target)
        except TypeError:  # a dict: its tensors carry the identity
            ref = None
        objs = list(live.values())
        if checked and previous is not None and not previous._dead[0] and previous._views_are(tensors):
            p = previous
            now = versions if versions is not None and len(versions) == len(objs) else _versions(objs)
            return cls(step, digest, ref, p.names, p.ids, p.refs, p._dead, now, p.keys, p.views)
        names = list(live)
        ids = list(map(id, objs))
        if previous is not None and not previous._dead[0] and previous.ids == ids:
            refs, dead = previous.refs, previous._dead  # the same objects, all alive: the same references
        else:
            dead = [False]

            def died(_ref: Any, dead: list[bool] = dead) -> None:
                dead[0] = True  # an id of the list may be reused from now on

            refs = [weakref.ref(t, died) for t in objs]
        keys = tensors.keys_of(names) if isinstance(tensors, TensorViews) else [tensors[n].key for n in names]
        try:
            views: weakref.ref[Any] | None = weakref.ref(tensors)
        except TypeError:
            views = None
        return cls(step, digest, ref, names, ids, refs, dead, _versions(objs), keys, views)

    def gone(self) -> bool:
        """True once the target (or every tensor it held) was garbage-collected."""
        if self.target is not None:
            return self.target() is None
        return all(r() is None for r in self.refs)

    def _views_are(self, tensors: Mapping[str, TargetTensor]) -> bool:
        return self.views is not None and self.views() is tensors

    def same(
        self, target: Any, live: Mapping[str, Any], tensors: Mapping[str, TargetTensor], *, checked: bool = False
    ) -> bool:
        """True when ``target`` holds the very tensors this fetcher wrote, unmodified since (by torch's
        version counters) and at the same memory. ``checked``: ``tensors`` came from
        :meth:`TargetViews.of` of this very ``live``, which compared the names, tensor objects and
        memory (so, when they are the views recorded, only the version counters are left to compare)."""
        return self.versions_if_same(target, live, tensors, checked=checked) is not None

    def versions_if_same(
        self, target: Any, live: Mapping[str, Any], tensors: Mapping[str, TargetTensor], *, checked: bool = False
    ) -> list[int | None] | None:
        """:meth:`same`, saying yes with the version counters it read (in ``live``'s order), no with None."""
        if self.target is not None and self.target() is not target:
            return None
        if self._dead[0]:  # a tensor recorded was collected: what has its id now is another object
            return None
        objs = list(live.values())
        if not (checked and self._views_are(tensors)):
            if list(live) != self.names or list(map(id, objs)) != self.ids:
                return None
            # the very views recorded (read-only, kept while the same tensors are at the same memory), or
            # views with the same keys
            if not self._views_are(tensors) and not all(
                map(operator.eq, (tensors[n].key for n in self.names), self.keys)
            ):
                return None
        now = _versions(objs)
        if now == self.versions or all(v is None or w == v for v, w in zip(self.versions, now, strict=True)):
            return now
        return None


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
        self,
        target: Any,
        step: int,
        digest: str,
        live: Mapping[str, Any],
        tensors: Mapping[str, TargetTensor],
        *,
        checked: bool = False,
        versions: list[int | None] | None = None,
    ) -> None:
        """``target`` now holds committed ``step`` (manifest ``digest``) in these very tensors
        (``checked``: ``tensors`` are :attr:`views` of ``live``; ``versions``: see :meth:`HeldState.record`)."""
        previous = self._by_id.get(id(target))
        self._by_id[id(target)] = HeldState.record(
            step, digest, target, live, tensors, previous=previous, checked=checked, versions=versions
        )

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
