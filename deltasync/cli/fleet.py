"""``deltasync fleet --signal URL --run NAME [--wait STEP --max-lag K --timeout T]``: a run's fleet."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from deltasync.errors import DeltaSyncError

__all__ = ["DESCRIPTION", "EPILOG", "NAME", "SUMMARY", "add_arguments", "run"]

NAME = "fleet"
SUMMARY = "show which step each replica of a run serves, or wait until they all serve one"
DESCRIPTION = """
        Show a run's fleet as the signal server sees it: every live replica (a `deltasync follow`,
        a vLLM server behind the driver, a vLLM engine with the deltasync backend reporting) with
        the step it serves, its lag behind the run's head, its state and last error. With --wait
        STEP, wait until every live replica (or --quorum of them) serves STEP - --max-lag or newer:
        exit 0 with the fleet, or exit 1 after --timeout seconds with who is behind. The token is
        DELTASYNC_SUBSCRIBE_TOKEN (or, when that is unset, DELTASYNC_PUBLISH_TOKEN). What replicas
        report (ids, last errors) is printed escaped: a control or bidi character shows as \x1b, \u202e.
        """
EPILOG: str | None = """
        examples:
          deltasync fleet --signal http://trainer:8000 --run r1
          deltasync fleet --signal http://trainer:8000 --run r1 --wait head --max-lag 1 --timeout 300
        """


def _step(text: str) -> int | str:
    if text == "head":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a step number or 'head', got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a step is >= 0, got {value}")
    return value


def _quorum(text: str) -> int | float:
    try:
        value: int | float = int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a count (3) or a fraction (0.75), got {text!r}") from None
    if (isinstance(value, int) and value < 1) or (isinstance(value, float) and not 0 < value <= 1):
        raise argparse.ArgumentTypeError(f"a quorum is a count >= 1 or a fraction in (0, 1], got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``deltasync fleet``."""
    p.add_argument("--signal", required=True, metavar="URL", help="the signal server the replicas report to")
    p.add_argument("--run", required=True, metavar="NAME", help="the run's name at the signal server")
    p.add_argument(
        "--wait", type=_step, metavar="STEP", help="wait until the fleet serves STEP ('head': the run's newest step)"
    )
    p.add_argument("--max-lag", type=int, default=0, metavar="K", help="with --wait: STEP - K or newer is enough")
    p.add_argument(
        "--quorum",
        type=_quorum,
        metavar="Q",
        help="with --wait: this many replicas (3), or this fraction of them (0.75), instead of every live one",
    )
    p.add_argument(
        "--min-replicas", type=int, default=1, metavar="N", help="with --wait: at least N replicas must report"
    )
    p.add_argument(
        "--unreachable",
        choices=("exclude", "wait"),
        default="exclude",
        help="with --wait: a replica reported unreachable is left out of the live replicas (exclude, the default: "
        "named in the report) or waited for (wait)",
    )
    p.add_argument(
        "--healthy-only",
        action="store_true",
        help="with --wait: count only serving replicas (not failed or diverged ones: docs/audit.md)",
    )
    p.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS", help="with --wait: give up after this")
    p.add_argument("--poll", type=float, default=1.0, metavar="SECONDS", help="with --wait: seconds between reads")
    p.add_argument("--json", action="store_true", help="print the fleet as JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    """Print the run's fleet, after waiting for it with --wait; exit 1 when the wait times out."""
    from deltasync._util.text import escape_text
    from deltasync.signal import FleetView, SignalClient, wait_for_fleet

    if args.max_lag < 0 or args.min_replicas < 0:
        raise DeltaSyncError("--max-lag and --min-replicas must be >= 0")
    token = os.environ.get("DELTASYNC_SUBSCRIBE_TOKEN") or os.environ.get("DELTASYNC_PUBLISH_TOKEN") or None
    with SignalClient(args.signal, token) as client:
        view: FleetView
        if args.wait is None:
            view = client.fleet(args.run)
        else:
            step = args.wait
            if step == "head":
                head = client.head(args.run)
                if head is None:
                    raise DeltaSyncError(
                        f"run {args.run!r} has no signalled step yet at {args.signal}: nothing to wait for"
                    )
                step = head.step
            view = wait_for_fleet(
                client,
                args.run,
                step,
                max_lag=args.max_lag,
                quorum=args.quorum,
                min_replicas=args.min_replicas,
                unreachable=args.unreachable,
                healthy_only=args.healthy_only,
                timeout=args.timeout,
                poll=args.poll,
            )
    if args.json:
        print(json.dumps(asdict(view), indent=2))
    else:
        print(
            f"run {escape_text(view.run)}: head {'-' if view.head is None else view.head}, {len(view.replicas)} live replicas"
        )
        if view.replicas:
            print(view.table())
    sys.stdout.flush()
    return 0
