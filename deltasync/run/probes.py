"""A run's probes and the trainer's references over a store (SPEC.md "Probes and references").

``probes.json`` at the run's root holds the run's :class:`~deltasync.protocol.probes.ProbeSet` (and
its audit policy); ``references/{step:012d}.json`` holds the trainer's per-token logprobs of the
probes at a step. Both are written once: :func:`write_probes` and :func:`write_reference` create
them when absent, accept the same bytes again (an idempotent retry) and refuse a different object
with :class:`~deltasync.errors.AlreadyExists`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import xxhash

from deltasync.errors import AlreadyExists, ObjectNotFound, ProtocolError, UnsupportedVersion
from deltasync.protocol import TensorInfo
from deltasync.protocol.audit import AuditPolicy
from deltasync.protocol.probes import (
    MAX_PROBES_BYTES,
    MAX_REFERENCE_BYTES,
    PROBES_KEY,
    REFERENCES_PREFIX,
    ProbeSet,
    Reference,
    parse_reference_key,
    reference_key,
)
from deltasync.storage.base import Store

__all__ = [
    "ProbeSet",
    "Reference",
    "default_probes",
    "list_references",
    "read_probes",
    "read_reference",
    "vocab_size_of",
    "write_probes",
    "write_reference",
]

#: tensor-name endings that hold the vocabulary's rows, most specific first
_EMBEDDING_NAMES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight", "lm_head.weight")


def vocab_size_of(inventory: Iterable[TensorInfo]) -> int:
    """The vocabulary size of a causal LM: the rows of its input embedding (else of ``lm_head``).

    Raises ProtocolError when the inventory has no 2-D tensor named like an embedding.
    """
    tensors = list(inventory)
    for suffix in _EMBEDDING_NAMES:
        for t in tensors:
            if t.name.endswith(suffix) and len(t.shape) == 2 and t.shape[0] >= 2:
                return int(t.shape[0])
    raise ProtocolError(
        "cannot tell the vocabulary size from the run's tensors (no 2-D embed_tokens / wte / lm_head weight): "
        "pass vocab_size, or a probe set of your own"
    )


def default_probes(
    source: int | Iterable[TensorInfo],
    run_id: str,
    *,
    n: int = 8,
    length: int = 32,
    policy: AuditPolicy | None = None,
) -> ProbeSet:
    """The probe set a run gets when the user gives none: ``n`` sequences of ``length`` token ids drawn
    uniformly from the vocabulary by a hash of ``run_id`` (the same run always gets the same probes).

    ``source``: the vocabulary size, or the run's inventory (see :func:`vocab_size_of`).
    """
    vocab = source if isinstance(source, int) and not isinstance(source, bool) else vocab_size_of(source)  # type: ignore[arg-type]
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"run_id must be a non-empty string, got {run_id!r}")
    seed = xxhash.xxh3_64_intdigest(run_id.encode())
    tokens = tuple(
        tuple(xxhash.xxh3_64_intdigest(f"{i}/{j}".encode(), seed=seed) % vocab for j in range(length)) for i in range(n)
    )
    return ProbeSet(tokens, vocab, policy if policy is not None else AuditPolicy())


def _write_once(store: Store, key: str, body: bytes, what: str, limit: int) -> bool:
    """Create ``key`` with ``body``; True when written, False when the same bytes were there (AlreadyExists otherwise).
    ``limit``: the most bytes the object may hold (what is there is read no further)."""
    try:
        old: bytes | None = store.get_bounded(key, limit)
    except ObjectNotFound:
        old = None
    if old is None:
        try:
            store.put(key, body, mode="create")
        except AlreadyExists:
            old = store.get_bounded(key, limit)  # a racing writer created it first
        else:
            if store.supports_conditional_put:
                return True
            old = store.get_bounded(key, limit)  # no create-only writes: read back who won
            if old == body:
                return True
    if old == body:
        return False
    raise AlreadyExists(f"{store.url}: {key} already holds {what}; it is written once per run and never replaced")


def write_probes(store: Store, probes: ProbeSet) -> bool:
    """Store the run's probe set (``probes.json``), once; True when written, False when this very set was there.

    Raises AlreadyExists when the run already carries a different probe set (or policy).
    """
    try:
        return _write_once(store, PROBES_KEY, probes.to_json(), "a different probe set", MAX_PROBES_BYTES)
    except AlreadyExists:
        try:
            old = read_probes(store)
        except (ProtocolError, UnsupportedVersion):
            old = None
        held = f" (digest {old.digest})" if old is not None else ""
        raise AlreadyExists(
            f"{store.url}: the run already carries a different probe set{held}; probes are written once per run "
            f"(this set's digest is {probes.digest}): use the stored one (read_probes) or start a new run"
        ) from None


def read_probes(store: Store) -> ProbeSet | None:
    """The run's probe set, or None when it has none (ProtocolError when ``probes.json`` is damaged:
    ObjectTooLarge, from its size, before more than 1 MiB of it is read)."""
    try:
        body = store.get_bounded(PROBES_KEY, MAX_PROBES_BYTES)
    except ObjectNotFound:
        return None
    try:
        return ProbeSet.from_json(body)
    except UnsupportedVersion as exc:
        raise UnsupportedVersion(f"{store.url}: {exc}") from None
    except ProtocolError as exc:
        raise ProtocolError(f"{store.url}: {PROBES_KEY} is damaged: {exc}") from None


def write_reference(store: Store, reference: Reference, probes: ProbeSet | None = None) -> bool:
    """Store a step's reference (``references/{step}.json``), once; True when written, False when the same was there.

    With ``probes`` (else the run's stored set), the reference must be of those probes: their
    digest, one row of ``len(probe) - 1`` logprobs per probe (ProtocolError otherwise; ObjectNotFound
    when the run has no probe set). Raises AlreadyExists for a different reference of the step.
    """
    probes = probes if probes is not None else read_probes(store)
    if probes is None:
        raise ObjectNotFound(f"{store.url}: the run has no probe set ({PROBES_KEY}); write_probes first")
    if reference.probes_digest != probes.digest:
        raise ProtocolError(
            f"the reference of step {reference.step} was computed on probes {reference.probes_digest}, "
            f"the run's are {probes.digest}"
        )
    probes.check_logprobs(reference.logprobs, f"reference of step {reference.step}")
    return _write_once(
        store,
        reference_key(reference.step),
        reference.to_json(),
        f"a different reference of step {reference.step}",
        MAX_REFERENCE_BYTES,
    )


def read_reference(store: Store, step: int, probes: ProbeSet | None = None) -> Reference | None:
    """The trainer's reference of ``step``, or None when there is none.

    Checked at read against ``probes`` (else the run's stored set, read only when a reference is
    there): computed on those probes (their digest), one row of ``len(probe) - 1`` logprobs per
    probe. A reference that is not, one of a run without a probe set, or one that does not parse
    raises ProtocolError naming its key (and the probe and lengths that differ): the step has no
    usable reference. ObjectTooLarge (a ProtocolError) when it is over 4 MiB, before it is read.
    """
    key = reference_key(step)
    try:
        body = store.get_bounded(key, MAX_REFERENCE_BYTES)
    except ObjectNotFound:
        return None
    try:
        ref = Reference.from_json(body, step)
    except UnsupportedVersion as exc:
        raise UnsupportedVersion(f"{store.url}: {exc}") from None
    except ProtocolError as exc:
        raise ProtocolError(f"{store.url}: {key} is damaged: {exc}") from None
    probes = probes if probes is not None else read_probes(store)
    if probes is None:
        raise ProtocolError(
            f"{store.url}: {key} cannot be checked: the run has no probe set ({PROBES_KEY}); a reference is written "
            "after its probes (write_probes, then write_reference)"
        )
    if ref.probes_digest != probes.digest:
        raise ProtocolError(
            f"{store.url}: {key} is not usable: computed on probes {ref.probes_digest}, the run's are {probes.digest}"
        )
    try:
        probes.check_logprobs(ref.logprobs, "its logprobs")
    except ProtocolError as exc:
        raise ProtocolError(f"{store.url}: {key} is damaged: {exc} (probes {probes.digest})") from None
    return ref


def list_references(store: Store) -> Sequence[int]:
    """The steps that have a reference, sorted (one listing)."""
    return sorted(s for o in store.list(REFERENCES_PREFIX) if (s := parse_reference_key(o.key)) is not None)
