"""A node mirror trusts nothing in its folder it did not create (issue 45, point 3).

The attack: the mirror's folder ``<base>/deltasync-<uid>/<run key>`` has a predictable name, and the
base (``/dev/shm``, ``/tmp``) is sticky and writable by every local user. Here a second uid
(``nobody``, through ``setpriv``) pre-creates that folder in such a base, plants symbolic links in it
(``leader.log``, ``prepared/.<pid>-r0.json.<..>.tmp``, ``lock``, a version's pack, the run folder
itself), and the root engine must get a clear :class:`~deltasync.errors.UnsafePath` while the
attacker gets nothing: no file of root's is readable by them, nothing is written through their
links (targets unchanged, nothing created), nothing of theirs is mapped. Then the checks one by
one (modes, owners, parents, links the node's own user left), the index's file names, and the
leader's answers to garbage on its socket.

Runs as root (as this machine and CI do): the tests that need a second uid skip otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import deltasync as ds  # noqa: E402
from deltasync.errors import ProtocolError, UnsafePath  # noqa: E402
from deltasync.serving.engine.mirror import EngineMirror, MirrorOptions  # noqa: E402
from deltasync.serving.engine.prepared import PreparedFile  # noqa: E402
from deltasync.serving.node import _link  # noqa: E402
from deltasync.serving.node.lock import NodeLock  # noqa: E402
from deltasync.serving.node.mirror import NodeMirror  # noqa: E402
from deltasync.serving.node.store import run_key  # noqa: E402
from deltasync.serving.node.versions import step_id  # noqa: E402

NAMES = ["layer.weight", "layer.bias"]
NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]


def _second_uid_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root, to act as a second uid (nobody) and as the engine (CI and this machine run as root)"
    if shutil.which("setpriv") is None:
        return "needs setpriv (util-linux) to run commands as nobody"
    if subprocess.run([*NOBODY, "true"], capture_output=True).returncode:
        return "cannot switch to nobody:nogroup with setpriv here"
    return None


needs_second_uid = pytest.mark.skipif(_second_uid_reason() is not None, reason=str(_second_uid_reason()))


def _state(step: int) -> dict[str, Any]:
    return {
        "layer.weight": torch.full((64, 32), 1.0 + step),
        "layer.bias": torch.arange(32, dtype=torch.float32) + step,
    }


def _push(path: Path, steps: range) -> str:
    with ds.DeltaUploader(str(path), anchor_every=1000, anchor_bytes_fraction=0) as up:
        for s in steps:
            up.push(_state(s), s).result()
    return path.as_uri()


def as_nobody(script: str) -> subprocess.CompletedProcess[str]:
    """``sh -c script`` as uid nobody (its output captured; its exit status not checked)."""
    return subprocess.run([*NOBODY, "sh", "-c", script], capture_output=True, text=True, timeout=60)


@pytest.fixture
def shared_base() -> Iterator[Path]:
    """A sticky folder every user may write, as ``/dev/shm`` is (mode 1777), that nobody can reach: a new
    one in ``/dev/shm`` (else the temp dir), removed after the test."""
    parent = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    base = Path(tempfile.mkdtemp(prefix="deltasync-trust-", dir=parent))
    os.chmod(base, 0o1777)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file of the engine user's (root here), mode 0600, that the attacker points links at."""
    path = tmp_path / "victim"
    path.write_text("root's secret\n")
    path.chmod(0o600)
    return path


def _tree(folder: Path) -> dict[str, tuple[int, int, str]]:
    """Every path below ``folder`` (links not followed): its owner, mode and, for a link, its target."""
    out = {}
    for p in [folder, *folder.rglob("*")]:
        st = p.lstat()
        out[str(p.relative_to(folder))] = (st.st_uid, st.st_mode, os.readlink(p) if p.is_symlink() else "")
    return out


def _untouched(victim: Path) -> None:
    st = victim.stat()
    assert victim.read_text() == "root's secret\n" and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()


# ------------------------------------------------------------------------- a second uid attacks


