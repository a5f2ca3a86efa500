"""``deltasync fetch --store URL --out DIR``: write a committed step as a full checkpoint dir."""

from __future__ import annotations

import argparse
import json
import shlex
import time

from deltasync.cli._common import (
    CONFIG_HELP,
    STORE_HELP,
    VERIFY_HELP,
    announce_store,
    progress_bar,
    require_run,
    signing_key_from_env,
)
from deltasync.storage import open_store

__all__ = ["DESCRIPTION", "EPILOG", "NAME", "SUMMARY", "add_arguments", "run"]

NAME = "fetch"
SUMMARY = "write a committed step as a full safetensors checkpoint dir"
DESCRIPTION = """
        Materialize one committed step of a store as a full safetensors checkpoint dir (HF layout:
        model.safetensors, or shards and model.safetensors.index.json). The dir is built beside OUT
        and swapped in atomically. With --config-from it also holds config.json and the tokenizer,
        so transformers' from_pretrained and vLLM load it as it is.
        """
EPILOG: str | None = """
        example:
          deltasync fetch --store s3://bucket/runs/r1 --out ckpt --config-from ./Qwen3-0.6B
        """


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``deltasync fetch``."""
    p.add_argument("--store", required=True, metavar="URL", help=STORE_HELP)
    p.add_argument("--out", required=True, metavar="DIR", help="output dir (replaced atomically; created if missing)")
    p.add_argument("--step", type=int, help="step to fetch (default: the latest committed)")
    p.add_argument("--config-from", metavar="DIR", help=CONFIG_HELP)
    p.add_argument("--no-verify", action="store_true", help=VERIFY_HELP)


def run(args: argparse.Namespace) -> int:
    """Run ``deltasync fetch``."""
    from deltasync.errors import ChainBroken, ChecksumMismatch, ProtocolError
    from deltasync.fetcher import DeltaFetcher

    update, close = progress_bar("fetch")
    with open_store(args.store) as store:
        announce_store(store)
        require_run(store)
        fetcher = DeltaFetcher(store, verify=not args.no_verify, signing_key=signing_key_from_env(), progress=update)
        inspect = f"`deltasync inspect --store {shlex.quote(args.store)}"
        if args.step is not None:
            try:
                fetcher.reader.require_step(args.step)
            except ChainBroken as exc:
                raise ChainBroken(f"{exc}; {inspect}` lists the committed steps") from None
        t0 = time.perf_counter()
        try:
            out = fetcher.materialize(args.out, step=args.step, config_from=args.config_from)
        except (ChecksumMismatch, ProtocolError) as exc:  # bad bytes in the store: the audit says which step
            raise type(exc)(
                f"{exc}; {inspect} --verify` checks every step and names the newest one that is intact"
            ) from exc
        finally:
            close()
        marker = json.loads((out / ".deltasync.json").read_text())
        done = fetcher.last_materialize
    shards = f" ({done.shards_written} shards written, {done.shards_linked} unchanged and linked)" if done else ""
    print(f"wrote step {marker['step']} to {out} in {time.perf_counter() - t0:.2f} s{shards}")
    return 0
