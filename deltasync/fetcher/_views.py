"""The identity cache of a sync's target: :class:`TargetViews` keeps each live tensor's
:class:`TargetTensor` and inventory entry from one sync to the next while the very same tensor
objects sit at the same memory with the same layouts, checked by a few C-level passes."""

from __future__ import annotations

import operator
import weakref
from collections.abc import Mapping
from typing import Any, cast

from deltasync._util.tensors import accessors, st_dtype
from deltasync.fetcher._target import TargetTensor, TensorViews, _view
from deltasync.protocol import TensorInfo

__all__ = ["GUARD_FROM", "TargetViews"]


def _accessors() -> tuple[Any, Any, Any, Any]:
    """(data_ptr, stride, shape, dtype) getters of torch tensors, as one C-level pass each maps them
    (by name where torch cannot be imported: tensor-like objects)."""
    try:
        a = accessors()
    except ImportError:
        return (
            operator.methodcaller("data_ptr"),
            operator.methodcaller("stride"),
            operator.attrgetter("shape"),
            operator.attrgetter("dtype"),
        )
    return a.data_ptr, a.stride, a.shape, a.dtype


def _layout_guard(objs: list[Any], shapes: list[Any], strides: list[Any]) -> Any:
    """A compiled check that each of ``objs`` still has its dtype, shape and strides (and Python
    type, device, requires_grad and dispatch keys: anything else only fails the check, which the
    caller answers with the full one), in one C++ pass over all of them: torch's own tensor guards,
    which torch.compile uses to reuse a graph. None where this torch has none, or where the check
    does not pass on the very tensors it was made from."""
    try:
        from torch._C._dynamo import guards

        guard = cast(Any, guards).TensorGuards(
            *objs,
            dynamic_dims_sizes=list(map(list, shapes)),  # torch.Size and stride tuples hold ints
            dynamic_dims_strides=list(map(list, strides)),
        )
        if guard.check(*objs) is True:
            return guard
    except Exception:  # noqa: BLE001 - a private API: anything off means the plain compares
        pass
    return None


class _Seen:
    """What :class:`TargetViews` last saw of a target, as lists compared in one pass each: the names,
    the tensor objects (by ``id()``, valid while they all live: the views forget everything once one
    is collected), their data addresses, strides, shapes and dtypes (or, where torch has them, its
    compiled guard of the dtypes, shapes and strides: :func:`_layout_guard`)."""

    __slots__ = ("dtypes", "guard", "guarded", "ids", "names", "out", "ptrs", "shapes", "strides")

    def __init__(
        self,
        names: list[str],
        ids: list[int],
        ptrs: list[int],
        strides: list[Any],
        shapes: list[Any],
        dtypes: list[Any],
        out: TensorViews,
    ) -> None:
        self.names, self.ids, self.ptrs, self.out = names, ids, ptrs, out
        self.strides, self.shapes, self.dtypes = strides, shapes, dtypes
        self.guard: Any = None
        self.guarded = False  # a guard was tried

    def same_layouts(self, objs: list[Any], get_stride: Any, get_shape: Any, get_dtype: Any) -> bool:
        """Whether ``objs`` (the same tensor objects at the same addresses) still have the dtypes,
        strides and shapes seen."""
        if self.guard is not None:
            return bool(self.guard.check(*objs))
        return (
            list(map(get_dtype, objs)) == self.dtypes
            # compared as they are read: a list of 18k tuples kept for a compare sets off the
            # garbage collector's full passes over a big heap (100+ ms), a stream keeps nothing
            and all(map(operator.eq, map(get_stride, objs), self.strides))
            and all(map(operator.eq, map(get_shape, objs), self.shapes))
        )


#: targets of at least this many tensors have their layouts checked by :func:`_layout_guard` (from
#: the third sync of the same tensors on: the second finds them by the plain compares and builds it)
GUARD_FROM = 64


class TargetViews:
    """The :class:`TargetTensor` and inventory entry of each live tensor, kept from one sync to the
    next while a name still holds the very same tensor object at the same memory with the same
    dtype and shape (a model synced step after step builds its 18k views once, not every step).
    Only identity and layout are remembered, never what the tensors hold; once any remembered
    tensor is collected, everything is forgotten (the views must not keep a dropped model's memory).
    When nothing changed, the check is a few C-level passes over lists and the very same
    :class:`TensorViews` object is returned (with what was derived from it)."""

    def __init__(self) -> None:
        cache: dict[str, tuple[weakref.ref[Any], int, Any, Any, TargetTensor, TensorInfo]] = {}
        seen: list[_Seen] = []
        self._cache = cache
        self._seen = seen

        def forget(_ref: Any) -> None:  # holds the containers, not self
            cache.clear()
            seen.clear()

        self._forget = forget
        self._inventory: tuple[TensorInfo, ...] = ()

    def of(self, live: Mapping[str, Any]) -> tuple[tuple[TensorInfo, ...], TensorViews]:
        """(inventory sorted by name, a TargetTensor per name) of ``live``."""
        names = list(live)
        objs = list(live.values())
        get_ptr, get_stride, get_shape, get_dtype = _accessors()
        for last in self._seen:
            if (
                len(self._cache) == len(names)
                and names == last.names
                and list(map(id, objs)) == last.ids
                and list(map(get_ptr, objs)) == last.ptrs
                and last.same_layouts(objs, get_stride, get_shape, get_dtype)
            ):
                if last.guard is None and not last.guarded and len(objs) >= GUARD_FROM:
                    # seen twice: a target synced step after step; its guard pays from the next sync on
                    # (a target seen once, as a node build's, never builds one)
                    last.guarded = True
                    last.guard = _layout_guard(objs, last.shapes, last.strides)
                return self._inventory, last.out
        self._seen.clear()
        cache = self._cache
        same = len(cache) == len(live)
        out: dict[str, TargetTensor] = {}
        ptrs: list[int] = []
        strides: list[Any] = []
        shapes: list[Any] = []
        dtypes: list[Any] = []
        for name, t in live.items():
            hit = cache.get(name)
            ptr, layout, dtype = t.data_ptr(), (t.shape, t.stride()), t.dtype  # an in-place t_() keeps the shape
            if hit is None or hit[0]() is not t or hit[1] != ptr or hit[2] != layout or hit[3] != dtype:
                same = False
                info = TensorInfo(name, st_dtype(dtype), tuple(layout[0]))
                hit = cache[name] = (weakref.ref(t, self._forget), ptr, layout, dtype, _view(t), info)
            out[name] = hit[4]
            ptrs.append(ptr)
            strides.append(layout[1])
            shapes.append(layout[0])
            dtypes.append(dtype)
        if not same:
            for name in [n for n in cache if n not in live]:
                del cache[name]
            self._inventory = tuple(sorted((cache[n][5] for n in live), key=lambda i: i.name))
        views = TensorViews(out)
        if len(cache) == len(names):  # every tensor is remembered (none was collected meanwhile)
            self._seen.append(_Seen(names, list(map(id, objs)), ptrs, strides, shapes, dtypes, views))
        return self._inventory, views
