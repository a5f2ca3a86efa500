"""Store-mutation fuzz: "bit-identical, or a clear error with the target at its last good state".

A small REAL run is written once per session by :class:`deltasync.DeltaUploader` into a
MemoryStore (cases copy it into a fresh MemoryStore, or, every fifth seed, a LocalStore): two anchors (several shards each) and patches, every dtype of protocol v1
(0-d and empty tensors included), and tensors whose changes drive the writer to every
coding it has (``rice``/``rice-z``/``dense`` positions, ``raw``/``xor-rank`` values,
rank escapes, big ``rice-z`` quotients, Rice parameters above 8, several patch files
per step). Each case copies the run's objects into a fresh MemoryStore and mutates
ONE of them (bytes, JSON structure, or a data file rewritten with the manifest's
sizes and digests fixed up so that only the semantics are wrong; a rewritten manifest's
children and HEAD are re-linked to its new digest). Then:

- zero: a fresh verifying fetcher syncs an all-zero target of the run's inventory to the latest step;
- held: a fresh fetcher syncs a target to an earlier step, then to the latest;
- claimed: a fresh fetcher syncs a target holding step j, told ``have_step=k`` (j != k half of the time);
- pristine-held: a fetcher syncs a target to an earlier step of the unmutated run, then the
  mutation lands in that store (bit rot, a bad later commit) and it syncs to the latest;
- mat: ``materialize`` into a fresh dir, then (held dir) an earlier step then the latest.

Fetchers verify (``verify=True``; every third seed ``verify="full"``). Every call must end with the exact state of the step it returned (bit-equal, compared as
integers), or raise a :mod:`deltasync.errors` exception with the target (dir) exactly as
it was before the call. Anything else fails and prints the command that replays the case.

Environment: ``DELTASYNC_FUZZ_CASES=n`` (default 1500) cases, seeds ``0..n-1``;
``DELTASYNC_FUZZ_SEED=s`` runs only case ``s``; ``DELTASYNC_FUZZ_REPORT=path`` writes the
outcome counts as JSON. Run with ``-s`` to see the summary.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import deltasync as ds
from deltasync.errors import DeltaSyncError
from deltasync.protocol import manifest_key, parse_manifest_key, xxh3_128
from deltasync.protocol.encoding import EncodedTensor, encode_changes
from deltasync.protocol.keys import HEAD_KEY
from deltasync.protocol.manifest import canonical_json
from deltasync.protocol.patchfile import build_patch_files
from deltasync.protocol.safetensors_io import parse_safetensors

torch = pytest.importorskip("torch")

# ------------------------------------------------------------------ the run

STEPS = (0, 1, 2, 5, 6, 8, 9)  # anchor_every=4: anchors at 0 and 6, patches between (numbers may skip)
SHARD_BYTES = 6000  # several anchor shards and several patch files per step
RUN_ID = "fuzz-run"
DEFAULT_CASES = 1500
CASES_PER_CHUNK = 100
LOCAL_EVERY = 5  # seeds divisible by this run on a LocalStore
FULL_EVERY = 3  # seeds that are 1 modulo this verify="full"
BITS = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
TIED = ("tied.emb", "tied.head")  # the second name shares the first one's tensor


@dataclass(frozen=True)
class Spec:
    """One tensor of the fuzz run and how it changes from step to step."""

    name: str
    dtype: Any
    shape: tuple[int, ...]
    mode: str
    n: int = 0

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def width(self) -> int:
        return int(torch.empty((), dtype=self.dtype).element_size())


def _specs() -> tuple[Spec, ...]:
    every = [
        ("bf16", torch.bfloat16),
        ("f16", torch.float16),
        ("f32", torch.float32),
        ("f64", torch.float64),
        ("f8e4m3", torch.float8_e4m3fn),
        ("f8e5m2", torch.float8_e5m2),
        ("i8", torch.int8),
        ("u8", torch.uint8),
        ("i16", torch.int16),
        ("u16", torch.uint16),
        ("i32", torch.int32),
        ("u32", torch.uint32),
        ("i64", torch.int64),
        ("u64", torch.uint64),
        ("bool", torch.bool),
    ]
    out = [Spec(f"dt.{n}", d, (5, 3), "sparse") for n, d in every]
    out += [Spec(f"scalar.{n}", d, (), "scalar") for n, d in every[::3]]
    out += [Spec("empty.bf16", torch.bfloat16, (0,), "none"), Spec("empty.i64", torch.int64, (3, 0), "none")]
    # tied weights: one tensor under two names, in the pushed state and in the targets
    out += [Spec(TIED[0], torch.bfloat16, (8, 8), "sparse"), Spec(TIED[1], torch.bfloat16, (8, 8), "sparse")]
    out += [
        Spec("code.rice_raw", torch.bfloat16, (64, 4), "const", 12),  # rice + raw
        Spec("code.rice_xor", torch.bfloat16, (32, 16), "lowbit", 40),  # rice + xor-rank
        Spec("code.rice_esc", torch.float16, (2048,), "escape", 900),  # rice + xor-rank with escapes
        Spec("code.ricez_xor", torch.bfloat16, (100, 100), "lowbit", 4200),  # rice-z + xor-rank
        Spec("code.ricez_raw", torch.float32, (10000,), "const", 4200),  # rice-z + raw
        Spec("code.ricez_esc", torch.int16, (10000,), "escape", 4300),  # rice-z + xor-rank with escapes
        Spec("code.ricez_bigq", torch.int8, (10000,), "bigq", 4200),  # rice-z, quotients >= 255
        Spec("code.dense", torch.bfloat16, (64, 64), "dense"),  # dense + xor-rank
        Spec("code.rice_bigk", torch.int16, (4096,), "lowbit", 3),  # rice with k > 8
    ]
    return tuple(sorted(out, key=lambda s: s.name))


SPECS = _specs()


def _initial(rng: np.random.Generator, s: Spec) -> np.ndarray:
    w = s.width
    if s.dtype == torch.bool:
        return rng.integers(0, 2, s.numel).astype(np.int8)
    return rng.integers(-(2 ** (8 * w - 1)), 2 ** (8 * w - 1), s.numel, dtype=BITS[w])


def _evolve(rng: np.random.Generator, s: Spec, old: np.ndarray) -> np.ndarray:
    """The next step's bits of one tensor (its ``mode`` decides which coding the writer picks)."""
    new = old.copy()
    if s.numel == 0 or s.mode == "none":
        return new
    one = new.dtype.type(1)
    if s.dtype == torch.bool:
        idx = rng.choice(s.numel, size=min(s.numel, int(rng.integers(1, 4))), replace=False)
        new[idx] ^= one
        return new
    if s.mode == "scalar":
        if rng.random() < 0.7:
            new[0] = _initial(rng, s)[0]
    elif s.mode == "sparse":
        idx = rng.choice(s.numel, size=int(rng.integers(1, 4)), replace=False)
        new[idx] = _initial(rng, s)[: idx.size] if s.numel >= idx.size else new[idx]
    elif s.mode == "lowbit":
        idx = rng.choice(s.numel, size=s.n, replace=False)
        new[idx] ^= one
    elif s.mode == "const":
        idx = rng.choice(s.numel, size=s.n, replace=False)
        new[idx] = _initial(rng, s)[0]
    elif s.mode == "escape":
        idx = rng.choice(s.numel, size=s.n, replace=False)
        masks = np.where(rng.random(s.n) < 0.7, 1, rng.integers(2, 2 ** (8 * s.width - 1), s.n))
        new[idx] ^= masks.astype(new.dtype)
    elif s.mode == "bigq":
        far = rng.choice(np.arange(s.n + 300, s.numel), size=3, replace=False)
        new[np.concatenate([np.arange(s.n), far])] ^= one
    elif s.mode == "dense":
        idx = rng.choice(s.numel, size=s.numel * 99 // 100, replace=False)
        new[idx] ^= one
    return new


def _tensor(s: Spec, bits: np.ndarray) -> Any:
    t = torch.from_numpy(bits.copy())
    t = t.to(torch.bool) if s.dtype == torch.bool else t.view(s.dtype)  # bool bits are 0/1
    return t.reshape(s.shape)


def _bits(t: Any) -> np.ndarray:
    """A copy of a tensor's flat bits as signed integers (0-d and empty tensors included)."""
    flat = t.detach().contiguous().reshape(-1)
    return (
        flat.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]).numpy().copy()
    )


