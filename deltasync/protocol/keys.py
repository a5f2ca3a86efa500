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
    "writer_folder",
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
_WRITER_DIR = re.compile(r"w[A-Za-z0-9]{1,32}")
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
    """Validate a file name listed in a manifest, relative to the step's (or span's) folder.

    Either one plain segment (``patch-00000.safetensors``: ``[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}``,
    no ``..``), or one writer's subfolder and a plain segment (``w3f9c0a1b2c3d4e5f/patch-00000.safetensors``:
    ``w`` and 1 to 32 ASCII letters and digits, ``/``, a plain segment). Nothing else: no other
    nesting, traversal, leading ``.`` or absolute path; and never ``manifest.json``.
    """
    if isinstance(name, str):
        folder, sep, leaf = name.rpartition("/")
        if (not sep or _WRITER_DIR.fullmatch(folder)) and _FILE_NAME.fullmatch(leaf) and ".." not in leaf:
            if leaf == MANIFEST_NAME:
                if sep:
                    raise ProtocolError(
                        f"manifest names an invalid file {name!r}: {MANIFEST_NAME} is never a data file"
                    )
                raise ProtocolError("a manifest may not list itself as a data file")
            return name
    raise ProtocolError(
        f"manifest names an invalid file {name!r}: files must be plain names inside the step's folder, "
        "or w<writer id>/<plain name> (no other '/', no '..', leading '.' or absolute paths)"
    )


def file_key(step: int, name: str) -> str:
    """Key of a data file of a step."""
    return step_prefix(step) + check_file_name(name)


def writer_folder(writer_id: str) -> str:
    """``w{writer_id}/``: writer ``writer_id``'s subfolder of a step's (or span's) folder, in which
    it stores its data files (SPEC.md "Commit rule"). ``writer_id`` is 1 to 32 ASCII letters and
    digits (the reference's ids are 16 hex digits)."""
    if not isinstance(writer_id, str) or not _WRITER_TAG.fullmatch(writer_id):
        raise ProtocolError(f"writer id {writer_id!r} cannot name files: expected 1 to 32 ASCII letters and digits")
    return f"w{writer_id}/"


def writer_file_name(writer_id: str, name: str) -> str:
    """``w{writer_id}/{name}``: the name (relative to the step's or span's folder) under which
    writer ``writer_id`` stores its data file ``name``, a plain name.

    Data and span files are named per writer (SPEC.md "Commit rule"), so two writers racing for
    one step never write the same key: on stores without create-only writes (HF buckets) neither
    can overwrite what the other wrote. The subfolder keeps the plain names inside it, so a
    writer's anchor folder ``steps/{step}/w{writer_id}/`` is an ordinary HF checkpoint dir.
    """
    folder = writer_folder(writer_id)
    if not isinstance(name, str) or "/" in name:
        raise ProtocolError(f"{name!r} is not a plain file name")
    return check_file_name(folder + name)


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
