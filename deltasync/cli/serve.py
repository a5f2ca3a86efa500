"""``deltasync serve``: run the signal server (FastAPI + uvicorn); tokens come from the environment."""

from __future__ import annotations

import argparse
import gc
import sys
from typing import Any

from deltasync.cli._common import resolved_store_url
from deltasync.errors import DeltaSyncError

__all__ = ["DESCRIPTION", "EPILOG", "NAME", "SUMMARY", "add_arguments", "run"]

NAME = "serve"
SUMMARY = "run the signal server (trainers publish steps, fetchers subscribe)"
DESCRIPTION = """
        Run the signal server (FastAPI + uvicorn): trainers POST "step N committed", fetchers wait by
        SSE, long-poll or signed webhooks. Tokens come from the environment:
        DELTASYNC_PUBLISH_TOKEN (needed to publish; required off loopback) and
        DELTASYNC_SUBSCRIBE_TOKEN (needed to subscribe, when set) and DELTASYNC_REPORT_TOKEN
        (needed to report to the fleet view, when set; else the subscribe token reports);
        DELTASYNC_REPLICA_KEY (the key of replica tokens, `deltasync replica-token`; else derived from
        the publish token).
        """
EPILOG: str | None = None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``deltasync serve``."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8000, help="port to bind")
    p.add_argument("--db", default="deltasync-signal.db", metavar="FILE", help="SQLite file for heads and webhooks")
    p.add_argument(
        "--store",
        metavar="URL",
        help="store URL to check commits against before announcing them ({run} is replaced by the run name)",
    )
    p.add_argument(
        "--fleet-ttl",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="a replica silent this long leaves the fleet view (a report may name its own)",
    )
    p.add_argument(
        "--max-replicas",
        type=int,
        default=4096,
        metavar="N",
        help="live replicas per run in the fleet view (a new unbound one past it gets 429)",
    )
    p.add_argument("--insecure", action="store_true", help="allow a non-loopback host without a publish token")
    p.add_argument(
        "--log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn log level",
    )


def _io_stack() -> tuple[str, str]:
    """uvicorn's HTTP parser and event loop: ``httptools`` and ``uvloop`` where installed (the
    ``server`` extra; C, a fraction of the cost per request), else ``h11`` and ``asyncio``."""
    try:
        import httptools  # noqa: F401

        http = "httptools"
    except ImportError:
        http = "h11"
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    return http, loop


def run(args: argparse.Namespace) -> int:
    """Run ``deltasync serve`` until the process is told to stop."""
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as exc:
        raise DeltaSyncError(
            f"deltasync serve needs fastapi and uvicorn ({exc.name} is missing): "
            "pip install 'fastapi>=0.115,<1' 'uvicorn>=0.30,<1' (or, in the deltasync clone's root: "
            "pip install -e '.[server]')"
        ) from None

    from deltasync.server import Settings, create_app, is_loopback

    if args.store is not None:  # a mistyped URL fails now, not at the first publish
        print(f"store: {resolved_store_url(args.store)}", file=sys.stderr, flush=True)
    settings = Settings.from_env(
        db_path=args.db, store_url=args.store, fleet_ttl_s=args.fleet_ttl, max_replicas=args.max_replicas
    )
    if not settings.secured and not is_loopback(args.host) and not args.insecure:
        raise DeltaSyncError(
            f"refusing to serve on {args.host} without DELTASYNC_PUBLISH_TOKEN: anyone could publish; "
            "set the token, bind 127.0.0.1, or pass --insecure"
        )
    scopes = ", ".join(
        f"{name}: {'token' if tok else 'open'}"
        for name, tok in (("publish", settings.publish_token), ("subscribe", settings.subscribe_token))
    )
    if settings.report_token:
        scopes += ", report: token"
    if settings.replica_key or settings.publish_token:
        scopes += (
            f", replica tokens: {'DELTASYNC_REPLICA_KEY' if settings.replica_key else 'key from the publish token'}"
        )
    http, loop = _io_stack()
    print(
        f"deltasync signal server on http://{args.host}:{args.port} ({scopes}; db {settings.db_path}"
        + ("" if settings.store_url else "; no store: published steps are not checked")
        + f"; {http} + {loop}"
        + (
            ""
            if (http, loop) == ("httptools", "uvloop")
            else " (httptools and uvloop, of the server extra, cost less per request)"
        )
        + ")",
        file=sys.stderr,
        flush=True,
    )
    app = create_app(settings)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            app.state.relay.close_streams()  # SSE streams would otherwise hold the shutdown
            super().handle_exit(sig, frame)

    # A fleet keeps thousands of long-lived objects (replicas, SSE streams): with the default
    # thresholds a full collection ran every few seconds under 4,096 heartbeating replicas and 1,000
    # followers, pausing the event loop up to 190 ms (benchmarks/bench_fleet.py, docs/fleet.md
    # "Scale"). What exists at start-up is frozen (never scanned again); young objects are collected
    # less often and the old generation rarely.
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        http=http,
        loop=loop,
        log_level=args.log_level,
        timeout_graceful_shutdown=2,
    )
    Server(config).run()
    return 0
