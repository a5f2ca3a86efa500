"""``deltasync inspect --verify``: check every committed step of a run, file by file, link by link.

For each step: its manifest parses (and verifies, with a signing key); every data file it lists
exists, has the listed size and the listed xxh3-128 (read in ranged chunks where the store serves
ranges, so a big shard is never held whole); a patch's parent is committed, its manifest's digest is
the one the patch records, and its parent walk reaches a committed anchor (the one parent walk,
:func:`deltasync.protocol.walk_chain`, with the links checked as the planner checks them). A step
whose walk passes through a step that failed here fails too: a fetch from its anchor would stop
there. Nothing is written. Spans are not checked (they are an optional shortcut; a reader ignores
a bad one).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from deltasync.errors import DeltaSyncError, ObjectNotFound
from deltasync.protocol import Committed, Manifest, file_key, manifest_key, step_prefix, walk_chain
from deltasync.protocol.digests import xxh3_128_chunks
from deltasync.run.manifests import HINT
from deltasync.run.reader import RunReader
from deltasync.storage import LocalStore, S3Store
from deltasync.storage.base import Store

__all__ = ["CHUNK_BYTES", "StepCheck", "file_digest", "verify_run"]

#: Bytes per ranged read while hashing a data file.
CHUNK_BYTES = 8 << 20
#: Stores whose ``get_range`` reads only the range (others read the whole object per call).
_RANGED = (LocalStore, S3Store)
#: File problems named per step before the rest are only counted.
_MAX_NAMED = 3


@dataclass(frozen=True, slots=True)
class StepCheck:
    """The verdict on one step: ``problem`` is None when it is OK."""

    step: int
    problem: str | None = None

    @property
    def ok(self) -> bool:
        """True when nothing is wrong with the step."""
        return self.problem is None

    def line(self) -> str:
        """``step N: OK`` or ``step N: FAIL <reason>``."""
        return f"step {self.step}: OK" if self.problem is None else f"step {self.step}: FAIL {self.problem}"


def file_digest(store: Store, key: str, size: int, *, chunk_bytes: int = CHUNK_BYTES) -> str:
    """xxh3-128 of the first ``size`` bytes of object ``key``, read in ranged chunks where the store
    serves ranges (a shorter object gives the digest of what is there: a mismatch)."""

    def chunks() -> Iterator[bytes]:
        if not isinstance(store, _RANGED):
            yield store.get(key)
            return
        for start in range(0, size, chunk_bytes):
            part = store.get_range(key, start, min(start + chunk_bytes, size))
            yield part
            if len(part) < min(chunk_bytes, size - start):
                return  # cut short since it was listed

    return xxh3_128_chunks(chunks())


def _file_problems(store: Store, m: Manifest, chunk_bytes: int) -> list[str]:
    """What is wrong with the data files of ``m`` (one listing of the step's folder, then each file streamed)."""
    listed = {o.key: o.size for o in store.list(step_prefix(m.step))}
    out: list[str] = []
    for f in m.files:
        key = file_key(m.step, f.path)
        size = listed.get(key)
        if size is None:
            out.append(f"file {key} is missing")
        elif size != f.size:
            out.append(f"file {key} is {size} bytes, the manifest says {f.size} (truncated or replaced)")
        else:
            try:
                digest = file_digest(store, key, size, chunk_bytes=chunk_bytes)
            except ObjectNotFound:
                out.append(f"file {key} is missing (deleted while verifying?)")
                continue
            if digest != f.xxh3_128:
                out.append(f"file {key} fails its xxh3-128 checksum (corrupted)")
    if len(out) > _MAX_NAMED:
        out[_MAX_NAMED:] = [f"and {len(out) - _MAX_NAMED} more bad files"]
    return out


def _parent_problem(reader: RunReader, c: Committed, committed: set[int]) -> str | None:
    """What is wrong with the link from patch ``c`` to its parent (the first link of the one walk), or None.

    A tensor inventory that differs from the parent's is left to :func:`_chain_problem` (the
    planner's words for it).
    """
    m = c.manifest
    p = m.parent_step
    have = {m.step: c}
    if p is not None and p < m.step and p in committed:
        try:
            have[p] = reader.committed(p)
        except ObjectNotFound:
            pass  # deleted since it was listed: the walk finds it missing
        except DeltaSyncError:
            return f"parent step {p}'s manifest {manifest_key(p)} cannot be read (see step {p})"
    walk = walk_chain(have, m.step)
    if walk.broken_at != m.step:
        return None
    if walk.problem == "no-parent":
        return f"{manifest_key(m.step)} names no earlier parent step (parent_step {p})"
    assert p is not None  # a walk that got past no-parent
    if walk.problem == "missing":
        return f"parent step {p} is not committed ({manifest_key(p)} is missing; deleted by gc?)"
    if walk.problem == "digest":
        return (
            f"{manifest_key(m.step)} records parent digest {m.parent_digest} but step {p}'s manifest "
            f"has digest {have[p].digest} (the parent was replaced, or this manifest was edited)"
        )
    return None


def _chain_problem(reader: RunReader, step: int, failed: set[int]) -> str | None:
    """Whether the parent walk from ``step`` reaches a committed anchor through steps that did not fail."""
    try:
        walk = walk_chain(reader.chain(step), step)
    except ObjectNotFound as exc:
        return f"cannot reach step {step}: {exc}"
    except DeltaSyncError as exc:  # a manifest on the walk does not parse (its message names it)
        return str(exc)
    if walk.anchor is None:
        return str(walk.error())
    bad = sorted(failed.intersection(walk.steps))
    if not bad:
        return None
    if bad[0] == walk.anchor:
        return f"its anchor, step {walk.anchor}, failed (see above)"
    return f"its chain from anchor {walk.anchor} passes through step {bad[0]}, which failed (see above)"


def _advice(step: int, last_good: int | None, own: bool) -> str:
    fetch = (
        f"`deltasync fetch --step {last_good}` still works (the newest earlier step that verified)"
        if last_good is not None
        else "no earlier step verified to fetch instead"
    )
    if own:
        return f"re-upload the damaged objects of step {step} from a good copy of the store; {fetch}"
    return f"{fetch}; a new anchor (`delta-upload CKPT --step N --anchor`) starts a clean chain"


def verify_run(
    store: Store,
    *,
    last: int = 0,
    signing_key: bytes | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> Iterator[StepCheck]:
    """Check the committed steps of the run in ``store`` (only the ``last`` N when > 0), in step order.

    Yields one :class:`StepCheck` per step as soon as that step is checked. Storage errors other than
    a missing object (network, permissions) propagate: they say nothing about the run's integrity.
    """
    reader = RunReader(store, signing_key=signing_key, spans=False)
    steps: Sequence[int] = reader.steps()
    committed = set(steps)
    failed: set[int] = set()
    last_good: int | None = None
    for s in steps[-last:] if last > 0 else steps:
        problems: list[str] = []
        try:
            c: Committed | None = reader.committed(s)
        except ObjectNotFound:
            c = None
            problems.append(f"manifest {manifest_key(s)} is gone (deleted since it was listed)")
        except DeltaSyncError as exc:  # ProtocolError, SignatureMismatch
            c = None
            msg = str(exc).replace(HINT, "")
            problems.append(msg if manifest_key(s) in msg else f"manifest {manifest_key(s)}: {msg}")
        if c is not None:
            problems += _file_problems(store, c.manifest, chunk_bytes)
        own = bool(problems)  # this step's own objects are damaged (else: only its chain is)
        if c is not None and c.manifest.kind == "patch":
            link = _parent_problem(reader, c, committed) or _chain_problem(reader, s, failed)
            if link is not None:
                problems.append(link)
        if problems:
            failed.add(s)
            yield StepCheck(s, "; ".join(problems) + f"; fix: {_advice(s, last_good, own)}")
        else:
            last_good = s
            yield StepCheck(s)
