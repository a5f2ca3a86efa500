"""Hugging Face Storage Buckets through ``huggingface_hub``'s bucket API (Xet storage).

URL form: ``hf://buckets/<namespace>/<bucket>[/<prefix>]``. Every object key is stored
under ``<prefix>/`` in the bucket.

What the bucket API gives and does not give, and how this backend copes:

* one ``put_many`` is ONE ``batch_bucket_files`` call: hf_xet uploads every payload in
  one Xet session, then one ``/batch`` request makes the paths visible. Payloads given
  as a :class:`~pathlib.Path` are uploaded from that file; in-memory payloads above
  ``spill_bytes`` are first written to a temp file (hf_xet handles files better than
  huge ``bytes``). ``/batch`` is not transactional: after an error some files of the
  batch may be visible and others not (each file is whole or absent).
* there is NO conditional write: ``supports_conditional_put`` is False and
  ``mode="create"`` checks for existing paths (one ``paths-info`` request) before it
  uploads: best effort, not atomic against a concurrent writer. The deltasync commit
  protocol does not rely on it: a step's files go up before its manifest, in a
  separate batch, objects are written once, and ``HEAD.json`` is only a hint.
* downloads: ``paths-info`` for the keys (a missing one raises ObjectNotFound; for a bounded
  read, one over its limit raises ObjectTooLarge before anything is downloaded), then
  ``download_bucket_files`` into a private temp dir, read and removed.
  ``get_range`` downloads the whole object and slices it (Xet reconstructs whole
  files; the protocol reads whole files anyway).
* listing uses the tree endpoint with the prefix, recursive, then filters client-side.

Every huggingface_hub / hf_xet / httpx error is translated at this boundary into the
:mod:`deltasync.errors` tree: 404 -> ObjectNotFound (or StorageError for a missing
bucket), 401/403 -> StorageError naming the token to set, 408/429/5xx, timeouts,
connection errors and partial ``/batch`` failures -> TransientStorageError.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from deltasync.errors import (
    AlreadyExists,
    DeltaSyncError,
    InvalidKey,
    ObjectNotFound,
    StorageError,
    TransientStorageError,
)
from deltasync.storage._hf_reach import check_reachable
from deltasync.storage.base import Data, ObjectInfo, PutMode, Store, check_limit, too_large, validate_key

__all__ = ["DEFAULT_ENDPOINT", "HFBucketStore", "parse_hf_url"]

DEFAULT_ENDPOINT = "https://huggingface.co"
ENDPOINT_HINT = "HF_ENDPOINT / DELTASYNC_HF_ENDPOINT (the Hub's URL) or proxy (HTTPS_PROXY) setting"
INSTALL_HINT = "pip install huggingface_hub==2.4.0 hf-xet==1.8.0 (the versions deltasync's hf extra pins)"
TOKEN_HINT = "set HF_TOKEN, run `hf auth login`, or pass token= (a token with write access for uploads)"
_TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


def parse_hf_url(url: str) -> tuple[str, str]:
    """``hf://buckets/ns/bucket[/prefix]`` -> (``"ns/bucket"``, ``"prefix"``)."""
    head = "hf://buckets/"
    if not url.startswith(head):
        raise StorageError(f"{url}: HF bucket URLs look like hf://buckets/<namespace>/<bucket>[/<prefix>]")
    parts = url[len(head) :].strip("/").split("/")
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise StorageError(f"{url}: HF bucket URLs look like hf://buckets/<namespace>/<bucket>[/<prefix>]")
    prefix = "/".join(parts[2:])
    if prefix:
        try:
            validate_key(prefix)
        except InvalidKey:
            raise StorageError(f"{url}: invalid prefix {prefix!r} (empty, '.' or '..' segments)") from None
    return f"{parts[0]}/{parts[1]}", prefix


_XET_STATUS = re.compile(r"HTTP status (?:client|server) error \((\d{3})")


def _status(exc: BaseException) -> int | None:
    """The HTTP status behind an error: from its response, or from an hf_xet error message."""
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    if isinstance(status, int):
        return status
    m = _XET_STATUS.search(str(exc))
    return int(m.group(1)) if m else None


@contextmanager
def map_hf_errors(what: str, bucket_id: str) -> Iterator[None]:
    """Translate huggingface_hub / hf_xet / httpx errors into deltasync errors (``from exc``)."""
    try:
        yield
    except DeltaSyncError:
        raise
    except Exception as exc:
        raise translate_hf_error(exc, what, bucket_id) from exc


