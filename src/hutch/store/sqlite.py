"""The embedded store: one SQLite file in WAL mode, synchronous=FULL.

Calls are short and serialized by a lock; with WAL a commit is one fsync of
the log, a millisecond or so, paid only on transitions (never per exec).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import threading
import time
from typing import Any

from .base import SandboxRow, Store, WorkspaceRow

FINAL_STATES = ("terminated", "failed")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    provider TEXT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT,
    workspace TEXT,
    spec TEXT NOT NULL,
    description TEXT NOT NULL,
    created_at_unix REAL NOT NULL,
    updated_at_unix REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS workspaces (
    name TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    provider TEXT NOT NULL,
    spec TEXT NOT NULL,
    live_sandbox_id TEXT,
    current_state_tag TEXT,
    source_snapshot_tag TEXT,
    image TEXT,
    host_workdir TEXT,
    created_at_unix REAL NOT NULL,
    last_active_unix REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    at_unix REAL NOT NULL,
    subject TEXT NOT NULL,
    kind TEXT NOT NULL,
    message TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_subject ON events(subject, seq);
"""


class SQLiteStore(Store):
    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        # FULL: a committed transition survives a power cut, not only a crash.
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(_SCHEMA)

    def _write(self, sql: str, params: tuple[Any, ...]) -> None:
        with self._lock:
            self._db.execute(sql, params)

    def _read(self, sql: str, params: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return list(self._db.execute(sql, params))

    # -- sandboxes -------------------------------------------------------------------
    def put_sandbox(self, row: SandboxRow) -> None:
        row.updated_at_unix = time.time()
        self._write(
            "INSERT OR REPLACE INTO sandboxes VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (row.id, row.provider, row.state, row.reason, row.workspace, json.dumps(row.spec),
             json.dumps(row.description), row.created_at_unix, row.updated_at_unix),
        )

    @staticmethod
    def _sandbox(r: sqlite3.Row) -> SandboxRow:
        return SandboxRow(
            id=r["id"], provider=r["provider"], state=r["state"], reason=r["reason"],
            workspace=r["workspace"], spec=json.loads(r["spec"]),
            description=json.loads(r["description"]), created_at_unix=r["created_at_unix"],
            updated_at_unix=r["updated_at_unix"],
        )

    def get_sandbox(self, sandbox_id: str) -> SandboxRow | None:
        rows = self._read("SELECT * FROM sandboxes WHERE id = ?", (sandbox_id,))
        return self._sandbox(rows[0]) if rows else None

    def list_sandboxes(self, *, include_final: bool = False) -> list[SandboxRow]:
        if include_final:
            rows = self._read("SELECT * FROM sandboxes ORDER BY created_at_unix")
        else:
            rows = self._read(
                "SELECT * FROM sandboxes WHERE state NOT IN (?, ?) ORDER BY created_at_unix",
                FINAL_STATES,
            )
        return [self._sandbox(r) for r in rows]

    def delete_sandbox(self, sandbox_id: str) -> None:
        self._write("DELETE FROM sandboxes WHERE id = ?", (sandbox_id,))

    # -- workspaces --------------------------------------------------------------------
    def put_workspace(self, row: WorkspaceRow) -> None:
        values = dataclasses.asdict(row)
        values["spec"] = json.dumps(row.spec)
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO workspaces VALUES (:name, :status, :provider, :spec, "
                ":live_sandbox_id, :current_state_tag, :source_snapshot_tag, :image, "
                ":host_workdir, :created_at_unix, :last_active_unix)",
                values,
            )

    @staticmethod
    def _workspace(r: sqlite3.Row) -> WorkspaceRow:
        values = dict(r)
        values["spec"] = json.loads(values["spec"])
        return WorkspaceRow(**values)

    def get_workspace(self, name: str) -> WorkspaceRow | None:
        rows = self._read("SELECT * FROM workspaces WHERE name = ?", (name,))
        return self._workspace(rows[0]) if rows else None

    def list_workspaces(self) -> list[WorkspaceRow]:
        return [self._workspace(r) for r in self._read("SELECT * FROM workspaces ORDER BY name")]

    def delete_workspace(self, name: str) -> None:
        self._write("DELETE FROM workspaces WHERE name = ?", (name,))

    # -- events ---------------------------------------------------------------------------
    def log_event(self, subject: str, kind: str, message: str) -> None:
        self._write(
            "INSERT INTO events (at_unix, subject, kind, message) VALUES (?, ?, ?, ?)",
            (time.time(), subject, kind, message),
        )

    def events(self, subject: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        if subject is None:
            rows = self._read("SELECT * FROM events ORDER BY seq DESC LIMIT ?", (limit,))
        else:
            rows = self._read(
                "SELECT * FROM events WHERE subject = ? ORDER BY seq DESC LIMIT ?",
                (subject, limit),
            )
        return [dict(r) for r in reversed(rows)]

    def close(self) -> None:
        with self._lock:
            self._db.close()
