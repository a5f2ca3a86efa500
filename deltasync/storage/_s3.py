"""S3-compatible object store through obstore: AWS S3, Cloudflare R2, HF's S3 gateway, MinIO, SeaweedFS.

Requests use obstore's synchronous API (it releases the GIL) on per-store thread
pools, so a batch (``put_many``/``get_many``) goes out in parallel, bounded by
``max_concurrency``. (obstore's asyncio API on a private loop thread was tried
first: processes using it sometimes died with SIGABRT at interpreter exit.)
Large puts are multipart (obstore; a :class:`~pathlib.Path` payload is streamed
from disk), large gets are split into parallel ranged GETs pinned to the
object's ETag. ``mode="create"`` is a single PUT with ``If-None-Match: *``, so
racing creators have exactly one winner (a single PUT: obstore sends preconditions
only there, so a create-mode payload is held in memory whole, at most 5 GiB on AWS);
:meth:`S3Store.put_if_match` is the ETag-conditioned update. Every obstore/HTTP error is translated into
:mod:`deltasync.errors` in :meth:`S3Store._translate`.

Configuration: explicit keyword arguments win; otherwise the usual ``AWS_*``
variables apply (obstore reads them itself, as every AWS client does):
``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT``, ``AWS_REGION``
(or ``AWS_DEFAULT_REGION``), ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``, ``AWS_VIRTUAL_HOSTED_STYLE_REQUEST``, ``AWS_ALLOW_HTTP``.
Plain ``http://`` is allowed for loopback endpoints without asking.
"""

from __future__ import annotations

import builtins
import concurrent.futures
import functools
import ipaddress
import os
import re
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlparse

from deltasync.errors import (
    AlreadyExists,
    DeltaSyncError,
    ObjectNotFound,
    PreconditionFailed,
    StorageError,
    TransientStorageError,
)
from deltasync.storage.base import (
    Data,
    ObjectInfo,
    PutMode,
    Store,
    check_limit,
    map_os_errors,
    too_large,
    validate_key,
)

try:
    import obstore as obs
    from obstore.exceptions import AlreadyExistsError, PermissionDeniedError, PreconditionError, UnauthenticatedError
    from obstore.store import S3Store as _ObstoreS3
except ImportError:  # pragma: no cover - the s3 extra is not installed
    obs = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from obstore.store import ClientConfig, RetryConfig, S3Config

__all__ = ["S3Store"]

T = TypeVar("T")

MiB = 1024 * 1024
_STATUS = re.compile(r"status code: (\d{3})")
_S3_CODE = re.compile(r"<Code>([^<]+)</Code>")
_HTTP_ERROR = re.compile(r"HTTP error: ([^\n]+)")
_RANGE_UNSATISFIABLE = "status code: 416"
_RANGE_IGNORED = "non-partial response"
_ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")
_TRUE = ("1", "true", "yes", "on")
_ENDPOINT_HINT = "AWS_ENDPOINT_URL or endpoint=; for AWS itself, AWS_REGION"


def _mtime(meta: Any) -> float | None:
    """Unix seconds of a listed object's ``last_modified`` (None when the server sent none)."""
    when = meta.get("last_modified")
    return when.timestamp() if when is not None else None


def _is_loopback(endpoint: str) -> bool:
    host = urlparse(endpoint).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _buffer(data: bytes | bytearray | memoryview) -> bytes | memoryview:
    """A flat byte view of a buffer payload (obstore wants 1-D unsigned bytes)."""
    if isinstance(data, bytes):
        return data
    view = memoryview(data)
    return view.cast("B") if view.c_contiguous else view.tobytes()


