"""Command line: ``deltasync {fetch,inspect,gc,upload,serve,follow,fleet,replica-token,demo}`` and ``delta-upload``.

The entry points and the error mapping; each command is one module of this package
(``NAME``, ``SUMMARY``, ``DESCRIPTION``, ``EPILOG``, ``add_arguments(p)``, ``run(args)``),
listed in :data:`COMMANDS` in the order ``deltasync --help`` shows them.

Errors print as one ``error: ...`` line on stderr with a non-zero exit status. Ctrl-C exits
130, except in ``delta-upload`` once its step is committed: it says so and exits 0.
Environment variables are read here only: DELTASYNC_SIGNING_KEY (HMAC key for
manifests), XDG_CACHE_HOME (where delta-upload keeps its baseline cache). For
s3:// stores the S3 client takes the usual AWS_* variables: AWS_ENDPOINT_URL
(or AWS_ENDPOINT_URL_S3), AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_SESSION_TOKEN, AWS_REGION, AWS_VIRTUAL_HOSTED_STYLE_REQUEST, AWS_ALLOW_HTTP.
Signal server tokens: DELTASYNC_PUBLISH_TOKEN / DELTASYNC_SUBSCRIBE_TOKEN (
``serve`` requires them, ``delta-upload --signal`` sends the publish token,
``follow --signal`` the subscribe token, or the publish token when that is unset);
DELTASYNC_REPORT_TOKEN (``follow`` reports with it: the server's report token or a replica token)
and DELTASYNC_REPLICA_KEY (``serve`` and ``replica-token``: the key of replica tokens).
DELTASYNC_DEMO_FOLLOW, DELTASYNC_SIGNAL_URL, DELTASYNC_SIGNAL_RUN and DELTASYNC_DEMO_LOOP
(``deltasync demo`` in a Space: follow that store / signal server and run instead of training
here; retrain after N s).
DELTASYNC_TEST_CACHE_GATE is a test hook: ``delta-upload`` holds after its commit, its cache
half written, until that file exists.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from deltasync.cli import demo, fetch, fleet, follow, gc, inspect, replica_token, serve, upload
from deltasync.cli._common import HelpFormatter
from deltasync.errors import DeltaSyncError

__all__ = ["COMMANDS", "Command", "build_parser", "build_upload_parser", "build_watch_parser", "main", "upload_main"]


class Command(Protocol):
    """What a command module of ``deltasync`` holds (see :mod:`deltasync.cli.fetch` for one)."""

    NAME: str  # the subcommand
    SUMMARY: str  # its line in ``deltasync --help``
    DESCRIPTION: str  # its own help, dedented
    EPILOG: str | None  # examples below its options, dedented

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        """Add the command's arguments to its parser ``p``."""

    def run(self, args: argparse.Namespace) -> int:
        """Do the command; the exit status."""


COMMANDS: tuple[Command, ...] = (fetch, inspect, gc, upload, serve, follow, fleet, replica_token, demo)


def _run(fn: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a command; its errors become one ``error: ...`` line and exit status 1, Ctrl-C 130."""
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


def _add_version(p: argparse.ArgumentParser) -> None:
    from importlib.metadata import PackageNotFoundError, version

    from deltasync import __version__

    try:
        v = version("deltasync")
    except PackageNotFoundError:  # run from a source tree that is not installed
        v = __version__
    p.add_argument("--version", action="version", version=f"%(prog)s {v} (python {sys.version.split()[0]})")


def _add_command(sub: Any, command: Command) -> None:
    """``command`` as a subcommand: its ``SUMMARY`` is its line in ``deltasync --help``, its
    ``DESCRIPTION`` and ``EPILOG`` its own help."""
    p: argparse.ArgumentParser = sub.add_parser(
        command.NAME,
        help=command.SUMMARY,
        description=textwrap.dedent(command.DESCRIPTION).strip(),
        epilog=textwrap.dedent(command.EPILOG).strip() if command.EPILOG else None,
        formatter_class=HelpFormatter,
    )
    command.add_arguments(p)
    p.set_defaults(fn=command.run)


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
    for command in COMMANDS:
        _add_command(sub, command)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``deltasync``."""
    args = build_parser().parse_args(argv)
    return _run(args.fn, args)


def build_watch_parser() -> argparse.ArgumentParser:
    """The ``delta-upload watch`` argument parser."""
    from deltasync.cli import watch

    w = argparse.ArgumentParser(
        prog=watch.PROG, description=watch.DESCRIPTION, epilog=watch.EPILOG, formatter_class=HelpFormatter
    )
    _add_version(w)
    watch.add_arguments(w)
    return w


def build_upload_parser() -> argparse.ArgumentParser:
    """The ``delta-upload`` argument parser."""
    p = argparse.ArgumentParser(
        prog="delta-upload",
        description=upload.SCRIPT_DESCRIPTION,
        epilog=upload.SCRIPT_EPILOG,
        formatter_class=HelpFormatter,
    )
    _add_version(p)
    upload.add_arguments(p)
    return p


def upload_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``delta-upload`` (and of ``delta-upload watch``, when that is the first word)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["watch"]:
        from deltasync.cli import watch

        return _run(watch.run, build_watch_parser().parse_args(argv[1:]))
    return _run(upload.run, build_upload_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
