"""A run's probes (``probes.json``) and the trainer's references (``references/{step}.json``) over real
stores: written once (the same bytes again are fine, a different object is AlreadyExists, also when
a rival writer races in between), default probes derived from the run, and hostile objects read
back as clear ProtocolErrors."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

import deltasync as ds
from deltasync.errors import AlreadyExists, ObjectNotFound, ProtocolError, UnsupportedVersion
from deltasync.protocol import TensorInfo
from deltasync.protocol.audit import AuditPolicy
from deltasync.protocol.probes import (
    MAX_PROBE_LEN,
    MAX_PROBES,
    PROBES_KEY,
    ProbeSet,
    Reference,
    parse_reference_key,
    reference_key,
)
from deltasync.run.probes import (
    default_probes,
    list_references,
    read_probes,
    read_reference,
    vocab_size_of,
    write_probes,
    write_reference,
)
from deltasync.storage import Store
from deltasync.storage.base import Data, PutMode
from deltasync.storage.wrapper import WrapperStore

INVENTORY = [
    TensorInfo("model.layers.0.mlp.up_proj.weight", "BF16", (64, 32)),
    TensorInfo("model.embed_tokens.weight", "BF16", (1000, 32)),
    TensorInfo("lm_head.weight", "BF16", (1000, 32)),
]


@pytest.fixture(params=["memory", "local"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    url = f"memory://probes-{id(request)}" if request.param == "memory" else str(tmp_path / "run")
    with ds.open_store(url) as s:
        yield s


def reference(probes: ProbeSet, step: int, offset: float = 0.0) -> Reference:
    rows = tuple(tuple(-6.0 - offset - 0.001 * i for i in range(n)) for n in probes.scored)
    return Reference(step, probes.digest, rows, "bfloat16")


# ------------------------------------------------------------------ probes


def test_default_probes_are_derived_from_the_run_and_its_vocabulary() -> None:
    p = default_probes(INVENTORY, "run-a")
    assert p == default_probes(1000, "run-a")  # the embedding's rows are the vocabulary
    assert len(p.tokens) == 8 and {len(t) for t in p.tokens} == {32}
    assert all(0 <= t < 1000 for row in p.tokens for t in row)
    assert len({t for row in p.tokens for t in row}) > 100  # spread over the vocabulary
    assert default_probes(1000, "run-b").digest != p.digest
    assert default_probes(1000, "run-a", n=2, length=6).scored == (5, 5)
    assert p.policy == AuditPolicy()
    assert vocab_size_of([TensorInfo("transformer.wte.weight", "F32", (50, 4))]) == 50
    with pytest.raises(ProtocolError, match="vocabulary size"):
        default_probes([TensorInfo("x.weight", "F32", (5, 5))], "run-a")


def test_probes_are_written_once_and_read_back(store: Store) -> None:
    assert read_probes(store) is None
    p = default_probes(1000, "run-a", policy=AuditPolicy(max_kl=None))
    assert write_probes(store, p) is True
    assert write_probes(store, p) is False  # the same set again: an idempotent retry
    assert read_probes(store) == p
    other = default_probes(1000, "run-b")
    with pytest.raises(AlreadyExists, match=f"different probe set \\(digest {p.digest}\\)"):
        write_probes(store, other)
    with pytest.raises(AlreadyExists):  # a different policy is a different object too
        write_probes(store, ProbeSet(p.tokens, p.vocab_size, AuditPolicy()))
    assert read_probes(store) == p


class Rival(WrapperStore[Store]):
    """Runs ``before`` once, just before the first write of ``key`` (a rival writer got there first),
    and can pretend to lack conditional writes (as the HF Bucket API does)."""

    def __init__(self, inner: Store, key: str, before: Callable[[Store], None], conditional: bool) -> None:
        super().__init__(inner)
        self.key, self.before, self.fired = key, before, False
        self.supports_conditional_put = conditional  # type: ignore[misc]

    def put_many(self, items: Mapping[str, Data], *, mode: PutMode = "overwrite") -> None:
        if self.key in items and not self.fired:
            self.fired = True
            self.before(self.inner)
        super().put_many(items, mode=mode if self.supports_conditional_put else "overwrite")


@pytest.mark.parametrize("conditional", [True, False])
def test_a_rival_that_writes_other_probes_first_is_not_overwritten_silently(store: Store, conditional: bool) -> None:
    mine, theirs = default_probes(1000, "mine"), default_probes(1000, "theirs")
    if conditional:
        rival = Rival(store, PROBES_KEY, lambda s: s.put(PROBES_KEY, theirs.to_json()), True)
    else:  # no create-only writes: the rival's write lands after ours; the read-back tells
        rival = Rival(store, PROBES_KEY, lambda s: None, False)
        orig = rival.put_many

        def put_then_rival(items: Mapping[str, Data], *, mode: PutMode = "overwrite") -> None:
            orig(items, mode=mode)
            if PROBES_KEY in items:
                store.put(PROBES_KEY, theirs.to_json())

        rival.put_many = put_then_rival  # type: ignore[method-assign]
    with pytest.raises(AlreadyExists, match="different probe set"):
        write_probes(rival, mine)
    assert read_probes(store) == theirs
    # the same set written by both: both succeed
    if conditional:
        key = reference_key(1)
        ref = reference(theirs, 1)
        racing = Rival(store, key, lambda s: s.put(key, ref.to_json()), True)
        assert write_reference(racing, ref) is False and read_reference(store, 1) == ref


def hostile_probes() -> list[tuple[bytes, type[Exception], str]]:
    ok: dict[str, Any] = json.loads(default_probes(1000, "h").to_json())

    def with_(**kw: Any) -> bytes:
        return json.dumps({**ok, **kw}).encode()

    return [
        (b"\xff", ProtocolError, "UTF-8"),
        (b"[]", ProtocolError, "object"),
        (with_(format_version=2), UnsupportedVersion, "format_version"),
        (with_(vocab_size=1), ProtocolError, "vocab_size"),
        (with_(vocab_size=True), ProtocolError, "vocab_size"),
        (with_(probes=[]), ProtocolError, "1 to 64"),
        (with_(probes=[[1, 2, 3, 4, 5]] * (MAX_PROBES + 1)), ProtocolError, "1 to 64"),
        (with_(probes=[[1, 2, 3]]), ProtocolError, "probe 0"),
        (with_(probes=[[1] * (MAX_PROBE_LEN + 1)]), ProtocolError, "probe 0"),
        (with_(probes=[[1, 2, 3, 4, 1000]]), ProtocolError, "token id 1000"),
        (with_(probes=[[1, 2, 3, 4, -1]]), ProtocolError, "token id -1"),
        (with_(probes=[[1, 2, 3, 4, 5.0]]), ProtocolError, "token id 5.0"),
        (with_(probes=[[1, 2, 3, 4, True]]), ProtocolError, "token id True"),
        (with_(probes=[[1] * 1000] * 17), ProtocolError, "16384 tokens"),
        (with_(policy={"max_kl": 1}), ProtocolError, "policy"),
        (with_(extra=1), ProtocolError, "unknown fields"),
        (b" " * (2 << 20), ProtocolError, "limit"),
    ]


@pytest.mark.parametrize(("body", "exc", "match"), hostile_probes())
def test_a_hostile_probes_object_is_a_clear_error(body: bytes, exc: type[Exception], match: str) -> None:
    s = ds.open_store(f"memory://hostile-{abs(hash(body))}")
    s.put(PROBES_KEY, body)
    with pytest.raises(exc, match=match) as info:
        read_probes(s)
    assert s.url in str(info.value)
    with pytest.raises(exc):
        ProbeSet.from_json(body)


# ------------------------------------------------------------------ references


def test_references_are_written_once_per_step_beside_the_steps(store: Store) -> None:
    p = default_probes(1000, "run-a", n=3, length=9)
    ref = reference(p, 12)
    with pytest.raises(ObjectNotFound, match="write_probes first"):
        write_reference(store, ref)
    write_probes(store, p)
    assert read_reference(store, 12) is None and list_references(store) == []
    assert write_reference(store, ref) is True
    assert write_reference(store, ref) is False
    assert read_reference(store, 12) == ref and read_reference(store, 13) is None
    assert reference_key(12) == "references/000000000012.json" and parse_reference_key(reference_key(12)) == 12
    assert store.exists("references/000000000012.json")
    with pytest.raises(AlreadyExists, match="step 12"):
        write_reference(store, reference(p, 12, offset=0.5))
    write_reference(store, reference(p, 3))
    assert list_references(store) == [3, 12]
    # a reference of other probes, or of the wrong shape, is refused before anything is written
    other = default_probes(1000, "run-b", n=3, length=9)
    with pytest.raises(ProtocolError, match="computed on probes"):
        write_reference(store, reference(other, 20))
    short = Reference(20, p.digest, tuple(r[:-1] for r in ref.logprobs), "bfloat16")
    with pytest.raises(ProtocolError, match="probe 0 has 7 logprobs, expected 8"):
        write_reference(store, short)
    assert list_references(store) == [3, 12]


def test_minus_infinity_is_clamped_and_nan_refused() -> None:
    p = default_probes(1000, "x", n=1, length=6)
    ref = Reference(0, p.digest, ((float("-inf"), -1.0, -2.0, -3.0, -4.0),), "float32")
    assert ref.logprobs[0][0] == -1.0e4
    with pytest.raises(ProtocolError, match="not a logprob"):
        Reference(0, p.digest, ((float("nan"), -1.0, -2.0, -3.0, -4.0),), "float32")


def hostile_references() -> list[tuple[bytes, str]]:
    p = default_probes(1000, "h", n=1, length=6)
    ok: dict[str, Any] = json.loads(Reference(5, p.digest, ((-1.0,) * 5,), "bfloat16").to_json())

    def with_(**kw: Any) -> bytes:
        return json.dumps({**ok, **kw}).encode()

    return [
        (with_(step=6), "says step 6"),
        (with_(probes_digest="x"), "probes_digest"),
        (with_(dtype="../etc"), "dtype"),
        (with_(logprobs=[]), "1 to 64"),
        (with_(logprobs=[[-1.0, 2.0, -1.0, -1.0, -1.0]]), "not a logprob"),
        (with_(logprobs=[[-1.0, "a", -1.0, -1.0, -1.0]]), "not a logprob"),
        (with_(logprobs=[[-1.0]]), "row 0"),
        (with_(logprobs=[[-1.0] * 1000] * 17), "16384"),
        (b'{"format_version":1,"step":5,"probes_digest":"' + b"0" * 32 + b'","dtype":"f","logprobs":[[NaN]]}', "JSON"),
    ]


@pytest.mark.parametrize(("body", "match"), hostile_references())
def test_a_hostile_reference_is_a_protocol_error_naming_the_key(body: bytes, match: str) -> None:
    s = ds.open_store(f"memory://hostile-ref-{abs(hash(body))}")
    s.put(reference_key(5), body)
    with pytest.raises(ProtocolError, match=match) as info:
        read_reference(s, 5)
    assert "references/000000000005.json" in str(info.value)


# ------------------------------------------------------------------ gc


def test_gc_deletes_a_steps_reference_with_the_step_and_keeps_the_probes(tmp_path: Path) -> None:
    import torch

    from deltasync.run.gc import collect_garbage

    store = ds.open_store(tmp_path / "run")
    state = {"model.embed_tokens.weight": torch.zeros(100, 4)}
    with ds.DeltaUploader(store, anchor_every=2) as up:
        for step in range(6):
            state["model.embed_tokens.weight"][step] = step + 1
            up.push(state, step).result()
            n = up.probes().scored
            up.attach_reference(step, [[-1.0 - step] * k for k in n]).result(30)
    assert list_references(store) == [0, 1, 2, 3, 4, 5]
    report = collect_garbage(store, keep_anchors=1, grace=0)
    kept = ds.RunReader(store).steps()
    assert kept and min(kept) > 0 and report.plan.deleted_steps
    assert list_references(store) == kept  # each deleted step's reference went with it
    assert read_probes(store) is not None
    assert not [n for n in report.plan.notes if "outside the run's layout" in n]
