"""Object keys under a run prefix (protocol v1, SPEC.md section "Layout")."""

from __future__ import annotations

import re

from deltasync.errors import ProtocolError

__all__ = [
    "HEAD_KEY",
    "STEPS_PREFIX",
    "check_file_name",
    "file_key",
    "manifest_key",
    "parse_manifest_key",
    "step_prefix",
    "writer_file_name",
    "writer_key",
    "parse_writer_key",
]

HEAD_KEY = "HEAD.json"
STEPS_PREFIX = "steps/"
MANIFEST_NAME = "manifest.json"
MAX_STEP = 10**12 - 1

WRITERS_PREFIX = "writers/"
_WRITER_KEY = re.compile(r"writers/([0-9]{12})\.json")
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_WRITER_TAG = re.compile(r"[A-Za-z0-9]{1,32}")
_MANIFEST_KEY = re.compile(r"steps/([0-9]{12})/manifest\.json")


def _check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise ProtocolError(f"step must be an integer in [0, {MAX_STEP}], got {step!r}")
    return step


def step_prefix(step: int) -> str:
    """``steps/000000000120/`` for step 120: zero-padded so keys sort by step."""
    return f"{STEPS_PREFIX}{_check_step(step):012d}/"


def manifest_key(step: int) -> str:
    """Key of a step's manifest; its existence is what commits the step."""
    return step_prefix(step) + MANIFEST_NAME


def check_file_name(name: str) -> str:
    """Validate a file name listed in a manifest: one plain path segment, no traversal."""
    if not isinstance(name, str) or not _FILE_NAME.fullmatch(name) or ".." in name:
        raise ProtocolError(
            f"manifest names an invalid file {name!r}: files must be plain names inside "
            "the step's folder (no '/', '..', leading '.' or absolute paths)"
        )
    if name == MANIFEST_NAME:
        raise ProtocolError("a manifest may not list itself as a data file")
    return name


def file_key(step: int, name: str) -> str:
    """Key of a data file of a step."""
    return step_prefix(step) + check_file_name(name)


def writer_file_name(writer_id: str, name: str) -> str:
    """``w{writer_id}-{name}``: the name under which writer ``writer_id`` stores its data file ``name``.

    Data and span files are named per writer (SPEC.md "Commit rule"), so two writers racing for
    one step never write the same key: on stores without create-only writes (HF buckets) neither
    can overwrite what the other wrote. ``writer_id`` is 1 to 32 ASCII letters and digits (the
    reference's ids are 16 hex digits).
    """
    if not isinstance(writer_id, str) or not _WRITER_TAG.fullmatch(writer_id):
        raise ProtocolError(f"writer id {writer_id!r} cannot name files: expected 1 to 32 ASCII letters and digits")
    return check_file_name(f"w{writer_id}-{name}")


def parse_manifest_key(key: str) -> int | None:
    """The step a manifest key belongs to, or None when ``key`` is not a manifest key."""
    m = _MANIFEST_KEY.fullmatch(key)
    return int(m.group(1)) if m else None


def writer_key(epoch: int) -> str:
    """Key of the claim of writer epoch ``epoch`` (SPEC.md "Single writer")."""
    return f"{WRITERS_PREFIX}{_check_step(epoch):012d}.json"


def parse_writer_key(key: str) -> int | None:
    """The epoch a writer-claim key belongs to, or None."""
    m = _WRITER_KEY.fullmatch(key)
    return int(m.group(1)) if m else None