@needs_second_uid
@pytest.mark.parametrize("mode", ["700", "755", "777"])
def test_a_mirror_folder_another_user_made_first_is_refused_and_they_get_nothing(
    tmp_path: Path, shared_base: Path, victim: Path, mode: str
) -> None:
    """nobody pre-creates the root and the run folder (the run key is predictable from the store URL)
    with the links of the reported attack in it; the root engine is refused at init, writes nothing
    there (their links' targets unchanged, nothing created through them) and maps nothing of theirs."""
    url = _push(tmp_path / "run", range(2))
    fetcher = ds.DeltaFetcher(url)
    root = shared_base / f"deltasync-{os.getuid()}"
    run = root / run_key(fetcher.store.url, fetcher.verify, fetcher.signing_key)
    created = tmp_path / "created-by-root"
    made = as_nobody(
        f"set -e; mkdir -m {mode} {root} {run} {run}/prepared {run}/versions {run}/data {run}/users;"
        f"ln -s {victim} {run}/leader.log; ln -s {created} {run}/spawn.lock; ln -s {victim} {run}/lock;"
        f"ln -s {victim} {run}/prepared/.{os.getpid()}-r0.json.tmp; ln -s {victim} {run}/data/{'a' * 24}.pack;"
        f"chmod {mode} {root} {run}"
    )
    assert made.returncode == 0, made.stderr
    before = _tree(root)
    engine = {n: t.clone() for n, t in _state(0).items()}
    with pytest.raises(UnsafePath) as caught:
        EngineMirror(fetcher, lambda pairs: None, MirrorOptions(seed=engine, seed_step=0, node_dir=root))
    message = str(caught.value)
    assert str(root) in message and "uid 65534" in message and f"mode 0{mode}" in message
    assert "DELTASYNC_NODE_DIR" in message and "0700" in message  # the fix
    assert _tree(root) == before  # nothing written, nothing removed, no link retargeted
    _untouched(victim)
    assert not created.exists()
    # the default root is the same folder: refused the same way
    with pytest.raises(UnsafePath):
        NodeMirror(fetcher, root=root, spawn=False)


@needs_second_uid
def test_the_mirror_folder_as_another_user_s_link_is_refused_wherever_it_points(
    tmp_path: Path, shared_base: Path
) -> None:
    """The root a symbolic link nobody made: to a folder of theirs, or to a folder of root's (a write
    where the attacker chooses): refused both ways, nothing created at either target."""
    fetcher = ds.DeltaFetcher(_push(tmp_path / "run", range(1)))
    root = shared_base / f"deltasync-{os.getuid()}"
    theirs = shared_base / "theirs"
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o700)
    for target in (theirs, ours):
        made = as_nobody(f"set -e; mkdir -p -m 777 {theirs}; rm -f {root}; ln -s {target} {root}")
        assert made.returncode == 0, made.stderr
        with pytest.raises(UnsafePath, match="symbolic link"):
            NodeMirror(fetcher, root=root, spawn=False)
        assert list(theirs.iterdir()) == [] and list(ours.iterdir()) == []


@needs_second_uid
def test_another_user_cannot_read_or_change_a_mirror_root_built(tmp_path: Path, shared_base: Path) -> None:
    """A mirror root built in the shared base: nobody reads no file of it (weights, index, log), writes
    none, and plants nothing (a swapped pack or a link is impossible); a second root worker maps the
    very bits the run holds."""
    url = _push(tmp_path / "run", range(2))
    root = shared_base / f"deltasync-{os.getuid()}"
    node = NodeMirror(ds.DeltaFetcher(url), root=root, spawn=False)
    try:
        node.seed(_state(0), 0)
        version = node.ensure(1)
        PreparedFile(node.dir / "prepared" / f"{os.getpid()}-r0.json").write(None, prepared=1, serving=1)
        files = [p for p in root.rglob("*") if p.is_file()]
        assert any(p.suffix == ".pack" for p in files) and any(p.parent.name == "versions" for p in files)
        tries = "; ".join(
            f"cat {p} >/dev/null 2>&1 && echo read {p}; (echo x >> {p}) 2>/dev/null && echo wrote {p}" for p in files
        )
        plants = f"; ln -s /etc/passwd {node.dir}/leader.log 2>/dev/null && echo planted; mv {root} {root}.x 2>/dev/null && echo moved"
        attempt = as_nobody(tries + plants + "; true")
        assert attempt.stdout == "", attempt.stdout  # nothing read, written, planted or moved
        assert stat.S_IMODE(root.stat().st_mode) == 0o700 and stat.S_IMODE(node.dir.stat().st_mode) == 0o700
        second = NodeMirror(ds.DeltaFetcher(url), root=root, spawn=False)  # another worker, same node
        try:
            got = second.versions.version(1)
            assert got is not None and got.files == version.files
            tensors = got.tensors()
            assert all(torch.equal(tensors[n], _state(1)[n]) for n in NAMES)  # 2.0, not the attacker's bits
        finally:
            second.close()
    finally:
        node.close()


