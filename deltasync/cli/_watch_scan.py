"""Finding checkpoints in a training output dir, and telling when one is completely written.

No torch here: only names, sizes and safetensors headers. A checkpoint is *ready* when
its weight files are all there (the index, when sharded, and every shard it lists),
each is a whole safetensors file (the size its header implies), and it has settled:
none of its files was modified in the last ``settle`` seconds (a checkpoint saved
before ``delta-upload watch --once`` started is pushed at once), or their sizes and
mtimes did not change between two polls.
"""

from __future__ import annotations

import json
import re
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from deltasync.errors import DeltaSyncError
from deltasync.protocol.checkpoint import INDEX_NAME

__all__ = ["SETTLE", "SETTLING", "Candidate", "CheckpointPattern", "Readiness", "WatchError", "weight_files"]

#: HF Trainer ``checkpoint-<step>``, ``step_<n>`` / ``step-<n>``, DeepSpeed ``global_step<n>``.
DEFAULT_NAMES = (re.compile(r"checkpoint-(\d+)"), re.compile(r"step[_-](\d+)"), re.compile(r"global_step(\d+)"))
DEFAULT_HELP = "checkpoint-<step>/, step_<n>/, step-<n>/ or global_step<n>/"
SHARD_NAME = re.compile(r".*-\d{5}-of-\d{5}\.safetensors")
SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")
MAX_HEADER = 100_000_000
#: seconds since a checkpoint's newest file was modified after which it counts as settled
SETTLE = 2.0
#: why a complete checkpoint is not ready yet: it may still be being written
SETTLING = "modified in the last seconds and not yet seen unchanged over two polls"

Fingerprint = tuple[tuple[str, int, int], ...]


class WatchError(DeltaSyncError, ValueError):
    """``delta-upload watch`` cannot follow the given dir (missing, a file, a bad pattern)."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """A checkpoint found in the watched dir: its training step and path."""

    step: int
    path: Path

    @property
    def name(self) -> str:
        return self.path.name


class CheckpointPattern:
    """Which entries of ``root`` are checkpoints, and their steps.

    Without ``glob``: the direct subdirectories named like ``DEFAULT_HELP``. With it:
    whatever ``root.glob(glob)`` matches (dirs or ``.safetensors`` files), the step
    being group 1 of ``step_regex`` searched in the path relative to ``root`` (by
    default the last number in it).
    """

    def __init__(self, root: Path, glob: str | None = None, step_regex: str | None = None) -> None:
        self.root = root
        if glob is not None and (Path(glob).is_absolute() or ".." in Path(glob).parts):
            raise WatchError(f"--glob {glob!r} must be a pattern relative to the watched dir, without '..'")
        self.glob = glob
        try:
            self.step_re = re.compile(step_regex) if step_regex else None
        except re.error as exc:
            raise WatchError(f"--step-regex {step_regex!r} is not a valid regular expression: {exc}") from None
        if self.step_re is not None and self.step_re.groups < 1:
            raise WatchError(f"--step-regex {step_regex!r} needs a group capturing the step, e.g. 'ckpt(\\d+)'")

    def describe(self) -> str:
        return f"entries matching {self.glob!r}" if self.glob else DEFAULT_HELP

    def step_of(self, path: Path) -> int | None:
        """The step a path's name says, or None when it is not a checkpoint name."""
        if self.glob is None:
            for rx in DEFAULT_NAMES:
                m = rx.fullmatch(path.name)
                if m:
                    return int(m.group(1))
            return None
        rel = path.relative_to(self.root).as_posix()
        if self.step_re is not None:
            m = self.step_re.search(rel)
            return int(m.group(1)) if m and m.group(1) and m.group(1).isdigit() else None
        nums = re.findall(r"\d+", rel)
        return int(nums[-1]) if nums else None

    def scan(self, *, missing_ok: bool = False) -> list[Candidate]:
        """Every checkpoint now in ``root``, by step (then path); ``missing_ok``: none while ``root``
        does not exist (a trainer that has not started yet), else that is an error."""
        if not self.root.exists():
            if missing_ok:
                return []
            raise WatchError(
                f"{self.root}: no such directory (the training output dir to watch; without --once, watch waits "
                "for it to be created)"
            )
        if not self.root.is_dir():
            raise WatchError(
                f"{self.root} is a file, not a training output dir; to push one checkpoint file run "
                f"`delta-upload {self.root} --store URL --step N`"
            )
        if self.glob is None:
            entries = [p for p in self.root.iterdir() if p.is_dir()]
        else:
            entries = [p for p in self.root.glob(self.glob) if p.is_dir() or p.suffix == ".safetensors"]
        out = [Candidate(s, p) for p in entries if (s := self.step_of(p)) is not None]
        return sorted(out, key=lambda c: (c.step, str(c.path)))