@dataclass
class Run:
    """The pristine run: its objects and the exact state of every committed step."""

    objects: dict[str, bytes]
    states: dict[int, dict[str, np.ndarray]]
    kinds: dict[int, str]

    @property
    def latest(self) -> int:
        return STEPS[-1]

    def parent(self, step: int) -> int:
        return STEPS[STEPS.index(step) - 1]

    def target_of(self, step: int) -> dict[str, Any]:
        """A target holding the exact state of ``step`` (tied names share one tensor)."""
        out = {s.name: _tensor(s, self.states[step][s.name]) for s in SPECS}
        out[TIED[1]] = out[TIED[0]]
        return out

    def zero_target(self) -> dict[str, Any]:
        out = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in SPECS}
        out[TIED[1]] = out[TIED[0]]
        return out


def _build_run() -> Run:
    rng = np.random.default_rng(20261123)
    bits = {s.name: _initial(rng, s) for s in SPECS}
    states: dict[int, dict[str, np.ndarray]] = {}
    kinds: dict[int, str] = {}
    store = ds.MemoryStore("fuzz-build")
    ids = itertools.count(1)
    with pytest.MonkeyPatch.context() as mp:
        # writer ids are random by nature: fixed here so that every seed replays the same bytes
        mp.setattr(uuid, "uuid4", lambda: uuid.UUID(int=(0xF0220000 + next(ids)) << 96))
        with ds.DeltaUploader(
            store,
            anchor_every=4,
            anchor_bytes_fraction=0,
            shard_bytes=SHARD_BYTES,
            run_id=RUN_ID,
            encode_threads=1,
            max_pending=1,
            on_backlog="block",
            # the mutations edit format 1's JSON (format 2's hostile fields: test_protocol_golden_v2,
            # and the corruption tests run on both formats)
            format_version=1,
            retries=0,
        ) as up:
            for i, step in enumerate(STEPS):
                if i:
                    bits = {s.name: _evolve(rng, s, bits[s.name]) for s in SPECS}
                bits[TIED[1]] = bits[TIED[0]]
                states[step] = {n: b.copy() for n, b in bits.items()}
                state = {s.name: _tensor(s, bits[s.name]) for s in SPECS}
                state[TIED[1]] = state[TIED[0]]
                info = up.push(state, step).result(60)
                kinds[step] = info.kind
    keys = [o.key for o in store.list("")]
    return Run(store.get_many(keys), states, kinds)


@pytest.fixture(scope="module")
def run() -> Run:
    return _build_run()


# ------------------------------------------------------------------ coding coverage


def _codings(r: Run) -> set[str]:
    seen: set[str] = set()
    for step in STEPS:
        m = json.loads(r.objects[manifest_key(step)])
        if m["kind"] == "anchor":
            seen.add("anchor-multi-shard" if len(m["files"]) > 2 else "anchor")
            continue
        if len(m["files"]) > 1:
            seen.add("multi-file-patch")
        for e in m["entries"]:
            seen.add(f"{e['positions']}+{e['values']}")
            data = r.objects[_key(step, e["file"])]
            if e["positions"] != "dense" and e["rice_k"] > 8:
                seen.add("rice-k>8")
            if e["values"] == "xor-rank":
                v = data[e["values_range"][0] : e["values_range"][1]]
                if int.from_bytes(v[:2], "little") == 255:
                    seen.add("xor-rank-escapes")
            if e["positions"] == "rice-z":
                p = data[e["positions_range"][0] : e["positions_range"][1]]
                plen = int.from_bytes(p[:4], "little")
                if int.from_bytes(p[4 + plen : 8 + plen], "little"):
                    seen.add("rice-z-big-quotients")
    return seen


