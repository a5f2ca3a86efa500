"""``deltasync gc [--store] URL --keep-anchors K [--grace SECONDS] [--dry-run]``: retention of a run."""

from __future__ import annotations

import argparse

from deltasync.cli._common import (
    add_store_args,
    announce_store,
    human_bytes,
    require_run,
    signing_key_from_env,
    store_url,
)
from deltasync.protocol.retention import describe_kept, step_ranges
from deltasync.run.gc import GcReport, collect_garbage
from deltasync.storage import open_store

__all__ = ["DESCRIPTION", "EPILOG", "NAME", "SUMMARY", "add_arguments", "report_lines", "run"]

NAME = "gc"
SUMMARY = "delete old steps: keep the newest K anchors and what fetcher leases need"
DESCRIPTION = """
        Delete the steps no fetcher needs. Kept: the newest K anchors and every step from the oldest
        of them on, the newest step, and every step a live lease (deltasync follow --lease-ttl) holds
        or is fetching. HEAD, writers/, unreadable manifests and keys outside the run's layout are
        never deleted. The plan is made twice, around a fresh listing, and only what both plans
        delete goes: manifests first, then their files.
        """
EPILOG: str | None = """
        example:
          deltasync gc --store s3://bucket/runs/r1 --keep-anchors 2 --dry-run
        """


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {raw!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {raw!r}")
    return value


def _positive(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {raw!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (the newest anchor always stays), got {value}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``deltasync gc``."""
    add_store_args(p)
    p.add_argument(
        "--keep-anchors", type=_positive, required=True, metavar="K", help="keep the newest K anchors and their chains"
    )
    p.add_argument(
        "--grace",
        type=_seconds,
        default=3600.0,
        metavar="SECONDS",
        help="files of uncommitted steps go once older than this (default 3600)",
    )
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted and why the rest stays")


def report_lines(report: GcReport, url: str) -> list[str]:
    """The human-readable plan or summary."""
    plan = report.plan
    verb = "would delete" if report.dry_run else "deleted"
    kept_anchors = list(plan.anchors[-plan.keep_anchors :])
    lines = [
        f"{url}: {_count(report.listed_steps, 'committed step')}, {_count(len(plan.anchors), 'anchor')}; "
        f"keeping the last {plan.keep_anchors} ({', '.join(map(str, kept_anchors)) or 'none'})"
    ]
    steps = plan.deleted_steps
    span = f" ({step_ranges(steps)})" if steps else ""
    lines.append(
        f"{verb}: {_count(len(steps), 'step')}{span}, {_count(len(plan.deleted_spans), 'span')}, "
        f"{_count(len(plan.orphans), 'orphan file')}, {_count(len(plan.expired_leases), 'expired lease')}: "
        f"{human_bytes(plan.delete_bytes)}"
    )
    lines.append(f"kept: {_count(len(plan.kept), 'step')}, {human_bytes(plan.keep_bytes)}")
    lines += [f"  {line}" for line in describe_kept(plan)]
    lines += [f"note: {n}" for n in plan.notes]
    if report.dry_run:
        lines.append("dry run: nothing deleted")
    return lines


def run(args: argparse.Namespace) -> int:
    """Run ``deltasync gc``."""
    with open_store(store_url(args, "deltasync gc")) as store:
        announce_store(store)
        require_run(store)  # not a run: nothing is read further, nothing deleted
        report = collect_garbage(
            store,
            keep_anchors=args.keep_anchors,
            grace=args.grace,
            dry_run=args.dry_run,
            signing_key=signing_key_from_env(),
        )
        for line in report_lines(report, store.url):
            print(line)
    return 0
