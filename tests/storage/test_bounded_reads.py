"""Bounded reads (issue 45, point 4): an object is sized before it is read, and read no further than
its own limit; a local store reads regular files only.

Each hostile object of the issue is here: a 2 GiB ``probes.json`` and a 2 GiB manifest (sparse
files: they cost no disk), ``probes.json`` as a symlink to ``/dev/zero`` and as a FIFO, and (in
:func:`test_every_hostile_object_costs_little_memory`, beside the format-2 inventories of
tests/protocol/test_inventory_bounds.py) an inflating inventory and a reference that does not fit
its probes. Each ends in a typed :mod:`deltasync.errors` exception; memory is measured (tracemalloc
peak in process, the peak RSS of a child process for all of them together), never time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from deltasync.errors import ObjectNotFound, ObjectTooLarge, ProtocolError, StorageError
from deltasync.protocol import manifest_key
from deltasync.protocol.head import MAX_HEAD_BYTES
from deltasync.protocol.manifest import MAX_MANIFEST_BYTES
from deltasync.protocol.probes import MAX_PROBES_BYTES, PROBES_KEY
from deltasync.run import RunReader
from deltasync.run.probes import default_probes, read_probes, write_probes
from deltasync.storage import LocalStore

GiB = 1 << 30
MiB = 1 << 20
#: the most extra memory a refused object may cost (issue 45: "<= 64 MiB of extra memory")
BUDGET = 64 * MiB
needs_posix = pytest.mark.skipif(not hasattr(os, "mkfifo") or not os.path.exists("/dev/zero"), reason="POSIX only")


def peak_of(call: Callable[[], Any]) -> tuple[BaseException | None, int]:
    """What ``call`` raised (None if nothing) and the peak of the memory Python allocated meanwhile."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        try:
            call()
            raised: BaseException | None = None
        except BaseException as exc:  # noqa: BLE001 - returned to the test, which checks its type
            raised = exc
        return raised, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.fixture
def local(tmp_path: Path) -> Iterator[LocalStore]:
    store = LocalStore(tmp_path / "run")
    store.put("HEAD.json", b"{}")  # makes the root
    yield store
    store.close()


def sparse(path: Path, size: int) -> Path:
    """A file of ``size`` bytes that holds no disk (a hole)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)
    return path


# ------------------------------------------------------------------ oversized objects


def test_a_2_gib_probes_json_is_refused_from_its_size(local: LocalStore) -> None:
    sparse(local.root / PROBES_KEY, 2 * GiB)
    raised, peak = peak_of(lambda: read_probes(local))
    assert isinstance(raised, ObjectTooLarge) and isinstance(raised, ProtocolError)
    assert f"{PROBES_KEY} holds {2 * GiB} bytes, over the {MAX_PROBES_BYTES}-byte limit" in str(raised)
    assert local.url in str(raised)
    assert peak <= BUDGET, f"{peak / MiB:.1f} MiB allocated to refuse it"


def test_a_2_gib_manifest_is_refused_from_its_size(local: LocalStore) -> None:
    sparse(local.root / manifest_key(1), 2 * GiB)
    reader = RunReader(local)
    raised, peak = peak_of(lambda: reader.committed(1))
    assert isinstance(raised, ObjectTooLarge), raised
    assert f"holds {2 * GiB} bytes, over the {MAX_MANIFEST_BYTES}-byte limit" in str(raised)
    assert peak <= BUDGET
    # a walk that meets it says which step breaks the chain; a listing of the run does not read it
    raised, peak = peak_of(lambda: reader.chain(1))
    assert isinstance(raised, ObjectTooLarge) and peak <= BUDGET
    assert reader.steps() == [1]


def test_an_object_at_its_limit_is_read_and_one_byte_more_is_not(local: LocalStore) -> None:
    local.put("HEAD.json", b" " * MAX_HEAD_BYTES)
    assert len(local.get_bounded("HEAD.json", MAX_HEAD_BYTES)) == MAX_HEAD_BYTES
    local.put("HEAD.json", b" " * (MAX_HEAD_BYTES + 1))
    with pytest.raises(ObjectTooLarge, match=f"{MAX_HEAD_BYTES + 1} bytes"):
        local.get_bounded("HEAD.json", MAX_HEAD_BYTES)
    assert RunReader(local).refresh() == []  # an unusable HEAD is only a hint: the run is listed


def test_a_file_that_grows_after_its_stat_is_read_no_further_than_its_limit(
    local: LocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fstat says 10 bytes; the file then holds 1 MiB: the read stops at the limit + 1."""
    path = local.root / "grows.json"
    path.write_bytes(b"x" * 10)
    longer = b"x" * MiB  # made before the measure starts
    real_fstat = os.fstat

    def fstat(fd: int) -> os.stat_result:
        st = real_fstat(fd)
        if st.st_size == 10:
            path.write_bytes(longer)  # the same inode, longer
        return st

    monkeypatch.setattr(os, "fstat", fstat)
    raised, peak = peak_of(lambda: local.get_bounded("grows.json", 100))
    assert isinstance(raised, ObjectTooLarge) and "more than 100 bytes" in str(raised)
    assert peak < 64 * 1024


# ------------------------------------------------------------------ special files


@needs_posix
def test_probes_json_as_a_symlink_to_dev_zero_is_refused_at_once(local: LocalStore) -> None:
    (local.root / PROBES_KEY).symlink_to("/dev/zero")
    raised, peak = peak_of(lambda: read_probes(local))
    assert type(raised) is StorageError, raised
    assert f"cannot read {PROBES_KEY}: it is a symbolic link" in str(raised)
    assert peak <= BUDGET
    reads: list[Callable[[], object]] = [lambda: local.get(PROBES_KEY), lambda: local.get_range(PROBES_KEY, 0, 10)]
    for read in reads:
        with pytest.raises(StorageError, match="symbolic link"):
            read()


