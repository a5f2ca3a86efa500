"""Checkpoint dirs kept current: :meth:`DeltaFetcher.materialize`, ``deltasync fetch`` and ``follow --out``.

Engines that reload from disk (SGLang ``update_weights_from_disk``, vLLM ``reload_weights``) read
the dir by path, so ``out`` must always be one complete version. Each version is built in a hidden
sibling ``.{name}.tmp-XXXXXXXX`` (marker first, then shards, index, kept files, config files, all
fsynced) and swapped in with ``renameat2(RENAME_EXCHANGE)``: ``out`` is the old version or the new
one, never missing or mixed. The old version (now under the tmp name) is then deleted, its marker
last. Where the exchange is not available (not Linux, a filesystem without it) two renames are used
and a warning says that ``out`` is missing for that moment; a run killed between them is repaired by
the next one (the intact old version is put back first).

Shards whose bytes would not change are hard-linked from the current version instead of being
rewritten: known without reading them again (the same file name, header and tensors, none of which
the plan changed, and the file unchanged since it was decoded). Stale ``.{name}.tmp-*`` /
``.{name}.old-*`` dirs of a killed run are removed on the next run only if they carry the marker
(or are empty) and no live writer holds their lock.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from deltasync.errors import DeltaSyncError, ObjectNotFound, ProtocolError, StorageError
from deltasync.fetcher._apply import check_anchor
from deltasync.fetcher._execute import apply_decoded, decode_plan
from deltasync.fetcher._source import DATA_ERRORS, Source
from deltasync.fetcher._swapdir import MARKER, exchange, fsync_path, lock_dir, reached, recover, remove_version
from deltasync.fetcher._target import HostTensor
from deltasync.protocol import FetchPlan, TensorInfo
from deltasync.protocol.adapter import ADAPTER_CONFIG_KEY, ADAPTER_WEIGHTS_NAME, AdapterConfig, check_adapter_names
from deltasync.protocol.checkpoint import CHECKPOINT_METADATA, INDEX_NAME, checkpoint_shards
from deltasync.protocol.dtypes import dtype_info
from deltasync.protocol.safetensors_io import TensorBytes, encode_header, parse_safetensors
from deltasync.run.adapter import read_adapter_config

__all__ = ["MARKER", "MaterializeStats", "config_files", "load_dir", "materialize"]

log = logging.getLogger("deltasync.materialize")
#: files of a ``config_from`` dir that are weights (or their index), never copied
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".npz", ".npy")
Bits = np.ndarray[Any, np.dtype[Any]]
_warned: set[Path] = set()


@dataclass(slots=True)
class MaterializeStats:
    """What one :meth:`DeltaFetcher.materialize` did (also in ``source.last_materialize``)."""

    step: int
    shards_written: int = 0
    shards_linked: int = 0
    bytes_written: int = 0
    #: files and dirs of the previous version kept in the new one (config.json, tokenizer files...)
    kept: tuple[str, ...] = ()
    #: files copied from ``config_from``
    config: tuple[str, ...] = ()
    #: ``"exchange"`` (atomic), ``"rename"`` (two renames: a short window without ``out``) or ``"new"``
    swap: str = "new"
    recovered: list[str] = field(default_factory=list)


# ------------------------------------------------------------------ config


def config_files(src: str | os.PathLike[str]) -> list[Path]:
    """The non-weight files of an HF model dir (config, generation config, tokenizer, chat template,
    remote code): every plain file except weights, weight indexes and hidden files; no subdirs.
    ObjectNotFound when ``src`` is not a dir or has no ``config.json``."""
    path = Path(src)
    if not path.is_dir():
        raise ObjectNotFound(f"--config-from {path}: no such directory")
    if not (path / "config.json").is_file():
        raise ObjectNotFound(f"--config-from {path}: no config.json there (expected an HF model dir)")
    return sorted(
        p
        for p in path.iterdir()
        if not p.name.startswith(".")
        and not p.name.endswith(WEIGHT_SUFFIXES)
        and not p.name.endswith(".index.json")
        and p.is_file()  # follows symlinks: an HF cache snapshot is all links to blobs
    )


# --------------------------------------------------------------- the dir


@dataclass(frozen=True, slots=True)
class _Shard:
    header: bytes  # length prefix + JSON header, as in the file
    names: tuple[str, ...]  # tensors in file order
    ident: tuple[int, int, int]  # inode, size, mtime_ns when decoded


@dataclass(frozen=True, slots=True)
class DirState:
    """A materialized dir as decoded: its marker's (step, manifest digest), tensors and shards."""

    have: tuple[int, str]
    arrays: dict[str, Bits]
    inventory: tuple[TensorInfo, ...]
    shards: dict[str, _Shard]


