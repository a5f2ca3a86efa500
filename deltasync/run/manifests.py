"""The one parser of a stored manifest: bytes read from a key -> a verified :class:`Committed`.

Everything that reads a step's (or a span's) manifest from a store goes through
:func:`parse_committed`: the run reader (and through it the fetcher, ``follow``, ``inspect``,
the audit and the signal server) and garbage collection. It parses the canonical JSON, checks
that the manifest is the one its key names, verifies the signature when a key is configured,
and digests the bytes; every failure is a :mod:`deltasync.errors` exception whose message names
the step and the key.
"""

from __future__ import annotations

from deltasync.errors import ProtocolError, UnsupportedVersion
from deltasync.protocol import Committed, Manifest, manifest_key, xxh3_128

__all__ = ["HINT", "parse_committed"]

#: The advice a damaged manifest's message ends with (``inspect --verify`` leaves it out).
HINT = " (`deltasync inspect` lists the readable steps)"


def parse_committed(
    step: int,
    body: bytes,
    *,
    key: str | None = None,
    signing_key: bytes | None = None,
    where: str | None = None,
) -> Committed:
    """The manifest of ``step`` stored under ``key`` (default: the step's manifest key), and its digest.

    ``where`` (the store's URL) starts the message of a manifest that does not parse.
    Raises UnsupportedVersion for a manifest of another format version, ProtocolError for one
    that does not parse or that says another step, SignatureMismatch when ``signing_key`` is set
    and the manifest is not signed with it.
    """
    key = key or manifest_key(step)
    at = f"{where}: step {step} ({key})" if where else f"step {step} ({key})"
    try:
        m = Manifest.from_json(body)
    except UnsupportedVersion as exc:
        raise UnsupportedVersion(f"{at}: {exc}") from None
    except ProtocolError as exc:
        raise ProtocolError(f"{at}: {exc}; the object is damaged or cut short{HINT}") from None
    if m.step != step:
        raise ProtocolError(f"{key}: the manifest stored under step {step} says step {m.step}")
    if signing_key is not None:
        m.check_signature(signing_key)
    return Committed(m, xxh3_128(body))