class S3Store(Store):
    """Objects under ``s3://<bucket>/<prefix>`` on any S3-compatible service.

    Keyword options (``None`` means "the ``AWS_*`` environment, else the default"):

    * ``endpoint``: e.g. ``http://127.0.0.1:8333``, ``https://<account>.r2.cloudflarestorage.com``
      (default: AWS for ``region``);
    * ``region`` (default ``us-east-1``), ``access_key_id``, ``secret_access_key``, ``session_token``;
    * ``virtual_hosted_style``: bucket in the host name instead of the path (default: path style);
    * ``allow_http``: permit ``http://`` endpoints (default: only loopback ones);
    * ``timeout`` / ``connect_timeout`` (seconds), ``max_retries`` / ``retry_timeout`` (obstore
      retries 5xx, 429 and connection errors with backoff before giving up);
    * ``part_size``: multipart part size and parallel ranged-GET size; ``max_concurrency``:
      requests in flight per store;
    * ``environ``: where ``AWS_*`` defaults are looked up for endpoint/allow_http (default
      ``os.environ``; obstore itself always reads the process environment for the rest).
    """

    supports_conditional_put = True

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        virtual_hosted_style: bool | None = None,
        allow_http: bool | None = None,
        skip_signature: bool | None = None,
        timeout: float = 120.0,
        connect_timeout: float = 10.0,
        max_retries: int = 5,
        retry_timeout: float = 120.0,
        part_size: int = 16 * MiB,
        max_concurrency: int = 16,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        if obs is None:  # pragma: no cover
            raise StorageError(
                "s3:// stores need obstore: pip install obstore==0.12.1 (the version deltasync's s3 extra pins)"
            )
        if not bucket or "/" in bucket or bucket != bucket.strip():
            raise StorageError(f"invalid S3 bucket name {bucket!r}")
        prefix = prefix.strip("/")
        if prefix:
            validate_key(prefix)
        if part_size < 5 * MiB or max_concurrency < 1:
            raise StorageError("S3Store: part_size must be at least 5 MiB and max_concurrency at least 1")
        env = os.environ if environ is None else environ
        if endpoint is None:
            endpoint = next((env[v] for v in _ENDPOINT_VARS if env.get(v)), None)
        if allow_http is None:
            allow_http = env.get("AWS_ALLOW_HTTP", "").lower() in _TRUE or (
                endpoint is not None and endpoint.startswith("http://") and _is_loopback(endpoint)
            )
        self.bucket = bucket
        self.prefix = prefix
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        region = region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
        self.endpoint = endpoint or f"https://s3.{region}.amazonaws.com"
        config: S3Config = {"region": region}
        for name, value in (
            ("endpoint", endpoint),
            ("access_key_id", access_key_id),
            ("secret_access_key", secret_access_key),
            ("session_token", session_token),
            ("virtual_hosted_style_request", virtual_hosted_style),
            ("skip_signature", skip_signature),
        ):
            if value is not None:
                config[name] = value  # type: ignore[literal-required]
        client: ClientConfig = {
            "allow_http": allow_http,
            "timeout": timedelta(seconds=timeout),
            "connect_timeout": timedelta(seconds=connect_timeout),
        }
        retry: RetryConfig = {
            "max_retries": max_retries,
            "retry_timeout": timedelta(seconds=retry_timeout),
            "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=15), "base": 2},
        }
        try:
            self._s3 = _ObstoreS3(
                bucket, prefix=prefix or None, config=config, client_options=client, retry_config=retry
            )
        except Exception as exc:
            raise StorageError(f"{self.url}: invalid S3 configuration: {exc}") from exc
        self._part_size = part_size
        self._concurrency = max_concurrency
        self._closed = False
        # whole objects of a batch on one pool, the ranged parts of large objects on another
        # (a part never waits for the pool it runs on, so neither can deadlock)
        self._batch = ThreadPoolExecutor(max_concurrency, thread_name_prefix="deltasync-s3")
        self._parts = ThreadPoolExecutor(max_concurrency, thread_name_prefix="deltasync-s3-part")

    @classmethod
    def from_url(cls, url: str, **options: Any) -> S3Store:
        """A store for ``s3://<bucket>[/<prefix>]``; ``options`` are the constructor's keywords."""
        parsed = urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc or parsed.query or parsed.fragment:
            raise StorageError(f"{url}: expected s3://<bucket>[/<prefix>] (endpoint and keys go in options or AWS_*)")
        return cls(parsed.netloc, parsed.path, **options)

    # -- plumbing -----------------------------------------------------------------

    def _translate(self, exc: BaseException, what: str, key: str | None, *, reading: bool) -> DeltaSyncError:
        """The deltasync error for an obstore/HTTP failure of ``what`` on ``key``."""
        if isinstance(exc, DeltaSyncError):
            return exc
        text = str(exc)
        head = text.split("\n", 1)[0]
        status_m, code_m = _STATUS.search(text), _S3_CODE.search(text)
        status = int(status_m.group(1)) if status_m else None
        code = code_m.group(1) if code_m else None
        where = f"{self.url}: cannot {what}" + (f" {key}" if key else "")
        reply = f"HTTP {status} {code or ''}".rstrip() if status else head[:300]
        if code == "NoSuchBucket":
            return StorageError(
                f"{where}: bucket {self.bucket!r} does not exist at {self.endpoint}; check the bucket name in the "
                f"URL and the endpoint ({_ENDPOINT_HINT}), or create the bucket"
            )
        if isinstance(exc, AlreadyExistsError):
            return AlreadyExists(f"{self.url}: {key} already exists (create-only write)")
        if isinstance(exc, PreconditionError):
            return PreconditionFailed(f"{self.url}: {key} changed since it was read (conditional write, {reply})")
        if isinstance(exc, (PermissionDeniedError, UnauthenticatedError)) or status in (401, 403):
            return StorageError(
                f"{where}: access denied by {self.endpoint} ({reply}); check AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), AWS_REGION, and that the key may use "
                f"bucket {self.bucket!r}"
            )
        if isinstance(exc, FileNotFoundError) and reading:
            return ObjectNotFound(f"{self.url}: no object {key}")
        http = _HTTP_ERROR.search(text)
        if status is not None and (status >= 500 or status in (408, 429)):
            return TransientStorageError(f"{where}: {self.endpoint} answered {reply} (after retries)")
        if http and status is None:
            if "builder error" in http.group(1):
                return StorageError(f"{where}: cannot use endpoint {self.endpoint} (http:// needs allow_http=True)")
            return TransientStorageError(
                f"{where}: no answer from endpoint {self.endpoint} ({http.group(1).strip()}, after retries); check "
                f"that the server is up and the endpoint ({_ENDPOINT_HINT})"
            )
        if isinstance(exc, OSError) and not reading and status is None:
            return StorageError(f"{where}: cannot read the payload: {exc.strerror or head}")
        return StorageError(f"{where}: {reply}")

    def _call(self, what: str, key: str | None, fn: Callable[[], T], *, reading: bool = True) -> T:
        """``fn()``, its obstore/HTTP errors translated."""
        if self._closed:
            raise StorageError(f"{self.url}: store is closed")
        try:
            return fn()
        except Exception as exc:
            raise self._translate(exc, what, key, reading=reading) from exc

    def _fan_out(self, pool: ThreadPoolExecutor, fns: Sequence[Callable[[], T]]) -> list[T]:
        """Run ``fns`` in parallel on ``pool``, wait for all, raise the first error (in input order)."""
        if self._closed:
            raise StorageError(f"{self.url}: store is closed")
        if len(fns) == 1:
            return [fns[0]()]  # no thread hop for a single request
        try:
            futs = [pool.submit(fn) for fn in fns]
        except RuntimeError:  # shut down meanwhile
            raise StorageError(f"{self.url}: store is closed") from None
        results: list[T] = []
        first: BaseException | None = None
        for fut in futs:
            try:
                results.append(fut.result())
            except concurrent.futures.CancelledError:
                first = first or StorageError(f"{self.url}: the store was closed while this request was queued")
            except BaseException as exc:
                first = first or exc
        if first is not None:
            raise first
        return results

    # -- writes -------------------------------------------------------------------

    def _payload(self, key: str, data: Data) -> Path | bytes | memoryview:
        if isinstance(data, Path):
            with map_os_errors(f"{self.url}: cannot read the payload of {key} from {data}"):
                if not data.is_file():
                    raise StorageError(f"{self.url}: cannot read the payload of {key}: {data} is not a file")
                data.stat()
            return data
        return _buffer(data)

    def _put(self, key: str, payload: Path | bytes | memoryview, mode: Any) -> str:
        result = self._call(
            "write",
            key,
            lambda: obs.put(
                self._s3,
                key,
                payload,
                mode=mode,
                use_multipart=None if mode == "overwrite" else False,
                chunk_size=self._part_size,
                max_concurrency=self._concurrency,
            ),
            reading=False,
        )
        return result["e_tag"] or ""

    def put_many(self, items: Mapping[str, Data], *, mode: PutMode = "overwrite") -> None:
        # docstring inherited
        if mode not in ("overwrite", "create"):
            raise StorageError(f"unknown put mode {mode!r}")
        payloads = [(validate_key(k), self._payload(k, d)) for k, d in items.items()]
        self._fan_out(self._batch, [functools.partial(self._put, k, p, mode) for k, p in payloads])

    def put_if_match(self, key: str, data: Data, etag: str) -> str:
        """Overwrite ``key`` only if its ETag is still ``etag``; return the new ETag.

        Raises PreconditionFailed when another writer got there first (or the
        object is gone); pair it with :meth:`get_with_etag`.
        """
        payload = self._payload(validate_key(key), data)
        return self._put(key, payload, {"e_tag": etag})

    # -- reads --------------------------------------------------------------------

    def _get_part(self, key: str, start: int, end: int, etag: str | None) -> Any:
        opts: dict[str, Any] = {"range": (start, end)}
        if etag:
            opts["if_match"] = etag
        return self._call("read", key, lambda: obs.get(self._s3, key, options=opts).bytes())  # type: ignore[arg-type]

    def _get_first(self, key: str, limit: int | None = None) -> tuple[Any, int, str]:
        """The first part of an object, its size and ETag. With ``limit``, the part is at most
        ``limit + 1`` bytes and an object over ``limit`` raises ObjectTooLarge (its size is the
        ranged answer's ``Content-Range``): nothing more of it is read."""
        first = self._part_size if limit is None else min(self._part_size, limit + 1)
        try:
            res = obs.get(self._s3, key, options={"range": (0, first)})
        except Exception as exc:
            if not any(m in str(exc) for m in (_RANGE_UNSATISFIABLE, _RANGE_IGNORED)):
                raise
            # an empty object has no byte 0; some servers answer a ranged GET in full: HEAD first
            # when the size matters, so that an object over the limit is never read whole
            if limit is not None and (size := obs.head(self._s3, key)["size"]) > limit:
                raise too_large(self.url, key, size, limit) from None
            res = obs.get(self._s3, key)
        meta = res.meta
        if limit is not None and meta["size"] > limit:
            raise too_large(self.url, key, meta["size"], limit)
        return res.bytes(), meta["size"], meta.get("e_tag") or ""

    def _get_whole(self, key: str, limit: int | None = None) -> tuple[bytes, str]:
        """The object and its ETag: one ranged GET, then parallel ranged GETs for the rest (with
        ``limit``: ObjectTooLarge from the first GET's answer when the object is over it)."""
        chunk = self._part_size
        for _ in range(3):
            head, size, etag = self._call("read", key, lambda: self._get_first(key, limit))
            if size <= len(head):
                return bytes(head), etag
            parts = [
                functools.partial(self._get_part, key, s, min(s + chunk, size), etag)
                for s in range(len(head), size, chunk)
            ]
            try:
                rest = self._fan_out(self._parts, parts)
            except PreconditionFailed:
                continue  # overwritten while we read it: start over
            return b"".join([head, *rest]), etag
        raise TransientStorageError(f"{self.url}: {key} kept changing while it was read")

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        # docstring inherited
        unique = list(dict.fromkeys(validate_key(k) for k in keys))
        blobs = self._fan_out(self._batch, [functools.partial(self._get_whole, k) for k in unique])
        return {k: b for k, (b, _) in zip(unique, blobs, strict=True)}

    def get_many_bounded(self, limits: Mapping[str, int]) -> dict[str, bytes]:
        # docstring inherited
        todo = [(validate_key(k), check_limit(limit)) for k, limit in limits.items()]
        blobs = self._fan_out(self._batch, [functools.partial(self._get_whole, k, limit) for k, limit in todo])
        return {k: b for (k, _), (b, _) in zip(todo, blobs, strict=True)}

    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        """An object and its ETag, for a later :meth:`put_if_match`."""
        return self._get_whole(validate_key(key))

    def get_range(self, key: str, start: int, end: int) -> bytes:
        # docstring inherited
        validate_key(key)
        if start < 0 or end < 0:
            return self.get(key)[start:end]
        if end > start:
            try:
                return bytes(self._get_part(key, start, end, None))
            except StorageError as exc:
                cause = str(exc.__cause__)
                if _RANGE_IGNORED in cause:  # the server does not do ranges: read it whole
                    return self._get_whole(key)[0][start:end]
                if _RANGE_UNSATISFIABLE not in cause:
                    raise
        self._call("read", key, lambda: obs.head(self._s3, key))  # it exists, with nothing in that range
        return b""

    def exists(self, key: str) -> bool:
        # docstring inherited
        validate_key(key)
        try:
            self._call("read", key, lambda: obs.head(self._s3, key))
        except ObjectNotFound:
            return False
        return True

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        # docstring inherited
        directory = prefix.rsplit("/", 1)[0] if "/" in prefix else None
        if directory is not None and any(p in ("", ".", "..") for p in directory.split("/")):
            return []  # no valid key starts like this
        found = self._call(f"list {prefix!r}", None, lambda: obs.list(self._s3, directory, chunk_size=1000).collect())
        return sorted(
            (ObjectInfo(o["path"], o["size"], _mtime(o)) for o in found if o["path"].startswith(prefix)),
            key=lambda o: o.key,
        )

    def list_after(self, prefix: str, start_after: str | None) -> builtins.list[ObjectInfo]:
        # docstring inherited
        if start_after is None:
            return self.list(prefix)
        directory = prefix.rsplit("/", 1)[0] if "/" in prefix else None
        if directory is not None and any(p in ("", ".", "..") for p in directory.split("/")):
            return []
        # The server starts one character early: S3 compares keys as strings, but some S3-compatible
        # servers (SeaweedFS) treat a start-after naming a folder as that folder and skip what is
        # inside it. One character shorter names nothing that could hide a key after start_after
        # (for a last character above "/"); the few extra keys are filtered out below.
        offset = start_after[:-1] if start_after and start_after[-1] > "/" else None
        found = self._call(
            f"list {prefix!r}",
            None,
            lambda: obs.list(self._s3, directory, offset=offset, chunk_size=1000).collect(),
        )
        return sorted(
            (
                ObjectInfo(o["path"], o["size"], _mtime(o))
                for o in found
                if o["path"].startswith(prefix) and o["path"] > start_after
            ),
            key=lambda o: o.key,
        )

    def delete_many(self, keys: Sequence[str]) -> None:
        # docstring inherited
        unique = list(dict.fromkeys(validate_key(k) for k in keys))
        if unique:
            self._call("delete", unique[0], lambda: obs.delete(self._s3, unique), reading=False)

    def close(self) -> None:
        # docstring inherited
        self._closed = True
        # queued work is cancelled (its callers get a StorageError); requests on the wire end by their timeouts
        for pool in (self._batch, self._parts):
            pool.shutdown(wait=False, cancel_futures=True)