@needs_second_uid
@pytest.mark.parametrize("owner", ["nobody-0755", "root-0777"])
def test_a_parent_another_user_could_rename_the_root_out_of_is_refused(tmp_path: Path, owner: str) -> None:
    """The folder the root lies in: another user's, or writable by all without the sticky bit (anyone
    could move the checked root away and put theirs in its place): refused, naming the fix."""
    base = Path(tempfile.mkdtemp(prefix="deltasync-trust-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        if owner == "nobody-0755":
            os.chown(base, 65534, 65534)
            os.chmod(base, 0o755)
        else:
            os.chmod(base, 0o777)
        fetcher = ds.DeltaFetcher(_push(tmp_path / "run", range(1)))
        with pytest.raises(UnsafePath) as caught:
            NodeMirror(fetcher, root=base / "node", spawn=False)
        assert str(base) in str(caught.value)
        assert ("uid 65534" if owner == "nobody-0755" else "chmod +t") in str(caught.value)
        assert not (base / "node").exists()
        os.chown(base, 0, 0)
        os.chmod(base, 0o1777)  # sticky, as /dev/shm: fine
        node = NodeMirror(fetcher, root=base / "node", spawn=False)
        node.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ------------------------------------------------------------------------- the checks one by one


@pytest.mark.parametrize("mode", [0o755, 0o750, 0o711, 0o701], ids=lambda m: f"{m:04o}")
def test_a_root_of_ours_open_to_others_is_refused(tmp_path: Path, mode: int) -> None:
    root = tmp_path / "node"
    root.mkdir()
    root.chmod(mode)
    with pytest.raises(UnsafePath, match=f"mode 0{mode:o}.*chmod 700"):
        NodeMirror(ds.DeltaFetcher(ds.MemoryStore("trust")), root=root, spawn=False)
    assert list(root.iterdir()) == []


@needs_second_uid
def test_a_root_of_another_owner_is_refused_even_with_mode_0700(tmp_path: Path) -> None:
    root = tmp_path / "node"
    root.mkdir(mode=0o700)
    os.chown(root, 65534, 65534)
    with pytest.raises(UnsafePath, match="owned by another user \\(uid 65534\\)"):
        NodeMirror(ds.DeltaFetcher(ds.MemoryStore("trust")), root=root, spawn=False)
    assert list(root.iterdir()) == []


def test_a_root_of_ours_with_mode_0700_is_used_again_after_a_restart(tmp_path: Path) -> None:
    """The restart case: the folders a previous engine made (ours, 0700) are accepted, its versions read."""
    url = _push(tmp_path / "run", range(2))
    root = tmp_path / "node"
    first = NodeMirror(ds.DeltaFetcher(url), root=root, spawn=False)
    first.seed(_state(0), 0)
    built = first.ensure(1)
    first.users.leave()  # killed without closing: its versions stay
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) & 0o077 == 0 for p in root.rglob("*"))  # folders and files
    again = NodeMirror(ds.DeltaFetcher(url), root=root, spawn=False)
    try:
        assert again.dir == first.dir and again.ensure(1) == built
    finally:
        again.close()


def test_links_left_in_a_folder_of_ours_are_never_followed(tmp_path: Path, victim: Path) -> None:
    """Defence in depth, for links only this user could have left (an owned 0700 root admits nobody
    else): the run folder as a link is refused; a planted ``lock`` or ``leader.log`` is refused; a
    planted report temp file is not written through."""
    store = ds.MemoryStore("trust")
    fetcher = ds.DeltaFetcher(store)
    root = tmp_path / "node"
    root.mkdir(mode=0o700)
    run = root / run_key(store.url, fetcher.verify, fetcher.signing_key)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    run.symlink_to(elsewhere)
    with pytest.raises(UnsafePath, match="symbolic link"):
        NodeMirror(fetcher, root=root, spawn=False)
    assert list(elsewhere.iterdir()) == []
    run.unlink()
    node = NodeMirror(fetcher, root=root, spawn=False)
    try:
        (node.dir / "lock").symlink_to(victim)
        with pytest.raises(UnsafePath, match="symbolic link"):
            NodeLock(node.dir / "lock").acquire(timeout=0.0)
        created = tmp_path / "created-by-root"
        (node.dir / "leader.log").symlink_to(created)
        config = _link.LeaderConfig(node.dir, "file:///nowhere", True, None, None)
        with pytest.raises(UnsafePath, match="leader.log"):
            _link.ensure_leader(config)
        assert not created.exists()
        report = PreparedFile(node.dir / "prepared" / f"{os.getpid()}-r0.json")
        report.path.parent.mkdir(mode=0o700)
        (report.path.parent / f".{report.path.name}.tmp").symlink_to(victim)  # the old, predictable name
        report.write(None, prepared=3, serving=2)
        assert json.loads(report.path.read_text())["prepared"] == 3 and not report.path.is_symlink()
        _untouched(victim)
    finally:
        node.close()