def translate_hf_error(exc: Exception, what: str, bucket_id: str) -> StorageError:
    """The deltasync error for one exception raised by the HF client stack."""
    import httpx2
    from huggingface_hub import errors as hf

    status = _status(exc)
    name = type(exc).__name__
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else name
    if isinstance(exc, hf.BucketBatchError):
        failed = ", ".join(f"{f.get('path')}: {f.get('error')}" for f in (exc.failures or [])[:5])
        return TransientStorageError(f"{what}: the bucket reported failed operations ({failed}); retry the batch")
    if isinstance(exc, hf.BucketNotFoundError | hf.RepositoryNotFoundError):
        return StorageError(f"{what}: bucket {bucket_id} not found or not accessible; {TOKEN_HINT}")
    if isinstance(exc, hf.EntryNotFoundError):
        return ObjectNotFound(f"{what}: {first_line}")
    if isinstance(exc, hf.OfflineModeIsEnabled):
        return StorageError(f"{what}: HF_HUB_OFFLINE is set; unset it to reach {bucket_id}")
    if status in (401, 403) or name == "XetAuthenticationError":
        return StorageError(f"{what}: access to bucket {bucket_id} denied ({status or name}); {TOKEN_HINT}")
    if status == 404:
        request = getattr(getattr(exc, "response", None), "request", None)
        url = str(getattr(request, "url", "")) or str(exc)
        if "/api/buckets/" in url and "/tree" not in url:  # a bucket endpoint (tokens, batch, paths-info)
            return StorageError(f"{what}: bucket {bucket_id} not found or not accessible; {TOKEN_HINT}")
        return ObjectNotFound(f"{what}: not found: {first_line}")
    if status in _TRANSIENT_STATUS or (status is not None and status >= 500):
        return TransientStorageError(f"{what}: HTTP {status} from the Hub (transient): {first_line}")
    if isinstance(exc, httpx2.TimeoutException | httpx2.TransportError | TimeoutError | ConnectionError):
        return TransientStorageError(f"{what}: network error talking to the Hub ({name}): {first_line}")
    if status is not None:
        return StorageError(f"{what}: HTTP {status} from the Hub: {first_line}")
    if type(exc).__module__.split(".")[0] == "hf_xet" or isinstance(exc, RuntimeError):
        # hf_xet retries its own transfers; what still fails is network or CAS trouble
        return TransientStorageError(f"{what}: Xet transfer failed ({name}): {first_line}")
    return StorageError(f"{what}: {name}: {first_line}")


