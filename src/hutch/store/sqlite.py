"""The embedded store: one SQLite file in WAL mode, synchronous=FULL.

Calls are short and serialized by a lock; with WAL a commit is one fsync of
the log, a millisecond or so, paid only on transitions (never per exec).
"""

from __future__ import annotations

import functools
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from .._errors import InvalidArgument, StoreUnavailable
from ..states import FINAL_VALUES
from .base import (
    OWNED_COLUMNS,
    DaemonRow,
    DefinitionRow,
    InstanceRow,
    RefRow,
    SandboxRow,
    SnapshotRow,
    Store,
    WorkspaceRow,
    check_fence,
    holder_alive,
)

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
_INSTANCE_COLUMNS = (
    "key", "definition_id", "thread_id", "tenant", "provider", "sandbox_id", "description",
    "spec", "updated_at_unix", "state", "last_active_unix", "created_at_unix", "deadline_unix",
    "reason",
)

_REF_COLUMNS = (
    "id", "sandbox_id", "secret_sha256", "created_at_unix", "expires_at_unix",
    "revoked_at_unix", "workspace",
)

#: Who owns a row (issue 24's fleet), on every sandbox, workspace and snapshot.
_OWNED_DECL = {"owner": "TEXT", "lease_expires_at_unix": "REAL",
               "epoch": "INTEGER NOT NULL DEFAULT 0", "version": "INTEGER NOT NULL DEFAULT 0"}
#: kind -> (table, key column) of the rows daemons own.
_OWNED_TABLES = {"sandbox": ("sandboxes", "id"), "workspace": ("workspaces", "name"),
                 "snapshot": ("snapshots", "id")}

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

_SANDBOX_COLUMNS = (
    "id", "provider", "state", "reason", "workspace", "spec", "description",
    "created_at_unix", "updated_at_unix", "deadline_unix", "last_active_unix", "meter",
    "base_snapshot_id", "origin_snapshot_id",
)
_PUT_SANDBOX = (
    f"INSERT OR REPLACE INTO sandboxes ({', '.join((*_SANDBOX_COLUMNS, *OWNED_COLUMNS))}) "
    f"VALUES ({', '.join('?' for _ in (*_SANDBOX_COLUMNS, *OWNED_COLUMNS))})"
)
_WORKSPACE_COLUMNS = (
    "name", "status", "provider", "spec", "live_sandbox_id", "state_snapshot_id",
    "source_snapshot_id", "created_at_unix", "last_active_unix",
)
_PUT_WORKSPACE = (
    f"INSERT OR REPLACE INTO workspaces ({', '.join((*_WORKSPACE_COLUMNS, *OWNED_COLUMNS))}) "
    f"VALUES ({', '.join('?' for _ in (*_WORKSPACE_COLUMNS, *OWNED_COLUMNS))})"
)
_SNAPSHOT_COLUMNS = (
    "id", "provider", "status", "label", "sandbox_id", "parent_id", "size_bytes",
    "created_at_unix", "handle", "spec",
)
_PUT_SNAPSHOT = (
    f"INSERT OR REPLACE INTO snapshots ({', '.join((*_SNAPSHOT_COLUMNS, *OWNED_COLUMNS))}) "
    f"VALUES ({', '.join('?' for _ in (*_SNAPSHOT_COLUMNS, *OWNED_COLUMNS))})"
)

_LOG_EVENT = "INSERT INTO events (at_unix, subject, kind, message) VALUES (?, ?, ?, ?)"


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


