"""The fetcher keeps its views of a target's tensors from sync to sync only while they are the very
same tensors at the same memory and layout; anything else is seen afresh (and proven as before)."""

from __future__ import annotations

import gc
import weakref

import pytest
from tensors import assert_state_equal, snapshot

import deltasync as ds
from deltasync.errors import InventoryMismatch
from deltasync.fetcher._views import TargetViews

torch = pytest.importorskip("torch")


def _states(n: int) -> list[dict[str, object]]:
    g = torch.Generator().manual_seed(0)
    s = {"a": torch.randn(4, 4, generator=g), "b": torch.randn(6, generator=g).to(torch.bfloat16)}
    out = [s]
    for _ in range(n - 1):
        s = {k: v + 0.5 for k, v in s.items()}
        out.append(s)
    return out


def test_views_are_kept_only_for_the_same_tensors() -> None:
    views = TargetViews()
    t = {"a": torch.zeros(4, 4), "b": torch.zeros(3)}
    inv1, tens1 = views.of(t)
    inv2, tens2 = views.of(t)
    assert inv2 is inv1 and tens2["a"] is tens1["a"]  # nothing changed: nothing rebuilt
    t["a"].t_()  # same memory and shape, another layout: seen afresh (and refused as not contiguous)
    with pytest.raises(InventoryMismatch, match="not contiguous"):
        views.of(t)
    t["a"] = torch.zeros(2, 8)  # another tensor under the name
    inv3, tens3 = views.of(t)
    assert tens3["a"] is not tens1["a"] and [i.shape for i in inv3] == [(2, 8), (3,)]
    t2 = {"b": t["b"]}  # a name gone
    assert [i.name for i in views.of(t2)[0]] == ["b"]


@pytest.mark.parametrize("guard", [True, False], ids=["torch-guard", "plain-compares"])
def test_a_dropped_target_is_forgotten(guard: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither the views nor torch's tensor guard keep a dropped target's tensors alive."""
    from deltasync.fetcher import _views

    monkeypatch.setattr(_views, "GUARD_FROM", 0 if guard else 1 << 30)
    views = TargetViews()
    t = {"a": torch.zeros(1000)}
    ref = weakref.ref(t["a"])
    views.of(t)
    assert views._seen[0].guard is None  # noqa: SLF001 - a target seen once builds no guard
    views.of(t)
    assert (views._seen[0].guard is not None) is guard  # noqa: SLF001 - the path under test
    del t
    gc.collect()
    assert not views._cache  # noqa: SLF001 - the views no longer hold the tensor's memory
    assert ref() is None


def test_replacing_tensors_between_syncs_syncs_right() -> None:
    store = ds.MemoryStore("views")
    states = _states(4)
    with ds.DeltaUploader(store, anchor_every=100, span_levels=()) as up:
        for i, s in enumerate(states):
            up.push(s, i).result(30)
    f = ds.DeltaFetcher(store)
    target = snapshot(states[0])
    f.sync(target, step=1)
    assert_state_equal(target, states[1])
    target["a"] = snapshot(states[0])["a"]  # swapped behind the fetcher's back: proven, not trusted
    f.sync(target, step=2)
    assert_state_equal(target, states[2])
    f.sync(target, step=3)
    assert_state_equal(target, states[3])


@pytest.mark.parametrize("guard", [True, False], ids=["torch-guard", "plain-compares"])
def test_a_layout_changed_in_place_at_the_same_memory_is_seen(guard: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same tensor objects at the same addresses, with another shape, strides or dtype, are seen
    afresh: by torch's compiled tensor guard where this torch has one (large targets), by the plain
    compares otherwise."""
    from deltasync.fetcher import _views

    if guard:
        monkeypatch.setattr(_views, "GUARD_FROM", 0)
    else:
        monkeypatch.setattr(_views, "_layout_guard", lambda *_: None)
    views = TargetViews()
    t = {"a": torch.zeros(4, 4), "b": torch.zeros(8, dtype=torch.bfloat16), "c": torch.zeros(3)}
    inv, tens = views.of(t)
    assert views.of(t)[1] is tens  # nothing changed: the very same views (and, seen twice, a guard)
    assert (views._seen[0].guard is not None) is guard  # noqa: SLF001 - the path under test
    ptr = t["a"].data_ptr()
    t["a"].resize_(2, 4)  # same memory, same strides, another shape
    assert t["a"].data_ptr() == ptr
    inv, tens = views.of(t)
    assert dict((i.name, i.shape) for i in inv)["a"] == (2, 4)
    assert views.of(t)[1] is tens
    t["b"].data = t["b"].data.view(torch.float16)  # same object, memory, shape and strides; another dtype
    inv, tens = views.of(t)
    assert dict((i.name, i.dtype) for i in inv)["b"] == "F16"
    assert views.of(t)[1] is tens
    t["c"].unsqueeze_(0)  # another shape and strides
    inv, _ = views.of(t)
    assert dict((i.name, i.shape) for i in inv)["c"] == (1, 3)