REQUIRED_CODINGS = {
    "anchor-multi-shard",
    "multi-file-patch",
    "rice+raw",
    "rice+xor-rank",
    "rice-z+raw",
    "rice-z+xor-rank",
    "dense+xor-rank",
    "rice-k>8",
    "xor-rank-escapes",
    "rice-z-big-quotients",
}


def test_run_covers_every_coding_and_dtype(run: Run) -> None:
    """The built run holds every coding the writer can produce and every dtype of protocol v1."""
    assert [run.kinds[s] for s in STEPS] == ["anchor", "patch", "patch", "patch", "anchor", "patch", "patch"]
    missing = REQUIRED_CODINGS - _codings(run)
    assert not missing, f"the fuzz run lacks codings {sorted(missing)}: adjust the specs' change modes"
    inv = json.loads(run.objects[manifest_key(0)])["inventory"]
    from deltasync.protocol.dtypes import DTYPES

    assert {t["dtype"] for t in inv} == set(DTYPES)
    assert any(t["shape"] == [] for t in inv) and any(0 in t["shape"] for t in inv)
    # the semantic mutations rebuild patches from the states: unmodified, that is byte-exact
    for step in STEPS:
        if run.kinds[step] == "patch":
            files, entries = _rebuild_patch(run, step, lambda items: items)
            for name, data in files.items():
                assert data == run.objects[_key(step, name)]
            m = json.loads(run.objects[manifest_key(step)])
            assert [e.to_json() for e in entries] == m["entries"]


# ------------------------------------------------------------------ mutations


class NotApplicable(Exception):
    """This mutation does not fit the object the case drew; draw another."""


@dataclass
class Case:
    """One mutated copy of the run."""

    seed: int
    objects: dict[str, bytes]
    kind: str = ""
    detail: str = ""
    expect_exact: bool = False  # a valid store: every call must reach its step exactly


def _key(step: int, name: str) -> str:
    return f"steps/{step:012d}/{name}"


def _manifest_steps(objs: dict[str, bytes]) -> list[int]:
    return sorted(s for k in objs if (s := parse_manifest_key(k)) is not None)


def _load(objs: dict[str, bytes], step: int) -> dict[str, Any]:
    raw = json.loads(objs[manifest_key(step)])
    assert isinstance(raw, dict)
    return raw


def _store_manifest(case: Case, step: int, raw: Any, relink: bool = True) -> None:
    """Write a (mutated) manifest; re-link its children's parent_digest and HEAD to its new digest."""
    key = manifest_key(step)
    body = json.dumps(raw, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    case.objects[key] = body
    if not relink:
        return
    digest = xxh3_128(body)
    head = case.objects.get(HEAD_KEY)
    if head is not None:
        try:
            h = json.loads(head)
            if isinstance(h, dict) and h.get("step") == step:
                h["manifest_digest"] = digest
                case.objects[HEAD_KEY] = canonical_json(h)
        except ValueError:
            pass
    for child in _manifest_steps(case.objects):
        if child <= step:
            continue
        try:
            c = _load(case.objects, child)
        except (ValueError, AssertionError):
            continue
        if c.get("parent_step") == step and c.get("parent_digest") != digest:
            c["parent_digest"] = digest
            _store_manifest(case, child, c)


def _fix_file(raw: dict[str, Any], name: str, data: bytes | None) -> None:
    """Make the manifest's file list (and stats.nbytes) agree with ``data`` (None: drop the file)."""
    files = [f for f in raw["files"] if f["path"] != name]
    if data is not None:
        files.append({"path": name, "size": len(data), "xxh3_128": xxh3_128(data)})
    raw["files"] = sorted(files, key=lambda f: f["path"])
    raw["stats"]["nbytes"] = sum(f["size"] for f in raw["files"])


def _data_key(rng: random.Random, case: Case, kind: str | None = None) -> tuple[int, str]:
    keys = [k for k in case.objects if k.startswith("steps/") and not k.endswith("/manifest.json")]
    if kind is not None:
        keys = [k for k in keys if kind in k]
    key = rng.choice(sorted(keys))
    _, step, name = key.split("/", 2)  # the name may be in the writer's subfolder: w<writer id>/<name>
    return int(step), name


def _byte_edit(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """One random byte-level edit: bit flips, truncation, extension or overwritten bytes."""
    op = rng.choice(["flip", "flip", "truncate", "extend", "overwrite"])
    b = bytearray(data)
    if op == "flip" and b:
        where = []
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(min(len(b), 400)) if rng.random() < 0.5 else rng.randrange(len(b))
            bit = rng.randrange(8)
            b[i] ^= 1 << bit
            where.append(f"{i}.{bit}")
        return bytes(b), f"flip bits {','.join(where)}"
    if op == "truncate" and b:
        n = rng.randrange(len(b))
        return bytes(b[:n]), f"truncate to {n} of {len(b)}"
    if op == "overwrite" and b:
        i = rng.randrange(len(b))
        n = rng.randint(1, 8)
        b[i : i + n] = bytes(rng.randrange(256) for _ in range(min(n, len(b) - i)))
        return bytes(b), f"overwrite {n} bytes at {i}"
    extra = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))) if rng.random() < 0.5 else b"\0" * 8
    return data + extra, f"extend by {len(extra)} bytes"


