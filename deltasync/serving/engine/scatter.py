"""Write only the changed elements of an update straight into an engine's parameters.

An update of a few percent of a model's elements touches nearly every tensor (RL learning rates
change ~17% of bf16 elements per step, spread over every weight), so handing the engine's
``load_weights`` each changed tensor copies the whole model. This module scatters the changed
elements instead, where the engine's layout is a plain strided view of the checkpoint tensor,
and leaves everything else to the loader.

**Where elements go comes from the model itself.** :meth:`ScatterMap.build` runs the model's own
``load_weights`` once per checkpoint name on a shape-only (``meta``) tensor, under a
``TorchDispatchMode`` that lets every view (``narrow``, ``t()``, slicing) run and records every
write instead of doing it. vLLM's name mapping (fused ``qkv_proj`` / ``gate_up_proj``, tied and
skipped names) and each parameter's ``weight_loader`` (this rank's tensor-parallel shard) decide;
nothing is written. A name gets a map when every write its load does is a ``copy_``

- into a view of a parameter (its storage: offset, strides, shape),
- from a view of that name's checkpoint tensor (offset and strides, no copy in between: a cast,
  ``.contiguous()`` of a strided view, arithmetic all make a new tensor, which does not count),
- of the same dtype and shape (no broadcast, no cast),

and the checkpoint view can be inverted (each flat checkpoint position has at most one index in
it: its strides nest). Anything else (a loader that transforms, casts, pads with ``fill_`` over
elements, raises on a meta tensor, writes nothing we can see, or swaps ``param.data``) has no
map: that name always goes through ``load_weights``.

**Bit-exact by construction.** A map replays the loader's own copies: a changed element goes to
every destination the loader's ``copy_`` would have written it to, with the same bits (no cast),
and an element that did not change is not written (it holds those bits already, since the
engine serves the previous step, which the mirror's values differ from only at the positions).

Use::

    loader = ScatterLoader(model, layout, load)      # layout: name -> (dtype, shape); load: load_weights
    counts = loader([TensorChange(name, positions, values), ...], tensors)

Each change is the one change type (:class:`deltasync.protocol.TensorChange`: what the fetcher
applied, as the node's version files keep it, :meth:`~deltasync.serving.node.versions.Version.changes`);
``tensors[name]`` is the new tensor in checkpoint coordinates (on the host: the mirror). ``positions``
are the changed flat (row-major) indices, sorted (None: copy the whole tensor), ``values`` the new
bits there when the caller has them (a decoded patch; else gathered from the new tensor). Parameters may
live anywhere: on CPU the write is numpy's fancy assignment on the parameter's bits, on an
accelerator positions are sent as int32 and the indices computed there. The engine must hold the
previous step's bits at every other position (a caller that does not know what the engine holds
passes None). Names whose load has no map go to ``load`` in one call; a rank's engine that refuses
raises what ``load`` raises (the caller undoes, as with the loader).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deltasync.protocol import TensorChange

__all__ = [
    "STRIDED_COST",
    "ScatterCounts",
    "ScatterLoader",
    "ScatterMap",
    "Segment",
    "default_max_density",
    "scatter",
]

log = logging.getLogger("deltasync.vllm")

#: checkpoint name -> (dtype, shape)
Layout = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Segment:
    """One ``copy_`` of a load: ``shape`` elements from the checkpoint tensor (flat offset and strides of
    the contiguous tensor) to a parameter's storage (element offset and strides in it)."""

    param: torch.Tensor
    shape: tuple[int, ...]
    src_offset: int
    src_strides: tuple[int, ...]
    dst_offset: int
    dst_strides: tuple[int, ...]
    #: number of elements copied
    numel: int = field(init=False)
    #: ``dst - src`` when the segment is one dense run of the checkpoint laid out the same way in the
    #: parameter (a flat position maps to position + shift), else None
    shift: int | None = field(init=False)
    #: the parameter's whole storage, flat (what the scatter writes into)
    flat: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        numel = 1
        for n in self.shape:
            numel *= n
        dims = [(n, s, d) for n, s, d in zip(self.shape, self.src_strides, self.dst_strides, strict=True) if n > 1]
        expect = 1
        shift: int | None = self.dst_offset - self.src_offset
        for n, s, d in reversed(dims):
            if s != expect or d != expect:
                shift = None
                break
            expect *= n
        p = self.param
        flat = p.as_strided((p.untyped_storage().nbytes() // p.element_size(),), (1,), 0)
        object.__setattr__(self, "numel", numel)
        object.__setattr__(self, "shift", shift)
        object.__setattr__(self, "flat", flat)

    def host_bits(self) -> Any:
        """The parameter's storage as a numpy array of same-size ints, sharing its memory (CPU only)."""
        bits = _BITS[self.flat.element_size()]
        return self.flat.detach().view(bits).numpy()

    def src_view(self, full: torch.Tensor) -> torch.Tensor:
        """The part of checkpoint tensor ``full`` this segment copies: its offsets and strides were
        traced on a contiguous tensor of its own, so they count from ``full``'s first element (which
        may lie anywhere in its storage: a node version's tensors share one pack)."""
        if not full.is_contiguous():
            full = full.contiguous()
        return full.as_strided(self.shape, self.src_strides, full.storage_offset() + self.src_offset)

    def dst_view(self) -> torch.Tensor:
        return self.param.as_strided(self.shape, self.dst_strides, self.dst_offset)


def _nested(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether every flat position has at most one index in this strided view (strides nest: each
    is larger than the span of all smaller ones), so a position can be decoded greedily."""
    dims = sorted((s, n) for n, s in zip(shape, strides, strict=True) if n > 1)
    span = 0
    for s, n in dims:
        if s <= span or s < 0:
            return False
        span += s * (n - 1)
    return True


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


#: bytes the storage behind a traced checkpoint tensor has beyond the tensor (odd, so that no tensor of
#: a wider dtype has a storage of that size): see :func:`_traced`
_MARK = 4099


def _traced(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A shape-only (meta) checkpoint tensor to trace a load with, whose storage is :data:`_MARK` bytes
    longer than the tensor: a view of it (what a plain load copies from) shares that storage, a tensor
    the load computes from it (a transform) has a storage of its own, of another size. Meta tensors
    have no addresses to tell them apart by (``data_ptr()`` is 0), and ``Tensor._base`` is private."""
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.empty(nbytes + _MARK, dtype=torch.uint8, device="meta")[:nbytes].view(dtype).view(shape)


def _shares_storage(t: torch.Tensor, root: torch.Tensor) -> bool:
    """Whether ``t`` is a view of the traced tensor ``root`` (:func:`_traced`): its storage is root's,
    told by size (public API: ``untyped_storage().nbytes()``)."""
    return t.is_meta and t.untyped_storage().nbytes() == root.untyped_storage().nbytes()


def _schema(func: Any) -> Any:
    """The ATen schema of the operator a dispatch mode sees (its arguments' alias info says which it
    writes). torch has no public accessor for it: ``OpOverload._schema`` is what ``__torch_dispatch__``
    modes read, torch's own included (``torch.utils._python_dispatch``); present from torch 2.0 through
    2.13 (the versions this was run with). The one private read of this module."""
    return func._schema


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Runs views, records ``copy_`` from the traced meta tensor into parameters, writes nothing."""

    def __init__(self, params: Mapping[tuple[str, int], torch.Tensor]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.params = params
        self.root: torch.Tensor | None = None
        self.segments: list[Segment] = []
        self.bad: str | None = None

    def fail(self, why: str) -> None:
        """Mark this trace unmappable (the first reason is kept)."""
        if self.bad is None:
            self.bad = why

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        schema = _schema(func)
        written = [
            a
            for a, arg in zip(schema.arguments, args, strict=False)
            if a.alias_info is not None and a.alias_info.is_write and isinstance(arg, torch.Tensor)
        ]
        if not written and not any(
            a.alias_info is not None and a.alias_info.is_write and a.name in kwargs for a in schema.arguments
        ):
            return func(*args, **kwargs)
        # a write: never done; record it when it is a plain copy from the traced tensor into a parameter
        dst = args[0] if args else None
        if isinstance(dst, torch.Tensor) and dst.numel() == 0:
            return dst  # writes nothing
        if func is not torch.ops.aten.copy_.default:
            self.fail(f"the load does {func} on a tensor")
            return dst
        src = args[1]
        assert isinstance(dst, torch.Tensor)
        if not isinstance(src, torch.Tensor) or not src.is_meta or self.root is None:
            self.fail("the load copies something that is not the checkpoint tensor")
            return dst
        if not _shares_storage(src, self.root):
            self.fail("the load copies a transformed checkpoint tensor (a new tensor, not a view)")
            return dst
        if src.dtype != dst.dtype or tuple(src.shape) != tuple(dst.shape):
            self.fail(
                f"the load casts or broadcasts ({src.dtype} {tuple(src.shape)} -> {dst.dtype} {tuple(dst.shape)})"
            )
            return dst
        param = self.params.get(_storage_key(dst)) if not dst.is_meta else None
        if param is None:
            self.fail("the load writes a tensor that is not a parameter")
            return dst
        if not _nested(src.shape, src.stride()):
            self.fail("the checkpoint view overlaps itself (broadcast or expanded)")
            return dst
        if not _nested(dst.shape, dst.stride()):
            self.fail("the parameter view overlaps itself")
            return dst
        self.segments.append(
            Segment(
                param=param,
                shape=tuple(int(n) for n in src.shape),
                src_offset=int(src.storage_offset()),
                src_strides=tuple(int(s) for s in src.stride()),
                dst_offset=int(dst.storage_offset()),
                dst_strides=tuple(int(s) for s in dst.stride()),
            )
        )
        return dst


@dataclass
class ScatterMap:
    """Per checkpoint name, the strided copies its load does (:class:`Segment`), or why it has none.

    ``maps``: name -> segments, for names whose load is only such copies; ``unmapped``: name -> why not.
    Holds the parameters it writes into; :meth:`stale` says when the engine replaced them (rebuild).
    """

    maps: dict[str, list[Segment]]
    unmapped: dict[str, str]
    #: parameter name -> the storage it had when the map was traced (see :meth:`stale`)
    storages: dict[str, tuple[str, int]] = field(default_factory=dict, repr=False)

    @classmethod
    def build(
        cls, model: torch.nn.Module, layout: Layout, *, load: Callable[[Iterable[tuple[str, Any]]], Any] | None = None
    ) -> ScatterMap:
        """Trace ``load`` (default ``model.load_weights``) once per name of ``layout`` on meta tensors."""
        loader: Callable[[Iterable[tuple[str, Any]]], Any] = load or model.load_weights  # type: ignore[assignment]
        named = _tensors(model)
        params = {_storage_key(t): t for t in named.values() if not t.is_meta and t.numel() > 0}
        before = {n: (t.device, t.data_ptr(), tuple(t.shape), t.stride()) for n, t in named.items()}
        saved = {n: t.data for n, t in named.items()}
        maps: dict[str, list[Segment]] = {}
        unmapped: dict[str, str] = {}
        for name, (dtype, shape) in layout.items():
            rec = _Recorder(params)
            root = _traced(dtype, shape)
            rec.root = root
            try:
                with torch.no_grad(), rec:
                    loader(iter([(name, root)]))
            except Exception as exc:  # noqa: BLE001 - any failure on meta data: the loader handles this name
                rec.fail(f"the load fails on a shape-only tensor ({type(exc).__name__}: {exc})")
            swapped = [n for n, t in named.items() if (t.device, t.data_ptr(), tuple(t.shape), t.stride()) != before[n]]
            for n in swapped:  # a loader that replaced param.data: put it back, never map that name
                named[n].data = saved[n]
                rec.fail(f"the load replaces {n}")
            if rec.bad is None and not rec.segments:
                rec.fail("the load writes nothing visible")
            if rec.bad is None:
                maps[name] = _checked(name, rec.segments, shape)
            else:
                unmapped[name] = rec.bad
        for name, why in _overlapping(maps).items():
            del maps[name]
            unmapped[name] = why
        out = cls(maps, unmapped, {n: _storage_key(t) for n, t in named.items() if not t.is_meta and t.numel() > 0})
        if unmapped:
            log.info("%d of %d tensors load through the loader only: %s", len(unmapped), len(layout), _first(unmapped))
        return out

    def stale(self, model: torch.nn.Module) -> bool:
        """Whether the engine's parameters are not the ones this map writes into any more."""
        named = _tensors(model)
        now = {n: _storage_key(t) for n, t in named.items() if not t.is_meta and t.numel() > 0}
        return now != self.storages


def _overlapping(maps: Mapping[str, list[Segment]]) -> dict[str, str]:
    """Names whose copies may write an element another copy writes too (a later copy wins in the
    loader, whether or not its element changed: only the loader gets that right). Compares the spans
    of the copies in each parameter's storage, a superset of the elements they write."""
    spans: dict[tuple[str, int], list[tuple[int, int, str]]] = {}
    for name, segments in maps.items():
        for seg in segments:
            lo = seg.dst_offset + sum(min(0, (n - 1) * d) for n, d in zip(seg.shape, seg.dst_strides, strict=True))
            hi = seg.dst_offset + sum(max(0, (n - 1) * d) for n, d in zip(seg.shape, seg.dst_strides, strict=True))
            spans.setdefault(_storage_key(seg.param), []).append((lo, hi, name))
    out: dict[str, str] = {}
    for found in spans.values():
        found.sort()
        for (_, hi, a), (lo, _, b) in zip(found, found[1:], strict=False):
            if lo <= hi:
                out[a] = out[b] = f"the loads of {a} and {b} may write the same elements"
    return out


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    named: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    return named


def _first(why: Mapping[str, str]) -> str:
    items = list(why.items())[:3]
    return "; ".join(f"{n}: {w}" for n, w in items) + (f"; and {len(why) - 3} more" if len(why) > 3 else "")


def _checked(name: str, segments: list[Segment], shape: tuple[int, ...]) -> list[Segment]:
    """Self-check of the position decoding: sample indices of each copied view (its corners and
    random ones), where the loader's ``copy_`` takes them from and puts them (``as_strided``'s
    definition), and check that decoding those checkpoint positions gives the same destinations."""
    g = torch.Generator().manual_seed(0)
    for seg in segments:
        dims = len(seg.shape)
        if not dims:
            continue
        corners = [[0] * dims, [max(n - 1, 0) for n in seg.shape]]
        picks = [torch.randint(0, max(n, 1), (64,), generator=g) for n in seg.shape]
        idx = torch.cat([torch.tensor(corners, dtype=torch.int64).T.reshape(dims, 2), torch.stack(picks)], dim=1)
        src = torch.full((idx.shape[1],), seg.src_offset, dtype=torch.int64)
        dst = torch.full((idx.shape[1],), seg.dst_offset, dtype=torch.int64)
        for k in range(dims):
            src += idx[k] * seg.src_strides[k]
            dst += idx[k] * seg.dst_strides[k]
        src, order = torch.sort(src)
        got, keep = _dst_index(seg, src)
        shift = seg.shift
        dense_ok = shift is None or torch.equal(src + shift, dst[order])
        if not bool(keep.all()) or not torch.equal(got, dst[order]) or not dense_ok:
            raise AssertionError(f"{name}: the scatter map does not decode the loader's view (a deltasync bug)")
    return segments


def _dst_index(seg: Segment, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For flat checkpoint positions ``pos``: their parameter-storage indices, and which of them the
    segment covers (indices of the others are meaningless)."""
    q = pos - seg.src_offset
    keep = q >= 0
    dst = torch.full_like(q, seg.dst_offset)
    dims = sorted(
        ((s, n, d) for n, s, d in zip(seg.shape, seg.src_strides, seg.dst_strides, strict=True) if n > 1),
        reverse=True,
    )
    for s, n, d in dims:
        i = torch.div(q, s, rounding_mode="floor")
        q = q - i * s
        keep &= (i >= 0) & (i < n)
        dst += i * d
    keep &= q == 0
    return dst, keep


@dataclass(frozen=True, slots=True)
class ScatterCounts:
    """What one :class:`ScatterLoader` call did: tensors scattered (and their elements), copied whole
    through their map, and handed to the loader."""

    scattered: int = 0
    elements: int = 0
    copied: int = 0
    loaded: int = 0


#: a strided segment (a tensor-parallel shard of columns) decodes every position into indices, a few
#: passes over them: it pays to scatter there below this fraction of the dense break-even density
STRIDED_COST = 0.25


def default_max_density(device: torch.device) -> float:
    """The fraction of changed elements above which copying a tensor whole beats scattering into it.

    Measured with ``benchmarks/bench_scatter.py`` (Qwen3-0.6B shapes, bf16). CPU: the copy is a
    memcpy and the scatter costs a few ns per element, so they break even near 6%. GPU (an H200,
    host tensors in pageable memory as the node mirror's are, TP=1): the whole model's copy took
    140-177 ms, the scatter 0.12x of it at 1%, 0.28x at 5%, 0.70x at 17%, 1.08x at 30%: they break even
    near a quarter; from pinned host memory the copy takes 25 ms and the scatter wins only near 1%.
    """
    return 0.06 if device.type == "cpu" else 0.2


class ScatterLoader:
    """The engine's loader, scattering changed elements where :class:`ScatterMap` has a map.

    model: the engine's model (parameters written in place). layout: checkpoint name -> (dtype, shape)
    of the tensors it is updated with. load: the model's loader (``model.load_weights``), for
    tensors without a map; called once per call, with all of them. max_density: above this fraction
    of changed elements a mapped tensor is copied whole through its map (the loader's own strided
    ``copy_``s, without the loader); default :func:`default_max_density` of the parameters' device,
    times :data:`STRIDED_COST` for strided segments.
    The map is built here and rebuilt when the engine replaced its parameters.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        layout: Layout,
        load: Callable[[Iterable[tuple[str, Any]]], Any],
        *,
        max_density: float | None = None,
    ) -> None:
        self.model = model
        self.layout = dict(layout)
        self.load = load
        self.max_density = max_density
        self.map = ScatterMap.build(model, self.layout, load=load)

    def refresh(self) -> bool:
        """Rebuild the map if the engine replaced its parameters (a ``reload_weights``); True if it did.
        Calls do this first; call it ahead (outside the pause) to keep the rebuild out of it."""
        if not self.map.stale(self.model):
            return False
        log.info("the engine replaced its parameters: rebuilding the scatter map")
        self.map = ScatterMap.build(self.model, self.layout, load=self.load)
        return True

    def __call__(
        self, changes: Iterable[TensorChange | tuple[Any, ...]], tensors: Mapping[str, torch.Tensor] | None = None
    ) -> ScatterCounts:
        """Apply each :class:`~deltasync.protocol.TensorChange` (the new tensor: ``tensors[name]``); one
        loader call for the tensors without a map. An item may also be a ``(name, new tensor,
        positions[, values])`` tuple (positions a torch tensor or numpy array, values the new tensor's
        dtype). Positions may be int32, widened only where they are scattered. Raises what the loader
        raises (the caller undoes)."""
        self.refresh()
        fallback: list[tuple[str, torch.Tensor]] = []
        scattered = elements = copied = 0
        with torch.no_grad():
            for item in changes:
                name, full, pos, values = _item(item, tensors)
                segments = self.map.maps.get(name)
                if segments is None or full.dtype != self.layout[name][0] or tuple(full.shape) != self.layout[name][1]:
                    fallback.append((name, full))
                    continue
                limit = self.max_density
                if limit is None:
                    limit = default_max_density(segments[0].flat.device)
                density = 1.0 if pos is None else pos.numel() / max(1, full.numel())
                whole = False
                for seg in segments:
                    if density > (limit if seg.shift is not None else limit * STRIDED_COST):
                        seg.dst_view().copy_(seg.src_view(full))
                        whole = True
                    elif pos is not None and pos.numel():
                        if pos.dtype != torch.int64:  # positions kept compact (int32) until they are used
                            pos = pos.long()
                        if values is None:
                            values = full.reshape(-1).index_select(0, pos)
                        scatter(seg, pos, values)
                if whole:
                    copied += 1
                else:
                    scattered += 1
                    elements += 0 if pos is None else int(pos.numel())
            if fallback:
                self.load(iter(fallback))
        return ScatterCounts(scattered, elements, copied, len(fallback))


def _item(
    item: TensorChange | tuple[Any, ...], tensors: Mapping[str, torch.Tensor] | None
) -> tuple[str, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(name, new tensor, positions, values)`` as torch tensors, from a change (and the new tensors) or a tuple."""
    if isinstance(item, TensorChange):
        if tensors is None:
            raise TypeError("ScatterLoader: changes need the new tensors by name (the second argument)")
        full = tensors[item.tensor]
        values = None if item.values is None else _torch(item.values).view(full.dtype)
        return item.tensor, full, None if item.positions is None else _torch(item.positions), values
    name, full, pos, *rest = item
    values = rest[0] if rest else None
    return name, full, None if pos is None else _torch(pos), None if values is None else _torch(values)


def _torch(a: Any) -> torch.Tensor:
    """A torch tensor over ``a`` (a numpy array: shared, not copied; a read-only one is copied, torch
    tensors are writable)."""
    if not isinstance(a, np.ndarray):
        return a  # type: ignore[no-any-return]
    a = np.ascontiguousarray(a)
    return torch.from_numpy(a if a.flags.writeable else a.copy())


def scatter(seg: Segment, pos: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``values`` (the new bits at flat checkpoint positions ``pos``, sorted int64) where ``seg``
    puts those positions; positions outside it are skipped. On an accelerator, positions cross the
    host link as int32 where they fit and the parameter indices are computed there."""
    if not pos.numel():
        return
    dev = seg.flat.device
    shift = seg.shift
    if shift is not None:
        # a dense run of the checkpoint, laid out alike: the positions inside it, shifted
        lo, hi = seg.src_offset, seg.src_offset + seg.numel
        first, last = int(pos[0]), int(pos[-1])
        if first >= hi or last < lo:
            return
        if first < lo or last >= hi:
            a, b = torch.searchsorted(pos, torch.tensor([lo, hi])).tolist()
            pos, values = pos[a:b], values[a:b]
            last = int(pos[-1])
    else:
        last = int(pos[-1])
    if dev.type == "cpu":
        # numpy's fancy assignment: about twice as fast as index_copy_ here (bits, as same-size ints)
        bits = _BITS[values.element_size()]
        out = seg.host_bits()
        if shift is None:
            idx, keep = _dst_index(seg, pos)
            out[idx[keep].numpy()] = values[keep].view(bits).numpy()
        else:
            out[(pos + shift if shift else pos).numpy()] = values.view(bits).numpy()
        return
    if last < 2**31:
        pos = pos.to(torch.int32)
    pos, values = pos.to(dev, non_blocking=True).long(), values.to(dev, non_blocking=True)
    if shift is None:
        idx, keep = _dst_index(seg, pos)
        seg.flat.index_copy_(0, idx[keep], values[keep])
    else:
        seg.flat.index_copy_(0, pos + shift if shift else pos, values)
