""":func:`open_store`: a store from a URL or a path, and the rules that tell one from the other.

A string is a URL when the part before its first ``/`` holds a ``:`` (``s3:``, ``hf:``,
``x:y``); it must then be one of the supported forms, ``scheme://...`` (the scheme in any
case: ``S3://b`` is ``s3://b``). Anything else is a local path. So a typo like
``s3:/bucket/r1`` or ``hf:buckets/...`` is refused instead of becoming a local directory
named ``s3:``; a local path whose first part holds a colon is written ``./x:y``. A
``pathlib.Path`` is always a local path.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import unquote, urlsplit

from deltasync._util.settings import hf_endpoint
from deltasync.errors import StorageError
from deltasync.storage._hf import open_hf_url
from deltasync.storage._local import LocalStore
from deltasync.storage._memory import MemoryStore
from deltasync.storage._s3 import S3Store
from deltasync.storage.base import Store

__all__ = ["SUPPORTED_FORMS", "open_store", "store_scheme"]

#: What :func:`open_store` accepts, as its errors list it.
SUPPORTED_FORMS = (
    "a local path (runs/r1, /abs/path; ./x:y for a name with a colon), file:///abs/path, memory://name, "
    "s3://<bucket>[/<prefix>], hf://buckets/<namespace>/<bucket>[/<prefix>]"
)
_SCHEMES = ("file", "memory", "s3", "hf")
_HINTS = {
    "http": "an S3-compatible server's http(s) endpoint goes in AWS_ENDPOINT_URL, with an s3:// URL",
    "gs": "Google Cloud Storage works through its S3-compatible endpoint (AWS_ENDPOINT_URL) with an s3:// URL",
}
_HINTS["https"] = _HINTS["http"]
_HINTS["gcs"] = _HINTS["gs"]


def store_scheme(url: str) -> str | None:
    """The scheme of ``url`` in lower case (``"s3"``, ``"file"``, ...), or None for a local path.

    Raises StorageError for a string that looks like a URL but is not a supported one:
    a malformed scheme (``s3:/b``, ``hf:buckets/...``, ``memory:x``), an unknown one
    (``gs://b``, ``x:y``), or ``://`` anywhere but after a leading scheme.
    """
    head = url.split("/", 1)[0]
    if ":" not in head:
        if "://" in url:
            raise StorageError(
                f"{url}: '://' in the middle of a store URL (a scheme goes first); this build supports {SUPPORTED_FORMS}"
            )
        return None
    given, rest = url.split(":", 1)
    scheme = given.lower()
    if not rest.startswith("//"):
        if scheme in _SCHEMES:
            fixed = f"{scheme}://{rest}" if scheme == "file" else f"{scheme}://{rest.lstrip('/')}"
            raise StorageError(
                f"{url}: malformed store URL (a scheme is followed by '://'); did you mean {fixed}? "
                f"This build supports {SUPPORTED_FORMS}"
            )
        raise StorageError(
            f"{url}: not a store URL this build supports ({given!r} before a ':' reads as a URL scheme); "
            f"this build supports {SUPPORTED_FORMS}"
        )
    if scheme not in _SCHEMES:
        hint = f" ({_HINTS[scheme]})" if scheme in _HINTS else ""
        raise StorageError(f"{url}: unsupported store scheme {given!r}{hint}; this build supports {SUPPORTED_FORMS}")
    return scheme


def open_store(url: str | os.PathLike[str], **options: Any) -> Store:
    """Open a store from a URL.

    * a plain path or ``file:///abs/path``: :class:`LocalStore` (its directory is made by the first write)
    * ``memory://name``: a fresh :class:`MemoryStore` (not shared between calls)
    * ``s3://<bucket>[/<prefix>]``: :class:`S3Store`; ``options`` are its keywords
      (endpoint, region, credentials, ...), else the ``AWS_*`` environment applies
    * ``hf://buckets/<ns>/<bucket>[/<prefix>]``: :class:`HFBucketStore`
      (needs the ``hf`` extra; endpoint from ``DELTASYNC_HF_ENDPOINT`` or ``HF_ENDPOINT``)

    A string whose part before the first ``/`` holds a ``:`` is a URL and must be one
    of these (the scheme in any case); anything else, and any ``os.PathLike``, is a
    local path (see this module's docstring). A malformed or unsupported URL raises
    StorageError naming the supported forms; nothing is opened or created.
    ``options`` are accepted by the s3:// backend only.
    """
    if isinstance(url, os.PathLike):
        if options:
            raise StorageError(f"{url}: store options {sorted(options)} are only accepted for s3:// URLs")
        return LocalStore(url)
    if not isinstance(url, str) or not url:
        raise StorageError(f"store URL must be a non-empty string, got {url!r}")
    scheme = store_scheme(url)
    if scheme is not None:
        url = scheme + url[url.index(":") :]  # S3://b is s3://b
    if scheme == "s3":
        return S3Store.from_url(url, **options)
    if options:
        raise StorageError(f"{url}: store options {sorted(options)} are only accepted for s3:// URLs")
    if scheme is None:
        return LocalStore(url)
    if scheme == "memory":
        return MemoryStore(url[len("memory://") :])
    if scheme == "hf":
        return open_hf_url(url, endpoint=hf_endpoint())  # the environment is read here, at the edge
    parsed = urlsplit(url)
    if parsed.netloc not in ("", "localhost") or parsed.query or parsed.fragment:
        raise StorageError(f"{url}: file:// URLs must name a local path (file:///abs/path)")
    if not parsed.path:
        raise StorageError(f"{url}: file:// URLs must name a local path (file:///abs/path)")
    return LocalStore(unquote(parsed.path))