def weight_files(path: Path) -> tuple[list[Path], str | None]:
    """The files whose bytes make up checkpoint ``path`` and, if it is not complete, why not."""
    if path.is_file():
        return [path], None
    index = path / INDEX_NAME
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return [], f"{INDEX_NAME} is not a complete index yet"
        bad = [n for n in names if not isinstance(n, str) or not SAFE_NAME.fullmatch(n) or ".." in n]
        if bad:
            return [], f"{INDEX_NAME} names files that are not plain file names: {bad[:3]}"
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            return [], f"shards not written yet: {missing[:3]}"
        return [index, *(path / n for n in names)], None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return [], "no *.safetensors file yet"
    if any(SHARD_NAME.fullmatch(f.name) for f in files):
        return [], f"sharded, but {INDEX_NAME} is not written yet"
    return files, None


def whole_safetensors(f: Path) -> str | None:
    """None when ``f`` is a complete safetensors file (the size its header implies), else why not."""
    try:
        with open(f, "rb") as fh:
            size = fh.seek(0, 2)
            fh.seek(0)
            raw = fh.read(8)
            if len(raw) < 8:
                return f"{f.name}: header not written yet"
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER or size < 8 + n:
                return f"{f.name}: header not written yet"
            header = json.loads(fh.read(n))
        end = max(
            (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
            default=0,
        )
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        return f"{f.name}: not a readable safetensors file yet ({type(exc).__name__})"
    if size != 8 + n + end:
        return f"{f.name}: {size} of {8 + n + end} bytes written"
    return None


class Readiness:
    """Remembers what each checkpoint looked like at the last poll.

    ``settle``: a complete checkpoint whose newest file was modified at least this many
    seconds before ``clock()`` (file mtimes: the wall clock, ``time.time``) is ready at
    first sight; a younger one once it is unchanged between two polls.
    """

    def __init__(self, settle: float = SETTLE, clock: Callable[[], float] = time.time) -> None:
        self.settle = settle
        self.clock = clock
        self._seen: dict[Path, Fingerprint] = {}
        self._settled_at: dict[Path, float] = {}

    def fingerprint(self, files: list[Path]) -> Fingerprint | None:
        try:
            stats = [(f.name, f.stat()) for f in files]
        except OSError:
            return None
        return tuple((name, st.st_size, st.st_mtime_ns) for name, st in stats)

    def check(self, path: Path) -> tuple[bool, str]:
        """(ready, why not): complete now, and settled (see the class) or unchanged since the previous poll."""
        files, why = weight_files(path)
        if why is not None:
            self._seen.pop(path, None)
            return False, why
        fp = self.fingerprint(files)
        prev = self._seen.get(path)
        if fp is None:
            self._seen.pop(path, None)
            return False, "files vanished while being read"
        self._seen[path] = fp
        for f in files:
            if f.name != INDEX_NAME and (why := whole_safetensors(f)) is not None:
                return False, why
        if prev == fp:
            return True, ""
        settled_at = max(mtime_ns for _, _, mtime_ns in fp) / 1e9 + self.settle
        if self.clock() >= settled_at:
            return True, ""
        self._settled_at[path] = settled_at
        return False, SETTLING

    def settles_in(self, path: Path) -> float:
        """Seconds until a checkpoint whose last check said :data:`SETTLING` is settled (0 if it is now)."""
        return max(0.0, self._settled_at.get(path, 0.0) - self.clock())

    def current(self, path: Path) -> Fingerprint | None:
        """The fingerprint recorded at the last poll."""
        return self._seen.get(path)

    def forget(self, path: Path) -> None:
        self._seen.pop(path, None)
        self._settled_at.pop(path, None)
