"""DigestTable: format 2's tensor digests kept as read (positions + one hex string). It must behave as
the name -> digest dict it stands for, write back the very bytes it was read from, and give the same
changed tensors as a compare of dicts."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import xxhash

from deltasync.fetcher._apply import changed_names
from deltasync.protocol.digests import hex_words
from deltasync.protocol.entries import TensorInfo
from deltasync.protocol.manifest_v2 import DigestTable, digests_from_json, digests_to_json, inventory_facts


def _inventory(n: int) -> tuple[TensorInfo, ...]:
    return tuple(TensorInfo(f"t{i:04d}", "BF16", (2, 3)) for i in range(n))


def _hex(i: int, salt: bytes = b"") -> str:
    return xxhash.xxh3_128_hexdigest(i.to_bytes(4, "little") + salt)


def test_a_table_is_the_dict_it_stands_for_and_writes_back_what_it_read() -> None:
    inv = _inventory(10)
    pos = [0, 2, 3, 9]
    body = {"tensors": pos, "xxh3_128": "".join(_hex(i) for i in pos)}
    table = digests_from_json(body, inv, "step 1")
    assert isinstance(table, DigestTable)
    plain = {f"t{i:04d}": _hex(i) for i in pos}
    assert table == plain and dict(table) == plain and len(table) == 4
    assert list(table) == list(plain) and "t0002" in table and "t0001" not in table
    assert table.get("t0001") is None and table["t0009"] == _hex(9)
    assert digests_to_json(table, inv) == body  # the very fields read
    assert digests_to_json(plain, inv) == body  # and what a dict writes
    assert pickle.loads(pickle.dumps(table)) == plain
    np.testing.assert_array_equal(table.words(), hex_words([_hex(i) for i in pos]))
    assert table.rows().tolist() == [0, -1, 1, 2, -1, -1, -1, -1, -1, 3]


class _M:
    """What changed_names reads of a manifest."""

    def __init__(self, digests: object) -> None:
        self.tensor_digests = digests


@pytest.mark.parametrize("every", [False, True], ids=["some-tensors", "every-tensor"])
def test_changed_names_from_tables_equal_those_from_dicts(every: bool) -> None:
    """Also with every tensor digested on both sides (the writers' default), read row by row."""
    inv = _inventory(50)
    rng = np.random.default_rng(0)
    before_pos = list(range(50)) if every else sorted(rng.choice(50, 40, replace=False).tolist())
    after_pos = list(range(50)) if every else sorted(rng.choice(50, 45, replace=False).tolist())
    flip = set(rng.choice(after_pos, 12, replace=False).tolist())

    def body(pos: list[int], salted: set[int]) -> dict[str, object]:
        return {"tensors": pos, "xxh3_128": "".join(_hex(i, b"x" if i in salted else b"") for i in pos)}

    before = digests_from_json(body(before_pos, set()), inv, "a")
    after = digests_from_json(body(after_pos, flip), inv, "b")
    assert isinstance(before, DigestTable) and before.facts is inventory_facts(inv)
    fast = changed_names(_M(after), _M(before), ())  # type: ignore[arg-type]
    slow = changed_names(_M(dict(after)), _M(dict(before)), ())  # type: ignore[arg-type]
    assert fast == slow
    expected = sorted({f"t{i:04d}" for i in after_pos if i in flip or i not in before_pos})
    assert fast == expected and fast  # something changed, and exactly that


def test_positions_are_kept_for_the_same_names_and_asked_again_for_others() -> None:
    import pytest

    from deltasync.fetcher._target import positions_in

    index = {"a": 0, "b": 1, "c": 2}
    memo: dict[object, object] = {}
    first = positions_in(index, ["c", "a"], memo)
    assert first.tolist() == [2, 0] and not first.flags.writeable
    assert positions_in(index, ("c", "a"), memo) is first  # the same names: kept
    assert positions_in(index, ["a", "b"], memo).tolist() == [0, 1]  # other names: looked up
    assert positions_in(dict(index), ["a", "b"], memo).tolist() == [0, 1]  # another index: looked up
    with pytest.raises(KeyError):
        positions_in(index, ["zz"], memo)
    assert positions_in(index, ["b"], None).tolist() == [1]  # nothing to keep it in


def test_every_tensor_changed_is_every_name_sorted() -> None:
    """Every digest differs (the usual RL step of an MoE: every expert moves): the names come back
    sorted, each once, with no look at the changes (they can name nothing else)."""
    inv = tuple(reversed(_inventory(30)))  # an inventory not in name order
    pos = list(range(30))
    before = digests_from_json({"tensors": pos, "xxh3_128": "".join(_hex(i, b"") for i in range(30))}, inv, "a")
    after = digests_from_json({"tensors": pos, "xxh3_128": "".join(_hex(i, b"x") for i in range(30))}, inv, "b")
    got = changed_names(_M(after), _M(before), ())  # type: ignore[arg-type]
    assert got == sorted(t.name for t in inv)
