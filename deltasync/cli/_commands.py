"""``deltasync fetch``, ``inspect``, ``serve``, ``follow`` and ``demo``: what each command does once
its arguments are parsed (the parsers, the entry points and the environment variables: :mod:`deltasync.cli`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Any

from deltasync.cli._common import _human, _progress, _require_run, _signing_key, store_url
from deltasync.errors import DeltaSyncError, DemoError
from deltasync.storage import LocalStore, Store, open_store

__all__ = ["cmd_demo", "cmd_fetch", "cmd_follow", "cmd_inspect", "cmd_serve"]


def cmd_fetch(args: argparse.Namespace) -> int:
    from deltasync.fetcher import DeltaFetcher

    update, close = _progress("fetch")
    with open_store(args.store) as store:
        _require_run(store)
        fetcher = DeltaFetcher(store, verify=not args.no_verify, signing_key=_signing_key(), progress=update)
        t0 = time.perf_counter()
        try:
            out = fetcher.materialize(args.out, step=args.step, config_from=args.config_from)
        finally:
            close()
        marker = json.loads((out / ".deltasync.json").read_text())
        done = fetcher.last_materialize
    shards = f" ({done.shards_written} shards written, {done.shards_linked} unchanged and linked)" if done else ""
    print(f"wrote step {marker['step']} to {out} in {time.perf_counter() - t0:.2f} s{shards}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from deltasync.run import RunReader

    args.url = store_url(args, "deltasync inspect")

    with open_store(args.url) as store:
        _require_run(store)
        if args.verify:
            return _inspect_verify(store, args.last)
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
            rows.append((str(s), m.kind, parent, changed, _human(m.stats.nbytes), f"{m.stats.nbytes / full:.4f}"))
    head = ("step", "kind", "parent", "changed", "bytes", "ratio to full")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    for bad in broken:
        print(f"error: {bad}", file=sys.stderr)
    return 1 if broken else 0


def _inspect_verify(store: Store, last: int) -> int:
    from deltasync.run.audit import verify_run

    total = failed = 0
    for check in verify_run(store, last=last, signing_key=_signing_key()):
        print(check.line(), flush=True)
        total += 1
        failed += not check.ok
    print(f"{total} steps verified, {failed} failed")
    return 1 if failed else 0


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from deltasync.server import Settings, create_app, is_loopback

    settings = Settings.from_env(db_path=args.db, store_url=args.store)
    if not settings.secured and not is_loopback(args.host) and not args.insecure:
        raise DeltaSyncError(
            f"refusing to serve on {args.host} without DELTASYNC_PUBLISH_TOKEN: anyone could publish; "
            "set the token, bind 127.0.0.1, or pass --insecure"
        )
    scopes = ", ".join(
        f"{name}: {'token' if tok else 'open'}"
        for name, tok in (("publish", settings.publish_token), ("subscribe", settings.subscribe_token))
    )
    print(
        f"deltasync signal server on http://{args.host}:{args.port} ({scopes}; db {settings.db_path}"
        + (f"; store {settings.store_url}" if settings.store_url else "")
        + ")",
        file=sys.stderr,
        flush=True,
    )
    app = create_app(settings)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            app.state.relay.close_streams()  # SSE streams would otherwise hold the shutdown
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=2)
    Server(config).run()
    return 0


def cmd_follow(args: argparse.Namespace) -> int:
    from deltasync.errors import RunNotFound
    from deltasync.fetcher import DeltaFetcher
    from deltasync.run import RunReader

    token = os.environ.get("DELTASYNC_SUBSCRIBE_TOKEN") or os.environ.get("DELTASYNC_PUBLISH_TOKEN") or None
    with open_store(args.store) as store:
        if isinstance(store, LocalStore) and not store.root.is_dir():  # a typo, not a run yet to start
            raise RunNotFound(
                f"{store.url}: no such directory; check the path (to wait for a trainer that has not "
                "started yet, create the directory first)"
            )
        if not RunReader(store).exists():
            print(
                f"waiting for the first commit at {store.url} (nothing committed yet; is the trainer running?)",
                file=sys.stderr,
                flush=True,
            )
        fetcher = DeltaFetcher(store, verify=not args.no_verify, signing_key=_signing_key(), lease_ttl=args.lease_ttl)
        t0 = time.perf_counter()

        def on_step(step: int) -> None:
            print(f"step {step} -> {args.out} (+{time.perf_counter() - t0:.2f} s)", flush=True)

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
            )
    print(f"stopped at step {step}")
    return 0


def _env_seconds(name: str) -> float:
    raw = os.environ.get(name) or "0"
    try:
        return float(raw)
    except ValueError:
        raise DemoError(f"${name} must be a number of seconds, got {raw!r}") from None


def cmd_demo(args: argparse.Namespace) -> int:
    try:
        from spaces_demo.app import run_demo
        from spaces_demo.live import DemoOptions
    except ImportError as exc:
        raise DemoError(
            f"the demo needs its extra dependencies ({exc.name} is missing): pip install 'deltasync[demo]'"
        ) from exc

    # a Space configures follower mode through its variables; flags win over them
    follow = os.environ.get("DELTASYNC_DEMO_FOLLOW") or None
    train = not args.no_train and not (follow and args.store is None)
    options = DemoOptions(
        store_url=args.store or follow or "deltasync-demo",
        train=train,
        steps=args.steps,
        lr=args.lr,
        model=args.model,
        anchor_every=args.anchor_every,
        step_interval=args.step_interval,
        signal_url=args.signal_url or os.environ.get("DELTASYNC_SIGNAL_URL") or None,
        signal_run=args.signal_run or os.environ.get("DELTASYNC_SIGNAL_RUN") or None,
        loop=args.loop if args.loop is not None else _env_seconds("DELTASYNC_DEMO_LOOP") if train else 0.0,
    )
    return run_demo(
        options, host=args.host, port=args.port, open_browser=not args.no_browser, exit_when_done=args.exit_when_done
    )