class SQLiteStore(Store):
    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        # Autocommit: each statement is its own transaction unless we open one.
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
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
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One durable transaction; a write the file cannot take (a full
        disk, an unwritable file) is rolled back whole and raised as
        ``StoreUnavailable``, so a caller never acknowledges what is not kept."""
        with self._lock:
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

    def _write(self, sql: str, params: tuple[Any, ...]) -> None:
        with self._transaction() as db:
            db.execute(sql, params)

    def _read(self, sql: str, params: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return list(self._db.execute(sql, params))

    # -- sandboxes -------------------------------------------------------------------
    @staticmethod
    def _sandbox_values(row: SandboxRow) -> tuple[Any, ...]:
        row.updated_at_unix = time.time()
        return (
            row.id, row.provider, row.state, row.reason, row.workspace, json.dumps(row.spec),
            json.dumps(row.description), row.created_at_unix, row.updated_at_unix,
            row.deadline_unix, row.last_active_unix, json.dumps(row.meter),
            row.base_snapshot_id, row.origin_snapshot_id,
        )

    # -- fenced writes of owned rows -----------------------------------------------
    def _fence(self, db: sqlite3.Connection, table: str, key: str, ident: str,
               row: SandboxRow | WorkspaceRow | SnapshotRow | None) -> tuple[Any, ...] | None:
        """The owned columns (owner, lease, epoch, version) the writer writes
        ``row`` with, as a compare and set on the stored ones (``check_fence``;
        None: no row is stored)."""
        found = db.execute(
            f"SELECT owner, epoch, version, lease_expires_at_unix FROM {table} WHERE {key} = ?",
            (ident,)).fetchone()
        now = time.time()
        if self.writer is None:  # unfenced: a program in-process, or a test
            if found is None:
                return (None, None, 0, 1) if row is None else (
                    row.owner, row.lease_expires_at_unix, row.epoch, 1)
            return (found["owner"], found["lease_expires_at_unix"], found["epoch"],
                    found["version"] + 1)
        if found is None:
            return (self.writer, now + self.lease_seconds,
                    max(row.epoch if row is not None else 0, 1), 1)
        check_fence(f"{table[:-1]} {ident}", self.writer, found, row, now)
        return (self.writer, now + self.lease_seconds, found["epoch"] or 1,
                found["version"] + 1)

    def _put_owned(self, db: sqlite3.Connection, statement: str, table: str, key: str,
                   row: SandboxRow | WorkspaceRow | SnapshotRow, values: tuple[Any, ...]) -> None:
        owned = self._fence(db, table, key, values[0], row)
        assert owned is not None
        db.execute(statement, (*values, *owned))
        row.owner, row.lease_expires_at_unix, row.epoch, row.version = owned

    def _delete_owned(self, table: str, key: str, ident: str) -> None:
        with self._transaction() as db:
            if db.execute(f"SELECT 1 FROM {table} WHERE {key} = ?", (ident,)).fetchone():
                self._fence(db, table, key, ident, None)
                db.execute(f"DELETE FROM {table} WHERE {key} = ?", (ident,))

    # -- the fleet -----------------------------------------------------------------------
    def register_daemon(self, daemon_id: str, url: str, seconds: float) -> None:
        until = time.time() + seconds
        with self._transaction() as db:
            db.execute("INSERT OR REPLACE INTO daemons (id, url, expires_at_unix) "
                       "VALUES (?, ?, ?)", (daemon_id, url, until))
            for table, _ in _OWNED_TABLES.values():
                db.execute(f"UPDATE {table} SET lease_expires_at_unix = ? WHERE owner = ?",
                           (until, daemon_id))

    def daemons(self) -> list[DaemonRow]:
        now = time.time()
        return [DaemonRow(r["id"], r["url"], r["expires_at_unix"], r["expires_at_unix"] > now)
                for r in self._read("SELECT * FROM daemons ORDER BY id")]

    def lapsed_sandboxes(self) -> list[SandboxRow]:
        rows = self._read(
            "SELECT * FROM sandboxes WHERE state NOT IN (?, ?) AND owner IS NOT NULL "
            "AND lease_expires_at_unix < ? ORDER BY created_at_unix",
            (*FINAL_VALUES, time.time()))
        return [self._sandbox(r) for r in rows]

    def take_over(self, kind: str, key: str) -> bool:
        table, column = _OWNED_TABLES[kind]
        if self.writer is None:
            raise InvalidArgument("only a daemon (act_as) takes rows over")
        now = time.time()
        with self._transaction() as db:
            found = db.execute(f"SELECT owner, lease_expires_at_unix FROM {table} "
                               f"WHERE {column} = ?", (key,)).fetchone()
            if found is None:
                return False
            lapsed = (found["lease_expires_at_unix"] or 0) < now
            if found["owner"] not in (None, self.writer) and not lapsed:
                return False
            db.execute(f"UPDATE {table} SET owner = ?, epoch = epoch + 1, "
                       f"version = version + 1, lease_expires_at_unix = ? WHERE {column} = ?",
                       (self.writer, now + self.lease_seconds, key))
            return True

    def take_over_lapsed(self, kind: str) -> list[str]:
        table, column = _OWNED_TABLES[kind]
        if self.writer is None:
            raise InvalidArgument("only a daemon (act_as) takes rows over")
        now = time.time()
        with self._transaction() as db:
            keys = [r[column] for r in db.execute(
                f"SELECT {column} FROM {table} WHERE owner IS NOT NULL AND owner <> ? "
                "AND lease_expires_at_unix < ?", (self.writer, now))]
            for key in keys:
                db.execute(f"UPDATE {table} SET owner = ?, epoch = epoch + 1, "
                           f"version = version + 1, lease_expires_at_unix = ? "
                           f"WHERE {column} = ?", (self.writer, now + self.lease_seconds, key))
        return keys

    # -- sandboxes -----------------------------------------------------------------------
    def put_sandbox(self, row: SandboxRow, *events: tuple[str, str]) -> None:
        with self._transaction() as db:
            self._put_owned(db, _PUT_SANDBOX, "sandboxes", "id", row, self._sandbox_values(row))
            for event in events:
                db.execute(_LOG_EVENT, (time.time(), row.id, *event))

    def put_sandboxes(self, rows: Sequence[SandboxRow]) -> None:
        # One transaction: one fsync for all of them.
        with self._transaction() as db:
            for row in rows:
                self._put_owned(db, _PUT_SANDBOX, "sandboxes", "id", row,
                                self._sandbox_values(row))

    def set_sandbox_deadline(self, sandbox_id: str, deadline_unix: float | None) -> None:
        with self._transaction() as db:
            if db.execute("SELECT 1 FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone():
                self._fence(db, "sandboxes", "id", sandbox_id, None)
                db.execute("UPDATE sandboxes SET deadline_unix = ?, version = version + 1 "
                           "WHERE id = ?", (deadline_unix, sandbox_id))

    @staticmethod
    def _sandbox(r: sqlite3.Row) -> SandboxRow:
        return SandboxRow(
            id=r["id"], provider=r["provider"], state=r["state"], reason=r["reason"],
            workspace=r["workspace"], spec=json.loads(r["spec"]),
            description=json.loads(r["description"]), created_at_unix=r["created_at_unix"],
            updated_at_unix=r["updated_at_unix"], deadline_unix=r["deadline_unix"],
            last_active_unix=r["last_active_unix"], meter=json.loads(r["meter"] or "{}"),
            base_snapshot_id=r["base_snapshot_id"],
            origin_snapshot_id=r["origin_snapshot_id"],
            **{c: r[c] for c in OWNED_COLUMNS},
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
                FINAL_VALUES,
            )
        return [self._sandbox(r) for r in rows]

    def delete_sandbox(self, sandbox_id: str) -> None:
        self._delete_owned("sandboxes", "id", sandbox_id)

    def prune_ended(self, ended_before_unix: float) -> list[str]:
        with self._transaction() as db:
            ids = [r["id"] for r in db.execute(
                "SELECT id FROM sandboxes WHERE state IN (?, ?) AND updated_at_unix < ?",
                (*FINAL_VALUES, ended_before_unix),
            )]
            for sandbox_id in ids:
                db.execute("DELETE FROM events WHERE subject = ?", (sandbox_id,))
                # A ref that follows a workspace outlives the sandbox it was made for.
                db.execute(
                    "DELETE FROM refs WHERE sandbox_id = ? AND (workspace IS NULL OR "
                    "workspace NOT IN (SELECT name FROM workspaces))", (sandbox_id,),
                )
                db.execute("DELETE FROM sandboxes WHERE id = ?", (sandbox_id,))
        return ids

    # -- workspaces --------------------------------------------------------------------
    def put_workspace(self, row: WorkspaceRow) -> None:
        with self._transaction() as db:
            self._put_owned(db, _PUT_WORKSPACE, "workspaces", "name", row, (
            row.name, row.status, row.provider, json.dumps(row.spec), row.live_sandbox_id,
            row.state_snapshot_id, row.source_snapshot_id, row.created_at_unix,
            row.last_active_unix,
            ))

    @staticmethod
    def _workspace(r: sqlite3.Row) -> WorkspaceRow:
        values = {name: r[name] for name in (*_WORKSPACE_COLUMNS, *OWNED_COLUMNS)}
        values["spec"] = json.loads(values["spec"])
        return WorkspaceRow(**values)

    def get_workspace(self, name: str) -> WorkspaceRow | None:
        rows = self._read("SELECT * FROM workspaces WHERE name = ?", (name,))
        return self._workspace(rows[0]) if rows else None

    def list_workspaces(self) -> list[WorkspaceRow]:
        return [self._workspace(r) for r in self._read("SELECT * FROM workspaces ORDER BY name")]

    def delete_workspace(self, name: str) -> None:
        self._delete_owned("workspaces", "name", name)

    # -- snapshots ---------------------------------------------------------------------
    def put_snapshot(self, row: SnapshotRow) -> None:
        with self._transaction() as db:
            self._put_owned(db, _PUT_SNAPSHOT, "snapshots", "id", row, (
                row.id, row.provider, row.status, row.label, row.sandbox_id, row.parent_id,
                row.size_bytes, row.created_at_unix, json.dumps(row.handle),
                json.dumps(row.spec),
            ))

    @staticmethod
    def _snapshot(r: sqlite3.Row) -> SnapshotRow:
        values = {name: r[name] for name in (*_SNAPSHOT_COLUMNS, *OWNED_COLUMNS)}
        values["handle"] = json.loads(values["handle"])
        values["spec"] = json.loads(values["spec"])
        return SnapshotRow(**values)

    def get_snapshot(self, snapshot_id: str) -> SnapshotRow | None:
        rows = self._read("SELECT * FROM snapshots WHERE id = ?", (snapshot_id,))
        return self._snapshot(rows[0]) if rows else None

    def list_snapshots(self) -> list[SnapshotRow]:
        rows = self._read("SELECT * FROM snapshots ORDER BY created_at_unix, id")
        return [self._snapshot(r) for r in rows]

    def delete_snapshot(self, snapshot_id: str) -> None:
        self._delete_owned("snapshots", "id", snapshot_id)

    # -- events and meta -------------------------------------------------------------------
    def log_event(self, subject: str, kind: str, message: str) -> None:
        self._write(_LOG_EVENT, (time.time(), subject, kind, message))

    def events(self, subject: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        if subject is None:
            rows = self._read("SELECT * FROM events ORDER BY seq DESC LIMIT ?", (limit,))
        else:
            rows = self._read(
                "SELECT * FROM events WHERE subject = ? ORDER BY seq DESC LIMIT ?",
                (subject, limit),
            )
        return [dict(r) for r in reversed(rows)]

    def get_meta(self, key: str) -> str | None:
        rows = self._read("SELECT value FROM meta WHERE key = ?", (key,))
        return str(rows[0]["value"]) if rows else None

    def set_meta(self, key: str, value: str | None) -> None:
        if value is None:
            self._write("DELETE FROM meta WHERE key = ?", (key,))
        else:
            self._write("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- refs --------------------------------------------------------------------------
    def put_ref(self, row: RefRow) -> None:
        self._write(
            f"INSERT OR REPLACE INTO refs ({', '.join(_REF_COLUMNS)}) "
            f"VALUES ({', '.join('?' for _ in _REF_COLUMNS)})",
            tuple(getattr(row, name) for name in _REF_COLUMNS),
        )

    def get_ref(self, ref_id: str) -> RefRow | None:
        rows = self._read("SELECT * FROM refs WHERE id = ?", (ref_id,))
        return RefRow(**{k: rows[0][k] for k in _REF_COLUMNS}) if rows else None

    def list_refs(self, sandbox_id: str, workspace: str | None = None) -> list[RefRow]:
        rows = self._read(
            "SELECT * FROM refs WHERE sandbox_id = ? OR (? IS NOT NULL AND workspace = ?) "
            "ORDER BY created_at_unix", (sandbox_id, workspace, workspace),
        )
        return [RefRow(**{k: r[k] for k in _REF_COLUMNS}) for r in rows]

    # -- definitions and their instances ------------------------------------------------
    def put_definition(self, row: DefinitionRow) -> None:
        self._write(
            "INSERT OR REPLACE INTO definitions (id, body, updated_at_unix) VALUES (?, ?, ?)",
            (row.id, json.dumps(row.body), row.updated_at_unix),
        )

    def list_definitions(self) -> list[DefinitionRow]:
        rows = self._read("SELECT * FROM definitions ORDER BY id")
        return [DefinitionRow(r["id"], json.loads(r["body"]), r["updated_at_unix"]) for r in rows]

    def put_instance(self, row: InstanceRow) -> None:
        values = tuple(
            json.dumps(v) if name in ("description", "spec") else v
            for name, v in ((n, getattr(row, n)) for n in _INSTANCE_COLUMNS)
        )
        self._write(
            f"INSERT OR REPLACE INTO instances ({', '.join(_INSTANCE_COLUMNS)}) "
            f"VALUES ({', '.join('?' for _ in _INSTANCE_COLUMNS)})",
            values,
        )

    def get_instance(self, key: str) -> InstanceRow | None:
        rows = self._read("SELECT * FROM instances WHERE key = ?", (key,))
        return _instance(rows[0]) if rows else None

    def changes_by_others(self) -> int | None:
        if not self._lock.acquire(blocking=False):
            return None
        try:
            # SQLite's own counter of other connections' commits (shared memory).
            return int(self._db.execute("PRAGMA data_version").fetchone()[0])
        finally:
            self._lock.release()

    def instance_of_sandbox(self, sandbox_id: str) -> InstanceRow | None:
        rows = self._read("SELECT * FROM instances WHERE sandbox_id = ? ORDER BY key",
                          (sandbox_id,))
        return _instance(rows[0]) if rows else None

    def note_instance_activity(self, sandbox_id: str, at_unix: float) -> None:
        self._write(
            "UPDATE instances SET last_active_unix = MAX(COALESCE(last_active_unix, 0), ?) "
            "WHERE sandbox_id = ?",
            (at_unix, sandbox_id),
        )

    def set_instance_deadline(self, sandbox_id: str, deadline_unix: float) -> None:
        self._write("UPDATE instances SET deadline_unix = ? WHERE sandbox_id = ?",
                    (deadline_unix, sandbox_id))

    def delete_instance(self, key: str) -> None:
        with self._transaction() as db:
            db.execute("DELETE FROM instances WHERE key = ?", (key,))
            db.execute("DELETE FROM instance_holders WHERE key = ?", (key,))

    def hold_instance(self, key: str, holder: str) -> None:
        self._write(
            "INSERT OR REPLACE INTO instance_holders (key, holder, since_unix) VALUES (?, ?, ?)",
            (key, holder, time.time()),
        )

    def release_instance(self, key: str, holder: str) -> None:
        self._write("DELETE FROM instance_holders WHERE key = ? AND holder = ?", (key, holder))

    def instance_holders(self, key: str) -> list[str]:
        rows = self._read(
            "SELECT holder FROM instance_holders WHERE key = ? ORDER BY since_unix", (key,)
        )
        return [r["holder"] for r in rows]

    def claim_instance(
        self, key: str, sandbox_id: str, holder: str, *,
        was: Mapping[str, Any], alive: Callable[[str], bool],
    ) -> bool:
        with self._transaction() as db:  # BEGIN IMMEDIATE: one program decides
            rows = list(db.execute(
                "SELECT sandbox_id, description FROM instances WHERE key = ?", (key,)))
            if not rows or rows[0]["sandbox_id"] != sandbox_id \
                    or json.loads(rows[0]["description"]) != dict(was):
                return False
            others = [r["holder"] for r in db.execute(
                "SELECT holder FROM instance_holders WHERE key = ? AND holder != ?",
                (key, holder))]
            if any(alive(other) for other in others):
                return False
            db.execute("DELETE FROM instance_holders WHERE key = ?", (key,))
            db.execute(
                "INSERT INTO instance_holders (key, holder, since_unix) VALUES (?, ?, ?)",
                (key, holder, time.time()),
            )
            return True

    def local_dir(self, name: str) -> str:
        return f"{os.path.abspath(self.path)}-{name}"

    def instance_sandbox_ids(self) -> set[str]:
        rows = self._read("SELECT sandbox_id FROM instances WHERE sandbox_id IS NOT NULL")
        return {r["sandbox_id"] for r in rows}

    def record_instance_sandbox(
        self,
        sandbox_id: str,
        state: str,
        description: Mapping[str, Any],
        *,
        was: tuple[str, Mapping[str, Any]] | None = None,
        reason: str | None = None,
    ) -> bool:
        written = False
        with self._transaction() as db:  # BEGIN IMMEDIATE: compare and set, atomically
            rows = list(db.execute(
                "SELECT key, state, description FROM instances WHERE sandbox_id = ?",
                (sandbox_id,),
            ))
            for r in rows:
                if was is not None and (
                    r["state"] != was[0] or json.loads(r["description"]) != was[1]
                ):
                    continue
                db.execute(
                    "UPDATE instances SET state = ?, description = ?, updated_at_unix = ?, "
                    "reason = ? WHERE key = ?",
                    (state, json.dumps(dict(description)), time.time(), reason, r["key"]),
                )
                written = True
        return written

    def take_lease(self, name: str, holder: str, seconds: float) -> bool:
        now = time.time()
        with self._transaction() as db:  # BEGIN IMMEDIATE: one writer decides
            rows = list(db.execute("SELECT holder, expires_at_unix FROM leases WHERE name = ?",
                                   (name,)))
            if rows and rows[0]["holder"] != holder and rows[0]["expires_at_unix"] > now \
                    and holder_alive(rows[0]["holder"]):
                return False
            db.execute(
                "INSERT OR REPLACE INTO leases (name, holder, expires_at_unix) VALUES (?, ?, ?)",
                (name, holder, now + seconds),
            )
            return True

    def lease_holder(self, name: str) -> str | None:
        rows = self._read("SELECT holder FROM leases WHERE name = ?", (name,))
        return str(rows[0]["holder"]) if rows else None

    def release_lease(self, name: str, holder: str) -> None:
        self._write("DELETE FROM leases WHERE name = ? AND holder = ?", (name, holder))


def _instance(r: sqlite3.Row) -> InstanceRow:
    return InstanceRow(**{
        n: json.loads(r[n]) if n in ("description", "spec") else r[n]
        for n in _INSTANCE_COLUMNS
    })
