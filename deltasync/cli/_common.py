"""Helpers shared by the ``deltasync`` and ``delta-upload`` commands: the help formatter, the
store argument, dtype casts, the signing key and publish token from the environment, the
uploader both upload commands build, byte counts and progress bars."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

__all__ = [
    "CONFIG_HELP",
    "STORE_HELP",
    "VERIFY_HELP",
    "HelpFormatter",
    "add_store_args",
    "announce_store",
    "cast_name",
    "cli_uploader",
    "human_bytes",
    "progress_bar",
    "require_run",
    "resolved_store_url",
    "signing_key_from_env",
    "store_url",
]

_CASTS = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "half": "float16"}
_CASTS |= {"fp32": "float32", "float32": "float32", "float": "float32"}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions keep their line breaks; every option shows its default unless its help says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            not action.option_strings
            or action.default in (None, False, argparse.SUPPRESS)
            or "default" in text.lower()
            or "%(default)" in text
        ):
            return text
        return f"{text} (default: %(default)s)"


STORE_HELP = "store URL: a path, file:///..., memory://, s3://bucket/prefix, hf://buckets/owner/name/prefix"
CONFIG_HELP = (
    "copy the non-weight files of this HF model dir (config.json, tokenizer, chat template...) into the "
    "output, so transformers/vLLM/SGLang can load it"
)
VERIFY_HELP = "skip the xxh3 checksum of each file and the digest proof of each tensor (sizes are still checked)"


def add_store_args(p: argparse.ArgumentParser) -> None:
    """The store as a positional ``STORE`` or as ``--store URL`` (like every other command)."""
    p.add_argument("url", nargs="?", metavar="STORE", help=f"{STORE_HELP} (or --store URL)")
    p.add_argument("--store", dest="store_opt", metavar="URL", help="the store, as the other commands take it")


def announce_store(store: Any) -> None:
    """``store: URL`` on stderr: the store a command resolved its URL to (stdout stays machine-readable)."""
    print(f"store: {store.url}", file=sys.stderr, flush=True)


def resolved_store_url(url: str) -> str:
    """The URL ``url`` resolves to (a path as ``file:///abs/path``, ``S3://`` as ``s3://``), a
    ``{run}`` placeholder kept; StorageError for a malformed or unsupported one. Nothing is written."""
    from deltasync.storage import open_store

    placeholder = "deltasync-run-placeholder-4f1c"  # a valid key segment, unchanged by any backend's URL
    with open_store(url.replace("{run}", placeholder)) as store:
        return store.url.replace(placeholder, "{run}")


def store_url(args: argparse.Namespace, prog: str) -> str:
    """The store of :func:`add_store_args`: ``STORE`` or ``--store URL``; none, or two different, exits 2."""
    url: str | None = args.url or args.store_opt
    if url is None:
        print(
            f"usage: {prog} --store URL ...\n{prog}: error: a store is required (STORE or --store URL)", file=sys.stderr
        )
        raise SystemExit(2)
    if args.url and args.store_opt and args.url != args.store_opt:
        print(
            f"{prog}: error: two different stores given: {args.url!r} and --store {args.store_opt!r}", file=sys.stderr
        )
        raise SystemExit(2)
    return url


def cast_name(value: str) -> str:
    """``--cast``: the torch dtype name for bf16 / fp16 / fp32 (or their torch spellings)."""
    try:
        return _CASTS[value.strip().lower()]
    except KeyError:
        import argparse

        raise argparse.ArgumentTypeError(f"unknown dtype {value!r}: choose bf16, fp16 or fp32") from None


def signing_key_from_env() -> bytes | None:
    """The manifest HMAC key: ``$DELTASYNC_SIGNING_KEY``, or None when unset or empty."""
    key = os.environ.get("DELTASYNC_SIGNING_KEY")
    return key.encode() if key else None


def cli_uploader(store: Any, args: Any, **options: Any) -> Any:
    """The DeltaUploader of `delta-upload` and `delta-upload watch`: ``args`` from their parsers
    (anchor_every, signal, run); blocks on a backlog; keys and tokens from the environment;
    ``options``: more UploaderConfig fields."""
    from deltasync.uploader import DeltaUploader

    # both commands print each failed commit themselves (from its future): the uploader's log line would repeat it
    logging.getLogger("deltasync.uploader.commits").setLevel(logging.CRITICAL)
    return DeltaUploader(
        store,
        **options,
        anchor_every=args.anchor_every,
        on_backlog="block",
        signing_key=signing_key_from_env(),
        signal_url=args.signal,
        signal_token=os.environ.get("DELTASYNC_PUBLISH_TOKEN") or None,
        signal_run=args.run,
    )


def human_bytes(n: float) -> str:
    """``n`` bytes in decimal units: ``512 B``, ``1.50 kB``, ... ``3.20 TB``."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"  # pragma: no cover


def progress_bar(desc: str) -> tuple[Callable[[int, int], None], Callable[[], None]]:
    """A tqdm byte bar on stderr (silent when stderr is not a terminal)."""
    from tqdm import tqdm

    bar: Any = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(
                total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr, disable=not sys.stderr.isatty()
            )
        bar.update(done - bar.n)

    def close() -> None:
        if bar is not None:
            bar.close()

    return update, close


def require_run(store: Any) -> None:
    """RunNotFound unless ``store`` holds a run (a committed step or a writer claim): a mistyped
    URL must fail, not read as an empty run."""
    from deltasync.run import RunReader

    RunReader(store).require()
