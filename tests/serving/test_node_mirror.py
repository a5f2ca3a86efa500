"""The node mirror: one version of each step per node, built once by a leader child process.

Workers here are :class:`EngineMirror` objects over plain dict "engines" sharing one node dir, as
the TP ranks of an engine (or several engines) on one node do; the leaders are real child
processes reading a real local store. tests/integrations/test_vllm_node.py runs real vLLM engines.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tensors import bits_equal  # noqa: E402

import deltasync as ds  # noqa: E402
from deltasync.errors import InventoryMismatch, UpdateRolledBack  # noqa: E402
from deltasync.protocol import TensorChange, decode_patch, file_key  # noqa: E402
from deltasync.serving.engine.mirror import EngineMirror, MirrorOptions  # noqa: E402
from deltasync.serving.node.mirror import NodeMirror  # noqa: E402
from deltasync.serving.node.versions import step_id  # noqa: E402

NAMES = [f"layers.{i}.w" for i in range(8)]
SHAPE = (128, 64)
MODEL_BYTES = len(NAMES) * SHAPE[0] * SHAPE[1] * 2


def _state(step: int, seed: int = 5) -> dict[str, Any]:
    """Every step changes ~17% of the elements of every tensor (as AdamW at lr 1e-5 does)."""
    g = torch.Generator().manual_seed(seed)
    out = {n: torch.randn(SHAPE, generator=g).to(torch.bfloat16) for n in NAMES}
    for s in range(1, step + 1):
        g2 = torch.Generator().manual_seed(1000 + s)
        for n in NAMES:
            mask = torch.rand(SHAPE, generator=g2) < 0.17
            out[n] = torch.where(mask, (out[n].float() * 1.01 + 1e-3).to(torch.bfloat16), out[n])
    return out


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return sorted(a) == sorted(b) and all(bits_equal(a[k], b[k]) for k in a)


def _push(path: Path, steps: Iterable[int], seed: int = 5) -> str:
    with ds.DeltaUploader(str(path), anchor_every=1000, anchor_bytes_fraction=0) as up:
        for s in steps:
            up.push(_state(s, seed), s).result()
    return path.as_uri()


class Engine:
    """Live weights behind a loader that copies into them (vLLM's load_weights for unfused names)."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.weights = {k: v.clone() for k, v in state.items()}
        self.loaded: list[list[str]] = []

    def load(self, pairs: Iterable[tuple[str, Any]]) -> None:
        names = []
        for name, t in pairs:
            self.weights[name].copy_(t)
            names.append(name)
        self.loaded.append(names)


def _worker(url: str, node_dir: Path, engine: Engine, *, metrics: Any = None, **kw: Any) -> EngineMirror:
    options = MirrorOptions(seed=dict(engine.weights), seed_step=0, node_dir=node_dir, **kw)
    return EngineMirror(ds.DeltaFetcher(url), engine.load, options, metrics=metrics)


def _data_files(node: NodeMirror) -> set[str]:
    return {p.name for p in node.versions.data.iterdir()}


def _named_files(node: NodeMirror) -> set[str]:
    return {
        f
        for v in node.versions.all_versions()
        for f in [*(e.name for e in v.files.values()), *(p.file for p in v.positions.values())]
    }


def test_workers_share_one_version_and_one_store_read_per_step(tmp_path: Path) -> None:
    steps = 8
    url = _push(tmp_path / "run", range(steps + 1))
    engines = [Engine(_state(0)), Engine(_state(0))]
    workers = [_worker(url, tmp_path / "node", e) for e in engines]
    leaders: list[str] = []
    for w in workers:
        w.node.on_phase = lambda pid, phase: leaders.append(phase) if phase == "start" else None
    assert workers[0].node.dir == workers[1].node.dir
    assert len(workers[0].node.versions.all_versions()) == 1  # the seed, written once for both
    store = ds.open_store(url)
    on_disk = []
    for s in range(1, steps + 1):
        leaders.clear()
        served = workers[0].held.served
        reports = [w.commit(s) for w in workers]
        assert leaders == ["start"], f"step {s}: {len(leaders)} leaders"  # one build, whichever worker asked first
        version = workers[0].node.versions.version(s)
        assert version is not None
        patch = sum(o.size for o in store.list(f"steps/{s:012d}/") if not o.key.endswith("manifest.json"))
        assert version.stats["store_bytes"] == patch  # the step's files, read once for the node
        # the positions of the changed elements, for engines that write only those
        changes = version.changes(served)
        before, after = _state(s - 1), _state(s)
        assert sorted(changes) == NAMES
        for n in NAMES:
            diff = torch.nonzero(before[n].view(-1).view(torch.int16) != after[n].view(-1).view(torch.int16)).view(-1)
            positions = changes[n].positions
            assert positions is not None and torch.equal(torch.from_numpy(positions).long(), diff)
        for e in engines:
            assert _equal(e.weights, _state(s))
        assert all(r.tensors == len(NAMES) for r in reports)
        on_disk.append(workers[0].node.versions.nbytes_on_disk())
    # memory stays flat: the newest version and its parent (each with the positions of its changes: 4
    # bytes per changed element, ~0.34x a bf16 tensor at 17%), whatever the number of steps
    assert max(on_disk[2:]) <= 2 * 1.4 * MODEL_BYTES
    assert max(on_disk[2:]) <= 1.02 * min(on_disk[2:])
    assert _data_files(workers[0].node) == _named_files(workers[0].node)
    for w in workers:
        w.close()
    assert not list(workers[0].node.versions.index.glob("*.json"))  # the last user out removes the versions


@pytest.mark.parametrize("phase", ["start", "synced", "wrote", "publish"])
def test_a_leader_killed_at_any_phase_publishes_nothing(tmp_path: Path, phase: str) -> None:
    url = _push(tmp_path / "run", range(3))
    engine = Engine(_state(0))
    worker = _worker(url, tmp_path / "node", engine)
    worker.commit(1)
    node = worker.node
    node.pace = True
    killed: list[int] = []

    def kill(pid: int, seen: str) -> None:
        if seen == phase and not killed:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    node.on_phase = kill
    with pytest.raises(UpdateRolledBack, match=r"leader \(pid \d+\) died while building step 2; nothing of that step"):
        worker.commit(2)
    assert killed
    assert node.versions.version(2) is None and worker.serving == 1
    assert _equal(engine.weights, _state(1))  # the engine still serves step 1, whole
    assert _data_files(node) == _named_files(node)  # the dead leader's files are gone
    node.on_phase = None
    assert worker.commit(2).step == 2
    assert _equal(engine.weights, _state(2))
    worker.close()


def test_a_run_recreated_at_the_same_url_is_never_served_from_the_old_versions(tmp_path: Path) -> None:
    url = _push(tmp_path / "run", range(2), seed=5)
    first = _worker(url, tmp_path / "node", Engine(_state(0, 5)))
    first.commit(1)
    shutil.rmtree(tmp_path / "run")
    _push(tmp_path / "run", range(2), seed=9)  # another run, same URL, same step numbers
    engine = Engine(_state(0, 9))
    second = EngineMirror(
        ds.DeltaFetcher(url),
        engine.load,
        MirrorOptions(seed=dict(engine.weights), seed_id="other", node_dir=tmp_path / "node"),
    )
    assert second.node.dir == first.node.dir
    second.commit(1)
    assert _equal(engine.weights, _state(1, 9))
    first.close()
    second.close()


def _killed(worker: EngineMirror) -> None:
    """What the node sees of a worker whose process was killed: its registration's lock is released,
    its file stays, and nothing of the mirror is collected (it never closed it)."""
    users = worker.node.users
    path = users.path
    os.close(users.fd)
    users.fd = -1
    worker.close()  # the preparer thread only: the node is not told
    assert path is not None and path.exists()


def test_an_older_step_is_built_next_to_newer_versions_killed_engines_left(tmp_path: Path) -> None:
    """Versions are kept by when they were published, not by step: the version just built for an
    engine behind the node's newest steps survives its build."""
    url = _push(tmp_path / "run", range(6))
    ahead = _worker(url, tmp_path / "node", Engine(_state(0)))
    for s in (4, 5):
        ahead.commit(s)
    _killed(ahead)
    engine = Engine(_state(0))
    behind = _worker(url, tmp_path / "node", engine)
    for s in (1, 2, 3):
        assert behind.commit(s).step == s
        assert _equal(engine.weights, _state(s))
    node = behind.node
    assert {v.step for v in node.versions.all_versions()} == {2, 3}  # the newest two published, 4 and 5 collected
    assert _data_files(node) == _named_files(node)
    behind.close()  # the last live user: the dead one's registration goes, and every version
    assert not list(node.versions.index.glob("*.json")) and not list(node.users.dir.iterdir())


def test_the_leader_deletes_what_killed_engines_left_when_it_leaves(tmp_path: Path) -> None:
    from deltasync.serving.node import _link

    url = _push(tmp_path / "run", range(3))
    worker = _worker(url, tmp_path / "node", Engine(_state(0)))
    pids: list[int] = []
    worker.node.on_phase = lambda pid, phase: pids.append(pid)
    worker.commit(2)
    node = worker.node
    assert node.versions.version(2) is not None and pids
    (leader,) = [p for p in _link._children if p.pid == pids[0]]
    _killed(worker)  # the only engine of the mirror dies
    assert leader.wait(timeout=120) == 0  # the leader saw nobody uses the mirror and left
    assert not list(node.versions.index.glob("*.json")) and not list(node.versions.data.iterdir())
    assert not list(node.users.dir.iterdir())


def test_memory_stores_never_share_a_node_dir(tmp_path: Path) -> None:
    a, b = ds.MemoryStore("same"), ds.MemoryStore("same")
    for store, seed in ((a, 5), (b, 9)):
        with ds.DeltaUploader(store, anchor_bytes_fraction=0) as up:
            up.push(_state(0, seed), 0).result()
    engines = [Engine({k: torch.zeros_like(v) for k, v in _state(0).items()}) for _ in range(2)]
    mirrors = [EngineMirror(ds.DeltaFetcher(s), e.load) for s, e in zip((a, b), engines, strict=True)]
    assert mirrors[0].node.dir != mirrors[1].node.dir and not mirrors[0].node.spawn
    for m in mirrors:
        m.commit(0)
    assert _equal(engines[0].weights, _state(0, 5)) and _equal(engines[1].weights, _state(0, 9))
    private = mirrors[0].node.root
    for m in mirrors:
        m.close()
    assert not private.exists()


def test_a_build_in_this_process_reads_with_a_fetcher_of_its_own(tmp_path: Path) -> None:
    """``max_bytes`` caps the build's own fetcher; the engine's fetcher is read, never changed."""
    store = ds.MemoryStore("own")
    with ds.DeltaUploader(store, anchor_bytes_fraction=0) as up:
        for s in range(3):
            up.push(_state(s), s).result()
    fetcher = ds.DeltaFetcher(store)
    limit = fetcher.max_alloc_bytes
    engine = Engine({k: torch.zeros_like(v) for k, v in _state(0).items()})
    capped = EngineMirror(fetcher, engine.load, MirrorOptions(max_bytes=1024))
    with pytest.raises(UpdateRolledBack) as refused:
        capped.commit(1)
    assert isinstance(refused.value.__cause__, InventoryMismatch)
    capped.close()
    mirror = EngineMirror(fetcher, engine.load, MirrorOptions(max_bytes=2 * MODEL_BYTES))
    for s in (1, 2):
        assert mirror.commit(s).step == s and _equal(engine.weights, _state(s))
    assert fetcher.max_alloc_bytes == limit and fetcher.last_stats is None  # the builds synced with their own
    mirror.close()


def test_a_version_s_index_and_the_leader_s_config_keep_their_form(tmp_path: Path) -> None:
    """The index on disk and the line a leader reads are what engines of other deltasync versions on the
    same node read and write: the same keys, a tensor as ``[file, dtype, shape, offset]`` (index format
    2; format 1 had no offset, and a deltasync of another format keeps its own folder)."""
    import json

    from deltasync.serving.node._link import LeaderConfig
    from deltasync.serving.node.versions import Version, VersionFile

    url = _push(tmp_path / "run", range(1))
    worker = _worker(url, tmp_path / "node", Engine(_state(0)))
    (seed,) = worker.node.versions.all_versions()
    doc = json.loads((worker.node.versions.index / f"{seed.id}.json").read_text())
    assert sorted(doc) == ["base", "digest", "files", "format", "id", "moved", "positions", "stats", "step"]
    assert doc["format"] == 2 and doc["step"] == 0 and doc["digest"] is not None
    file, dtype, shape, offset = doc["files"][NAMES[0]]
    assert (dtype, shape) == ("bfloat16", list(SHAPE)) and (worker.node.versions.data / file).exists()
    assert seed.files[NAMES[0]] == VersionFile(file, "bfloat16", SHAPE, offset)
    assert len({f[0] for f in doc["files"].values()}) == 1  # the seed is one pack, each tensor at a page
    assert all(f[3] % 4096 == 0 for f in doc["files"].values())
    assert Version.from_json(seed.to_json(), seed.data) == seed
    worker.close()
    config = LeaderConfig(tmp_path / "node" / "x", url, "full", b"\x01key", 1 << 20)
    line = json.loads(config.to_json())
    assert line == {
        "dir": str(tmp_path / "node" / "x"),
        "store": url,
        "verify": "full",
        "signing_key": "016b6579",
        "max_bytes": 1 << 20,
    }
    assert LeaderConfig.from_json(config.to_json()) == config


def test_an_engine_writing_only_the_changed_elements_ends_bit_exact(tmp_path: Path) -> None:
    """The positions a version records are those that changed since the version it was built from;
    an engine that serves another version gets none (and loads whole tensors)."""
    url = _push(tmp_path / "run", range(5))
    engines = [Engine(_state(0)), Engine(_state(0))]
    given: list[list[bool]] = [[], []]

    def scatter_for(i: int) -> Any:
        def make(layout: Any) -> Any:
            def scatter(changes: Sequence[TensorChange], tensors: Mapping[str, Any]) -> Any:
                for c in changes:
                    given[i].append(c.positions is not None)
                    flat, full = engines[i].weights[c.tensor].view(-1), tensors[c.tensor].reshape(-1)
                    if c.positions is None:
                        flat.copy_(full)
                    else:
                        pos = torch.from_numpy(c.positions).long()
                        flat[pos] = full[pos]
                return SimpleNamespace(loaded=0, copied=0, scattered=len(given[i]), elements=0)

            return scatter

        return make

    a, b = (_worker(url, tmp_path / "node", e, scatter=scatter_for(i)) for i, e in enumerate(engines))
    a.commit(1)
    a.commit(2)
    assert given[0] and all(given[0])
    assert _equal(engines[0].weights, _state(2))
    b.commit(2)  # b serves step 0, not version 2's base (version 1): whole tensors
    assert given[1] and not any(given[1])
    assert _equal(engines[1].weights, _state(2))
    given[1].clear()
    b.commit(3)
    assert given[1] and all(given[1])
    assert _equal(engines[1].weights, _state(3))
    a.close()
    b.close()


# ------------------------------------------------------------------ registration with CUDA (pinning)


class FakeCuda:
    """cudaHostRegister / cudaHostUnregister stand-ins (CI has no GPU; the device test below runs the
    real ones): records what is registered, and can refuse."""

    def __init__(self, refuse: bool = False) -> None:
        self.live: dict[int, int] = {}
        self.registrations = 0
        self.refuse = refuse

    def register(self, ptr: int, nbytes: int) -> None:
        if self.refuse:
            raise RuntimeError("cudaErrorHostMemoryAlreadyRegistered (test)")
        assert ptr not in self.live, "registered twice"
        self.live[ptr] = nbytes
        self.registrations += 1

    def unregister(self, ptr: int) -> None:
        del self.live[ptr]


def _ptrs(view: dict[str, Any]) -> set[int]:
    return {t.data_ptr() for t in view.values()}


def test_the_versions_an_engine_serves_and_prepares_stay_registered_and_nothing_else(tmp_path: Path) -> None:
    from deltasync.fetcher.metrics import SyncMetrics
    from deltasync.serving.engine.pinning import HostPins

    url = _push(tmp_path / "run", range(5))
    cuda = FakeCuda()
    pins = HostPins(cuda.register, cuda.unregister)
    engine = Engine(_state(0))
    metrics = SyncMetrics()
    worker = _worker(url, tmp_path / "node", engine, pin=pins, metrics=metrics)
    assert set(cuda.live) == _ptrs(worker.held.served_view)  # the seed: what an undo reads
    assert cuda.registrations == len(NAMES)
    # registered views are mapped shared and write-protected (a write faults, never reaching the node)
    assert {_mapping(t.data_ptr())[0] for t in worker.held.served_view.values()} == {"r--s"}
    for s in range(1, 5):
        worker.prepare(s).result()
        assert set(cuda.live) == _ptrs(worker.held.served_view) | _ptrs(worker.held.prepared_view)
        changed = worker.held.prepared.changed_from(worker.held.served)  # type: ignore[union-attr]
        before = cuda.registrations
        assert worker.commit(s).step == s
        assert _equal(engine.weights, _state(s))
        assert cuda.registrations == before  # registered while preparing, not in the pause
        assert set(cuda.live) == _ptrs(worker.held.served_view)
        assert len(changed) == len(NAMES)  # every tensor changes at 17%: each step maps and registers them anew
    # a tensor a step leaves alone keeps its mapping (and its registration): the view reuses it
    version = worker.held.served
    assert version is not None
    again = version.tensors(reuse=version.by_file(worker.held.served_view))
    assert _ptrs(again) == _ptrs(worker.held.served_view)
    assert pins.nbytes == MODEL_BYTES
    assert f"deltasync_engine_pinned_bytes {MODEL_BYTES}" in metrics.render()
    worker.close()
    assert cuda.live == {} and pins.held() == 0


def test_an_engine_whose_pages_cannot_be_registered_updates_from_pageable_memory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from deltasync.serving.engine.pinning import HostPins

    url = _push(tmp_path / "run", range(3))
    pins = HostPins(FakeCuda(refuse=True).register, lambda ptr: None)
    engine = Engine(_state(0))
    worker = _worker(url, tmp_path / "node", engine, pin=pins)
    for s in (1, 2):
        assert worker.commit(s).step == s
        assert _equal(engine.weights, _state(s))
    assert not pins.enabled and pins.held() == 0
    assert caplog.text.count("cannot register the node mirror's pages with CUDA") == 1
    worker.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_engine_updates_bit_exact_from_registered_pages(tmp_path: Path) -> None:
    from deltasync.serving.engine.pinning import HostPins

    url = _push(tmp_path / "run", range(4))
    pins = HostPins()
    engine = Engine({k: v.cuda() for k, v in _state(0).items()})
    worker = EngineMirror(
        ds.DeltaFetcher(url),
        engine.load,
        MirrorOptions(seed=_state(0), seed_step=0, node_dir=tmp_path / "node", pin=pins),
    )
    for s in range(1, 4):
        worker.prepare(s).result()
        assert pins.enabled and pins.held() == 2 * len(NAMES)
        assert worker.commit(s).step == s
        assert _equal({k: v.cpu() for k, v in engine.weights.items()}, _state(s))
    worker.close()
    assert pins.held() == 0


def _mapping(ptr: int) -> tuple[str, int]:
    """The permissions (``r--s``...) and resident KiB of this process's mapping that holds ``ptr`` (a
    version's pack is one mapping of many tensors)."""
    perms = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            perms = line.split()[1] if start <= ptr < end else None
        elif perms is not None and head == "Rss:":
            return perms, int(line.split()[1])
    raise AssertionError(f"no mapping at {ptr:#x}")


def _resident_kib(ptr: int) -> int:
    return _mapping(ptr)[1]


def test_preparing_faults_the_new_version_in_so_the_pause_does_not(tmp_path: Path) -> None:
    url = _push(tmp_path / "run", range(2))
    worker = _worker(url, tmp_path / "node", Engine(_state(0)))
    worker.prepare(1).result()
    view = worker.held.prepared_view
    assert view
    assert {_mapping(t.data_ptr())[0] for t in view.values()} == {"rw-p"}  # not registered: copy-on-write
    for t in view.values():  # every page of each mapping is in place before the pause reads it
        assert _resident_kib(t.data_ptr()) * 1024 >= t.numel() * t.element_size()
    worker.close()


def test_the_leader_does_not_inherit_the_cpu_binding_of_the_worker_that_starts_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's CPU workers bind OpenMP to their own core (``GOMP_CPU_AFFINITY``) and pin themselves:
    a leader that inherited either would build on one busy core for every worker of the node."""
    monkeypatch.setenv("GOMP_CPU_AFFINITY", "0")
    monkeypatch.setenv("OMP_PROC_BIND", "close")
    url = _push(tmp_path / "run", range(2))
    worker = _worker(url, tmp_path / "node", Engine(_state(0)))
    pids: list[int] = []
    worker.node.on_phase = lambda pid, phase: pids.append(pid)
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})  # the starting worker is pinned to one CPU
    try:
        worker.commit(1)
    finally:
        os.sched_setaffinity(0, before)
    env = dict(line.split("=", 1) for line in Path(f"/proc/{pids[0]}/environ").read_text().split("\0") if "=" in line)
    assert "GOMP_CPU_AFFINITY" not in env and "OMP_PROC_BIND" not in env
    assert os.sched_getaffinity(pids[0]) >= before  # every CPU, not the starter's one
    worker.close()


def _no_room_said(exc: BaseException) -> None:
    text = str(exc)
    assert "no room for the node mirror" in text and "DELTASYNC_NODE_DIR" in text and "--shm-size" in text, text


@pytest.mark.parametrize("fails", [0, 1], ids=["pack", "positions"])
def test_a_full_filesystem_is_a_clear_error_and_leaves_the_engine_and_the_node_at_their_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fails: int
) -> None:
    """The build runs in this process here (``spawn=False``) so that the write can fail on cue: the
    filesystem fills up on step 1's pack, or on its positions file after the pack (test_a_real_full_tmpfs_... runs the leader on a
    real full tmpfs where the machine lets it mount one)."""
    from deltasync.serving.node import packs as node_module

    url = _push(tmp_path / "run", range(2))
    engine = Engine(_state(0))
    worker = _worker(url, tmp_path / "node", engine, spawn=False)
    node = worker.node
    real = node_module.write_buffers
    written: list[Path] = []

    def filling(path: Path | str, buffers: Any) -> None:
        path = Path(path)
        if len(written) == fails:
            path.write_bytes(b"\0" * 100)  # a partial file, as a write cut short leaves
            raise OSError(28, "No space left on device", str(path))
        written.append(path)
        real(path, buffers)

    monkeypatch.setattr(node_module, "write_buffers", filling)
    with pytest.raises(UpdateRolledBack) as caught:
        worker.commit(1)
    _no_room_said(caught.value)
    assert worker.serving == 0 and _equal(engine.weights, _state(0))
    assert [v.step for v in node.versions.all_versions()] == [0]
    assert _data_files(node) == _named_files(node)  # nothing of the unfinished version is left
    monkeypatch.setattr(node_module, "write_buffers", real)  # room again: the same step goes through
    assert worker.commit(1).step == 1 and _equal(engine.weights, _state(1))
    worker.close()


def test_a_seed_that_does_not_fit_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from deltasync.errors import DeltaSyncError
    from deltasync.serving.node import packs as node_module

    url = _push(tmp_path / "run", range(1))
    real = node_module.write_buffers

    def filling(path: Path, buffers: Any) -> None:
        def cut_short() -> Any:  # the third tensor does not fit: the file is left half-written
            for i, b in enumerate(buffers):
                if i == 4:
                    raise OSError(28, "No space left on device", str(path))
                yield b

        real(path, cut_short())

    monkeypatch.setattr(node_module, "write_buffers", filling)
    with pytest.raises(DeltaSyncError) as caught:
        _worker(url, tmp_path / "node", Engine(_state(0)), spawn=False)
    _no_room_said(caught.value)
    (run_dir,) = (tmp_path / "node").iterdir()
    assert not list((run_dir / "data").iterdir()) and not list((run_dir / "versions").glob("*.json"))


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterable[Path]:
    """A real 192 KiB tmpfs (the seed, 128 KiB, fits; a version of step 1 does not), where this machine
    lets the test mount one (root with CAP_SYS_ADMIN, as CI's container has); mode 0700, as a node
    folder must be (a tmpfs is mounted 1777 unless told)."""
    import subprocess

    mnt = tmp_path / "shm"
    mnt.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192k,mode=0700", "tmpfs", str(mnt)]).returncode
    ):
        pytest.skip("needs root allowed to mount a tmpfs")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_real_full_tmpfs_fails_the_leaders_build_clearly_and_the_engine_keeps_its_step(
    tmp_path: Path, small_tmpfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import subprocess

    url = _push(tmp_path / "run", range(2))
    engine = Engine(_state(0))
    with caplog.at_level("WARNING", logger="deltasync.node"):
        worker = _worker(url, small_tmpfs, engine)
    assert "MiB free after seeding 0.1 MiB" in caplog.text  # said at init, before any update
    assert worker.node.spawn  # the build runs in the node's leader process
    with pytest.raises(UpdateRolledBack) as caught:
        worker.commit(1)
    _no_room_said(caught.value)
    assert worker.serving == 0 and _equal(engine.weights, _state(0))
    node = worker.node
    assert [v.step for v in node.versions.all_versions()] == [0] and _data_files(node) == _named_files(node)
    subprocess.run(["mount", "-o", "remount,size=2m", str(small_tmpfs)], check=True)
    assert worker.commit(1).step == 1 and _equal(engine.weights, _state(1))
    worker.close()


def _carried(url: str, step: int) -> dict[str, Any]:
    """The positions step ``step``'s patch carries, by tensor, decoded from its files."""
    store = ds.open_store(url)
    m = ds.DeltaFetcher(store).manifest(step)
    keys = {f.path: file_key(step, f.path) for f in m.files}
    got = store.get_many(list(keys.values()))
    return {d.tensor: d.idx for d in decode_patch(m, {p: got[k] for p, k in keys.items()})}


def test_a_build_writes_the_positions_the_patch_carried_without_comparing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The build takes the changed positions from what the fetcher applied (the decoded patch's own),
    never comparing the new tensors with the base version's; the positions files hold exactly those."""
    from deltasync.serving.node import _build

    compared: list[str] = []
    compare = _build.changed_positions

    def spy(old: Any, new: Any) -> Any:
        compared.append("compare")
        return compare(old, new)

    monkeypatch.setattr(_build, "changed_positions", spy)
    url = _push(tmp_path / "run", range(4))
    node = NodeMirror(ds.DeltaFetcher(url), root=tmp_path / "node", spawn=False)
    try:
        node.seed(_state(0), 0)
        for s in (1, 2):
            version = node.ensure(s)
            carried = _carried(url, s)
            assert version.base == step_id(s - 1) and sorted(version.positions) == sorted(carried) == NAMES
            for name, ref in version.positions.items():
                written = np.fromfile(
                    version.data / ref.file, np.int32 if ref.width == 4 else np.int64, ref.count, offset=ref.offset
                )
                assert np.array_equal(written, carried[name])
        assert node.ensure(3).step == 3  # no positions file (two steps folded: denser than POSITIONS_DENSITY)
        assert compared == []
    finally:
        node.close()


def test_a_build_over_an_anchor_load_compares_the_tensors_it_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the fetcher wrote whole tensors (an anchor over a version of unknown step), it cannot say
    which elements changed: the build compares those tensors, and only those, with the base's."""
    from deltasync.serving.node import _build

    compared: list[int] = []
    compare = _build.changed_positions

    def spy(old: Any, new: Any) -> Any:
        compared.append(1)
        return compare(old, new)

    monkeypatch.setattr(_build, "changed_positions", spy)
    url = _push(tmp_path / "run", range(2))
    seed = {n: t.clone() for n, t in _state(1).items()}
    seed[NAMES[0]].view(-1)[:5] = 0  # an engine checkpoint that is not quite step 1
    node = NodeMirror(ds.DeltaFetcher(url), root=tmp_path / "node", spawn=False)
    try:
        node.seed(seed, None, seed_id="engine")
        version = node.ensure(1)
        assert len(compared) == 1  # the one tensor whose bits differed was written whole
        assert sorted(version.positions) == [NAMES[0]]
        ref = version.positions[NAMES[0]]
        written = np.fromfile(version.data / ref.file, np.int32, ref.count, offset=ref.offset)
        want = torch.nonzero(
            seed[NAMES[0]].view(-1).view(torch.int16) != _state(1)[NAMES[0]].view(-1).view(torch.int16)
        )
        assert np.array_equal(written, want.view(-1).numpy())
        assert _equal(version.tensors(), _state(1))
    finally:
        node.close()


def test_the_leader_starts_and_warms_up_before_the_first_step_is_asked_for(tmp_path: Path) -> None:
    """Issue 34: ``EngineMirror.warm`` (an engine's init) starts the node's leader while nothing is asked
    yet, and the leader compiles what a build runs at once; the first step is built by that leader."""
    from deltasync.serving.node import _link

    url = _push(tmp_path / "run", range(2))
    worker = _worker(url, tmp_path / "node", Engine(_state(0)))
    before = {p.pid for p in _link._children}
    assert worker.warm().result(timeout=300) is None
    (leader,) = [p for p in _link._children if p.pid not in before]
    assert leader.poll() is None  # running, with no step asked for
    pids: list[int] = []
    worker.node.on_phase = lambda pid, phase: pids.append(pid)
    worker.commit(1)
    assert set(pids) == {leader.pid} and worker.node.versions.version(1) is not None
    assert "request failed" not in (worker.node.dir / "leader.log").read_text()  # the start was no request
    worker.close()


def test_an_index_replaced_on_disk_is_read_again(tmp_path: Path) -> None:
    """The store keeps what it parsed of each index while the file is the same one (inode, mtime,
    size): one replaced on disk (a rename over it, as publishing does) is read afresh, never served
    from memory."""
    import json
    import os

    from deltasync.serving.node.store import VersionStore
    from deltasync.serving.node.versions import Version, VersionFile

    vs = VersionStore(tmp_path / "node", reader=None, keep=2)  # type: ignore[arg-type]  # read() needs no run

    vid = step_id(1)

    def put(step: int) -> None:
        doc = Version(vid, step, {"w": VersionFile(f"{step:024x}.bin", "float32", (2,))}, vs.data).to_json()
        tmp = vs.index / f".{vid}.json.tmp"
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, vs.index / f"{vid}.json")

    put(3)
    first = vs.read(vid)
    assert first is not None and first.step == 3
    assert vs.read(vid) is first  # the same file: parsed once
    put(12)
    again = vs.read(vid)
    assert again is not None and again.step == 12 and again.files["w"].name == f"{12:024x}.bin"
    (vs.index / f"{vid}.json").unlink()
    assert vs.read(vid) is None


def test_a_build_packs_what_the_step_changes_and_compacts_packs_mostly_superseded(tmp_path: Path) -> None:
    """Each build writes one pack file with the tensors its step changes (the step applied in place in
    it); the tensors it leaves alone stay in the packs they were in, until a pack would be named for
    less than half of its bytes: then they move into the new pack, and the old one is collected once
    no kept version names it. Every version reads back bit-exact."""
    from deltasync.serving.node.store import COMPACT_BELOW

    assert COMPACT_BELOW == 0.5
    names = ["a", "b", "c", "d"]
    g = torch.Generator().manual_seed(3)
    state = {n: torch.randn(64, 32, generator=g).to(torch.bfloat16) for n in names}  # 4 KiB each: no padding
    states = [{n: t.clone() for n, t in state.items()}]
    touched = [names, ["a"], ["b"], ["c"], ["a"]]  # steps 1..5 change these
    for ns in touched:
        for n in ns:
            state[n].view(-1)[::7] = (state[n].view(-1)[::7].float() * 1.01 + 1e-3).to(torch.bfloat16)
        states.append({n: t.clone() for n, t in state.items()})
    with ds.DeltaUploader(str(tmp_path / "run"), anchor_every=1000, anchor_bytes_fraction=0, span_levels=()) as up:
        for s, st in enumerate(states):
            up.push(st, s).result()
    node = NodeMirror(ds.DeltaFetcher((tmp_path / "run").as_uri()), root=tmp_path / "node", spawn=False)
    try:
        node.seed(states[0], 0)
        packs: dict[int, dict[str, str]] = {}
        built = {}
        for s in range(1, 6):
            version = built[s] = node.ensure(s)
            assert _equal(version.tensors(), states[s])
            packs[s] = {n: f.name for n, f in version.files.items()}
            assert {packs[s][n] for n in touched[s - 1]} == {version.stats["pack"]}  # one new pack holds them
        p1 = packs[1]["a"]
        assert set(packs[1].values()) == {p1}  # step 1 changed all four: one pack
        assert [packs[2][n] == p1 for n in names] == [False, True, True, True]  # 3/4 of p1 still named
        assert [packs[3][n] == p1 for n in names] == [False, False, True, True]  # 1/2: not below the bar
        # step 4 changes c: d alone would keep 1/4 of p1 alive, so d moved into step 4's pack
        assert packs[4]["d"] == packs[4]["c"] != p1 and p1 not in packs[4].values()
        # d holds the bits it had: an engine serving step 3 loads c alone
        assert built[4].moved == {"d": built[3].files["d"]} and built[4].changed_from(built[3]) == ["c"]
        assert built[4].changed_from(built[2]) == ["b", "c"]
        assert p1 not in _data_files(node)  # versions 4 and 5 are kept, neither names it
        assert _data_files(node) == _named_files(node)
    finally:
        node.close()


def test_a_format_1_index_still_reads(tmp_path: Path) -> None:
    """A version indexed in format 1 (one data file per tensor, a positions file per tensor named by a
    string) reads as offset 0 and whole files."""
    import json

    from deltasync.serving.node.store import VersionStore

    vs = VersionStore(tmp_path / "node", reader=None, keep=2)  # type: ignore[arg-type]  # read() needs no run
    t = torch.arange(12, dtype=torch.float32).view(3, 4)
    name = "0123456789abcdef01234567"  # format 1's names: 24 hex digits, .bin and .i32 / .i64
    (vs.data / f"{name}.bin").write_bytes(t.numpy().tobytes())
    (vs.data / f"{name}.i32").write_bytes(np.array([1, 5, 7], dtype=np.int32).tobytes())
    doc = {
        "format": 1,
        "id": step_id(2),
        "step": 2,
        "digest": None,
        "files": {"w": [f"{name}.bin", "float32", [3, 4]]},
        "stats": {},
        "base": "v1",
        "positions": {"w": f"{name}.i32"},
    }
    (vs.index / f"{step_id(2)}.json").write_text(json.dumps(doc))
    version = vs.read(step_id(2))
    assert version is not None and version.files["w"].offset == 0
    assert torch.equal(version.tensors()["w"], t)
    served = SimpleNamespace(id="v1", files={"w": None})
    change = version.changes(served, ["w"])["w"]  # type: ignore[arg-type]
    assert change.positions is not None and change.positions.tolist() == [1, 5, 7]
    doc["format"] = 3  # a newer deltasync's: a clear error, not a guess
    (vs.index / f"{step_id(3)}.json").write_text(json.dumps(doc))
    with pytest.raises(ds.errors.DeltaSyncError, match="index format 3"):
        vs.read(step_id(3))


def test_a_data_file_cut_short_is_a_clear_error_and_the_node_keeps_its_versions(tmp_path: Path) -> None:
    from deltasync.errors import DeltaSyncError

    url = _push(tmp_path / "run", range(2))
    node = NodeMirror(ds.DeltaFetcher(url), root=tmp_path / "node", spawn=False)
    try:
        seed = node.seed(_state(0), 0)
        (pack,) = {f.name for f in seed.files.values()}
        path = seed.data / pack
        os.truncate(path, path.stat().st_size // 2)
        with pytest.raises(DeltaSyncError, match="cut short"):
            node.ensure(1)
        assert [v.step for v in node.versions.all_versions()] == [0]
        assert _data_files(node) == _named_files(node)  # what the failed build wrote is gone
    finally:
        node.close()