class HFBucketStore(Store):
    """Objects in a Hugging Face Storage Bucket, under an optional prefix.

    ``token``: an HF token; None uses huggingface_hub's usual sources (``HF_TOKEN``,
    the token saved by ``hf auth login``). ``endpoint``: the Hub URL, always passed to
    ``HfApi(endpoint=...)`` (:func:`deltasync.open_store` fills it from
    ``DELTASYNC_HF_ENDPOINT`` or ``HF_ENDPOINT``). ``create``: create the bucket if it
    is missing (``private`` by default). ``spill_bytes``: in-memory payloads larger
    than this are uploaded from a temp file. ``hf_api``: an ``HfApi`` to use instead.
    ``reach_check``: called as ``reach_check(endpoint, what=, hint=)`` before the first
    request; the default (:func:`~deltasync.storage._hf_reach.check_reachable`) fails within a
    few seconds when the endpoint cannot be reached at all, instead of huggingface_hub's
    ~25 s of retries. None skips it.
    """

    supports_conditional_put = False

    def __init__(
        self,
        bucket_id: str,
        prefix: str = "",
        *,
        token: str | None = None,
        endpoint: str | None = None,
        create: bool = False,
        private: bool = True,
        spill_bytes: int = 8 << 20,
        hf_api: Any = None,
        reach_check: Callable[..., Any] | None = check_reachable,
    ) -> None:
        try:
            from huggingface_hub import HfApi
        except ImportError:
            raise StorageError(f"hf:// stores need huggingface_hub and hf-xet: {INSTALL_HINT}") from None

        ns, _, name = bucket_id.partition("/")
        if not ns or not name or "/" in name:
            raise StorageError(f"invalid bucket id {bucket_id!r}: expected '<namespace>/<bucket>'")
        prefix = prefix.strip("/")
        if prefix:
            validate_key(prefix)
        self.bucket_id = bucket_id
        self.prefix = prefix
        self.endpoint = (endpoint or DEFAULT_ENDPOINT).rstrip("/")
        self.url = f"hf://buckets/{bucket_id}" + (f"/{prefix}" if prefix else "")
        self.spill_bytes = spill_bytes
        self._api = hf_api if hf_api is not None else HfApi(endpoint=self.endpoint, token=token)
        self._tmp: Path | None = None
        self._lock = threading.Lock()
        self.reach_check = reach_check
        self._reached = False
        if create:
            with self._errors("cannot create bucket"):
                self._api.create_bucket(bucket_id, private=private, exist_ok=True)

    # ---------------------------------------------------------------- helpers

    def _errors(self, what: str) -> Any:
        if not self._reached:
            self._reach()
        return map_hf_errors(f"{self.url}: {what}", self.bucket_id)

    def _reach(self) -> None:
        """Before the first call: fail within seconds when the endpoint cannot be reached at all."""
        from huggingface_hub import constants

        if self.reach_check is None or constants.HF_HUB_OFFLINE:
            self._reached = True  # offline mode raises its own clear error
            return
        self.reach_check(self.endpoint, what=self.url, hint=ENDPOINT_HINT)
        self._reached = True

    def _remote(self, key: str) -> str:
        validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _key(self, remote: str) -> str:
        return remote[len(self.prefix) + 1 :] if self.prefix else remote

    def _tmpdir(self) -> Path:
        with self._lock:
            if self._tmp is None or not self._tmp.is_dir():
                self._tmp = Path(tempfile.mkdtemp(prefix="deltasync-hf-"))
            return self._tmp

    def _infos(self, remotes: Sequence[str]) -> dict[str, Any]:
        """remote path -> BucketFile for the paths that exist (one request per 1000 paths)."""
        if not remotes:
            return {}
        with self._errors("cannot look up paths"):
            return {i.path: i for i in self._api.get_bucket_paths_info(self.bucket_id, list(remotes))}

    # ------------------------------------------------------------------ Store

    def put_many(self, items: Mapping[str, Data], *, mode: PutMode = "overwrite") -> None:
        # docstring inherited
        remotes = {key: self._remote(key) for key in items}
        for key, data in items.items():
            if isinstance(data, Path) and not data.is_file():
                raise StorageError(f"{self.url}: cannot write {key}: payload file {data} does not exist")
        if not items:
            return
        if mode == "create":  # best effort: the bucket API has no conditional write
            present = self._infos(sorted(set(remotes.values())))
            taken = [key for key, remote in remotes.items() if remote in present]
            if taken:
                raise AlreadyExists(f"{self.url}: {taken[0]} already exists (create-only write)")
        spill: Path | None = None
        try:
            add: list[tuple[str | Path | bytes, str]] = []
            for i, (key, data) in enumerate(items.items()):
                if isinstance(data, Path):
                    add.append((data, remotes[key]))  # hf_xet reads the file itself
                    continue
                view = memoryview(data).cast("B")
                if view.nbytes > self.spill_bytes:  # big buffers go through a file (hf_xet copes better)
                    spill = spill or Path(tempfile.mkdtemp(prefix="put-", dir=self._tmpdir()))
                    src = spill / f"{i}.bin"
                    with open(src, "wb") as f:
                        f.write(view)
                    add.append((src, remotes[key]))
                else:
                    add.append((view.tobytes(), remotes[key]))
            with self._errors(f"cannot write {len(add)} object(s)"):
                self._api.batch_bucket_files(self.bucket_id, add=add)
        except OSError as exc:
            raise StorageError(f"{self.url}: cannot spill a payload to a temp file: {exc}") from exc
        finally:
            if spill is not None:
                shutil.rmtree(spill, ignore_errors=True)

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        # docstring inherited
        return self._get(dict.fromkeys(keys))

    def get_many_bounded(self, limits: Mapping[str, int]) -> dict[str, bytes]:
        # docstring inherited (the sizes come from paths-info, before any download)
        return self._get({key: check_limit(limit) for key, limit in limits.items()})

    def _get(self, limits: Mapping[str, int | None]) -> dict[str, bytes]:
        """Objects ``limits`` names, each at most its limit (None: any size)."""
        remotes = {key: self._remote(key) for key in limits}
        infos = self._infos(sorted(set(remotes.values())))
        for key, remote in remotes.items():
            if remote not in infos:
                raise ObjectNotFound(f"{self.url}: no object {key}")
            limit = limits[key]
            if limit is not None and int(infos[remote].size) > limit:
                raise too_large(self.url, key, int(infos[remote].size), limit)
        out: dict[str, bytes] = {}
        todo: list[tuple[Any, str | Path]] = []
        dest = Path(tempfile.mkdtemp(prefix="get-", dir=self._tmpdir()))
        try:
            local: dict[str, Path] = {}
            for i, remote in enumerate(sorted(set(remotes.values()))):
                if infos[remote].size == 0:
                    continue
                local[remote] = dest / f"{i}.bin"
                todo.append((infos[remote], local[remote]))
            if todo:
                with self._errors(f"cannot read {len(todo)} object(s)"):
                    self._api.download_bucket_files(self.bucket_id, todo, raise_on_missing_files=True)
            for key, remote in remotes.items():
                if remote not in local:
                    out[key] = b""
                    continue
                size = int(infos[remote].size)
                try:
                    with open(local[remote], "rb") as f:
                        out[key] = f.read(size + 1)  # a download longer than listed is read no further
                except FileNotFoundError:
                    raise ObjectNotFound(f"{self.url}: {key} vanished while downloading") from None
                if len(out[key]) != size:
                    got = f"{len(out[key])}" if len(out[key]) <= size else f"more than {size}"
                    raise TransientStorageError(f"{self.url}: {key}: downloaded {got} bytes, the bucket lists {size}")
        finally:
            shutil.rmtree(dest, ignore_errors=True)
        return out

    def get_range(self, key: str, start: int, end: int) -> bytes:
        # docstring inherited (Xet reconstructs whole files: download, then slice)
        return self.get_many([key])[key][start:end]

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        # docstring inherited
        if "\\" in prefix or "\x00" in prefix or prefix.startswith("/"):
            return []
        if any(seg in ("", ".", "..") for seg in prefix.split("/")[:-1]):
            return []  # a complete segment no key can have
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        last = full.rsplit("/", 1)[-1]
        # "." / ".." would be resolved away in the URL: ask for the folder, filter here
        ask = full[: len(full) - len(last)] if last in (".", "..") else full
        try:
            with self._errors(f"cannot list {prefix!r}"):
                entries = list(self._api.list_bucket_tree(self.bucket_id, prefix=ask or None, recursive=True))
        except ObjectNotFound:  # a tree endpoint may answer 404 for a prefix that names nothing
            return []
        seen: dict[str, ObjectInfo] = {}
        for e in entries:
            if getattr(e, "type", "") != "file" or not e.path.startswith(full):
                continue
            if self.prefix and not e.path.startswith(self.prefix + "/"):
                continue
            when = getattr(e, "uploaded_at", None)  # the Hub's clock, not the client-provided mtime
            key = self._key(e.path)
            seen[key] = ObjectInfo(key, int(e.size), when.timestamp() if when is not None else None)
        return [seen[k] for k in sorted(seen)]

    def delete_many(self, keys: Sequence[str]) -> None:
        # docstring inherited
        remotes = sorted({self._remote(key) for key in keys})
        infos = self._infos(remotes)
        present = [r for r in remotes if r in infos]
        if not present:
            return
        with self._errors(f"cannot delete {len(present)} object(s)"):
            self._api.batch_bucket_files(self.bucket_id, delete=present)

    def exists(self, key: str) -> bool:
        # docstring inherited
        remote = self._remote(key)
        return remote in self._infos([remote])

    def close(self) -> None:
        # docstring inherited
        with self._lock:
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)
                self._tmp = None


def open_hf_url(url: str, *, endpoint: str | None = None) -> HFBucketStore:
    """The store for an ``hf://buckets/...`` URL at ``endpoint`` (None: the public Hub);
    :func:`~deltasync.storage.open_store` passes the one from the environment."""
    bucket_id, prefix = parse_hf_url(url)
    return HFBucketStore(bucket_id, prefix, endpoint=endpoint or DEFAULT_ENDPOINT)