def m_bytes(rng: random.Random, case: Case, run: Run) -> None:
    """A byte-level edit of any object (data file, manifest, HEAD, writer claim, index)."""
    key = rng.choice(sorted(case.objects))
    case.objects[key], what = _byte_edit(rng, case.objects[key])
    case.detail = f"{key}: {what}"


def m_bytes_fixed(rng: random.Random, case: Case, run: Run) -> None:
    """A byte-level edit of a data file, with the manifest's size and xxh3-128 fixed up."""
    step, name = _data_key(rng, case)
    data, what = _byte_edit(rng, case.objects[_key(step, name)])
    case.objects[_key(step, name)] = data
    raw = _load(case.objects, step)
    _fix_file(raw, name, data)
    _store_manifest(case, step, raw)
    case.detail = f"{_key(step, name)}: {what}; manifest size/digest fixed up"


def m_delete(rng: random.Random, case: Case, run: Run) -> None:
    """Delete one object."""
    key = rng.choice(sorted(case.objects))
    del case.objects[key]
    case.detail = f"delete {key}"


def m_swap_steps(rng: random.Random, case: Case, run: Run) -> None:
    """An object of one step stored under another step (same name), optionally fixed up in the manifest."""
    key = rng.choice(sorted(k for k in case.objects if k.startswith("steps/")))
    _, folder, name = key.split("/", 2)
    step = int(folder)
    others = [s for s in STEPS if s != step and _key(s, name) in case.objects]
    if not others:
        raise NotApplicable
    other = rng.choice(others)
    case.objects[key] = case.objects[_key(other, name)]
    case.detail = f"{key} := the same file of step {other}"
    if name != "manifest.json" and rng.random() < 0.5:
        raw = _load(case.objects, step)
        _fix_file(raw, name, case.objects[key])
        _store_manifest(case, step, raw)
        case.detail += "; manifest size/digest fixed up"


def m_add_object(rng: random.Random, case: Case, run: Run) -> None:
    """An extra object: garbage or a copied manifest under a new step, an orphan file, a newer writer claim."""
    op = rng.choice(["manifest-copy", "manifest-garbage", "orphan", "claim", "claim"])
    new_step = rng.choice([3, 10, 11, 10**12 - 1])
    if op == "manifest-copy":
        src = rng.choice(STEPS)
        case.objects[manifest_key(new_step)] = case.objects[manifest_key(src)]
        case.detail = f"manifest of step {src} copied to step {new_step}"
    elif op == "manifest-garbage":
        case.objects[manifest_key(new_step)] = rng.choice([b"", b"{}", b"null", b'{"format_version":1}', b"\xff" * 9])
        case.detail = f"garbage manifest at step {new_step}"
    elif op == "orphan":
        step = rng.choice(STEPS)
        case.objects[_key(step, "patch-00077.safetensors")] = b"\0" * 16
        case.detail = f"orphan file under step {step}"
    else:
        after = rng.choice([*STEPS, None])
        epoch = rng.choice([2, 2, 1, 0, 7])
        body = canonical_json({"format_version": 1, "epoch": epoch, "writer": "intruder", "after_step": after})
        case.objects[f"writers/{epoch:012d}.json"] = body
        case.detail = f"writer claim epoch {epoch} after_step {after}"


