"""Command line: ``deltasync {fetch,follow,inspect,gc,serve,demo}`` and ``delta-upload``.

Errors print as one ``error: ...`` line on stderr with a non-zero exit status. Ctrl-C exits
130, except in ``delta-upload`` once its step is committed: it says so and exits 0.
Environment variables are read here only: DELTASYNC_SIGNING_KEY (HMAC key for
manifests), XDG_CACHE_HOME (where delta-upload keeps its baseline cache). For
s3:// stores the S3 client takes the usual AWS_* variables: AWS_ENDPOINT_URL
(or AWS_ENDPOINT_URL_S3), AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_SESSION_TOKEN, AWS_REGION, AWS_VIRTUAL_HOSTED_STYLE_REQUEST, AWS_ALLOW_HTTP.
Signal server tokens: DELTASYNC_PUBLISH_TOKEN / DELTASYNC_SUBSCRIBE_TOKEN (
``serve`` requires them, ``delta-upload --signal`` sends the publish token,
``follow --signal`` the subscribe token, or the publish token when that is unset).
DELTASYNC_DEMO_FOLLOW, DELTASYNC_SIGNAL_URL and DELTASYNC_DEMO_LOOP (``deltasync demo``
in a Space: follow that store / signal server instead of training here; retrain after N s).
DELTASYNC_TEST_CACHE_GATE is a test hook: ``delta-upload`` holds after its commit, its cache
half written, until that file exists.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from typing import Any

from deltasync.errors import DeltaSyncError, DemoError
from deltasync.storage import LocalStore, Store, open_store

__all__ = ["build_parser", "build_upload_parser", "build_watch_parser", "main", "upload_main"]


from deltasync._cli_common import (
    STORE_HELP,
    HelpFormatter,
    _human,
    _progress,
    _require_run,
    _signing_key,
    add_store_args,
    store_url,
)
from deltasync._gc_cli import cmd_gc, gc_parser
from deltasync._upload_cli import _upload_parser, cmd_upload


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
    from deltasync.storage import RunReader

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
    from deltasync.storage._verify import verify_run

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
            app.state.hub.close_streams()  # SSE streams would otherwise hold the shutdown
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=2)
    Server(config).run()
    return 0


def cmd_follow(args: argparse.Namespace) -> int:
    from deltasync.errors import RunNotFound
    from deltasync.fetcher import DeltaFetcher
    from deltasync.storage import RunReader

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
                from deltasync.metrics import SyncMetrics

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


# ------------------------------------------------------------------ parsers


def _run(fn: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    try:
        return fn(args)
    except DeltaSyncError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError, TypeError) as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


_CONFIG_HELP = (
    "copy the non-weight files of this HF model dir (config.json, tokenizer, chat template...) into the "
    "output, so transformers/vLLM/SGLang can load it"
)


def _add_version(p: argparse.ArgumentParser) -> None:
    from importlib.metadata import PackageNotFoundError, version

    from deltasync import __version__

    try:
        v = version("deltasync")
    except PackageNotFoundError:  # run from a source tree that is not installed
        v = __version__
    p.add_argument("--version", action="version", version=f"%(prog)s {v} (python {sys.version.split()[0]})")


def _command(sub: Any, name: str, summary: str, description: str, epilog: str | None = None) -> argparse.ArgumentParser:
    """A subcommand: ``summary`` is its line in ``deltasync --help``, ``description`` its own help."""
    p: argparse.ArgumentParser = sub.add_parser(
        name,
        help=summary,
        description=textwrap.dedent(description).strip(),
        epilog=textwrap.dedent(epilog).strip() if epilog else None,
        formatter_class=HelpFormatter,
    )
    return p


_VERIFY_HELP = "skip the xxh3 checksum of each file and the digest proof of each tensor (sizes are still checked)"


def build_parser() -> argparse.ArgumentParser:
    """The ``deltasync`` argument parser."""
    p = argparse.ArgumentParser(
        prog="deltasync",
        description="Sync RL weights from a trainer to inference engines as sparse, bit-exact patches.",
        epilog="Run `deltasync COMMAND --help` for a command's options. The trainer side is also\n"
        "`delta-upload` (one checkpoint) and `delta-upload watch` (a training output dir).",
        formatter_class=HelpFormatter,
    )
    _add_version(p)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    f = _command(
        sub,
        "fetch",
        "write a committed step as a full safetensors checkpoint dir",
        """
        Materialize one committed step of a store as a full safetensors checkpoint dir (HF layout:
        model.safetensors, or shards and model.safetensors.index.json). The dir is built beside OUT
        and swapped in atomically. With --config-from it also holds config.json and the tokenizer,
        so transformers' from_pretrained and vLLM load it as it is.
        """,
        """
        example:
          deltasync fetch --store s3://bucket/runs/r1 --out ckpt --config-from ./Qwen3-0.6B
        """,
    )
    f.add_argument("--store", required=True, metavar="URL", help=STORE_HELP)
    f.add_argument("--out", required=True, metavar="DIR", help="output dir (replaced atomically; created if missing)")
    f.add_argument("--step", type=int, help="step to fetch (default: the latest committed)")
    f.add_argument("--config-from", metavar="DIR", help=_CONFIG_HELP)
    f.add_argument("--no-verify", action="store_true", help=_VERIFY_HELP)
    f.set_defaults(fn=cmd_fetch)
    i = _command(
        sub,
        "inspect",
        "list the committed steps of a store",
        """
        List the committed steps of a store: kind (anchor or patch), parent step, the fraction of
        elements changed, bytes written, and bytes relative to a full checkpoint. A step whose
        manifest cannot be read is listed as BROKEN and the exit status is 1. With --verify every
        file is read and checked instead (see below).
        """,
        """
        examples:
          deltasync inspect --store s3://bucket/runs/r1 --last 20
          deltasync inspect --store s3://bucket/runs/r1 --verify
        """,
    )
    add_store_args(i)
    i.add_argument("--last", type=int, default=0, metavar="N", help="only the last N steps (default: all)")
    i.add_argument(
        "--verify",
        action="store_true",
        help="check each step instead of listing it: its manifest parses, every data file exists with the "
        "manifest's size and xxh3-128 checksum, and its parent link (digest) and chain to a committed anchor "
        "hold; prints `step N: OK` or `step N: FAIL <reason>` per step, exits 1 if any step fails",
    )
    i.set_defaults(fn=cmd_inspect)
    g = _command(
        sub,
        "gc",
        "delete old steps: keep the newest K anchors and what fetcher leases need",
        """
        Delete the steps no fetcher needs. Kept: the newest K anchors and every step from the oldest
        of them on, the newest step, and every step a live lease (deltasync follow --lease-ttl) holds
        or is fetching. HEAD, writers/, unreadable manifests and keys outside the run's layout are
        never deleted. The plan is made twice, around a fresh listing, and only what both plans
        delete goes: manifests first, then their files.
        """,
        """
        example:
          deltasync gc --store s3://bucket/runs/r1 --keep-anchors 2 --dry-run
        """,
    )
    gc_parser(g)
    g.set_defaults(fn=cmd_gc)
    u = _command(
        sub,
        "upload",
        "push one checkpoint as a patch or anchor (same as delta-upload)",
        """
        Push one checkpoint (a .safetensors file or an HF checkpoint dir) to a store: a sparse patch
        against the previous push, or a full anchor every --anchor-every steps. Same as
        `delta-upload`; to follow a training output dir use `delta-upload watch`.
        """,
    )
    _upload_parser(u)
    u.set_defaults(fn=cmd_upload)
    s = _command(
        sub,
        "serve",
        "run the signal server (trainers publish steps, fetchers subscribe)",
        """
        Run the signal server (FastAPI + uvicorn): trainers POST "step N committed", fetchers wait by
        SSE, long-poll or signed webhooks. Tokens come from the environment:
        DELTASYNC_PUBLISH_TOKEN (needed to publish; required off loopback) and
        DELTASYNC_SUBSCRIBE_TOKEN (needed to subscribe, when set).
        """,
    )
    s.add_argument("--host", default="127.0.0.1", help="address to bind")
    s.add_argument("--port", type=int, default=8000, help="port to bind")
    s.add_argument("--db", default="deltasync-signal.db", metavar="FILE", help="SQLite file for heads and webhooks")
    s.add_argument(
        "--store",
        metavar="URL",
        help="store URL to check commits against before announcing them ({run} is replaced by the run name)",
    )
    s.add_argument("--insecure", action="store_true", help="allow a non-loopback host without a publish token")
    s.add_argument(
        "--log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn log level",
    )
    s.set_defaults(fn=cmd_serve)
    fo = _command(
        sub,
        "follow",
        "keep a checkpoint dir at the newest committed step",
        """
        Keep a checkpoint dir at the newest committed step, for engines that reload weights from
        disk: wait for each commit (SSE from --signal, else by polling the store), apply it, and swap
        the dir in atomically. The signal server token is DELTASYNC_SUBSCRIBE_TOKEN (or, when that is
        unset, DELTASYNC_PUBLISH_TOKEN).
        """,
        """
        example:
          deltasync follow --store s3://bucket/runs/r1 --out /ckpt/live --config-from ./Qwen3-0.6B \\
              --signal http://trainer:8000 --lease-ttl 600
        """,
    )
    fo.add_argument("--store", required=True, metavar="URL", help=STORE_HELP)
    fo.add_argument("--out", required=True, metavar="DIR", help="checkpoint dir, rewritten atomically at each step")
    fo.add_argument("--signal", metavar="URL", help="signal server to wait on (SSE); without it the store is polled")
    fo.add_argument("--config-from", metavar="DIR", help=_CONFIG_HELP)
    fo.add_argument("--run", metavar="NAME", help="run name at the signal server (default: the store's run id)")
    fo.add_argument(
        "--until", type=int, metavar="STEP", help="exit once this step is reached (default: run until Ctrl-C)"
    )
    fo.add_argument("--poll-interval", type=float, default=2.0, metavar="SECONDS", help="seconds between store polls")
    fo.add_argument("--no-verify", action="store_true", help=_VERIFY_HELP)
    fo.add_argument(
        "--metrics-port", type=int, metavar="PORT", help="serve Prometheus metrics at /metrics on PORT (0: any free)"
    )
    fo.add_argument("--metrics-host", default="127.0.0.1", metavar="ADDR", help="address of the metrics endpoint")
    fo.add_argument(
        "--lease-ttl",
        type=float,
        metavar="SECONDS",
        help="write a lease (leases/<id>.json) valid this long after each step, so `deltasync gc` keeps what this "
        "follower needs (needs write access to the store; default: no lease)",
    )
    fo.set_defaults(fn=cmd_follow)
    d = _command(
        sub,
        "demo",
        "train a tiny Qwen3 and watch patches land live at http://127.0.0.1:7860",
        """
        Train a toy Qwen3 on a small task in this process, push every step to a store (default
        ./deltasync-demo) with the real uploader, and apply it to an inference copy with the real
        fetcher, while a page at http://HOST:PORT shows each patch land and proves it bit-exact.
        With --no-train it only follows what a trainer elsewhere commits (the Space's follower mode).
        """,
    )
    d.add_argument(
        "--store",
        metavar="URL",
        help="store URL (default: ./deltasync-demo). Training needs an empty store or one the demo created "
        "(emptied first); any other store is refused, never deleted. $DELTASYNC_DEMO_FOLLOW follows that store",
    )
    d.add_argument(
        "--signal-url",
        metavar="URL",
        help="signal server to wait on for new steps (default: in-process + store polling)",
    )
    d.add_argument(
        "--signal-run",
        metavar="NAME",
        help="run name at the signal server (default demo-<episode>; $DELTASYNC_SIGNAL_RUN)",
    )
    d.add_argument("--no-train", action="store_true", help="follower mode: only apply what a trainer elsewhere commits")
    d.add_argument("--host", default="127.0.0.1", help="address to serve the page on; 0.0.0.0 in a Space")
    d.add_argument("--port", type=int, default=7860, help="port to serve the page on")
    d.add_argument("--no-browser", action="store_true", help="do not open a browser")
    d.add_argument("--steps", type=int, default=400, help="training steps")
    d.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    d.add_argument("--model", choices=["small", "tiny"], default="small", help="toy Qwen3 shape (small: 0.4M params)")
    d.add_argument("--anchor-every", type=int, default=50, metavar="N", help="a full anchor at least every N steps")
    d.add_argument(
        "--step-interval", type=float, default=0.25, metavar="SECONDS", help="minimum seconds per training step"
    )
    d.add_argument(
        "--exit-when-done", action="store_true", help="exit once the last step is applied (status 1 unless bit-exact)"
    )
    d.add_argument(
        "--loop",
        type=float,
        metavar="SECONDS",
        help="when training is done, wait this long, empty the (demo-created) store and train again "
        "(default 0: off; $DELTASYNC_DEMO_LOOP)",
    )
    d.set_defaults(fn=cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``deltasync``."""
    args = build_parser().parse_args(argv)
    return _run(args.fn, args)


def build_watch_parser() -> argparse.ArgumentParser:
    """The ``delta-upload watch`` argument parser."""
    from deltasync._watch import watch_parser

    w = argparse.ArgumentParser(
        prog="delta-upload watch",
        description="Follow a training output dir and push each new complete checkpoint, in step order,\n"
        "as patches against the previous push (an anchor every --anchor-every pushes). Ctrl-C finishes\n"
        "the commit in flight; a second Ctrl-C abandons it.",
        epilog="example:\n  delta-upload watch outputs/ --store s3://bucket/runs/r1 --signal http://127.0.0.1:8000",
        formatter_class=HelpFormatter,
    )
    _add_version(w)
    watch_parser(w)
    return w


def build_upload_parser() -> argparse.ArgumentParser:
    """The ``delta-upload`` argument parser."""
    p = argparse.ArgumentParser(
        prog="delta-upload",
        description="Push one checkpoint (a .safetensors file or an HF checkpoint dir) to a store, as a sparse\n"
        "patch against the previous push, or a full anchor every --anchor-every steps.",
        epilog="example:\n  delta-upload checkpoint-120/ --store s3://bucket/runs/r1 --step 120\n\n"
        "`delta-upload watch DIR --store URL` follows a training output dir instead (see\n"
        "`delta-upload watch --help`); to push a checkpoint dir that is named watch, write ./watch.",
        formatter_class=HelpFormatter,
    )
    _add_version(p)
    _upload_parser(p)
    return p


def upload_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``delta-upload`` (and of ``delta-upload watch``, when that is the first word)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["watch"]:
        from deltasync._watch import cmd_watch

        return _run(cmd_watch, build_watch_parser().parse_args(argv[1:]))
    return _run(cmd_upload, build_upload_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
