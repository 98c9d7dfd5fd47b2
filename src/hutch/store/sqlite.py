"""The embedded store: one SQLite file in WAL mode, synchronous=FULL.

Calls are short and serialized by a lock; with WAL a commit is one fsync of
the log, a millisecond or so, paid only on transitions (never per exec).
A lease's change waits for no fsync (see :meth:`SQLiteStore._lease_transaction`).
The queries are :mod:`.sql`'s, shared with PostgreSQL; what is SQLite's own
is here: the schema and its added columns, the connection, JSON as text,
the clock (this host's), and ``BEGIN IMMEDIATE`` as the lock of every write.
"""

from __future__ import annotations

import functools
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from .._errors import StoreUnavailable
from .base import check_off_loop
from .sql import Row, SQLStore

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
    updated_at_unix REAL NOT NULL,
    deadline_unix REAL,
    last_active_unix REAL,
    meter TEXT NOT NULL DEFAULT '{}',
    base_snapshot_id TEXT,
    origin_snapshot_id TEXT
);
CREATE TABLE IF NOT EXISTS workspaces (
    name TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    provider TEXT NOT NULL,
    spec TEXT NOT NULL,
    live_sandbox_id TEXT,
    state_snapshot_id TEXT,
    source_snapshot_id TEXT,
    created_at_unix REAL NOT NULL,
    last_active_unix REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS snapshots (
    id TEXT PRIMARY KEY,
    provider TEXT NOT NULL,
    status TEXT NOT NULL,
    label TEXT,
    sandbox_id TEXT,
    parent_id TEXT,
    size_bytes INTEGER NOT NULL DEFAULT 0,
    created_at_unix REAL NOT NULL,
    handle TEXT NOT NULL DEFAULT '{}',
    spec TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS snapshots_parent ON snapshots(parent_id);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    at_unix REAL NOT NULL,
    subject TEXT NOT NULL,
    kind TEXT NOT NULL,
    message TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_subject ON events(subject, seq);
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""

_REFS_SCHEMA = """
CREATE TABLE IF NOT EXISTS refs (
    id TEXT PRIMARY KEY,
    sandbox_id TEXT NOT NULL,
    secret_sha256 TEXT NOT NULL,
    created_at_unix REAL NOT NULL,
    expires_at_unix REAL,
    revoked_at_unix REAL
);
CREATE INDEX IF NOT EXISTS refs_sandbox ON refs(sandbox_id);
"""
_DEFINITIONS_SCHEMA = """
CREATE TABLE IF NOT EXISTS definitions (
    id TEXT PRIMARY KEY,
    body TEXT NOT NULL,
    updated_at_unix REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS instances (
    key TEXT PRIMARY KEY,
    definition_id TEXT NOT NULL,
    thread_id TEXT NOT NULL,
    tenant TEXT,
    provider TEXT NOT NULL,
    sandbox_id TEXT,
    description TEXT NOT NULL DEFAULT '{}',
    spec TEXT NOT NULL DEFAULT '{}',
    updated_at_unix REAL NOT NULL,
    state TEXT NOT NULL DEFAULT 'running',
    last_active_unix REAL,
    created_at_unix REAL,
    deadline_unix REAL,
    reason TEXT
);
CREATE TABLE IF NOT EXISTS instance_holders (
    key TEXT NOT NULL,
    holder TEXT NOT NULL,
    since_unix REAL NOT NULL,
    PRIMARY KEY (key, holder)
);
CREATE TABLE IF NOT EXISTS leases (
    name TEXT PRIMARY KEY,
    holder TEXT NOT NULL,
    expires_at_unix REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS daemons (
    id TEXT PRIMARY KEY,
    url TEXT NOT NULL,
    expires_at_unix REAL NOT NULL
);
"""
#: Who owns a row (issue 24's fleet), on every sandbox, workspace and snapshot.
_OWNED_DECL = {"owner": "TEXT", "lease_expires_at_unix": "REAL",
               "epoch": "INTEGER NOT NULL DEFAULT 0", "version": "INTEGER NOT NULL DEFAULT 0"}
#: Columns added after the first release, for data directories made before them.
_ADDED_COLUMNS = {
    "sandboxes": {
        "deadline_unix": "REAL",
        "last_active_unix": "REAL",
        "meter": "TEXT NOT NULL DEFAULT '{}'",
        "base_snapshot_id": "TEXT",
        "origin_snapshot_id": "TEXT",
        **_OWNED_DECL,
    },
    # Workspaces on snapshots (provider-neutral); columns of the Docker-only
    # rows of older data directories are left unread.
    "workspaces": {"state_snapshot_id": "TEXT", "source_snapshot_id": "TEXT", **_OWNED_DECL},
    "snapshots": dict(_OWNED_DECL),
    # The workspace a ref follows.
    "refs": {"workspace": "TEXT"},
    # The state of an instance's sandbox, kept with its description.
    "instances": {"state": "TEXT NOT NULL DEFAULT 'running'",
                  # The latest activity of every program holding its sandbox.
                  "last_active_unix": "REAL",
                  # Its sandbox's time limits, every holding program's
                  # (max_lifetime counts from its creation), and why it ended.
                  "created_at_unix": "REAL", "deadline_unix": "REAL", "reason": "TEXT"},
}


def _while_locked(statement: Callable[[], object], seconds: float = 30.0) -> None:
    """Run ``statement``, again while another process holds the database locked."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            statement()
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class SQLiteStore(SQLStore):
    #: This host's clock (a function of the connection, see __init__).
    now_sql = "hutch_now()"

    def __init__(self, path: str) -> None:
        check_off_loop(f"opening {path}")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        # Autocommit: each statement is its own transaction unless we open one.
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.create_function("hutch_now", 0, time.time)
        # First: every statement below may meet another process opening the
        # same store (two programs sharing one HUTCH_HOME).
        self._db.execute("PRAGMA busy_timeout=5000")
        # Switching to WAL takes an exclusive lock without waiting on the
        # busy handler, so a second process opening a new store at the same
        # moment retries it.
        _while_locked(lambda: self._db.execute("PRAGMA journal_mode=WAL"))
        # FULL: a committed transition survives a power cut, not only a crash.
        self._db.execute("PRAGMA synchronous=FULL")
        for script in (_SCHEMA, _REFS_SCHEMA, _DEFINITIONS_SCHEMA):
            _while_locked(functools.partial(self._db.executescript, script))
        self._migrate()

    def _migrate(self) -> None:
        """Add the columns an older store lacks. The look and the change are
        one write transaction: another process opening the same new store at
        the same moment adds them first or finds them added, never between."""
        _while_locked(lambda: self._db.execute("BEGIN IMMEDIATE"))
        try:
            for table, columns in _ADDED_COLUMNS.items():
                have = {r["name"] for r in self._db.execute(f"PRAGMA table_info({table})")}
                for name, decl in columns.items():
                    if name not in have:
                        self._db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")
            for table in ("sandboxes", "workspaces", "snapshots"):
                # A row stored before versions were counted is at its first:
                # version 0 is a row not stored yet (see SQLStore._fenced_put).
                self._db.execute(f"UPDATE {table} SET version = 1 WHERE version = 0")
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One durable transaction; a write the file cannot take (a full
        disk, an unwritable file) is rolled back whole and raised as
        ``StoreUnavailable``, so a caller never acknowledges what is not kept."""
        check_off_loop("a write transaction")
        with self._lock, self._begun() as db:
            yield db

    @contextmanager
    def _lease_transaction(self) -> Iterator[sqlite3.Connection]:
        """A lease's change, committed without waiting for the disk
        (synchronous=NORMAL for it: in WAL mode every process sees it at
        once, and a crash of any of them keeps it). Only a power cut or the
        host's crash may lose it, which ends every process that could hold
        a lease on this file with it; the fsync it skips is most of the
        cost of ``ensure`` resuming a sandbox (two leases' changes each)."""
        check_off_loop("a lease's write")
        with self._lock:
            # Never inside a transaction (SQLite refuses): none is open
            # while the lock is free.
            self._db.execute("PRAGMA synchronous=NORMAL")
            try:
                with self._begun() as db:
                    yield db
            finally:
                self._db.execute("PRAGMA synchronous=FULL")

    def _lease_write(self, sql: str, params: Sequence[Any]) -> None:
        with self._lease_transaction() as db:
            db.execute(sql, params)

    @contextmanager
    def _begun(self) -> Iterator[sqlite3.Connection]:
        """A write transaction on the connection, the lock held by the caller."""
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise self._unavailable(exc) from exc
        try:
            yield self._db
            self._db.execute("COMMIT")
        except BaseException as exc:
            if self._db.in_transaction:
                try:
                    self._db.execute("ROLLBACK")
                except sqlite3.Error:
                    pass  # SQLite has rolled it back itself
            if isinstance(exc, sqlite3.Error):
                raise self._unavailable(exc) from exc
            raise

    def _unavailable(self, exc: sqlite3.Error) -> StoreUnavailable:
        return StoreUnavailable(f"the state store {self.path} cannot record the change: {exc}")

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        check_off_loop(sql)
        with self._lock:
            return list(self._db.execute(sql, params))

    # -- what SQLite does its own way ------------------------------------------------------
    @staticmethod
    def json_in(value: Any) -> Any:
        return json.dumps(value)

    @staticmethod
    def json_out(value: Any) -> Any:
        return json.loads(value) if value is not None else None

    def close(self) -> None:
        check_off_loop("close")
        with self._lock:
            self._db.close()

    def changes_by_others(self) -> int | None:
        if not self._lock.acquire(blocking=False):
            return None
        try:
            # SQLite's own counter of other connections' commits (shared memory).
            return int(self._db.execute("PRAGMA data_version").fetchone()[0])
        finally:
            self._lock.release()

    def local_dir(self, name: str) -> str:
        return f"{os.path.abspath(self.path)}-{name}"