def _json_paths(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _json_paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _json_paths(v, (*path, i))


def _get(root: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        root = root[p]
    return root


_BIG = [2**31, 2**32 + 1, 2**40, 2**48, 2**48 + 1, 2**62, 2**63, 2**64, 10**12]


def _odd_value(rng: random.Random, v: Any) -> Any:
    if isinstance(v, bool):
        return rng.choice([not v, 1, None])
    if isinstance(v, int):
        return rng.choice([v + 1, v - 1, 0, -1, v * 2, v + 7, rng.choice(_BIG), True, str(v), float(v), None])
    if isinstance(v, str):
        pool = ["", "x", "../x", "a/b", v + "x", v[:-1], "BF16", "F8_E4M3", "U64", "BOOL", "I4", "rice", "rice-z"]
        pool += ["dense", "raw", "xor-rank", "anchor", "patch", "0" * 32, "f" * 64, "manifest.json", v.upper()]
        return rng.choice(pool)
    if isinstance(v, list):
        return rng.choice([[], v + v, v[::-1], [v], None, {}])
    if isinstance(v, dict):
        return rng.choice([{}, None, [], {"x": 1}])
    return rng.choice([0, "", [], {}])


def _json_edit(rng: random.Random, raw: Any) -> str:
    """One structural edit of a JSON document, in place; returns what it did."""
    paths = [(p, v) for p, v in _json_paths(raw) if p]
    if not paths:
        raise NotApplicable
    op = rng.choice(["drop", "add", "change", "change", "change", "list", "swap"])
    path, v = rng.choice(paths)
    parent = _get(raw, path[:-1])
    if op == "drop":
        del parent[path[-1]]
        return f"drop {path}"
    if op == "add":
        dicts = [p for p, n in _json_paths(raw) if isinstance(n, dict)]
        where = _get(raw, rng.choice(dicts))
        where[rng.choice(["x_unknown", "signature", "extra", "writer", "format_version", "count"])] = rng.choice(
            [1, "x", None, {"a": "b"}]
        )
        return "add a field"
    if op == "list":
        lists = [(p, n) for p, n in _json_paths(raw) if isinstance(n, list) and n]
        if not lists:
            raise NotApplicable
        p, lst = rng.choice(lists)
        i = rng.randrange(len(lst))
        sub = rng.choice(["drop", "dup", "swap"])
        if sub == "drop":
            del lst[i]
        elif sub == "dup":
            lst.insert(i, json.loads(json.dumps(lst[i])))
        else:
            j = rng.randrange(len(lst))
            lst[i], lst[j] = lst[j], lst[i]
        return f"list {sub} at {p}[{i}]"
    if op == "swap":
        same = [(p, w) for p, w in paths if type(w) is type(v) and p != path and p[:-1] != path]
        if not same:
            raise NotApplicable
        p2, w = rng.choice(same)
        try:
            _get(raw, p2[:-1])[p2[-1]], parent[path[-1]] = v, w
        except (KeyError, IndexError, TypeError):
            raise NotApplicable from None
        return f"swap {path} <-> {p2}"
    parent[path[-1]] = new = _odd_value(rng, v)
    return f"set {path} = {new!r:.60}"


def m_json(rng: random.Random, case: Case, run: Run) -> None:
    """A structural JSON edit of a manifest (children re-linked or not), HEAD.json or a writer claim."""
    keys = [k for k in case.objects if k.endswith(".json") and not k.endswith("index.json")]
    key = rng.choice(sorted(keys))
    raw = json.loads(case.objects[key])
    what = _json_edit(rng, raw)
    step = parse_manifest_key(key)
    if step is not None:
        relink = rng.random() < 0.7
        _store_manifest(case, step, raw, relink=relink)
        case.detail = f"{key}: {what}" + ("; children re-linked" if relink else "")
    else:
        case.objects[key] = json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()
        case.detail = f"{key}: {what}"


Items = list[tuple[str, EncodedTensor]]


def _rebuild_patch(run: Run, step: int, edit: Callable[[Items], Items]) -> tuple[dict[str, bytes], list[Any]]:
    """Re-encode patch ``step`` from the exact states, ``edit`` the coded items, pack the files
    (named as the uploader names them: in the step's writer's subfolder, SPEC.md "Commit rule")."""
    parent, cur = run.states[run.parent(step)], run.states[step]
    items: Items = []
    for name in sorted(cur):
        idx = np.flatnonzero(parent[name] != cur[name]).astype(np.int64)
        if idx.size:
            items.append((name, encode_changes(cur[name].size, idx, parent[name][idx], cur[name][idx])))
    writer = json.loads(run.objects[manifest_key(step)])["writer"]["id"]
    return build_patch_files(step, edit(items), SHARD_BYTES, writer_id=writer)


def _replace_patch(case: Case, step: int, files: dict[str, bytes], entries: list[Any]) -> None:
    raw = _load(case.objects, step)
    for f in raw["files"]:
        case.objects.pop(_key(step, f["path"]), None)
    raw["files"] = []
    for name, data in files.items():
        case.objects[_key(step, name)] = data
        _fix_file(raw, name, data)
    raw["entries"] = [e.to_json() for e in entries]
    _store_manifest(case, step, raw)


def m_semantic_patch(rng: random.Random, case: Case, run: Run) -> None:
    """A patch rewritten with valid codings and a fixed-up manifest, but a wrong change."""
    step = rng.choice([s for s in STEPS if run.kinds[s] == "patch"])
    parent, cur = run.states[run.parent(step)], run.states[step]
    changed = sorted(n for n in cur if not np.array_equal(parent[n], cur[n]))
    victim = rng.choice(changed)
    numel = cur[victim].size
    idx = np.flatnonzero(parent[victim] != cur[victim]).astype(np.int64)
    old, new = parent[victim][idx].copy(), cur[victim][idx].copy()
    op = rng.choice(["value", "position", "extra", "drop-position", "drop-entry", "swap-tensor"])
    one = new.dtype.type(1)
    if op == "value":
        i = rng.randrange(idx.size)
        new[i] ^= one << new.dtype.type(rng.randrange(8 * new.dtype.itemsize - 1))
    elif op == "position":
        free = np.setdiff1d(np.arange(numel), idx)
        if not free.size:
            raise NotApplicable
        i = rng.randrange(idx.size)
        idx[i] = int(rng.choice(free.tolist()))
        order = np.argsort(idx)
        idx, new = idx[order], new[order]
        old = parent[victim][idx]
    elif op == "extra":
        free = np.setdiff1d(np.arange(numel), idx)
        if not free.size:
            raise NotApplicable
        idx = np.sort(np.append(idx, int(rng.choice(free.tolist()))))
        old = parent[victim][idx]
        new = cur[victim][idx].copy()
        new[old == new] ^= one
    elif op == "drop-position":
        if idx.size < 2:
            raise NotApplicable
        keep = np.ones(idx.size, dtype=bool)
        keep[rng.randrange(idx.size)] = False
        idx, old, new = idx[keep], old[keep], new[keep]
    other = rng.choice([n for n in changed if n != victim and cur[n].dtype == cur[victim].dtype] or [victim])

    def edit(items: Items) -> Items:
        out: Items = []
        for name, e in items:
            if name != victim:
                out.append((name, e))
            elif op == "swap-tensor":
                out.append((name, dict(items)[other]))
            elif op != "drop-entry":
                out.append((name, encode_changes(numel, idx, old, new)))
        return out

    files, entries = _rebuild_patch(run, step, edit)
    _replace_patch(case, step, files, entries)
    case.detail = f"step {step}: patch of {victim!r} rewritten ({op}" + (
        f" from {other!r})" if op == "swap-tensor" else ")"
    )


def _forced(rng: random.Random, old_full: np.ndarray, new_full: np.ndarray) -> tuple[EncodedTensor, str]:
    """The change from ``old_full`` to ``new_full`` in a coding drawn at random (SPEC: any valid one may be written)."""
    from deltasync.protocol.positions import encode_rice as _encode_rice
    from deltasync.protocol.streams import byte_planes as _planes
    from deltasync.protocol.streams import compress as _compress
    from deltasync.protocol.values import encode_xor_rank as _encode_xor_rank

    positions = rng.choice(["rice", "rice-z", "dense"])
    values = rng.choice(["raw", "xor-rank"])
    if positions == "dense":
        old, new, pos_blob, k = old_full, new_full, b"", 0
        count = old_full.size
    else:
        idx = np.flatnonzero(old_full != new_full).astype(np.int64)
        old, new, count = old_full[idx], new_full[idx], int(idx.size)
        gaps = np.diff(idx, prepend=-1) - 1
        k = rng.choice([0, 1, 2, 5, 9, 17, 33, 62])
        pos_blob = _encode_rice(gaps, k, positions == "rice-z")
    val_blob = _compress(_planes(new)) if values == "raw" else _encode_xor_rank(old ^ new)
    return EncodedTensor(count, positions, k, values, pos_blob, val_blob), f"{positions}(k={k})+{values}"


def m_recode(rng: random.Random, case: Case, run: Run) -> None:
    """A patch tensor re-coded in another VALID coding (the writer would not pick it): must sync exactly."""
    step = rng.choice([s for s in STEPS if run.kinds[s] == "patch"])
    parent, cur = run.states[run.parent(step)], run.states[step]
    victim = rng.choice(sorted(n for n in cur if not np.array_equal(parent[n], cur[n])))
    enc, what = _forced(rng, parent[victim], cur[victim])
    files, entries = _rebuild_patch(run, step, lambda items: [(n, enc if n == victim else e) for n, e in items])
    _replace_patch(case, step, files, entries)
    case.expect_exact = True
    case.detail = f"step {step}: {victim!r} re-coded as {what}"


def m_semantic_manifest(rng: random.Random, case: Case, run: Run) -> None:
    """A manifest edited in a meaningful way (data untouched, children re-linked)."""
    step = rng.choice(STEPS)
    raw = _load(case.objects, step)
    op = rng.choice(["coding", "count", "range", "range+size", "shape", "shape+size", "digest", "files"])
    if raw["kind"] == "patch" and op in ("coding", "count", "range", "range+size"):
        e = rng.choice(raw["entries"])
        if op == "coding":
            field_, val = rng.choice(
                [("positions", "rice"), ("positions", "rice-z"), ("positions", "dense"), ("values", "raw")]
                + [("values", "xor-rank"), ("rice_k", rng.randrange(63))]
            )
            e[field_] = val
            what = f"entry {e['tensor']!r} {field_} = {val!r}"
        elif op == "count":
            numel = int(np.prod(next(t["shape"] for t in raw["inventory"] if t["name"] == e["tensor"])))
            e["count"] = rng.choice([e["count"] + 1, e["count"] - 1, numel, max(1, numel - 1), 2**40])
            what = f"entry {e['tensor']!r} count = {e['count']}"
        else:
            r = rng.choice(["positions_range", "values_range"])
            size = next(f["size"] for f in raw["files"] if f["path"] == e["file"])
            e[r] = rng.choice([[e[r][0], size + 9], [size, size + 4], [e[r][0], e[r][1] + 1], [e[r][0] - 1, e[r][1]]])
            what = f"entry {e['tensor']!r} {r} = {e[r]}"
            if op == "range+size":
                f = next(f for f in raw["files"] if f["path"] == e["file"])
                f["size"] = max(f["size"], e[r][1])
                raw["stats"]["nbytes"] = sum(x["size"] for x in raw["files"])
                what += "; file size declared to fit"
    elif op in ("shape", "shape+size", "coding", "count", "range", "range+size"):
        t = rng.choice(raw["inventory"])
        t["shape"] = rng.choice([[2**20], [2**40], [2**24, 2**24], [1] * 3 + [2**16], [*t["shape"], 2], [3]])
        from deltasync.protocol import TensorInfo, inventory_digest

        inv = [TensorInfo(x["name"], x["dtype"], tuple(x["shape"])) for x in raw["inventory"]]
        raw["inventory_digest"] = inventory_digest(inv)
        raw["stats"]["total"] = sum(x.numel for x in inv)
        what = f"inventory {t['name']!r} shape = {t['shape']} (inventory digest fixed)"
        if op == "shape+size" and raw["kind"] == "anchor":
            a = next(e for e in raw["entries"] if e["tensor"] == t["name"])
            nbytes = next(x.nbytes for x in inv if x.name == t["name"])
            a["range"] = [a["range"][0], a["range"][0] + nbytes]
            f = next(f for f in raw["files"] if f["path"] == a["file"])
            f["size"] = max(f["size"], a["range"][1])
            raw["stats"]["nbytes"] = sum(x["size"] for x in raw["files"])
            what += "; anchor range and file size declared to fit"
    elif op == "digest":
        name = rng.choice(sorted(raw["tensor_digests"]))
        if rng.random() < 0.3:
            del raw["tensor_digests"][name]
            what = f"tensor digest of {name!r} dropped"
        else:
            raw["tensor_digests"][name] = rng.choice([*raw["tensor_digests"].values(), "0" * 32])
            what = f"tensor digest of {name!r} replaced"
    else:
        f = rng.choice(raw["files"])
        f[rng.choice(["size", "xxh3_128"])] = rng.choice([f["size"] + 1, 0, "0" * 32, xxh3_128(b"")])
        what = f"file entry {f['path']} changed"
    _store_manifest(case, step, raw)
    case.detail = f"step {step} manifest: {what}; children re-linked"


def m_semantic_anchor(rng: random.Random, case: Case, run: Run) -> None:
    """An anchor shard with a tensor's bytes changed (header intact), digest fixed up."""
    step = rng.choice([s for s in STEPS if run.kinds[s] == "anchor"])
    raw = _load(case.objects, step)
    e = rng.choice([e for e in raw["entries"] if e["range"][1] > e["range"][0]])
    key = _key(step, e["file"])
    b = bytearray(case.objects[key])
    i = rng.randrange(e["range"][0], e["range"][1])
    b[i] ^= 1 << rng.randrange(8)
    case.objects[key] = bytes(b)
    _fix_file(raw, e["file"], case.objects[key])
    _store_manifest(case, step, raw)
    case.detail = f"step {step}: anchor bytes of {e['tensor']!r} changed at {i}; file digest fixed up"


MUTATIONS: list[tuple[Callable[[random.Random, Case, Run], None], int]] = [
    (m_bytes, 6),
    (m_bytes_fixed, 6),
    (m_delete, 2),
    (m_swap_steps, 3),
    (m_add_object, 2),
    (m_json, 8),
    (m_semantic_patch, 5),
    (m_semantic_manifest, 5),
    (m_semantic_anchor, 1),
    (m_recode, 3),
]


def make_case(run: Run, seed: int) -> Case:
    """The mutated store of case ``seed`` (deterministic)."""
    rng = random.Random(seed)
    fns = [f for f, w in MUTATIONS for _ in range(w)]
    for _ in range(50):
        case = Case(seed, dict(run.objects))
        fn = rng.choice(fns)
        try:
            fn(rng, case, run)
        except NotApplicable:
            continue
        case.kind = fn.__name__.removeprefix("m_")
        return case
    raise AssertionError(f"seed {seed}: no mutation applied")


# ------------------------------------------------------------------ checking


@dataclass
class Tally:
    """Outcomes of all cases run in this session."""

    outcomes: Counter[str] = field(default_factory=Counter)
    by_op: Counter[str] = field(default_factory=Counter)
    by_mutation: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    cases: int = 0
    seconds: float = 0.0


def replay(seed: int) -> str:
    """The command that runs case ``seed`` alone."""
    return f"DELTASYNC_FUZZ_SEED={seed} python -m pytest tests/test_store_fuzz.py -q -s -k cases"


def _state(target: dict[str, Any]) -> dict[str, np.ndarray]:
    return {n: _bits(t) for n, t in target.items()}


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> list[str]:
    return sorted(n for n in b if n not in a or not np.array_equal(a[n], b[n])) + sorted(set(a) - set(b))


def _outcome(
    run: Run,
    case: Case,
    op: str,
    call: Callable[[], int],
    before: Callable[[], Any],
    after_ok: Callable[[int], list[str]],
) -> tuple[str, bool]:
    """Run one fetcher call; classify it; return (outcome, exact?) and record failures."""
    snap = before()
    try:
        step = call()
    except DeltaSyncError as exc:
        if _differs(before(), snap):
            case_fail(case, op, f"raised {type(exc).__name__} ({exc}) but changed the target/dir")
        elif case.expect_exact and not op.startswith("pristine"):
            # (a fetcher that read the run before may refuse it: committed manifests were rewritten under it)
            case_fail(case, op, f"refused a valid store: {type(exc).__name__} ({exc})")
        return type(exc).__name__, False
    except Exception as exc:  # noqa: BLE001 - anything outside deltasync.errors is the failure we look for
        case_fail(case, op, f"non-deltasync exception {type(exc).__name__}: {exc!s:.300}")
        return f"CRASH:{type(exc).__name__}", False
    if step not in run.states:
        case_fail(case, op, f"returned step {step}, which the run never committed")
        return "WRONG", False
    bad = after_ok(step)
    if bad:
        case_fail(case, op, f"returned step {step} but {bad[:4]} are not that step's bits")
        return "WRONG", False
    return "exact", True


def _differs(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if set(a) != set(b):
        return True
    return any(not (np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] == b[k]) for k in a)


_CURRENT: list[Tally] = []


def case_fail(case: Case, op: str, msg: str) -> None:
    _CURRENT[-1].failures.append(
        f"seed {case.seed} [{case.kind}: {case.detail}] {op}: {msg}\n    replay: {replay(case.seed)}"
    )


def _dir_state(root: Path) -> dict[str, Any]:
    """Every file under ``root`` (its parent's temp dirs included) by relative path."""
    out: dict[str, Any] = {}
    for p in sorted(root.rglob("*")):
        out[str(p.relative_to(root))] = p.read_bytes() if p.is_file() else "dir"
    return out


def _dir_tensors(out: Path) -> tuple[int, dict[str, np.ndarray]]:
    marker = json.loads((out / ".deltasync.json").read_text())
    arrays: dict[str, np.ndarray] = {}
    for p in sorted(out.glob("*.safetensors")):
        data = p.read_bytes()
        st = parse_safetensors(data)
        for e in st.entries.values():
            w = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1}.get(e.dtype) or int(e.dtype[-2:]) // 8
            arrays[e.name] = np.frombuffer(data[e.start : e.end], dtype=BITS[w]).copy()
    return int(marker["step"]), arrays


def _fetcher(store: ds.Store, seed: int) -> ds.DeltaFetcher:
    """A verifying fetcher: ``verify=True``, or ``"full"`` (every tensor proven) for every third seed."""
    return ds.DeltaFetcher(store, verify="full" if seed % FULL_EVERY == 1 else True)


def _store(seed: int, root: Path) -> ds.Store:
    """Every fifth case runs on a LocalStore (files under ``root``), the others on a MemoryStore."""
    return ds.LocalStore(root, fsync=False) if seed % LOCAL_EVERY == 0 else ds.MemoryStore(f"fuzz-{seed}")


def run_case(run: Run, case: Case, tmp: Path) -> list[str]:
    """All calls of one case; returns the outcome labels ``op:outcome``."""
    labels: list[str] = []
    store = _store(case.seed, tmp / "store")
    store.put_many(case.objects)
    pick = random.Random(case.seed ^ 0x5EED)
    k = pick.choice(STEPS[:-1])

    def sync_op(
        op: str, target: dict[str, Any], fetcher: ds.DeltaFetcher, step: int | None, have_step: int | None = None
    ) -> bool:
        res, ok = _outcome(
            run,
            case,
            op,
            lambda: fetcher.sync(target, step=step, have_step=have_step),
            lambda: _state(target),
            lambda s: _same(_state(target), run.states[s]),
        )
        labels.append(f"{op}:{res}")
        return ok

    # (a) from zero
    sync_op("zero", run.zero_target(), _fetcher(store, case.seed), None)
    # (b) from a held earlier step
    held, fetcher = run.zero_target(), _fetcher(store, case.seed)
    sync_op(f"held-to-{k}", held, fetcher, k)
    sync_op("held", held, fetcher, None)
    # (b'') a target holding step j that a fresh fetcher is told holds step k (a lie half of the time)
    j = k if pick.random() < 0.5 else pick.choice([s for s in STEPS if s != k])
    sync_op("claimed" if j == k else "claimed-lie", run.target_of(j), _fetcher(store, case.seed), None, k)
    # (b') held at an earlier step of the pristine run; then the store changes under the fetcher
    pristine = _store(case.seed, tmp / "pristine")
    pristine.put_many(run.objects)
    held, fetcher = run.zero_target(), _fetcher(pristine, case.seed)
    if sync_op(f"pristine-to-{k}", held, fetcher, k):
        pristine.delete_many([key for key in run.objects if key not in case.objects])
        pristine.put_many({key: v for key, v in case.objects.items() if run.objects.get(key) != v})
        sync_op("pristine-held", held, fetcher, None)
    # (c) materialize: into a fresh dir, then a held dir moved on
    for op, steps in (("mat", (None,)), ("mat-held", (k, None))):
        root = tmp / op
        root.mkdir()
        out = root / "ckpt"
        fetcher = _fetcher(store, case.seed)
        for i, step in enumerate(steps):
            name = op if i == len(steps) - 1 else f"{op}-to-{k}"

            def check(s: int, out: Path = out, root: Path = root) -> list[str]:
                stray = sorted(p.name for p in root.iterdir() if p != out)
                if stray:
                    return [f"left {stray} next to the checkpoint dir"]
                got_step, arrays = _dir_tensors(out)
                if got_step != s:
                    return [f"marker says step {got_step}"]
                return _same(arrays, run.states[s])

            res, _ = _outcome(
                run,
                case,
                name,
                lambda step=step, out=out, fetcher=fetcher: int(
                    json.loads((fetcher.materialize(out, step=step) / ".deltasync.json").read_text())["step"]
                ),
                lambda root=root: _dir_state(root),
                check,
            )
            labels.append(f"{name}:{res}")
        shutil.rmtree(root, ignore_errors=True)
    return labels


def _seeds() -> list[int]:
    one = os.environ.get("DELTASYNC_FUZZ_SEED")
    if one is not None:
        return [int(one)]
    return list(range(int(os.environ.get("DELTASYNC_FUZZ_CASES", DEFAULT_CASES))))


def _chunks() -> list[list[int]]:
    seeds = _seeds()
    return [seeds[i : i + CASES_PER_CHUNK] for i in range(0, len(seeds), CASES_PER_CHUNK)]


@pytest.fixture(scope="module")
def tally() -> Iterator[Tally]:
    t = Tally()
    _CURRENT.append(t)
    yield t
    _CURRENT.remove(t)


def _tmp_root() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


@pytest.mark.parametrize("seeds", _chunks(), ids=lambda s: f"cases{s[0]}-{s[-1]}")
def test_store_mutation_cases(run: Run, tally: Tally, seeds: list[int]) -> None:
    """Each mutated store: every sync/materialize ends exact, or in a deltasync error with nothing changed."""
    start = len(tally.failures)
    t0 = time.perf_counter()
    for seed in seeds:
        case = make_case(run, seed)
        tmp = Path(tempfile.mkdtemp(prefix="dsfuzz-", dir=_tmp_root()))
        try:
            labels = run_case(run, case, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        tally.cases += 1
        tally.by_mutation[case.kind] += 1
        for label in labels:
            op, res = label.split(":", 1)
            tally.outcomes[res] += 1
            tally.by_op[f"{op.split('-to-')[0]}:{res}"] += 1
        if len(seeds) == 1:
            print(f"\nseed {seed} [{case.kind}] {case.detail}\n  " + "\n  ".join(labels))
    tally.seconds += time.perf_counter() - t0
    failures = tally.failures[start:]
    assert not failures, f"{len(failures)} failed calls in seeds {seeds[0]}..{seeds[-1]}:\n" + "\n".join(failures[:20])


def test_store_fuzz_summary(tally: Tally) -> None:
    """Print (and with DELTASYNC_FUZZ_REPORT, write) the outcomes by kind; every mutation kind ran."""
    if not tally.cases:
        pytest.skip("no fuzz cases ran in this session")
    failed_seeds = sorted({int(f.split()[1]) for f in tally.failures})
    summary = {
        "cases": tally.cases,
        "calls": sum(tally.outcomes.values()),
        "seconds": round(tally.seconds, 1),
        "outcomes": dict(tally.outcomes.most_common()),
        "by_call": dict(sorted(tally.by_op.items())),
        "by_mutation": dict(tally.by_mutation.most_common()),
        "failed_calls": len(tally.failures),
        "failed_seeds": failed_seeds,
    }
    print("\nstore fuzz:", json.dumps(summary, indent=1))
    report = os.environ.get("DELTASYNC_FUZZ_REPORT")
    if report:
        Path(report).write_text(json.dumps(summary, indent=1) + "\n")
    if tally.cases >= 500:
        assert set(tally.by_mutation) == {f.__name__.removeprefix("m_") for f, _ in MUTATIONS}
        assert tally.outcomes["exact"] > 0 and len(tally.outcomes) > 3
