"""``delta-upload``: push one checkpoint (file or HF dir) as a patch or anchor, keeping a local
baseline cache so separate invocations chain (see ``deltasync.cli`` for the environment)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from deltasync.cli._common import STORE_HELP, announce_store, cast_name, cli_uploader, human_bytes, signing_key_from_env
from deltasync.cli._upload_cache import (
    cache_dir,
    cache_size,
    cached_baseline,
    drop_cache,
    drop_legacy_materialized,
    write_cache,
)
from deltasync.errors import DeltaSyncError
from deltasync.storage import open_store

__all__ = [
    "DESCRIPTION",
    "EPILOG",
    "NAME",
    "SCRIPT_DESCRIPTION",
    "SCRIPT_EPILOG",
    "SUMMARY",
    "add_arguments",
    "run",
]

NAME = "upload"
SUMMARY = "push one checkpoint as a patch or anchor (same as delta-upload)"
DESCRIPTION = """
        Push one checkpoint (a .safetensors file or an HF checkpoint dir) to a store: a sparse patch
        against the previous push, or a full anchor every --anchor-every steps. Same as
        `delta-upload`; to follow a training output dir use `delta-upload watch`.
        """
EPILOG: str | None = None
# the same command as its own console script, ``delta-upload``
SCRIPT_DESCRIPTION = (
    "Push one checkpoint (a .safetensors file or an HF checkpoint dir) to a store, as a sparse\n"
    "patch against the previous push, or a full anchor every --anchor-every steps."
)
SCRIPT_EPILOG = (
    "example:\n  delta-upload checkpoint-120/ --store s3://bucket/runs/r1 --step 120\n\n"
    "`delta-upload watch DIR --store URL` follows a training output dir instead (see\n"
    "`delta-upload watch --help`); to push a checkpoint dir that is named watch, write ./watch."
)


def run(args: argparse.Namespace) -> int:
    """Run ``delta-upload`` (and ``deltasync upload``)."""
    import torch

    from deltasync._util.checkpoint_io import load_checkpoint
    from deltasync.errors import ChainBroken, ObjectNotFound, ProtocolError

    cast = getattr(torch, args.cast) if args.cast else None
    with open_store(args.store) as store:  # first: a mistyped URL fails before the checkpoint is read
        announce_store(store)
        state = load_checkpoint(args.path, mmap=True)  # pages are read as the diff touches them
        if cast is not None:
            state = {k: v.to(cast) if v.is_floating_point() and v.dtype != cast else v for k, v in state.items()}
        cache = cache_dir(store.url, args.cache)
        try:
            up = cli_uploader(store, args, defer_diff=False)  # one step: diff in push(), no staging copy
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
                raise DeltaSyncError(
                    f"step {args.step} is not after the last committed step {latest} in {store.url}: "
                    f"use --step {latest + 1} or more"
                )
            if latest is not None and not args.anchor:
                try:
                    _resume(up, store, cache, latest, state, use_cache=not args.no_cache)
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
            f"step {info.step}: {info.kind}, {human_bytes(info.nbytes)} ({100 * info.changed / max(info.total, 1):.3f}% "
            f"changed, {info.nbytes / full:.4f} of a full checkpoint) committed in {time.perf_counter() - t0:.2f} s",
            flush=True,
        )
        _keep_baseline(args, cache, state, info, store.url, interrupted)
    return 0


def _resume(up: Any, store: Any, cache: Path, latest: int, state: dict[str, Any], *, use_cache: bool) -> None:
    """Make committed ``latest`` the uploader's baseline: from the local cache when it is that step,
    else synced from the store into memory. When ``state``'s tensors (names, dtypes, shapes) differ
    from ``latest``'s, the push is an anchor anyway and nothing is fetched."""
    import torch

    from deltasync._util.tensors import inventory_of
    from deltasync.errors import ChecksumMismatch, InventoryMismatch
    from deltasync.fetcher import DeltaFetcher

    base = cached_baseline(cache, store.url, latest) if use_cache else None
    if base is not None:
        try:
            up.resume(base, latest, strict=True)
            return
        except (ChecksumMismatch, InventoryMismatch):
            print(f"cache at {cache} is stale; rebuilding step {latest} from the store", file=sys.stderr)
        finally:
            del base  # unmaps the cache file: the uploader keeps its own copy
    elif use_cache:
        print(f"no local baseline for step {latest}; fetching it from {store.url}", file=sys.stderr)
    fetcher = DeltaFetcher(store, signing_key=signing_key_from_env())
    if fetcher.reader.manifest(latest).inventory != inventory_of(state):
        print(
            f"the checkpoint's tensors (names, dtypes or shapes) differ from step {latest}'s: it is pushed as "
            "a full anchor",
            file=sys.stderr,
        )
        return
    target = {k: torch.empty_like(v) for k, v in state.items()}  # sized by the local checkpoint, not the manifest
    fetcher.sync(target, step=latest)
    up.resume(target, latest, strict=True)


