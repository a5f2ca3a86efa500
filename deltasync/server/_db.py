"""SQLite persistence of the signal server: commit history (hence heads) and webhook subscriptions."""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Commit", "Database", "Webhook"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS commits (
    run TEXT NOT NULL,
    step INTEGER NOT NULL,
    manifest_digest TEXT NOT NULL,
    run_id TEXT,
    kind TEXT,
    time REAL NOT NULL,
    PRIMARY KEY (run, step)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS webhooks (
    id TEXT PRIMARY KEY,
    run TEXT NOT NULL,
    url TEXT NOT NULL,
    secret TEXT NOT NULL,
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS webhooks_run ON webhooks (run);
"""


@dataclass(frozen=True, slots=True)
class Commit:
    """One signalled commit of a run. Its SSE event id is its step."""

    run: str
    step: int
    manifest_digest: str
    run_id: str | None
    kind: str | None
    time: float

    def to_dict(self) -> dict[str, object]:
        """The JSON object sent to clients."""
        return {
            "run": self.run,
            "step": self.step,
            "manifest_digest": self.manifest_digest,
            "run_id": self.run_id,
            "kind": self.kind,
            "time": self.time,
        }


@dataclass(frozen=True, slots=True)
class Webhook:
    """A registered webhook receiver."""

    id: str
    run: str
    url: str
    secret: str
    created: float


class Database:
    """A small thread-safe wrapper around one SQLite connection (WAL mode for files)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        with self._lock:
            self._open()

    def _open(self) -> sqlite3.Connection:
        if self._db is None:
            if self.path != ":memory:":
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            if self.path != ":memory:":
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")
            conn.executescript(_SCHEMA)
            self._db = conn
        return self._db

    @property
    def _conn(self) -> sqlite3.Connection:
        # (re)opened on use: an app whose lifespan ended may be started again (test harnesses do)
        return self._open()

    def close(self) -> None:
        """Close the connection (a file database reopens on next use; an in-memory one stays open)."""
        with self._lock:
            if self._db is not None and self.path != ":memory:":
                self._db.close()
                self._db = None

    # -------------------------------------------------------------- commits

    def get_commit(self, run: str, step: int) -> Commit | None:
        """The recorded commit of ``run`` at ``step``."""
        with self._lock:
            row = self._conn.execute(
                "SELECT run, step, manifest_digest, run_id, kind, time FROM commits WHERE run = ? AND step = ?",
                (run, step),
            ).fetchone()
        return Commit(*row) if row else None

    def head(self, run: str) -> Commit | None:
        """The newest recorded commit of ``run``."""
        with self._lock:
            row = self._conn.execute(
                "SELECT run, step, manifest_digest, run_id, kind, time FROM commits WHERE run = ? "
                "ORDER BY step DESC LIMIT 1",
                (run,),
            ).fetchone()
        return Commit(*row) if row else None

    def after(self, run: str, step: int, limit: int) -> list[Commit]:
        """Commits of ``run`` newer than ``step``, oldest first, at most ``limit``."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT run, step, manifest_digest, run_id, kind, time FROM commits WHERE run = ? AND step > ? "
                "ORDER BY step LIMIT ?",
                (run, step, limit),
            ).fetchall()
        return [Commit(*r) for r in rows]

    def add_commit(self, c: Commit, keep: int) -> None:
        """Record a commit and prune the run's history to its newest ``keep`` commits."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.execute(
                    "INSERT INTO commits (run, step, manifest_digest, run_id, kind, time) VALUES (?, ?, ?, ?, ?, ?)",
                    (c.run, c.step, c.manifest_digest, c.run_id, c.kind, c.time),
                )
                self._conn.execute(
                    "DELETE FROM commits WHERE run = ? AND step < (SELECT MIN(step) FROM "
                    "(SELECT step FROM commits WHERE run = ? ORDER BY step DESC LIMIT ?))",
                    (c.run, c.run, keep),
                )
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise

    def runs(self) -> list[str]:
        """Every run with at least one recorded commit."""
        with self._lock:
            return [r[0] for r in self._conn.execute("SELECT DISTINCT run FROM commits ORDER BY run")]

    # ------------------------------------------------------------- webhooks

    def add_webhook(self, w: Webhook) -> None:
        """Register a webhook."""
        with self._lock:
            self._conn.execute(
                "INSERT INTO webhooks (id, run, url, secret, created) VALUES (?, ?, ?, ?, ?)",
                (w.id, w.run, w.url, w.secret, w.created),
            )

    def webhooks(self, run: str) -> list[Webhook]:
        """The webhooks of ``run``, oldest first."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT id, run, url, secret, created FROM webhooks WHERE run = ? ORDER BY created, id", (run,)
            ).fetchall()
        return [Webhook(*r) for r in rows]

    def delete_webhook(self, run: str, hook_id: str) -> bool:
        """Remove a webhook; whether it existed."""
        with self._lock:
            cur = self._conn.execute("DELETE FROM webhooks WHERE run = ? AND id = ?", (run, hook_id))
            return cur.rowcount > 0