@needs_posix
def test_a_symlink_to_a_regular_file_is_not_an_object_either(local: LocalStore, tmp_path: Path) -> None:
    outside = tmp_path / "outside.json"
    outside.write_bytes(default_probes(1000, "elsewhere").to_json())
    (local.root / PROBES_KEY).symlink_to(outside)
    with pytest.raises(StorageError, match="symbolic link"):
        read_probes(local)


@needs_posix
def test_a_store_root_reached_through_a_symlink_is_fine(tmp_path: Path) -> None:
    real = LocalStore(tmp_path / "real")
    probes = default_probes(1000, "linked")
    write_probes(real, probes)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "real" / "sub").mkdir()
    assert read_probes(LocalStore(tmp_path / "link")) == probes
    assert LocalStore(tmp_path / "link").get_bounded(PROBES_KEY, MAX_PROBES_BYTES) == probes.to_json()


@needs_posix
@pytest.mark.timeout(60)  # the safety net: the store refuses a FIFO from its fstat, before any read
def test_probes_json_as_a_fifo_is_refused_without_waiting_for_a_writer(local: LocalStore) -> None:
    os.mkfifo(local.root / PROBES_KEY)
    with pytest.raises(StorageError, match=f"cannot read {PROBES_KEY}: it is a FIFO, not a regular file"):
        read_probes(local)
    for read in (
        lambda: local.get(PROBES_KEY),
        lambda: local.get_many([PROBES_KEY]),
        lambda: local.get_range(PROBES_KEY, 0, 1),
    ):
        with pytest.raises(StorageError, match="FIFO"):
            read()


def test_a_directory_under_a_key_is_no_object(local: LocalStore) -> None:
    (local.root / "steps" / "000000000001").mkdir(parents=True)
    reads: list[Callable[[], object]] = [
        lambda: local.get("steps"),
        lambda: local.get_bounded("steps/000000000001", 10),
    ]
    for read in reads:
        with pytest.raises(ObjectNotFound):
            read()


# ------------------------------------------------------------------ all of them, in a child's RSS

CHILD = textwrap.dedent(
    """
    import json, resource, sys
    from pathlib import Path

    import zstandard  # imported before the baseline, as the manifest parser imports it
    from deltasync.errors import DeltaSyncError
    from deltasync.protocol.manifest import Manifest
    from deltasync.run import RunReader
    from deltasync.run.probes import read_probes, read_reference
    from deltasync.storage import LocalStore

    cases = json.loads(sys.argv[1])
    def rss(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    RunReader(LocalStore(cases["2 GiB manifest"][0])).steps()  # warm the code paths
    base = rss()
    out = {}
    for name, (root, what) in cases.items():
        store = LocalStore(root)
        try:
            if what == "probes":
                read_probes(store)
            elif what == "manifest":
                RunReader(store).committed(1)
            elif what == "reference":
                read_reference(store, 5)
            else:
                Manifest.from_json(Path(what).read_bytes())
            out[name] = "no error"
        except DeltaSyncError as exc:
            out[name] = type(exc).__name__
        out[name + " rss"] = rss() - base
    print(json.dumps(out))
    """
)


@needs_posix
@pytest.mark.timeout(120)
def test_every_hostile_object_costs_little_memory(tmp_path: Path) -> None:
    """One child process reads each object in turn: its peak RSS grows by at most 64 MiB over all of them."""
    from inventory_bombs import lying_manifest, small_manifest_declaring

    cases: dict[str, list[str]] = {}

    def case(name: str, what: str) -> LocalStore:
        store = LocalStore(tmp_path / name.replace(" ", "-"))
        store.put("HEAD.json", b"{}")
        cases[name] = [str(store.root), what]
        return store

    sparse(case("2 GiB probes.json", "probes").root / PROBES_KEY, 2 * GiB)
    sparse(case("2 GiB manifest", "manifest").root / manifest_key(1), 2 * GiB)
    (case("probes.json -> /dev/zero", "probes").root / PROBES_KEY).symlink_to("/dev/zero")
    os.mkfifo(case("probes.json FIFO", "probes").root / PROBES_KEY)
    bomb = tmp_path / "bomb.json"
    bomb.write_bytes(small_manifest_declaring(32 * MiB))
    assert len(bomb.read_bytes()) < 8 * 1024
    case("manifest declaring 32 MiB", str(bomb))
    liar = tmp_path / "liar.json"
    liar.write_bytes(lying_manifest(32 * MiB))
    case("manifest inflating past its declared size", str(liar))
    probes = default_probes(1000, "child", n=4, length=16)
    ref_store = case("reference of other lengths", "reference")
    write_probes(ref_store, probes)
    ref = {"format_version": 1, "step": 5, "probes_digest": probes.digest, "dtype": "bfloat16"}
    ref_store.put("references/000000000005.json", json.dumps({**ref, "logprobs": [[-1.0] * 14] * 4}).encode())

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), *sys.path) if p)}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(cases)], capture_output=True, text=True, timeout=100, env=env
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert {k: v for k, v in out.items() if not k.endswith(" rss")} == {
        "2 GiB probes.json": "ObjectTooLarge",
        "2 GiB manifest": "ObjectTooLarge",
        "probes.json -> /dev/zero": "StorageError",
        "probes.json FIFO": "StorageError",
        "manifest declaring 32 MiB": "ProtocolError",
        "manifest inflating past its declared size": "ProtocolError",
        "reference of other lengths": "ProtocolError",
    }
    worst = max(v for k, v in out.items() if k.endswith(" rss"))
    assert worst <= BUDGET, {k: f"{v / MiB:.1f} MiB" for k, v in out.items() if k.endswith(" rss")}