# ------------------------------------------------------------------------- the index's file names


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("file", "../../victim"),
        ("file", "/etc/passwd"),
        ("file", ".hidden.pack"),
        ("file", "a" * 24 + ".pack/.."),
        ("positions", "../" + "a" * 24 + ".pos"),
        ("id", "../000000000002"),
        ("id", step_id(3)),  # an index that names another version than its file
    ],
)
def test_an_index_naming_a_file_the_node_does_not_write_is_refused_and_the_node_keeps_its_versions(
    tmp_path: Path, victim: Path, field: str, bad: str
) -> None:
    url = _push(tmp_path / "run", range(3))
    node = NodeMirror(ds.DeltaFetcher(url), root=tmp_path / "node", spawn=False)
    try:
        node.seed(_state(0), 0)
        good = node.ensure(1)
        doc = good.to_json()
        doc.update(id=step_id(2), step=2)
        if field == "file":
            doc["files"]["layer.weight"][0] = bad
        elif field == "positions":
            doc["positions"] = {"layer.weight": [bad, 0, 1, 4]}
        else:
            doc["id"] = bad
        index = node.versions.index / f"{step_id(2)}.json"
        index.write_text(json.dumps(doc))
        with pytest.raises(UnsafePath, match=f"{index}.*is refused"):
            node.ensure(2)
        assert [v.step for v in node.versions.all_versions()] == [0, 1]  # the last good ones, listed
        _untouched(victim)
        node._tidy()  # the next collection (any build's) deletes the bad index...
        assert not index.exists()
        assert node.ensure(2).step == 2  # ...and the step is built from the last good version
    finally:
        node.close()


def test_an_index_that_is_not_json_or_not_an_object_is_a_protocol_error(tmp_path: Path) -> None:
    node = NodeMirror(ds.DeltaFetcher(ds.MemoryStore("trust")), root=tmp_path / "node", spawn=False)
    try:
        index = node.versions.index / f"{step_id(4)}.json"
        for text in ("{not json", "[1]", '{"id": "000000000004"}', '{"format": "x"}'):
            index.write_text(text)
            with pytest.raises(ProtocolError, match="unreadable"):
                node.versions.read(step_id(4))
        assert node.versions.all_versions() == []
    finally:
        node.close()


# ------------------------------------------------------------------------- the leader's socket


def _ask_raw(node_dir: Path, payload: bytes) -> tuple[int, dict[str, Any]]:
    """Send ``payload`` to the leader of ``node_dir`` as a worker would; its pid and its one answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(_link.socket_name(node_dir))
        pid, _ = _link.peer(sock)
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)  # all it says (the leader still answers)
        with sock.makefile("rb") as lines:
            line = lines.readline()
    return pid, json.loads(line) if line else {}


def test_the_leader_answers_garbage_with_an_error_and_keeps_serving(tmp_path: Path) -> None:
    """Requests of this user's on the leader's socket that are no request (``[1]`` killed the leader
    with a TypeError before) each get a ``protocol_error`` answer from the same leader, which then
    builds the next worker's step."""
    url = _push(tmp_path / "run", range(2))
    engine = {n: t.clone() for n, t in _state(0).items()}
    worker = EngineMirror(
        ds.DeltaFetcher(url), lambda pairs: None, MirrorOptions(seed=engine, seed_step=0, node_dir=tmp_path / "node")
    )
    try:
        assert worker.node.spawn
        _link.ensure_leader(worker.node.leader)
        pids = set()
        for payload in [
            b"[1]\n",
            b"7\n",
            b"not json\n",
            b"\xff\xfe\n",
            b'{"step": "1"}\n',
            b'{"step": -1}\n',
            b'{"step": true}\n',
            b'{"step": 1.5}\n',
            b'{"step": 1, "pace": "yes"}\n',
            b'{"pace": false}\n',
            b'{"step": 1}',  # no end of line: the worker closed half-way
            b"{" + b" " * 8192 + b"}\n",  # longer than any request
        ]:
            pid, answer = _ask_raw(worker.node.dir, payload)
            pids.add(pid)
            assert answer.get("error") == "protocol_error", (payload, answer)
            assert "node leader request" in answer["message"]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:  # one that connects and leaves
            sock.connect(_link.socket_name(worker.node.dir))
            pids.add(_link.peer(sock)[0])
        assert len(pids) == 1  # one leader answered them all
        assert worker.node.versions.version(1) is None  # nothing of it built a step
        assert worker.commit(1).step == 1  # and it builds the next worker's step
        built = worker.node.versions.version(1)
        assert built is not None and built.stats["pid"] in pids
    finally:
        worker.close()
