"""``deltasync demo``: train a toy Qwen3 here and watch its patches land live in a browser page
(or, with ``--no-train``, follow what a trainer elsewhere commits: the Space's follower mode)."""

from __future__ import annotations

import argparse
import os

from deltasync.errors import DemoError

__all__ = ["DESCRIPTION", "EPILOG", "NAME", "SUMMARY", "add_arguments", "run"]

NAME = "demo"
SUMMARY = "train a tiny Qwen3 and watch patches land live at http://127.0.0.1:7860"
DESCRIPTION = """
        Train a toy Qwen3 on a small task in this process, push every step to a store (default
        ./deltasync-demo) with the real uploader, and apply it to an inference copy with the real
        fetcher, while a page at http://HOST:PORT shows each patch land and proves it bit-exact.
        With --no-train it only follows what a trainer elsewhere commits (the Space's follower mode).
        """
EPILOG: str | None = None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``deltasync demo``."""
    p.add_argument(
        "--store",
        metavar="URL",
        help="store URL (default: ./deltasync-demo). Training needs an empty store or one the demo created "
        "(emptied first); any other store is refused, never deleted. $DELTASYNC_DEMO_FOLLOW follows that store",
    )
    p.add_argument(
        "--signal-url",
        metavar="URL",
        help="signal server to wait on for new steps (default: in-process + store polling)",
    )
    p.add_argument(
        "--signal-run",
        metavar="NAME",
        help="run name at the signal server (default demo-<episode>; $DELTASYNC_SIGNAL_RUN)",
    )
    p.add_argument("--no-train", action="store_true", help="follower mode: only apply what a trainer elsewhere commits")
    p.add_argument("--host", default="127.0.0.1", help="address to serve the page on; 0.0.0.0 in a Space")
    p.add_argument("--port", type=int, default=7860, help="port to serve the page on")
    p.add_argument("--no-browser", action="store_true", help="do not open a browser")
    p.add_argument("--steps", type=int, default=400, help="training steps")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--model", choices=["small", "tiny"], default="small", help="toy Qwen3 shape (small: 0.4M params)")
    p.add_argument("--anchor-every", type=int, default=50, metavar="N", help="a full anchor at least every N steps")
    p.add_argument(
        "--step-interval", type=float, default=0.25, metavar="SECONDS", help="minimum seconds per training step"
    )
    p.add_argument(
        "--exit-when-done", action="store_true", help="exit once the last step is applied (status 1 unless bit-exact)"
    )
    p.add_argument(
        "--loop",
        type=float,
        metavar="SECONDS",
        help="when training is done, wait this long, empty the (demo-created) store and train again "
        "(default 0: off; $DELTASYNC_DEMO_LOOP)",
    )


def _env_seconds(name: str) -> float:
    raw = os.environ.get(name) or "0"
    try:
        return float(raw)
    except ValueError:
        raise DemoError(f"${name} must be a number of seconds, got {raw!r}") from None


def run(args: argparse.Namespace) -> int:
    """Run ``deltasync demo``; a Space configures follower mode through its variables, flags win over them."""
    try:
        from spaces_demo.app import run_demo
        from spaces_demo.live import DemoOptions
    except ImportError as exc:
        raise DemoError(
            f"the demo needs its extra dependencies ({exc.name} is missing): "
            "pip install 'fastapi>=0.115,<1' 'uvicorn>=0.30,<1' 'torch>=2.2' 'transformers>=4.51' "
            "(or, in the deltasync clone's root: pip install -e '.[demo]')"
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
