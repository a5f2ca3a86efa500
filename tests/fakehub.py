"""A fake Hugging Face Hub, just enough of the Storage Buckets API for the real client.

The unmodified ``huggingface_hub`` + ``hf_xet`` talk to it over HTTP on 127.0.0.1.
Its Xet token endpoints hand out ``casUrl = "local://<dir>"``, so ``hf_xet`` chunks,
deduplicates and stores real bytes in a directory (xet-core's own local CAS), and the
server only keeps each bucket's path -> (xet hash, size) table, as the real Hub does.

The server never sees a file's bytes. It learns an uploaded file's size from the
shard files that ``hf_xet`` writes into the CAS directory (the file-info section of
the Xet MDB shard format), keyed by the file's Xet hash.

Faults: :meth:`FakeHub.fail` queues HTTP errors (5xx, 429 with ``Retry-After``) for
requests that match a method and a path pattern, :meth:`FakeHub.fail_batch_paths`
makes ``/batch`` report some operations as failed (and apply the others), and
:meth:`FakeHub.slow` delays matching requests. Every request is recorded in
:attr:`FakeHub.requests`.

Limits: hf_xet's local CAS is a database that the first process whose Xet session
opens it keeps locked ("Database already open"), so all transfers against one CAS
directory must come from one process (a test that runs CLI subprocesses starts its
own FakeHub with its own CAS). Nothing here exercises hf_xet's network client,
CDN redirects, token refresh or the real Hub's listing consistency.
"""

from __future__ import annotations

import itertools
import json
import re
import struct
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from deltasync.storage import HFBucketStore

__all__ = ["TOKEN", "FakeHub", "Fault", "hf_store", "new_bucket", "raw_path", "shard_file_sizes"]

TOKEN_TTL = 3600

# ----------------------------------------------------------------- Xet shards


def _hash_hex(raw: bytes) -> str:
    """A Xet Merkle hash (32 bytes, four little-endian u64 words) as its hex string."""
    return "".join(f"{w:016x}" for w in struct.unpack("<4Q", raw))


_SHARD_HEADER = 48  # 32-byte tag, u64 version, u64 footer size
_ENTRY = 48
_FLAG_VERIFICATION = 1 << 31
_FLAG_METADATA_EXT = 1 << 30


def shard_file_sizes(data: bytes) -> dict[str, int]:
    """File hash -> file size from the file-info section of one Xet MDB shard."""
    out: dict[str, int] = {}
    pos = _SHARD_HEADER
    while pos + _ENTRY <= len(data):
        file_hash = data[pos : pos + 32]
        if file_hash == b"\xff" * 32:  # bookend: end of the file-info section
            break
        flags, n = struct.unpack_from("<II", data, pos + 32)
        pos += _ENTRY
        size = 0
        for i in range(n):
            (seg_bytes,) = struct.unpack_from("<I", data, pos + i * _ENTRY + 36)
            size += seg_bytes
        pos += n * _ENTRY
        if flags & _FLAG_VERIFICATION:
            pos += n * _ENTRY
        if flags & _FLAG_METADATA_EXT:
            pos += _ENTRY
        out[_hash_hex(file_hash)] = size
    return out


# ------------------------------------------------------------------- state


@dataclass
class _File:
    xet_hash: str
    size: int
    mtime: int  # ms since epoch
    uploaded_at: float


@dataclass
class _Bucket:
    id: str
    private: bool
    created_at: float
    files: dict[str, _File] = field(default_factory=dict)


@dataclass
class Fault:
    """An injected failure: the next ``times`` requests matching method and path get it."""

    method: str
    path: re.Pattern[str]
    status: int = 503
    times: int = 1
    retry_after: int | None = None
    delay: float = 0.0
    hits: int = 0

    def matches(self, method: str, path: str) -> bool:
        return self.hits < self.times and (self.method in ("*", method)) and bool(self.path.search(path))


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat().replace("+00:00", "Z")


