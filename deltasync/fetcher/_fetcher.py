"""DeltaFetcher: bring live weights or a checkpoint dir to a committed step."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from deltasync._tensors import flat_bits, inventory_of, numpy_bits, state_tensors
from deltasync.errors import ChainBroken, ChecksumMismatch, DeltaSyncError, ObjectNotFound, ProtocolError, StorageError
from deltasync.fetcher._apply import NumpySlot, Slot, TorchSlot, apply_anchor, apply_patch, check_inventory
from deltasync.fetcher._follow import follow as _follow
from deltasync.fetcher._reader import StepReader
from deltasync.protocol import FetchPlan, TensorInfo, plan_fetch, superseded_by
from deltasync.protocol.checkpoint import INDEX_NAME, build_checkpoint
from deltasync.protocol.dtypes import dtype_info
from deltasync.protocol.safetensors_io import parse_safetensors
from deltasync.storage import Store
from deltasync.storage._claims import read_claims

__all__ = ["DeltaFetcher"]

MARKER = ".deltasync.json"
Bits = np.ndarray[Any, np.dtype[Any]]


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DeltaFetcher:
    """Fetch committed steps from ``store`` and apply them bit-exactly.

    verify: check every file's xxh3-128 before applying and every touched
        tensor's digest after (a mismatch undoes the step and raises).
    signing_key: require manifests signed with this HMAC key.
    progress: a callback ``(bytes_done, bytes_total)`` for downloads.
    """

    def __init__(
        self,
        store: Store,
        *,
        verify: bool = True,
        signing_key: bytes | None = None,
        progress: Callable[[int, int], None] | None = None,
        shard_bytes: int = 2 << 30,
    ) -> None:
        self.store = store
        self.verify = verify
        self.progress = progress
        self.shard_bytes = shard_bytes
        self._reader = StepReader(store, verify=verify, signing_key=signing_key)
        self._have: dict[int, tuple[tuple[Any, ...], int, str]] = {}

    # ----------------------------------------------------------- discovery

    def steps(self) -> list[int]:
        """Committed steps in the store, ascending."""
        return self._reader.steps()

    def latest_step(self) -> int | None:
        """Newest committed step of the run, or None for an empty run.

        Skips steps that a fenced-off writer committed after a newer uploader
        took over the run (SPEC.md "Single writer").
        """
        steps = self.steps()
        claims = read_claims(self.store) if steps else []
        for step in reversed(steps):
            if superseded_by(self._reader.committed(step).manifest, claims) is None:
                return step
        return None

    def _target_step(self, step: int | None) -> int:
        if step is not None:
            return step
        latest = self.latest_step()
        if latest is None:
            raise ChainBroken(f"{self.store.url} has no committed steps yet")
        return latest

    def _plan(self, target: int, have: tuple[int, str] | None) -> FetchPlan:
        committed = self._reader.chain(target, also=have[0] if have else None)
        try:
            return plan_fetch(
                committed, target, have[0] if have else None, have[1] if have else None, read_claims(self.store)
            )
        except ChainBroken:
            self._reader.forget(committed)  # a cached manifest may be what breaks the chain
            raise

    # -------------------------------------------------------------- apply

    def _run(
        self,
        slots: Mapping[str, Slot],
        inventory: tuple[TensorInfo, ...],
        plan: FetchPlan,
        on_step: Callable[[int, str], None],
    ) -> None:
        manifests = [self._reader.committed(s) for s in plan.steps]
        for c in manifests:
            check_inventory(inventory, c.manifest)
        total = plan.nbytes
        done = 0

        def tick(n: int) -> None:
            nonlocal done
            done += n
            if self.progress:
                self.progress(done, total)

        try:
            # every byte is downloaded and checked before the target is touched
            files = [self._reader.download(c.manifest, tick) for c in manifests]
            for c, f in zip(manifests, files, strict=True):
                m = c.manifest
                if m.kind == "anchor":
                    apply_anchor(slots, m, StepReader.anchor_arrays(m, f), verify=self.verify)
                else:
                    apply_patch(slots, m, StepReader.decode_patch(m, f), verify=self.verify)
                on_step(m.step, c.digest)
        except (ChecksumMismatch, ProtocolError):
            # the bad bytes may be a cached manifest (read corrupted, or since repaired):
            # read the plan's manifests afresh next time instead of failing forever
            self._reader.forget(plan.steps)
            raise

    def sync(self, target: Any, step: int | None = None, *, have_step: int | None = None) -> int:
        """Bring ``target`` (nn.Module or dict of tensors) in place to ``step`` (default: latest).

        Patches forward from the target's current step when this fetcher put it
        there (or ``have_step`` says so), else loads the nearest anchor. Each
        applied step is all or nothing. Returns the step reached.
        """
        tensors = state_tensors(target)
        inventory = inventory_of(tensors)
        slots: dict[str, Slot] = {
            n: NumpySlot(numpy_bits(t)) if t.device.type == "cpu" else TorchSlot(flat_bits(t, copy_if_needed=False))
            for n, t in tensors.items()
        }
        ident = tuple(sorted((n, s.key) for n, s in slots.items()))
        target_step = self._target_step(step)
        known = self._have.get(id(target))
        have: tuple[int, str] | None = None
        if known is not None and known[0] == ident:
            have = (known[1], known[2])
        elif have_step is not None:
            try:
                c = self._reader.committed(have_step)
            except ObjectNotFound:
                c = None  # not (or no longer) committed, e.g. garbage-collected: start from an anchor
            if c is not None:
                have = (have_step, c.digest)
                digests = c.manifest.tensor_digests
                if self.verify and any(slots[n].digest() != d for n, d in digests.items() if n in slots):
                    have = None  # the claim does not hold: start from an anchor
        plan = self._plan(target_step, have)

        def on_step(s: int, digest: str) -> None:
            self._have[id(target)] = (ident, s, digest)

        self._run(slots, inventory, plan, on_step)
        return target_step

    def follow(self, target: Any, **options: Any) -> int | None:
        """Apply each new step to ``target`` as it is signalled (SSE), polling the store when the
        signal server is unreachable. Options: see :func:`deltasync.fetcher._follow.follow`
        (``signal_url``, ``token``, ``run``, ``until_step``, ``stop``, ``poll_interval``, ``on_step``).
        """
        return _follow(self, target, **options)

    def current_step(self, target: Any) -> int | None:
        """The step this fetcher last brought ``target`` to, if any."""
        known = self._have.get(id(target))
        return known[1] if known else None

    # --------------------------------------------------------- materialize

    def _load_dir(self, out: Path) -> tuple[tuple[int, str], dict[str, Bits]] | None:
        try:
            marker = json.loads((out / MARKER).read_text())
            have = (int(marker["step"]), str(marker["manifest_digest"]))
            index = json.loads((out / INDEX_NAME).read_text())
            arrays: dict[str, Bits] = {}
            for fname in sorted(set(index["weight_map"].values())):
                data = (out / fname).read_bytes()
                st = parse_safetensors(data, what=str(out / fname))
                for e in st.entries.values():
                    arrays[e.name] = np.frombuffer(
                        data,
                        dtype=dtype_info(e.dtype).bits,
                        count=(e.end - e.start) // dtype_info(e.dtype).itemsize,
                        offset=e.start,
                    ).copy()
            return have, arrays
        except (OSError, ValueError, KeyError, TypeError, DeltaSyncError):
            return None

    def materialize(self, out_dir: str | os.PathLike[str], step: int | None = None) -> Path:
        """Write step ``step`` (default latest) as a safetensors checkpoint dir, atomically.

        The dir holds ``model-*.safetensors`` shards and ``model.safetensors.index.json``
        (transformers/vLLM load it as is) plus a ``.deltasync.json`` marker. When
        ``out_dir`` already holds an earlier materialized step of this chain, only
        the patches since are downloaded. An existing dir without the marker is
        never replaced.
        """
        out = Path(out_dir).absolute()
        target_step = self._target_step(step)
        if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MARKER).is_file())):
            raise StorageError(f"refusing to replace {out}: it exists and was not written by deltasync materialize")
        loaded = self._load_dir(out) if out.exists() else None
        have = loaded[0] if loaded else None
        plan = self._plan(target_step, have)
        top = self._reader.committed(target_step)
        inventory = top.manifest.inventory
        if plan.base == "current" and loaded is not None:
            arrays = loaded[1]
            if set(arrays) != {t.name for t in inventory}:
                arrays, plan = {}, self._plan(target_step, None)
        else:
            arrays = {}
        if not arrays:
            arrays = {t.name: np.zeros(t.numel, dtype=dtype_info(t.dtype).bits) for t in inventory}
        if plan.base == "current" and loaded is not None and self.verify and have is not None:
            base = self._reader.committed(have[0]).manifest
            if any(NumpySlot(arrays[n]).digest() != d for n, d in base.tensor_digests.items()):
                arrays = {t.name: np.zeros(t.numel, dtype=dtype_info(t.dtype).bits) for t in inventory}
                plan = self._plan(target_step, None)
        slots = {n: NumpySlot(a, key=n) for n, a in arrays.items()}
        reached: list[tuple[int, str]] = []
        self._run(slots, inventory, plan, lambda s, d: reached.append((s, d)))
        if not plan.steps:
            reached.append((target_step, top.digest))
        files, _ = build_checkpoint(inventory, arrays, self.shard_bytes)
        marker = {
            "step": target_step,
            "manifest_digest": reached[-1][1],
            "run_id": top.manifest.run_id,
            "store": self.store.url,
        }
        files[MARKER] = json.dumps(marker, indent=2).encode()
        tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir(parents=True)
            for name, data in files.items():
                with open(tmp / name, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
            _fsync(tmp)
            if out.exists():
                # keep what the user put next to the weights (config.json, tokenizer files, ...)
                for extra in out.iterdir():
                    if extra.name not in files and extra.is_file() and not extra.name.endswith(".safetensors"):
                        shutil.copy2(extra, tmp / extra.name)
                old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
                os.rename(out, old)
                os.rename(tmp, out)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, out)
            _fsync(out.parent)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise StorageError(f"cannot write checkpoint dir {out}: {exc.strerror or exc}") from exc
        return out
