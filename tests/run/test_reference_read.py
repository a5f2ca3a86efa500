"""A trainer's reference is checked against the run's probes when it is read (issue 45, point 5):
one that does not fit them is refused at read, naming the probe and the lengths, so an audit finds
no usable reference instead of failing later."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import deltasync as ds
from deltasync.errors import ObjectTooLarge, ProtocolError
from deltasync.protocol.probes import MAX_REFERENCE_BYTES, ProbeSet, Reference, reference_key
from deltasync.run.probes import default_probes, read_reference, write_probes, write_reference
from deltasync.storage import Store

#: probes of 9, 12 and 7 tokens: 8, 11 and 6 logprobs each
PROBES = ProbeSet(((1,) * 9, (2,) * 12, (3,) * 7), 1000)


@pytest.fixture(params=["memory", "local"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    url = f"memory://refs-{id(request)}" if request.param == "memory" else str(tmp_path / "run")
    with ds.open_store(url) as s:
        write_probes(s, PROBES)
        yield s


def stored(store: Store, step: int, logprobs: Any, digest: str = PROBES.digest) -> None:
    """A reference written behind write_reference's back (as a buggy or hostile trainer could)."""
    body = {"format_version": 1, "step": step, "probes_digest": digest, "dtype": "bfloat16", "logprobs": logprobs}
    store.put(reference_key(step), json.dumps(body).encode())


def rows(*lengths: int) -> list[list[float]]:
    return [[-1.0 - i * 0.01 for i in range(n)] for n in lengths]


MISMATCHED = {
    "a row one short": (rows(8, 10, 6), "probe 1 has 10 logprobs, expected 11"),
    "a row one long": (rows(8, 11, 7), "probe 2 has 7 logprobs, expected 6"),
    "one logprob per token (no shift)": (rows(9, 12, 7), "probe 0 has 9 logprobs, expected 8"),
    "a probe missing": (rows(8, 11), "2 rows of logprobs for 3 probes"),
    "a probe too many": (rows(8, 11, 6, 6), "4 rows of logprobs for 3 probes"),
    "rows in another order": (rows(11, 8, 6), "probe 0 has 11 logprobs, expected 8"),
}


@pytest.mark.parametrize("case", list(MISMATCHED))
def test_a_reference_that_does_not_fit_the_probes_is_refused_at_read(store: Store, case: str) -> None:
    logprobs, match = MISMATCHED[case]
    stored(store, 5, logprobs)
    with pytest.raises(ProtocolError, match=match) as info:
        read_reference(store, 5)
    assert reference_key(5) in str(info.value) and store.url in str(info.value)
    assert PROBES.digest in str(info.value)
    # with the probes given, the same
    with pytest.raises(ProtocolError, match=match):
        read_reference(store, 5, PROBES)


def test_a_fitting_reference_reads_and_others_are_none(store: Store) -> None:
    ref = Reference(3, PROBES.digest, tuple(tuple(r) for r in rows(8, 11, 6)), "float32")
    assert write_reference(store, ref) is True
    assert read_reference(store, 3) == ref == read_reference(store, 3, PROBES)
    assert read_reference(store, 4) is None


def test_a_reference_of_other_probes_is_not_usable(store: Store) -> None:
    other = default_probes(1000, "another run", n=3, length=9)
    stored(store, 7, rows(8, 8, 8), other.digest)
    with pytest.raises(ProtocolError, match=f"computed on probes {other.digest}, the run's are {PROBES.digest}"):
        read_reference(store, 7)


def test_a_reference_of_a_run_without_probes_cannot_be_checked(tmp_path: Path) -> None:
    with ds.open_store(tmp_path / "bare") as s:
        stored(s, 1, rows(8, 11, 6))
        with pytest.raises(ProtocolError, match="the run has no probe set"):
            read_reference(s, 1)
        assert read_reference(s, 1, PROBES) is not None  # the caller's probes: checked against them


def test_the_numbers_of_a_reference_are_bounded(store: Store) -> None:
    good = rows(8, 11, 6)
    stored(store, 1, [[1e308, *good[0][1:]], good[1], good[2]])
    with pytest.raises(ProtocolError, match="not a logprob"):
        read_reference(store, 1)
    # far below the floor, as a float or as an integer with hundreds of digits: clamped to the floor
    store.put(
        reference_key(2),
        json.dumps({"format_version": 1, "step": 2, "probes_digest": PROBES.digest, "dtype": "f", "logprobs": good})
        .encode()
        .replace(b"-1.0,", b"-" + b"9" * 400 + b",", 1),
    )
    ref = read_reference(store, 2)
    assert ref is not None and ref.logprobs[0][0] == -1.0e4
    stored(store, 3, [[10**400, *good[0][1:]], good[1], good[2]])
    with pytest.raises(ProtocolError, match="an integer of 401 digits is not a logprob"):
        read_reference(store, 3)


def test_a_reference_over_4_mib_is_refused_from_its_size(tmp_path: Path) -> None:
    with ds.open_store(tmp_path / "run") as s:
        write_probes(s, PROBES)
        path = Path(s.root) / reference_key(9)  # type: ignore[attr-defined]
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.truncate(1 << 31)
        with pytest.raises(ObjectTooLarge, match=f"over the {MAX_REFERENCE_BYTES}-byte limit"):
            read_reference(s, 9)


def test_an_audit_finds_no_usable_reference_instead_of_failing_later(store: Store) -> None:
    from deltasync.serving.audit import AuditSource, ProbeOutput, ReplicaAuditor

    stored(store, 5, rows(8, 10, 6))
    answers = ProbeOutput(tuple(tuple(r) for r in rows(8, 11, 6)))
    result = ReplicaAuditor(AuditSource(store)).judge(5, answers)
    assert result.divergence is None and not result.diverged
    # the divergence check could not run, and says why; the others ran (issue 46: one bad input spoils only its check)
    assert [u.check for u in result.unavailable] == ["divergence"]
    assert result.summary().startswith("audit of step 5: no reference (not run: divergence: the reference of step 5")
    assert "probe 1 has 10 logprobs, expected 11" in result.summary() and result.summary().endswith(": ok")
    # once the trainer writes a fitting one (a new run would: references are written once), it is compared
    store.delete_many([reference_key(5)])
    write_reference(store, Reference(5, PROBES.digest, answers.logprobs, "float32"))
    again = ReplicaAuditor(AuditSource(store)).judge(5, answers)
    assert again.divergence is not None and again.divergence.max_abs == 0.0
