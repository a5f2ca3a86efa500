"""``delta-upload``: push one checkpoint (file or HF dir) as a patch or anchor, keeping a local
baseline cache so separate invocations chain (see ``deltasync.cli`` for the environment)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from deltasync._cli_common import _cli_uploader, _human, _signing_key, cast_name
from deltasync.errors import DeltaSyncError
from deltasync.protocol import xxh3_128
from deltasync.storage import open_store

__all__ = ["cmd_upload"]


def _cache_dir(store_url: str, override: str | None) -> Path:
    if override:
        return Path(override)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "deltasync" / "upload" / xxh3_128(store_url.encode())[:16]


def cmd_upload(args: argparse.Namespace) -> int:
    import torch

    from deltasync._checkpoint_io import load_checkpoint
    from deltasync.errors import ChainBroken, ChecksumMismatch, InventoryMismatch, ObjectNotFound, ProtocolError
    from deltasync.fetcher import DeltaFetcher

    cast = getattr(torch, args.cast) if args.cast else None
    state = load_checkpoint(args.path)
    if cast is not None:
        state = {k: v.to(cast) if v.is_floating_point() else v for k, v in state.items()}
    with open_store(args.store) as store:
        cache = _cache_dir(store.url, args.cache)
        try:
            up = _cli_uploader(store, args)
        except ProtocolError as exc:  # the newest step's manifest does not parse: nothing can follow it
            raise ProtocolError(
                f"{exc}. No push can follow an unreadable newest step: restore that object from a copy of the "
                "store, or move it away (its step is then no longer committed) and push again, or push to a new "
                "run prefix"
            ) from exc
        fut: Any = None
        interrupted = abandoned = False
        try:
            latest = up.last_committed_step
            if latest is not None and args.step <= latest:
                raise DeltaSyncError(f"step {args.step} is not after the last committed step {latest} in {store.url}")
            if latest is not None and not args.anchor:
                try:
                    base = _baseline(store, cache, latest)
                    try:
                        up.resume(base, latest, strict=True)
                    except (ChecksumMismatch, InventoryMismatch):
                        print(f"cache at {cache} is stale; rebuilding step {latest} from the store", file=sys.stderr)
                        out = DeltaFetcher(store, signing_key=_signing_key()).materialize(
                            cache / "materialized", step=latest
                        )
                        up.resume(load_checkpoint(out), latest, strict=True)
                except (ChainBroken, ObjectNotFound, ProtocolError) as exc:
                    raise ChainBroken(
                        f"cannot continue the chain of step {latest}, the newest step in {store.url}: {exc}. "
                        f"Push this checkpoint as a full anchor instead (readers fetch it and every later step "
                        f"without the broken chain): delta-upload {args.path} --store {args.store} "
                        f"--step {args.step} --anchor"
                    ) from exc
            t0 = time.perf_counter()
            fut = up.push(state, args.step)
            info = fut.result()
        except KeyboardInterrupt:
            interrupted = True
            landed, abandoned = _interrupted_commit(fut, args.step)
            if landed is None:
                print(
                    f"interrupted: the commit of step {args.step} was abandoned mid-write; check "
                    f"`deltasync inspect {store.url}` before pushing that step again"
                    if abandoned
                    else f"interrupted: step {args.step} was not committed to {store.url}",
                    file=sys.stderr,
                )
                return 130
            info = landed
        finally:
            if not abandoned:  # close() waits for the commit in flight
                up.close()
        # the manifest has landed: say so now, whatever happens to the local cache below
        full = sum(v.numel() * v.element_size() for v in state.values()) or 1
        print(
            f"step {info.step}: {info.kind}, {_human(info.nbytes)} ({100 * info.changed / max(info.total, 1):.3f}% "
            f"changed, {info.nbytes / full:.4f} of a full checkpoint) committed in {time.perf_counter() - t0:.2f} s",
            flush=True,
        )
        try:
            if interrupted:
                raise KeyboardInterrupt
            _write_cache(cache, state, info, store.url)
        except (KeyboardInterrupt, OSError) as exc:
            _drop_cache(cache)
            why = "interrupted" if isinstance(exc, KeyboardInterrupt) else f"cannot write the baseline cache ({exc})"
            print(
                f"{why}: step {info.step} is committed to {store.url}; the local baseline cache at {cache} was "
                f"removed (the next delta-upload fetches step {info.step} from the store)",
                file=sys.stderr,
            )
    return 0


def _interrupted_commit(fut: Any, step: int) -> tuple[Any, bool]:
    """After Ctrl-C: (the step's CommitInfo if its commit landed, else None; whether it was abandoned).

    A commit in flight is waited for, so that what is reported is what happened; a
    second Ctrl-C abandons it (then nobody can say whether its manifest landed).
    """
    from concurrent.futures import wait

    if fut is None:
        return None, False  # interrupted before the push
    if not fut.done():
        print(
            f"interrupted: waiting for the commit of step {step} to finish (Ctrl-C again to abandon it)",
            file=sys.stderr,
            flush=True,
        )
        try:
            wait([fut])
        except KeyboardInterrupt:
            return None, True
    return (None if fut.exception() is not None else fut.result()), False


CACHE_FILES = ("state.json", "state.json.tmp", "state.safetensors", "state.safetensors.tmp")


def _write_cache(cache: Path, state: dict[str, Any], info: Any, store_url: str) -> None:
    """Keep the pushed state as the next upload's baseline; ``state.json`` (written last) makes it valid."""
    from deltasync._checkpoint_io import save_checkpoint

    meta = cache / "state.json"
    meta.unlink(missing_ok=True)  # the cache of the previous step stops being valid first
    save_checkpoint(state, cache / "state.safetensors")
    gate = os.environ.get("DELTASYNC_TEST_CACHE_GATE")
    if gate:  # test hook: hold here, the cache half written, until that file exists
        print(f"test hook: waiting for {gate}", file=sys.stderr, flush=True)
        while not os.path.exists(gate):
            time.sleep(0.01)
    tmp = cache / "state.json.tmp"
    tmp.write_text(json.dumps({"step": info.step, "manifest_digest": info.manifest_digest, "store": store_url}))
    os.replace(tmp, meta)


def _drop_cache(cache: Path) -> None:
    """Remove the baseline cache's files, whole or partial (best effort)."""
    for name in CACHE_FILES:
        with contextlib.suppress(OSError):
            (cache / name).unlink(missing_ok=True)


def _baseline(store: Any, cache: Path, step: int) -> dict[str, Any]:
    """The weights of committed ``step``: from the local cache when it matches, else from the store."""
    from deltasync._checkpoint_io import load_checkpoint
    from deltasync.fetcher import DeltaFetcher

    meta_path = cache / "state.json"
    try:
        meta = json.loads(meta_path.read_text())
        if meta.get("step") == step and meta.get("store") == store.url:
            return load_checkpoint(cache / "state.safetensors")
    except (OSError, ValueError, DeltaSyncError):
        pass
    print(f"no local baseline for step {step}; fetching it from {store.url}", file=sys.stderr)
    out = DeltaFetcher(store, signing_key=_signing_key()).materialize(cache / "materialized", step=step)
    return load_checkpoint(out)


def _upload_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="a .safetensors file or an HF checkpoint dir (with model.safetensors.index.json)")
    p.add_argument(
        "--store", required=True, help="store URL: a path, file:///..., memory://, s3://bucket/prefix, hf://buckets/..."
    )
    p.add_argument("--step", required=True, type=int, help="training step of this checkpoint (must increase)")
    p.add_argument("--anchor-every", type=int, default=50, help="full anchor every N steps (default 50)")
    p.add_argument("--anchor", action="store_true", help="force a full anchor for this step")
    p.add_argument(
        "--cast",
        type=cast_name,
        metavar="{bf16,fp16,fp32}",
        help="cast floating tensors to this dtype before diffing (keeps a bf16 run bf16 when the trainer saves fp32)",
    )
    p.add_argument("--cache", help="baseline cache dir (default: $XDG_CACHE_HOME/deltasync/upload/<store hash>)")
    p.add_argument("--signal", metavar="URL", help="signal server to notify (token: $DELTASYNC_PUBLISH_TOKEN)")
    p.add_argument("--run", help="run name at the signal server (default: the store's run id)")
