"""Command line: ``deltasync`` and ``delta-upload``, one module per command (see :mod:`deltasync.cli.main`)."""

from __future__ import annotations

from deltasync.cli.main import build_parser, build_upload_parser, build_watch_parser, main, upload_main

__all__ = ["build_parser", "build_upload_parser", "build_watch_parser", "main", "upload_main"]