class FakeHub:
    """A threaded HTTP server on 127.0.0.1 serving the bucket endpoints; see the module docstring."""

    def __init__(self, root: Path, *, token: str | None = "hf_fake_token", page_size: int = 100) -> None:
        self.root = Path(root)
        self.cas_dir = self.root / "cas"
        self.cas_dir.mkdir(parents=True, exist_ok=True)
        self.token = token
        self.page_size = page_size
        self.buckets: dict[str, _Bucket] = {}
        self.requests: list[tuple[str, str]] = []
        self.http_bytes_in = 0  # request bodies received (JSON, NDJSON: never file bytes)
        self.http_bytes_out = 0  # response bodies sent
        self._faults: list[Fault] = []
        self._batch_failures: list[tuple[re.Pattern[str], int]] = []
        self._sizes: dict[str, int] = {}
        self._seen_shards: set[str] = set()
        self._lock = threading.RLock()
        hub = self

        class Handler(_Handler):
            server_hub = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fakehub", daemon=True)

    # ------------------------------------------------------------ lifecycle

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeHub:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---------------------------------------------------------- test hooks

    def create_bucket(self, bucket_id: str, private: bool = True) -> None:
        with self._lock:
            self.buckets.setdefault(bucket_id, _Bucket(bucket_id, private, time.time()))

    def fail(
        self,
        path: str,
        *,
        method: str = "*",
        status: int = 503,
        times: int = 1,
        retry_after: int | None = None,
        delay: float = 0.0,
    ) -> Fault:
        """Answer the next ``times`` requests whose path matches regex ``path`` with ``status``.

        ``status=200`` with ``delay`` only slows the requests down.
        """
        fault = Fault(method, re.compile(path), status, times, retry_after, delay)
        with self._lock:
            self._faults.append(fault)
        return fault

    def slow(self, path: str, delay: float, *, method: str = "*", times: int = 1) -> Fault:
        """Delay the next ``times`` matching requests by ``delay`` seconds, then serve them."""
        return self.fail(path, method=method, status=200, times=times, delay=delay)

    def fail_batch_paths(self, path: str, times: int = 1) -> None:
        """The next ``times`` ``/batch`` operations on a path matching ``path`` fail (the rest apply)."""
        with self._lock:
            self._batch_failures.append((re.compile(path), times))

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()
            self._batch_failures.clear()

    def put_file_entry(self, bucket_id: str, path: str, xet_hash: str, size: int) -> None:
        """Register ``path`` directly (a raw write, as another client would make it)."""
        with self._lock:
            self.buckets[bucket_id].files[path] = _File(xet_hash, size, int(time.time() * 1000), time.time())

    def file_entry(self, bucket_id: str, path: str) -> tuple[str, int] | None:
        with self._lock:
            f = self.buckets[bucket_id].files.get(path)
            return (f.xet_hash, f.size) if f else None

    def cas_bytes(self) -> int:
        """Bytes of xorbs and shards in the local CAS: what hf_xet uploaded (after dedup and compression)."""
        return sum(
            p.stat().st_size
            for p in self.cas_dir.rglob("*")
            if p.is_file() and p.parent.name in ("xorbs", "shards") and p.suffix not in (".tagset", ".redb")
        )

    def count(self, method: str, pattern: str) -> int:
        rx = re.compile(pattern)
        with self._lock:
            return sum(1 for m, p in self.requests if m == method and rx.search(p))

    # -------------------------------------------------------------- internals

    def _take_fault(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.matches(method, path):
                    fault.hits += 1
                    return fault
        return None

    def _take_batch_failure(self, path: str) -> bool:
        with self._lock:
            for i, (rx, times) in enumerate(self._batch_failures):
                if times > 0 and rx.search(path):
                    self._batch_failures[i] = (rx, times - 1)
                    return True
        return False

    def size_of(self, xet_hash: str) -> int | None:
        """Size of the file with this Xet hash, learnt from the CAS directory's shards."""
        with self._lock:
            if xet_hash not in self._sizes:
                for shard in self.cas_dir.rglob("*.mdb"):
                    if shard.name in self._seen_shards:
                        continue
                    self._sizes.update(shard_file_sizes(shard.read_bytes()))
                    self._seen_shards.add(shard.name)
            return self._sizes.get(xet_hash)


_BUCKET_API = re.compile(r"^/api/buckets/(?P<ns>[^/]+)/(?P<name>[^/]+)(?P<rest>/.*)?$")
_RESOLVE = re.compile(r"^/buckets/(?P<ns>[^/]+)/(?P<name>[^/]+)/resolve/(?P<path>.+)$")


class _Handler(BaseHTTPRequestHandler):
    server_hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        return

    # -------------------------------------------------------------- plumbing

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        data = self.rfile.read(n) if n else b""
        with self.server_hub._lock:
            self.server_hub.http_bytes_in += len(data)
        return data

    def _send(self, status: int, body: Any = None, headers: dict[str, str] | None = None) -> None:
        data = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if body is not None and not isinstance(body, bytes):
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
            with self.server_hub._lock:
                self.server_hub.http_bytes_out += len(data)

    def _error(self, status: int, message: str, code: str | None = None) -> None:
        headers = {"X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        self._send(status, {"error": message}, headers)

    def _authorized(self) -> bool:
        hub = self.server_hub
        if hub.token is None:
            return True
        auth = self.headers.get("Authorization", "")
        if auth == f"Bearer {hub.token}":
            return True
        self._error(401 if not auth else 403, "Invalid credentials in Authorization header")
        return False

    def _dispatch(self) -> None:
        hub = self.server_hub
        url = urlsplit(self.path)
        path = url.path
        with hub._lock:
            hub.requests.append((self.command, path))
        fault = hub._take_fault(self.command, path)
        if fault is not None:
            if fault.delay:
                time.sleep(fault.delay)
            if fault.status != 200:
                self._body()
                headers = {} if fault.retry_after is None else {"Retry-After": str(fault.retry_after)}
                self._send(fault.status, {"error": f"injected {fault.status}"}, headers)
                return
        if not self._authorized():
            self._body()
            return
        if m := _RESOLVE.match(path):
            self._resolve(f"{m['ns']}/{m['name']}", unquote(m["path"]))
            return
        m = _BUCKET_API.match(path)
        if m is None:
            self._error(404, f"no route for {self.command} {path}")
            return
        bucket_id, rest = f"{m['ns']}/{m['name']}", m["rest"] or ""
        if rest == "" and self.command == "POST":
            self._create(bucket_id)
            return
        with hub._lock:
            bucket = hub.buckets.get(bucket_id)
        if bucket is None:
            self._body()
            self._error(404, f"Bucket {bucket_id} not found", "RepoNotFound")
            return
        query = parse_qs(url.query)
        if rest == "" and self.command == "GET":
            self._info(bucket)
        elif rest == "" and self.command == "DELETE":
            with hub._lock:
                del hub.buckets[bucket_id]
            self._send(200, {})
        elif rest == "/tree" or rest.startswith("/tree/"):
            self._tree(bucket, unquote(rest[len("/tree/") :]), query)
        elif rest == "/paths-info" and self.command == "POST":
            self._paths_info(bucket)
        elif rest == "/batch" and self.command == "POST":
            self._batch(bucket)
        elif rest in ("/xet-read-token", "/xet-write-token") and self.command == "GET":
            self._xet_token()
        else:
            self._error(404, f"no route for {self.command} {path}")

    do_GET = do_POST = do_HEAD = do_DELETE = _dispatch

    # ------------------------------------------------------------- endpoints

    def _create(self, bucket_id: str) -> None:
        hub = self.server_hub
        payload = json.loads(self._body() or b"{}")
        url = f"{hub.endpoint}/buckets/{bucket_id}"
        with hub._lock:
            if bucket_id in hub.buckets:
                self._send(409, {"error": "You already created this bucket", "url": url})
                return
            hub.buckets[bucket_id] = _Bucket(bucket_id, payload.get("visibility") != "public", time.time())
        self._send(200, {"url": url, "name": bucket_id.split("/")[1], "id": bucket_id})

    def _info(self, bucket: _Bucket) -> None:
        with self.server_hub._lock:
            files = list(bucket.files.values())
        self._send(
            200,
            {
                "id": bucket.id,
                "private": bucket.private,
                "createdAt": _iso(bucket.created_at),
                "size": sum(f.size for f in files),
                "totalFiles": len(files),
            },
        )

    @staticmethod
    def _file_json(path: str, f: _File) -> dict[str, Any]:
        return {
            "type": "file",
            "path": path,
            "size": f.size,
            "xetHash": f.xet_hash,
            "mtime": _iso(f.mtime / 1000),
            "uploadedAt": _iso(f.uploaded_at),
        }

    def _tree(self, bucket: _Bucket, prefix: str, query: dict[str, list[str]]) -> None:
        hub = self.server_hub
        recursive = query.get("recursive", ["false"])[0].lower() == "true"
        offset = int(query.get("cursor", ["0"])[0])
        with hub._lock:
            files = sorted((p, f) for p, f in bucket.files.items() if p.startswith(prefix))
        items: list[dict[str, Any]] = []
        if recursive:
            items = [self._file_json(p, f) for p, f in files]
        else:  # one level below the prefix's directory: files and folders
            base = prefix.rsplit("/", 1)[0] + "/" if "/" in prefix else ""
            dirs: set[str] = set()
            for p, f in files:
                rest = p[len(base) :]
                if "/" in rest:
                    dirs.add(base + rest.split("/", 1)[0])
                else:
                    items.append(self._file_json(p, f))
            items += [{"type": "directory", "path": d} for d in sorted(dirs)]
        page = items[offset : offset + hub.page_size]
        headers = {}
        if offset + hub.page_size < len(items):
            nxt = f"{hub.endpoint}{urlsplit(self.path).path}?recursive={str(recursive).lower()}&cursor={offset + hub.page_size}"
            headers["Link"] = f'<{nxt}>; rel="next"'
        self._send(200, page, headers)

    def _paths_info(self, bucket: _Bucket) -> None:
        paths = json.loads(self._body())["paths"]
        if len(paths) > 1000:
            self._error(400, "at most 1000 paths per call")
            return
        with self.server_hub._lock:
            found = [self._file_json(p, bucket.files[p]) for p in paths if p in bucket.files]
        self._send(200, found)

    def _batch(self, bucket: _Bucket) -> None:
        hub = self.server_hub
        ops = [json.loads(line) for line in self._body().splitlines() if line.strip()]
        failed: list[dict[str, str]] = []
        for op in ops:
            path = op.get("path", "")
            if not path or path.startswith("/") or any(s in ("", ".", "..") for s in path.split("/")):
                failed.append({"path": path, "error": "invalid path"})
                continue
            if hub._take_batch_failure(path):
                failed.append({"path": path, "error": "injected failure"})
                continue
            if op["type"] == "addFile":
                size = hub.size_of(op["xetHash"])
                if size is None:
                    failed.append({"path": path, "error": f"unknown xet hash {op['xetHash']}"})
                    continue
                with hub._lock:
                    bucket.files[path] = _File(op["xetHash"], size, int(op.get("mtime") or 0), time.time())
            elif op["type"] == "deleteFile":
                with hub._lock:
                    bucket.files.pop(path, None)
            else:
                failed.append({"path": path, "error": f"unsupported operation {op['type']}"})
        if failed and len(failed) == len(ops):
            self._send(422, {"failed": failed})
        else:
            self._send(200, {"failed": failed} if failed else {})

    def _resolve(self, bucket_id: str, path: str) -> None:
        hub = self.server_hub
        with hub._lock:
            bucket = hub.buckets.get(bucket_id)
            f = bucket.files.get(path) if bucket else None
        if f is None:
            self._error(404, f"Entry {path} not found", "EntryNotFound")
            return
        refresh = f"{hub.endpoint}/api/buckets/{bucket_id}/xet-read-token"
        self._send(
            200,
            b"",
            {
                "X-Xet-Hash": f.xet_hash,
                "X-Linked-Size": str(f.size),
                "X-Xet-Refresh-Route": refresh,
                "Link": f'<{refresh}>; rel="xet-auth"',
            },
        )

    def _xet_token(self) -> None:
        hub = self.server_hub
        exp = int(time.time()) + TOKEN_TTL
        cas = f"local://{hub.cas_dir}"
        self._send(
            200,
            {"accessToken": "xet-local", "exp": exp, "casUrl": cas},
            {"X-Xet-Cas-Url": cas, "X-Xet-Access-Token": "xet-local", "X-Xet-Token-Expiration": str(exp)},
        )


# ------------------------------------------------------------ test helpers

TOKEN = "hf_fake_token"
_bucket_names = itertools.count()


def new_bucket(hub: FakeHub) -> str:
    """A fresh, empty bucket id on ``hub``."""
    bucket_id = f"ns/bucket-{next(_bucket_names)}"
    hub.create_bucket(bucket_id)
    return bucket_id


def hf_store(hub: FakeHub, bucket_id: str, prefix: str = "run", **kw: Any) -> HFBucketStore:
    """An HFBucketStore on the fake Hub with the right token."""
    return HFBucketStore(bucket_id, prefix, endpoint=hub.endpoint, token=TOKEN, **kw)


def raw_path(store: HFBucketStore, key: str) -> str:
    """The bucket path of ``key`` in ``store``."""
    return f"{store.prefix}/{key}" if store.prefix else key
