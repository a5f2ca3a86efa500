"""``deltasync inspect [--store] URL [--last N] [--verify]``: list (or check) the committed steps of a store."""

from __future__ import annotations

import argparse
import sys

from deltasync.cli._common import (
    add_store_args,
    announce_store,
    human_bytes,
    require_run,
    signing_key_from_env,
    store_url,
)
from deltasync.errors import DeltaSyncError
from deltasync.storage import Store, open_store

__all__ = ["DESCRIPTION", "EPILOG", "NAME", "SUMMARY", "add_arguments", "run"]

NAME = "inspect"
SUMMARY = "list the committed steps of a store"
DESCRIPTION = """
        List the committed steps of a store: kind (anchor or patch), parent step, the fraction of
        elements changed, bytes written, and bytes relative to a full checkpoint. A step whose
        manifest cannot be read is listed as BROKEN and the exit status is 1. With --verify every
        file is read and checked instead (see below).
        """
EPILOG: str | None = """
        examples:
          deltasync inspect --store s3://bucket/runs/r1 --last 20
          deltasync inspect --store s3://bucket/runs/r1 --verify
        """


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``deltasync inspect``."""
    add_store_args(p)
    p.add_argument("--last", type=int, default=0, metavar="N", help="only the last N steps (default: all)")
    p.add_argument(
        "--verify",
        action="store_true",
        help="check each step instead of listing it: its manifest parses, every data file exists with the "
        "manifest's size and xxh3-128 checksum, and its parent link (digest) and chain to a committed anchor "
        "hold; prints `step N: OK` or `step N: FAIL <reason>` per step, exits 1 if any step fails",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``deltasync inspect``."""
    from deltasync.run import RunReader

    args.url = store_url(args, "deltasync inspect")

    with open_store(args.url) as store:
        announce_store(store)
        require_run(store)
        if args.verify:
            return _verify(store, args.last)
        reader = RunReader(store)
        steps = reader.steps()
        if not steps:
            print(f"{store.url}: no committed steps")
            return 0
        rows: list[tuple[str, ...]] = []
        broken: list[DeltaSyncError] = []
        for s in steps[-args.last :] if args.last else steps:
            try:
                m = reader.committed(s).manifest
            except DeltaSyncError as exc:  # list the other steps; report this one below
                rows.append((str(s), "BROKEN", "-", "-", "-", "-"))
                broken.append(exc)
                continue
            full = sum(t.nbytes for t in m.inventory) or 1
            changed = f"{100 * m.stats.changed / m.stats.total:.3f}%" if m.kind == "patch" and m.stats.total else "-"
            parent = "-" if m.parent_step is None else str(m.parent_step)
            rows.append((str(s), m.kind, parent, changed, human_bytes(m.stats.nbytes), f"{m.stats.nbytes / full:.4f}"))
    head = ("step", "kind", "parent", "changed", "bytes", "ratio to full")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    for bad in broken:
        print(f"error: {bad}", file=sys.stderr)
    return 1 if broken else 0


def _verify(store: Store, last: int) -> int:
    """``inspect --verify``: one ``step N: OK`` / ``FAIL`` line per step, then a summary."""
    from deltasync.run.audit import verify_run

    total = failed = 0
    for check in verify_run(store, last=last, signing_key=signing_key_from_env()):
        print(check.line(), flush=True)
        total += 1
        failed += not check.ok
    print(f"{total} steps verified, {failed} failed")
    return 1 if failed else 0
