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
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

from deltasync.cli._commands import cmd_demo, cmd_fetch, cmd_follow, cmd_inspect, cmd_serve
from deltasync.cli._common import STORE_HELP, HelpFormatter, add_store_args
from deltasync.cli.gc import cmd_gc, gc_parser
from deltasync.errors import DeltaSyncError

__all__ = ["build_parser", "build_upload_parser", "build_watch_parser", "main", "upload_main"]

from deltasync.cli.upload import _upload_parser, cmd_upload

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
    from deltasync.cli.watch import watch_parser

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
        from deltasync.cli.watch import cmd_watch

        return _run(cmd_watch, build_watch_parser().parse_args(argv[1:]))
    return _run(cmd_upload, build_upload_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