def _keep_baseline(args: Any, cache: Path, state: dict[str, Any], info: Any, store_url: str, interrupted: bool) -> None:
    """After the commit: write the baseline cache (or drop it with --no-cache) and say where it is."""
    freed = drop_legacy_materialized(cache, store_url)
    if freed:
        print(
            f"removed {cache / 'materialized'} ({human_bytes(freed)}), a stale copy earlier versions kept",
            file=sys.stderr,
        )
    if args.no_cache:
        drop_cache(cache)
        print(
            f"--no-cache: no local baseline kept; the next delta-upload fetches step {info.step} from {store_url}",
            file=sys.stderr,
        )
        return
    try:
        if interrupted:
            raise KeyboardInterrupt
        cache.mkdir(parents=True, exist_ok=True)
        write_cache(cache, state, info, store_url)
    except (KeyboardInterrupt, OSError) as exc:
        drop_cache(cache)
        why = "interrupted" if isinstance(exc, KeyboardInterrupt) else f"cannot write the baseline cache ({exc})"
        print(
            f"{why}: step {info.step} is committed to {store_url}; the local baseline cache at {cache} was "
            f"removed (the next delta-upload fetches step {info.step} from the store)",
            file=sys.stderr,
        )
        return
    print(
        f"baseline cache: {cache} ({human_bytes(cache_size(cache))}, one copy of step {info.step}; "
        "--no-cache skips it, deleting the dir is safe)",
        file=sys.stderr,
    )


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``delta-upload`` and ``deltasync upload``."""
    p.add_argument("path", help="a .safetensors file or an HF checkpoint dir (with model.safetensors.index.json)")
    p.add_argument("--store", required=True, metavar="URL", help=STORE_HELP)
    p.add_argument("--step", required=True, type=int, help="training step of this checkpoint (must increase)")
    p.add_argument("--anchor-every", type=int, default=50, metavar="N", help="full anchor every N steps")
    p.add_argument("--anchor", action="store_true", help="force a full anchor for this step")
    p.add_argument(
        "--cast",
        type=cast_name,
        metavar="{bf16,fp16,fp32}",
        help="cast floating tensors to this dtype before diffing (keeps a bf16 run bf16 when the trainer saves "
        "fp32; default: each tensor's own dtype)",
    )
    p.add_argument(
        "--cache", metavar="DIR", help="baseline cache dir (default: $XDG_CACHE_HOME/deltasync/upload/<store hash>)"
    )
    p.add_argument(
        "--no-cache",
        action="store_true",
        help="keep no local copy of the pushed state (and remove this store's cached one); the next upload "
        "fetches its baseline from the store",
    )
    p.add_argument("--signal", metavar="URL", help="signal server to notify (token: $DELTASYNC_PUBLISH_TOKEN)")
    p.add_argument("--run", metavar="NAME", help="run name at the signal server (default: the store's run id)")
