"""``deltasync follow --store URL --out DIR``: keep a checkpoint dir at the newest committed step."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

from deltasync.cli._common import CONFIG_HELP, STORE_HELP, VERIFY_HELP, announce_store, signing_key_from_env
from deltasync.cli._vllm import add_vllm_arguments, run_vllm
from deltasync.storage import open_store

__all__ = ["DESCRIPTION", "EPILOG", "NAME", "SUMMARY", "add_arguments", "run"]

NAME = "follow"
SUMMARY = "keep a checkpoint dir at the newest committed step"
DESCRIPTION = """
        Keep a checkpoint dir at the newest committed step, for engines that reload weights from
        disk: wait for each commit (SSE from --signal, else by polling the store), apply it, and swap
        the dir in atomically. Started before the trainer, it waits for the run's first commit. The
        signal server token is DELTASYNC_SUBSCRIBE_TOKEN (or, when that is unset,
        DELTASYNC_PUBLISH_TOKEN). With --signal, what the target serves is reported to the server's
        fleet view (`deltasync fleet`), with DELTASYNC_REPORT_TOKEN when set: the server's report token,
        or this replica's own token (`deltasync replica-token --replica ID`, for --replica ID; with
        --vllm it covers the servers' ids ID-0, ID-1, ...), which binds the reports to it (docs/fleet.md).
        """
EPILOG: str | None = """
        example:
          deltasync follow --store s3://bucket/runs/r1 --out /ckpt/live --config-from ./Qwen3-0.6B \\
              --signal http://trainer:8000 --lease-ttl 600
        """


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``deltasync follow``."""
    p.add_argument("--store", required=True, metavar="URL", help=STORE_HELP)
    p.add_argument("--out", metavar="DIR", help="checkpoint dir, rewritten atomically at each step (or --vllm)")
    p.add_argument("--signal", metavar="URL", help="signal server to wait on (SSE); without it the store is polled")
    p.add_argument("--config-from", metavar="DIR", help=CONFIG_HELP)
    p.add_argument("--run", metavar="NAME", help="run name at the signal server (default: the store's run id)")
    p.add_argument(
        "--until", type=int, metavar="STEP", help="exit once this step is reached (default: run until Ctrl-C)"
    )
    p.add_argument("--poll-interval", type=float, default=2.0, metavar="SECONDS", help="seconds between store polls")
    p.add_argument("--no-verify", action="store_true", help=VERIFY_HELP)
    p.add_argument(
        "--metrics-port", type=int, metavar="PORT", help="serve Prometheus metrics at /metrics on PORT (0: any free)"
    )
    p.add_argument("--metrics-host", default="127.0.0.1", metavar="ADDR", help="address of the metrics endpoint")
    p.add_argument(
        "--lease-ttl",
        type=float,
        metavar="SECONDS",
        help="write a lease (leases/<id>.json) valid this long after each step, so `deltasync gc` keeps what this "
        "follower needs (needs write access to the store; default: no lease)",
    )
    p.add_argument(
        "--replica",
        metavar="ID",
        help="replica id in the signal server's fleet view (default: <hostname>-<pid>; with --vllm, each server's "
        "host:port, or ID-<i>)",
    )
    p.add_argument("--no-report", action="store_true", help="do not report to the signal server's fleet view")
    add_vllm_arguments(p)


def _held_step(out: str) -> int | None:
    """The step the checkpoint dir ``out`` holds (its ``.deltasync.json`` marker), or None."""
    try:
        step = json.loads((Path(out) / ".deltasync.json").read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def run(args: argparse.Namespace) -> int:
    """Run ``deltasync follow`` until ``--until`` is reached or the process is interrupted."""
    if (args.out is None) == (args.vllm is None):
        print(
            "usage: deltasync follow --store URL (--out DIR | --vllm URL [URL ...]) ...\n"
            "deltasync follow: error: give either --out DIR (a checkpoint dir) or --vllm URL [URL ...] (vLLM servers)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if args.vllm is not None:
        return run_vllm(args)
    from deltasync.fetcher import DeltaFetcher
    from deltasync.run import RunReader
    from deltasync.signal import check_replica, default_replica

    token = os.environ.get("DELTASYNC_SUBSCRIBE_TOKEN") or os.environ.get("DELTASYNC_PUBLISH_TOKEN") or None
    replica = None if args.no_report or not args.signal else check_replica(args.replica or default_replica())
    with open_store(args.store) as store:
        announce_store(store)
        # a run that is not there yet (not even its directory) is waited for: the trainer may start after
        # this; nothing is created in the store meanwhile (a lease only with --lease-ttl, after a step)
        latest = RunReader(store).latest_step()
        if latest is None:
            print(
                f"waiting for the first commit at {store.url} (nothing committed there yet: start the trainer, "
                "or check the URL; Ctrl-C stops)",
                file=sys.stderr,
                flush=True,
            )
        elif args.out is not None and (held := _held_step(args.out)) is not None and held >= latest:
            done = args.until is not None and held >= args.until
            then = f"--until {args.until} is reached" if done else "waiting for the next step (Ctrl-C stops)"
            print(
                f"{args.out} already holds step {held}, the newest committed at {store.url}; {then}",
                file=sys.stderr,
                flush=True,
            )
        fetcher = DeltaFetcher(
            store, verify=not args.no_verify, signing_key=signing_key_from_env(), lease_ttl=args.lease_ttl
        )
        t0 = time.perf_counter()

        def on_step(step: int) -> None:
            print(f"step {step} -> {args.out} ({time.perf_counter() - t0:.2f} s after follow started)", flush=True)

        with contextlib.ExitStack() as scope:
            metrics = None
            if args.metrics_port is not None:
                from deltasync.fetcher.metrics import SyncMetrics

                metrics = SyncMetrics()
                server = scope.enter_context(metrics.serve(args.metrics_port, args.metrics_host))
                print(f"metrics at {server.url}", file=sys.stderr, flush=True)
            step = fetcher.follow(
                args.out,
                signal_url=args.signal,
                token=token,
                run=args.run,
                until_step=args.until,
                poll_interval=args.poll_interval,
                on_step=on_step,
                config_from=args.config_from,
                metrics=metrics,
                replica=replica,
                report_token=os.environ.get("DELTASYNC_REPORT_TOKEN") or None,
            )
    print(f"stopped at step {step}")
    return 0