def _ident(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_ino, st.st_size, st.st_mtime_ns


def load_dir(out: Path) -> DirState | None:
    """The tensors of a dir this module wrote (None if it is not one, or is damaged). Arrays are
    writable views of each shard's bytes, read once."""
    try:
        marker = json.loads((out / MARKER).read_text())
        have = (int(marker["step"]), str(marker["manifest_digest"]))
        if (out / INDEX_NAME).is_file():
            fnames = sorted(set(json.loads((out / INDEX_NAME).read_text())["weight_map"].values()))
        else:  # an adapter dir: one weights file, no index
            fnames = [ADAPTER_WEIGHTS_NAME]
        arrays: dict[str, Bits] = {}
        infos: list[TensorInfo] = []
        shards: dict[str, _Shard] = {}
        for fname in fnames:
            if not isinstance(fname, str) or "/" in fname or fname.startswith("."):
                return None
            with open(out / fname, "rb") as f:
                ident = _ident(os.fstat(f.fileno()))
                raw = np.fromfile(f, dtype=np.uint8)
            st = parse_safetensors(raw.data, what=str(out / fname))
            for e in st.entries.values():
                if e.name in arrays:
                    return None
                arrays[e.name] = raw[e.start : e.end].view(dtype_info(e.dtype).bits)
                infos.append(TensorInfo(e.name, e.dtype, tuple(e.shape)))
            order = tuple(e.name for e in sorted(st.entries.values(), key=lambda e: e.start))
            shards[fname] = _Shard(raw[: st.data_start].tobytes(), order, ident)
        return DirState(have, arrays, tuple(sorted(infos, key=lambda t: t.name)), shards)
    except (OSError, ValueError, KeyError, TypeError, DeltaSyncError):
        return None


# -------------------------------------------------------------- one version


def _link_or_copy(src: str | Path, dst: str | Path) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


def _write(path: Path, parts: Sequence[Any]) -> int:
    n = 0
    with open(path, "xb") as f:
        for part in parts:
            n += f.write(part)
        f.flush()
        os.fsync(f.fileno())
    return n


def _data(t: TensorBytes) -> Any:
    d = t.data
    return d.reshape(-1).view(np.uint8) if isinstance(d, np.ndarray) else memoryview(d).cast("B")


def _write_version(
    out: Path,
    shards: list[tuple[str, list[TensorBytes]]],
    files: Mapping[str, bytes],
    marker: Mapping[str, Any],
    reusable: Mapping[str, _Shard],
    config: Sequence[Path],
    stats: MaterializeStats,
) -> None:
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    lock = lock_dir(tmp, wait=True)
    old: Path | None = None
    try:
        reached("tmp")
        _write(tmp / MARKER, [json.dumps(dict(marker), indent=2).encode()])  # first: a killed run's tmp is ours
        reached("marker")
        for fname, shard in shards:
            prev = reusable.get(fname)
            if prev is not None and _same_file(out / fname, prev):
                _link_or_copy(out / fname, tmp / fname)
                stats.shards_linked += 1
            else:
                stats.bytes_written += _write(
                    tmp / fname, [encode_header(shard, CHECKPOINT_METADATA)] + [_data(t) for t in shard]
                )
                stats.shards_written += 1
            reached("shard")
        for fname, body in files.items():  # the index (an adapter dir: its adapter_config.json)
            _write(tmp / fname, [body])
        names = {MARKER, *files, *(f for f, _ in shards)}
        kept: list[str] = []
        if out.is_dir():  # keep what the user put next to the weights (config.json, tokenizer files...)
            for p in sorted(out.iterdir()):
                if p.name in names or p.name.endswith(".safetensors"):
                    continue
                if p.is_dir() and not p.is_symlink():
                    shutil.copytree(p, tmp / p.name, symlinks=True, copy_function=_link_or_copy)
                else:
                    _link_or_copy(p, tmp / p.name)
                kept.append(p.name)
        stats.kept = tuple(kept)
        reached("kept")
        for src in config:
            dst = tmp / src.name
            if dst.is_dir() and not dst.is_symlink():
                shutil.rmtree(dst)
            dst.unlink(missing_ok=True)  # a kept file is a link to the live version's: never write through it
            shutil.copy2(src, dst)
            fsync_path(dst)
        stats.config = tuple(p.name for p in config)
        reached("config")
        fsync_path(tmp)
        reached("swap")
        if out.exists():
            if exchange(tmp, out):
                stats.swap, old = "exchange", tmp
            else:
                stats.swap = "rename"
                retire = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
                if out.parent not in _warned:
                    _warned.add(out.parent)
                    log.warning(
                        "%s: no atomic directory exchange here (renameat2 RENAME_EXCHANGE); replacing it with two "
                        "renames, so for a moment it does not exist (a reader may fail to open it then)",
                        out,
                    )
                held = lock_dir(out, wait=True)  # a concurrent run's recover() must not take it for stale
                try:
                    os.rename(out, retire)
                    reached("renamed-old")
                    try:
                        os.rename(tmp, out)
                    except BaseException:
                        os.rename(retire, out)
                        raise
                    old = retire
                finally:
                    if held is not None:
                        os.close(held)
        else:
            os.rename(tmp, out)
        fsync_path(out.parent)
        reached("swapped")
    except BaseException:
        if old is None and tmp.exists():
            remove_version(tmp)
        raise
    finally:
        if lock is not None:
            os.close(lock)
    if old is not None:
        try:
            remove_version(old)
        except OSError as exc:  # the new version is in place: a leftover is removed by the next run
            log.warning("cannot remove the previous version %s: %s", old, exc)
    reached("done")


def _same_file(path: Path, prev: _Shard) -> bool:
    try:
        return _ident(os.stat(path, follow_symlinks=False)) == prev.ident
    except OSError:
        return False


# --------------------------------------------------------------- materialize


def _build(
    source: Source,
    plan: FetchPlan,
    inventory: Sequence[TensorInfo],
    have: tuple[int, str] | None,
    arrays: dict[str, Bits],
) -> tuple[dict[str, Bits], set[str] | None]:
    """Load ``plan`` and apply it onto ``arrays`` (the dir's tensors; a failure undoes the writes).

    Returns the arrays and the names changed (None: an anchor was decoded, compare everything).
    """
    base = source.reader.committed(have[0]).manifest if plan.base == "current" and have else None
    decoded = decode_plan(source, plan, inventory, base)
    changed: set[str] | None = set()
    if decoded.anchor is not None:
        # fresh memory, sized by the anchor's bytes (checked against the inventory)
        arrays = {n: np.array(a) for n, a in decoded.anchor.items()}
        changed = None
    tensors = {n: HostTensor(a, key=n) for n, a in arrays.items()}
    if decoded.anchor is not None:
        check_anchor(
            tensors, decoded.steps[0].manifest, decoded.anchor, verify=bool(source.verify), threads=source.threads
        )
        decoded = dataclasses.replace(decoded, anchor=None)  # decoded already: only the patches are left
    apply_decoded(tensors, decoded, verify=source.verify, threads=source.threads)
    if changed is not None:
        changed.update(n for _, _, names in decoded.patches for n in names)
    return arrays, changed


def _layout(
    source: Source,
    inventory: Sequence[TensorInfo],
    arrays: Mapping[str, Bits],
    shard_bytes: int,
    adapter: AdapterConfig | None,
) -> tuple[list[tuple[str, list[TensorBytes]]], dict[str, bytes]]:
    """The dir's weight files (name, tensors) and its small files by name: a checkpoint's shards and
    index, or for an adapter run (its ``adapter_config.json`` in the store) the PEFT adapter dir's
    ``adapter_model.safetensors`` and ``adapter_config.json``, which vLLM and PEFT load as they are."""
    if adapter is None:
        shards, index = checkpoint_shards(inventory, arrays, shard_bytes)
        return shards, {INDEX_NAME: index}
    try:
        check_adapter_names(t.name for t in inventory)
    except ValueError as exc:
        raise ProtocolError(f"{source.store.url} is an adapter run whose steps are not a LoRA adapter: {exc}") from None
    tensors = [TensorBytes(t.name, t.dtype, t.shape, arrays[t.name]) for t in inventory]
    return [(ADAPTER_WEIGHTS_NAME, tensors)], {ADAPTER_CONFIG_KEY: adapter.to_json()}


def materialize(
    source: Source,
    out_dir: str | os.PathLike[str],
    step: int | None = None,
    config_from: str | os.PathLike[str] | None = None,
    *,
    shard_bytes: int,
    adapter: Callable[..., AdapterConfig | None] | None = None,
) -> tuple[Path, MaterializeStats]:
    """See :meth:`DeltaFetcher.materialize`. ``adapter(committed=True)``: the run's adapter config (None:
    full weights), e.g. the fetcher's cached one; default: read from the store."""
    out = Path(out_dir).absolute()
    config = config_files(config_from) if config_from is not None else []
    target_step = source.target_step(step)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MARKER).is_file())):
        raise StorageError(f"refusing to replace {out}: it exists and was not written by deltasync materialize")
    top = source.reader.committed(target_step)
    inventory = top.manifest.inventory
    stats = MaterializeStats(target_step)
    try:
        stats.recovered = recover(out)
    except OSError as exc:
        raise StorageError(f"cannot clean up after an earlier run next to {out}: {exc.strerror or exc}") from exc
    state = load_dir(out) if out.is_dir() else None
    have: tuple[int, str] | None = None
    arrays: dict[str, Bits] = {}
    if state is not None and state.inventory == inventory:
        arrays = state.arrays
        tensors0 = {n: HostTensor(a, key=n) for n, a in arrays.items()}
        have = source.holds(tensors0, state.have[0]) if source.verify else state.have
        if have is not None and have[1] != state.have[1]:
            have = None  # the marker names another manifest of that step
    plan = source.reader.plan(target_step, have)
    changed: set[str] | None = set()  # None: compare with the dir's tensors
    held = arrays
    while True:
        arrays = {} if plan.base == "anchor" else held
        if plan.is_noop:
            break
        try:
            arrays, changed = _build(source, plan, inventory, have, arrays)
            break
        except DATA_ERRORS as exc:
            if not source.drop_failed_spans(plan, exc):
                raise
            plan = source.reader.plan(target_step, have)
    # read once a step is committed: an adapter run's config is in the store before its first step
    run_adapter = adapter(committed=True) if adapter is not None else read_adapter_config(source.store)
    shards, files = _layout(source, inventory, arrays, shard_bytes, run_adapter)
    reusable: dict[str, _Shard] = {}
    if state is not None:
        old = state.arrays
        if changed is None:
            changed = {n for n in arrays if n not in old or not np.array_equal(old[n], arrays[n])}
        for fname, shard in shards:
            prev = state.shards.get(fname)
            if (
                prev is not None
                and prev.names == tuple(t.name for t in shard)
                and not changed.intersection(prev.names)
                and prev.header == encode_header(shard, CHECKPOINT_METADATA)
            ):
                reusable[fname] = prev
    marker = {
        "step": target_step,
        "manifest_digest": top.digest,
        "run_id": top.manifest.run_id,
        "store": source.store.url,
    }
    if ADAPTER_CONFIG_KEY in files:
        marker["kind"] = "adapter"
    try:
        _write_version(out, shards, files, marker, reusable, config, stats)
    except OSError as exc:
        raise StorageError(f"cannot write checkpoint dir {out}: {exc.strerror or exc}") from exc
    log.info(
        "step %d -> %s: %d shards written (%d bytes), %d hard-linked unchanged (%s)",
        target_step,
        out,
        stats.shards_written,
        stats.bytes_written,
        stats.shards_linked,
        stats.swap,
    )
    if ADAPTER_CONFIG_KEY not in files and not (out / "config.json").is_file() and out not in _warned:
        _warned.add(out)  # once per dir and process: follow materializes at every step
        log.warning(
            "%s has no config.json: transformers, vLLM and SGLang need one to load it "
            "(pass config_from= / --config-from DIR, an HF model dir of this architecture)",
            out,
        )
    return out, stats
