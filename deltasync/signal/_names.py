"""Run names as they appear in the signal server's URLs (``/v1/runs/{run}/...``)."""

from __future__ import annotations

import re

from deltasync.errors import SignalRejected

__all__ = ["RUN_PATTERN", "check_run"]

#: A run name as it appears in ``/v1/runs/{run}/...``.
RUN_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_RUN = re.compile(RUN_PATTERN)


def check_run(run: str) -> str:
    """Return ``run`` if it is a valid run name, else raise SignalRejected (the server would refuse it)."""
    if not isinstance(run, str) or not _RUN.fullmatch(run):
        raise SignalRejected(
            f"invalid run name {run!r}: use 1-128 characters [A-Za-z0-9._-], starting with a letter or digit"
        )
    return run
