"""The shared store: PostgreSQL, for one daemon or several.

The same rows as the embedded SQLite store (:mod:`.sqlite`), through a
psycopg 3 connection pool. Every write is one transaction, committed before
it returns; the ones that decide between programs (claims, leases, compare
and set) lock the rows they read (``SELECT ... FOR UPDATE``). Leases expire
by the database's clock, never a daemon's, so daemons on several hosts
agree on when one has lapsed.

The schema is a numbered list of migrations, applied in one transaction
under an advisory lock: daemons starting at once against a new database
migrate it once, and the others wait for that and find it done.

Change notices: every write to a shared table notifies the channel
``hutch_changes`` with the writing connection's ``application_name`` (one
per store object); a listening connection counts the notices that came from
another store, which is :meth:`changes_by_others` (within a second of the
commit, without a query).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import ConnectionPool

from .._errors import InvalidArgument, StoreUnavailable
from ..states import FINAL_VALUES
from .base import (
    OWNED_COLUMNS,
    DaemonRow,
    DefinitionRow,
    InstanceRow,
    OwnershipLost,
    RefRow,
    SandboxRow,
    SnapshotRow,
    Store,
    WorkspaceRow,
    check_fence,
    holder_alive,
)

__all__ = ["MIGRATIONS", "PostgresStore", "probe"]

Row = dict[str, Any]

#: The schema, one step a number; a step once released never changes (a new
#: one is added instead). Applied in order by :meth:`PostgresStore._migrate`.
MIGRATIONS: tuple[tuple[int, str], ...] = (
    (1, """
CREATE TABLE sandboxes (
    id TEXT PRIMARY KEY,
    provider TEXT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT,
    workspace TEXT,
    spec JSONB NOT NULL,
    description JSONB NOT NULL,
    created_at_unix DOUBLE PRECISION NOT NULL,
    updated_at_unix DOUBLE PRECISION NOT NULL,
    deadline_unix DOUBLE PRECISION,
    last_active_unix DOUBLE PRECISION,
    meter JSONB NOT NULL DEFAULT '{}',
    base_snapshot_id TEXT,
    origin_snapshot_id TEXT
);
CREATE TABLE workspaces (
    name TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    provider TEXT NOT NULL,
    spec JSONB NOT NULL,
    live_sandbox_id TEXT,
    state_snapshot_id TEXT,
    source_snapshot_id TEXT,
    created_at_unix DOUBLE PRECISION NOT NULL,
    last_active_unix DOUBLE PRECISION NOT NULL
);
CREATE TABLE snapshots (
    id TEXT PRIMARY KEY,
    provider TEXT NOT NULL,
    status TEXT NOT NULL,
    label TEXT,
    sandbox_id TEXT,
    parent_id TEXT,
    size_bytes BIGINT NOT NULL DEFAULT 0,
    created_at_unix DOUBLE PRECISION NOT NULL,
    handle JSONB NOT NULL DEFAULT '{}',
    spec JSONB NOT NULL DEFAULT '{}'
);
CREATE INDEX snapshots_parent ON snapshots(parent_id);
CREATE TABLE events (
    seq BIGSERIAL PRIMARY KEY,
    at_unix DOUBLE PRECISION NOT NULL,
    subject TEXT NOT NULL,
    kind TEXT NOT NULL,
    message TEXT NOT NULL
);
CREATE INDEX events_subject ON events(subject, seq);
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE refs (
    id TEXT PRIMARY KEY,
    sandbox_id TEXT NOT NULL,
    secret_sha256 TEXT NOT NULL,
    created_at_unix DOUBLE PRECISION NOT NULL,
    expires_at_unix DOUBLE PRECISION,
    revoked_at_unix DOUBLE PRECISION,
    workspace TEXT
);
CREATE INDEX refs_sandbox ON refs(sandbox_id);
CREATE TABLE definitions (
    id TEXT PRIMARY KEY,
    body JSONB NOT NULL,
    updated_at_unix DOUBLE PRECISION NOT NULL
);
CREATE TABLE instances (
    key TEXT PRIMARY KEY,
    definition_id TEXT NOT NULL,
    thread_id TEXT NOT NULL,
    tenant TEXT,
    provider TEXT NOT NULL,
    sandbox_id TEXT,
    description JSONB NOT NULL DEFAULT '{}',
    spec JSONB NOT NULL DEFAULT '{}',
    updated_at_unix DOUBLE PRECISION NOT NULL,
    state TEXT NOT NULL DEFAULT 'running',
    last_active_unix DOUBLE PRECISION,
    created_at_unix DOUBLE PRECISION,
    deadline_unix DOUBLE PRECISION,
    reason TEXT
);
CREATE INDEX instances_sandbox ON instances(sandbox_id);
CREATE TABLE instance_holders (
    key TEXT NOT NULL,
    holder TEXT NOT NULL,
    since_unix DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (key, holder)
);
CREATE TABLE leases (
    name TEXT PRIMARY KEY,
    holder TEXT NOT NULL,
    expires_at_unix DOUBLE PRECISION NOT NULL
);
"""),
    (2, """
CREATE FUNCTION hutch_notify_change() RETURNS trigger AS $$
BEGIN
    PERFORM pg_notify('hutch_changes', current_setting('application_name'));
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;
""" + "".join(
        f"CREATE TRIGGER {table}_changed AFTER INSERT OR UPDATE OR DELETE ON {table} "
        "FOR EACH STATEMENT EXECUTE FUNCTION hutch_notify_change();\n"
        for table in ("sandboxes", "workspaces", "snapshots", "refs", "definitions",
                      "instances", "instance_holders", "leases")
    )),
    # A fleet: daemons register; every sandbox, workspace and snapshot row
    # has an owner, a lease (the database's clock), an epoch and a version.
    (3, "".join(
        f"ALTER TABLE {table} ADD COLUMN owner TEXT, "
        "ADD COLUMN lease_expires_at_unix DOUBLE PRECISION, "
        "ADD COLUMN epoch BIGINT NOT NULL DEFAULT 0, "
        "ADD COLUMN version BIGINT NOT NULL DEFAULT 0;\n"
        f"CREATE INDEX {table}_owner ON {table}(owner);\n"
        for table in ("sandboxes", "workspaces", "snapshots")
    ) + """
CREATE TABLE daemons (
    id TEXT PRIMARY KEY,
    url TEXT NOT NULL,
    expires_at_unix DOUBLE PRECISION NOT NULL
);
CREATE TRIGGER daemons_changed AFTER INSERT OR UPDATE OR DELETE ON daemons
    FOR EACH STATEMENT EXECUTE FUNCTION hutch_notify_change();
"""),
)

#: The advisory lock migrations run under (any fixed number; "hutch" in ASCII).
_MIGRATION_LOCK = 0x6875746368

_SANDBOX_COLUMNS = (
    "id", "provider", "state", "reason", "workspace", "spec", "description",
    "created_at_unix", "updated_at_unix", "deadline_unix", "last_active_unix", "meter",
    "base_snapshot_id", "origin_snapshot_id",
)
_WORKSPACE_COLUMNS = (
    "name", "status", "provider", "spec", "live_sandbox_id", "state_snapshot_id",
    "source_snapshot_id", "created_at_unix", "last_active_unix",
)
_SNAPSHOT_COLUMNS = (
    "id", "provider", "status", "label", "sandbox_id", "parent_id", "size_bytes",
    "created_at_unix", "handle", "spec",
)
_REF_COLUMNS = (
    "id", "sandbox_id", "secret_sha256", "created_at_unix", "expires_at_unix",
    "revoked_at_unix", "workspace",
)
_INSTANCE_COLUMNS = (
    "key", "definition_id", "thread_id", "tenant", "provider", "sandbox_id", "description",
    "spec", "updated_at_unix", "state", "last_active_unix", "created_at_unix", "deadline_unix",
    "reason",
)
_JSON_COLUMNS = {"spec", "description", "meter", "handle", "body"}


def _upsert(table: str, columns: Sequence[str], key: str) -> str:
    """One statement writing a whole row, inserted or replacing its namesake."""
    updates = ", ".join(f"{c} = EXCLUDED.{c}" for c in columns if c != key)
    return (
        f"INSERT INTO {table} ({', '.join(columns)}) "
        f"VALUES ({', '.join('%s' for _ in columns)}) "
        f"ON CONFLICT ({key}) DO UPDATE SET {updates}"
    )


def _update(table: str, columns: Sequence[str], key: str) -> str:
    """One statement writing a row's columns but its key (the first), its version counted."""
    sets = ", ".join(f"{c} = %s" for c in columns[1:])
    return f"UPDATE {table} SET {sets}, version = version + 1 WHERE {key} = %s"


#: kind -> (table, key column) of the rows daemons own.
_OWNED_TABLES = {"sandbox": ("sandboxes", "id"), "workspace": ("workspaces", "name"),
                 "snapshot": ("snapshots", "id")}
_PUT_REF = _upsert("refs", _REF_COLUMNS, "id")
_PUT_INSTANCE = _upsert("instances", _INSTANCE_COLUMNS, "key")
_LOG_EVENT = "INSERT INTO events (at_unix, subject, kind, message) VALUES (%s, %s, %s, %s)"
_DB_NOW = "EXTRACT(EPOCH FROM clock_timestamp())::double precision"


def _values(row: object, columns: Sequence[str]) -> tuple[Any, ...]:
    return tuple(
        Jsonb(getattr(row, c)) if c in _JSON_COLUMNS else getattr(row, c) for c in columns
    )


class PostgresStore(Store):
    """The store in a PostgreSQL database named by ``conninfo`` (a
    ``postgresql://`` URL or a libpq keyword string). ``local_root`` is the
    directory on this host for what the programs sharing the store here
    keep outside it (:meth:`local_dir`)."""

    shared = True

    def __init__(self, conninfo: str, *, local_root: str, max_connections: int = 8) -> None:
        self.conninfo = conninfo
        self._local_root = os.path.abspath(local_root)
        #: Who this store is in the change notices (its connections' application_name).
        self._origin = f"hutch-{uuid.uuid4().hex[:16]}"
        try:
            self._pool = ConnectionPool(
                conninfo, connection_class=psycopg.Connection[Row], min_size=1,
                max_size=max_connections, open=True, timeout=30,
                kwargs={"autocommit": True, "row_factory": dict_row,
                        "application_name": self._origin},
                name=self._origin,
            )
            self._pool.wait(timeout=30)
        except (psycopg.Error, psycopg_pool_errors()) as exc:
            raise StoreUnavailable(
                f"cannot reach the PostgreSQL store {_masked(conninfo)}: {exc}"
            ) from exc
        self._migrate()
        self._changes = 0
        self._closed = threading.Event()
        self._listener = threading.Thread(target=self._listen, daemon=True,
                                          name=f"{self._origin}-listen")
        self._listening = threading.Event()
        self._listener.start()
        self._listening.wait(10)

    # -- plumbing ----------------------------------------------------------------------
    def _migrate(self) -> None:
        with self._connection() as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            conn.execute("CREATE TABLE IF NOT EXISTS hutch_migrations ("
                         "version INTEGER PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL)")
            done = {r["version"] for r in conn.execute("SELECT version FROM hutch_migrations")}
            for version, sql in MIGRATIONS:
                if version in done:
                    continue
                conn.execute(sql)  # type: ignore[arg-type]  # our own constant SQL
                conn.execute("INSERT INTO hutch_migrations VALUES (%s, clock_timestamp())",
                             (version,))

    def applied_migrations(self) -> list[int]:
        return [r["version"] for r in self._read(
            "SELECT version FROM hutch_migrations ORDER BY version")]

    @contextlib.contextmanager
    def _connection(self) -> Iterator[psycopg.Connection[Row]]:
        try:
            with self._pool.connection() as conn:
                yield conn
        except psycopg.Error as exc:
            raise StoreUnavailable(
                f"the PostgreSQL store {_masked(self.conninfo)} cannot record the change: {exc}"
            ) from exc

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[psycopg.Connection[Row]]:
        with self._connection() as conn, conn.transaction():
            yield conn

    def _write(self, sql: str, params: Sequence[Any]) -> None:
        with self._connection() as conn:
            conn.execute(sql, params)  # type: ignore[arg-type]

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        with self._connection() as conn:
            return conn.execute(sql, params).fetchall()  # type: ignore[arg-type]

    def _listen(self) -> None:
        """Count the change notices other stores' writes send, until closed."""
        while not self._closed.is_set():
            try:
                with psycopg.connect(self.conninfo, autocommit=True) as conn:
                    conn.execute("LISTEN hutch_changes")
                    self._listening.set()
                    while not self._closed.is_set():
                        for notice in conn.notifies(timeout=0.5):
                            if notice.payload != self._origin:
                                self._changes += 1
            except psycopg.Error:
                # Lost the connection: what changed meanwhile is unknown, so
                # say something did, and listen again.
                self._changes += 1
                self._listening.set()
                self._closed.wait(1.0)

    def close(self) -> None:
        self._closed.set()
        self._pool.close()
        self._listener.join(5)

    # -- sandboxes ---------------------------------------------------------------------
    # -- fenced writes of owned rows ---------------------------------------------------
    def _fenced_put(self, conn: psycopg.Connection[Row], table: str, key: str,
                    columns: Sequence[str], row: Any) -> None:
        """Write ``row`` (a sandbox, workspace or snapshot) as a compare and
        set on its owner, epoch and lease: a new row is the writer's; an
        existing one is written only by its owner within its lease, from
        the epoch it read (``check_fence``), its version counted up."""
        values = _values(row, columns)
        ident = getattr(row, key)
        found = conn.execute(
            f"SELECT owner, epoch, version, lease_expires_at_unix, {_DB_NOW} AS now "
            f"FROM {table} WHERE {key} = %s FOR UPDATE", (ident,)).fetchone()
        if self.writer is None:  # unfenced: a program in-process, or a test
            if found is None:
                conn.execute(_upsert(table, (*columns, "version"), key),  # type: ignore[arg-type]
                             (*values, 1))
                row.version = 1
            else:
                conn.execute(_update(table, columns, key), (*values[1:], ident))
                row.version = found["version"] + 1
            return
        if found is None:
            epoch = max(row.epoch, 1)
            inserted = conn.execute(
                f"INSERT INTO {table} ({', '.join((*columns, *OWNED_COLUMNS))}) "
                f"VALUES ({', '.join('%s' for _ in columns)}, %s, {_DB_NOW} + %s, %s, 1) "
                f"ON CONFLICT ({key}) DO NOTHING RETURNING lease_expires_at_unix",
                (*values, self.writer, self.lease_seconds, epoch)).fetchone()
            if inserted is None:
                raise OwnershipLost(f"{table[:-1]} {ident} was made by another daemon at once")
            row.owner, row.epoch, row.version = self.writer, epoch, 1
            row.lease_expires_at_unix = inserted["lease_expires_at_unix"]
            return
        check_fence(f"{table[:-1]} {ident}", self.writer, found, row, found["now"])
        epoch = found["epoch"] or 1
        done = conn.execute(
            f"UPDATE {table} SET {', '.join(f'{c} = %s' for c in columns[1:])}, "
            f"owner = %s, epoch = %s, version = version + 1, "
            f"lease_expires_at_unix = {_DB_NOW} + %s WHERE {key} = %s "
            "RETURNING version, lease_expires_at_unix",
            (*values[1:], self.writer, epoch, self.lease_seconds, ident)).fetchone()
        assert done is not None
        row.owner, row.epoch, row.version = self.writer, epoch, done["version"]
        row.lease_expires_at_unix = done["lease_expires_at_unix"]

    def _fenced_delete(self, table: str, key: str, ident: str) -> None:
        with self._transaction() as conn:
            found = conn.execute(
                f"SELECT owner, epoch, lease_expires_at_unix, {_DB_NOW} AS now "
                f"FROM {table} WHERE {key} = %s FOR UPDATE", (ident,)).fetchone()
            if found is None:
                return
            if self.writer is not None:
                check_fence(f"{table[:-1]} {ident}", self.writer, found, None, found["now"])
            conn.execute(f"DELETE FROM {table} WHERE {key} = %s", (ident,))  # type: ignore[arg-type]

    # -- the fleet ---------------------------------------------------------------------
    def register_daemon(self, daemon_id: str, url: str, seconds: float) -> None:
        with self._transaction() as conn:
            conn.execute(
                "INSERT INTO daemons (id, url, expires_at_unix) "
                f"VALUES (%s, %s, {_DB_NOW} + %s) ON CONFLICT (id) DO UPDATE SET "
                "url = EXCLUDED.url, expires_at_unix = EXCLUDED.expires_at_unix",
                (daemon_id, url, seconds))
            for table in ("sandboxes", "workspaces", "snapshots"):
                conn.execute(
                    f"UPDATE {table} SET lease_expires_at_unix = {_DB_NOW} + %s "  # type: ignore[arg-type]
                    "WHERE owner = %s", (seconds, daemon_id))

    def daemons(self) -> list[DaemonRow]:
        return [DaemonRow(r["id"], r["url"], r["expires_at_unix"], r["alive"])
                for r in self._read(f"SELECT id, url, expires_at_unix, expires_at_unix > "
                                    f"{_DB_NOW} AS alive FROM daemons ORDER BY id")]

    def lapsed_sandboxes(self) -> list[SandboxRow]:
        rows = self._read(
            "SELECT * FROM sandboxes WHERE state <> ALL(%s) AND owner IS NOT NULL "
            f"AND lease_expires_at_unix < {_DB_NOW} ORDER BY created_at_unix, id",
            (list(FINAL_VALUES),))
        return [self._sandbox(r) for r in rows]

    def take_over(self, kind: str, key: str) -> bool:
        table, column = _OWNED_TABLES[kind]
        if self.writer is None:
            raise InvalidArgument("only a daemon (act_as) takes rows over")
        with self._transaction() as conn:
            found = conn.execute(
                f"SELECT owner, lease_expires_at_unix < {_DB_NOW} AS lapsed "
                f"FROM {table} WHERE {column} = %s FOR UPDATE", (key,)).fetchone()
            if found is None:
                return False
            if found["owner"] not in (None, self.writer) and not found["lapsed"]:
                return False
            conn.execute(
                f"UPDATE {table} SET owner = %s, epoch = epoch + 1, version = version + 1, "  # type: ignore[arg-type]
                f"lease_expires_at_unix = {_DB_NOW} + %s WHERE {column} = %s",
                (self.writer, self.lease_seconds, key))
            return True

    def take_over_lapsed(self, kind: str) -> list[str]:
        table, column = _OWNED_TABLES[kind]
        if self.writer is None:
            raise InvalidArgument("only a daemon (act_as) takes rows over")
        return [r[column] for r in self._read_write(
            f"UPDATE {table} SET owner = %s, epoch = epoch + 1, version = version + 1, "
            f"lease_expires_at_unix = {_DB_NOW} + %s WHERE owner IS NOT NULL AND owner <> %s "
            f"AND lease_expires_at_unix < {_DB_NOW} RETURNING {column}",
            (self.writer, self.lease_seconds, self.writer))]

    def _read_write(self, sql: str, params: Sequence[Any]) -> list[Row]:
        with self._transaction() as conn:
            return conn.execute(sql, params).fetchall()  # type: ignore[arg-type]

    # -- sandboxes ---------------------------------------------------------------------
    def put_sandbox(self, row: SandboxRow, *events: tuple[str, str]) -> None:
        row.updated_at_unix = time.time()
        with self._transaction() as conn:
            self._fenced_put(conn, "sandboxes", "id", _SANDBOX_COLUMNS, row)
            for event in events:
                conn.execute(_LOG_EVENT, (time.time(), row.id, *event))

    def put_sandboxes(self, rows: Sequence[SandboxRow]) -> None:
        now = time.time()
        for row in rows:
            row.updated_at_unix = now
        with self._transaction() as conn:
            for row in rows:
                self._fenced_put(conn, "sandboxes", "id", _SANDBOX_COLUMNS, row)

    def set_sandbox_deadline(self, sandbox_id: str, deadline_unix: float | None) -> None:
        with self._transaction() as conn:
            found = conn.execute(
                f"SELECT owner, epoch, lease_expires_at_unix, {_DB_NOW} AS now "
                "FROM sandboxes WHERE id = %s FOR UPDATE", (sandbox_id,)).fetchone()
            if found is None:
                return
            if self.writer is not None:
                check_fence(f"sandbox {sandbox_id}", self.writer, found, None, found["now"])
            conn.execute("UPDATE sandboxes SET deadline_unix = %s, version = version + 1 "
                         "WHERE id = %s", (deadline_unix, sandbox_id))

    @staticmethod
    def _sandbox(r: Row) -> SandboxRow:
        return SandboxRow(**{c: r[c] for c in (*_SANDBOX_COLUMNS, *OWNED_COLUMNS)})

    def get_sandbox(self, sandbox_id: str) -> SandboxRow | None:
        rows = self._read("SELECT * FROM sandboxes WHERE id = %s", (sandbox_id,))
        return self._sandbox(rows[0]) if rows else None

    def list_sandboxes(self, *, include_final: bool = False) -> list[SandboxRow]:
        if include_final:
            rows = self._read("SELECT * FROM sandboxes ORDER BY created_at_unix, id")
        else:
            rows = self._read(
                "SELECT * FROM sandboxes WHERE state <> ALL(%s) ORDER BY created_at_unix, id",
                (list(FINAL_VALUES),),
            )
        return [self._sandbox(r) for r in rows]

    def delete_sandbox(self, sandbox_id: str) -> None:
        self._fenced_delete("sandboxes", "id", sandbox_id)

    def prune_ended(self, ended_before_unix: float) -> list[str]:
        with self._transaction() as conn:
            ids = [r["id"] for r in conn.execute(
                "DELETE FROM sandboxes WHERE state = ANY(%s) AND updated_at_unix < %s "
                "RETURNING id", (list(FINAL_VALUES), ended_before_unix))]
            if ids:
                conn.execute("DELETE FROM events WHERE subject = ANY(%s)", (ids,))
                # A ref that follows a workspace outlives the sandbox it was made for.
                conn.execute(
                    "DELETE FROM refs WHERE sandbox_id = ANY(%s) AND (workspace IS NULL OR "
                    "workspace NOT IN (SELECT name FROM workspaces))", (ids,))
        return ids

    # -- workspaces --------------------------------------------------------------------
    def put_workspace(self, row: WorkspaceRow) -> None:
        with self._transaction() as conn:
            self._fenced_put(conn, "workspaces", "name", _WORKSPACE_COLUMNS, row)

    def get_workspace(self, name: str) -> WorkspaceRow | None:
        rows = self._read("SELECT * FROM workspaces WHERE name = %s", (name,))
        return _workspace(rows[0]) if rows else None

    def list_workspaces(self) -> list[WorkspaceRow]:
        return [_workspace(r)
                for r in self._read("SELECT * FROM workspaces ORDER BY name")]

    def delete_workspace(self, name: str) -> None:
        self._fenced_delete("workspaces", "name", name)

    # -- snapshots ---------------------------------------------------------------------
    def put_snapshot(self, row: SnapshotRow) -> None:
        with self._transaction() as conn:
            self._fenced_put(conn, "snapshots", "id", _SNAPSHOT_COLUMNS, row)

    def get_snapshot(self, snapshot_id: str) -> SnapshotRow | None:
        rows = self._read("SELECT * FROM snapshots WHERE id = %s", (snapshot_id,))
        return _snapshot(rows[0]) if rows else None

    def list_snapshots(self) -> list[SnapshotRow]:
        return [_snapshot(r)
                for r in self._read("SELECT * FROM snapshots ORDER BY created_at_unix, id")]

    def delete_snapshot(self, snapshot_id: str) -> None:
        self._fenced_delete("snapshots", "id", snapshot_id)

    # -- events and meta ---------------------------------------------------------------
    def log_event(self, subject: str, kind: str, message: str) -> None:
        self._write(_LOG_EVENT, (time.time(), subject, kind, message))

    def events(self, subject: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        if subject is None:
            rows = self._read("SELECT * FROM events ORDER BY seq DESC LIMIT %s", (limit,))
        else:
            rows = self._read(
                "SELECT * FROM events WHERE subject = %s ORDER BY seq DESC LIMIT %s",
                (subject, limit))
        return [dict(r) for r in reversed(rows)]

    def get_meta(self, key: str) -> str | None:
        rows = self._read("SELECT value FROM meta WHERE key = %s", (key,))
        return str(rows[0]["value"]) if rows else None

    def set_meta(self, key: str, value: str | None) -> None:
        if value is None:
            self._write("DELETE FROM meta WHERE key = %s", (key,))
        else:
            self._write("INSERT INTO meta (key, value) VALUES (%s, %s) "
                        "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value", (key, value))

    # -- refs --------------------------------------------------------------------------
    def put_ref(self, row: RefRow) -> None:
        self._write(_PUT_REF, _values(row, _REF_COLUMNS))

    def get_ref(self, ref_id: str) -> RefRow | None:
        rows = self._read("SELECT * FROM refs WHERE id = %s", (ref_id,))
        return RefRow(**{c: rows[0][c] for c in _REF_COLUMNS}) if rows else None

    def list_refs(self, sandbox_id: str, workspace: str | None = None) -> list[RefRow]:
        rows = self._read(
            "SELECT * FROM refs WHERE sandbox_id = %s OR (%s::text IS NOT NULL AND "
            "workspace = %s) ORDER BY created_at_unix, id", (sandbox_id, workspace, workspace))
        return [RefRow(**{c: r[c] for c in _REF_COLUMNS}) for r in rows]

    # -- definitions and their instances -----------------------------------------------
    def put_definition(self, row: DefinitionRow) -> None:
        self._write(
            "INSERT INTO definitions (id, body, updated_at_unix) VALUES (%s, %s, %s) "
            "ON CONFLICT (id) DO UPDATE SET body = EXCLUDED.body, "
            "updated_at_unix = EXCLUDED.updated_at_unix",
            (row.id, Jsonb(row.body), row.updated_at_unix))

    def list_definitions(self) -> list[DefinitionRow]:
        return [DefinitionRow(r["id"], r["body"], r["updated_at_unix"])
                for r in self._read("SELECT * FROM definitions ORDER BY id")]

    def put_instance(self, row: InstanceRow) -> None:
        self._write(_PUT_INSTANCE, _values(row, _INSTANCE_COLUMNS))

    def get_instance(self, key: str) -> InstanceRow | None:
        rows = self._read("SELECT * FROM instances WHERE key = %s", (key,))
        return _instance(rows[0]) if rows else None

    def delete_instance(self, key: str) -> None:
        with self._transaction() as conn:
            conn.execute("DELETE FROM instances WHERE key = %s", (key,))
            conn.execute("DELETE FROM instance_holders WHERE key = %s", (key,))

    def hold_instance(self, key: str, holder: str) -> None:
        self._write(
            "INSERT INTO instance_holders (key, holder, since_unix) VALUES (%s, %s, %s) "
            "ON CONFLICT (key, holder) DO UPDATE SET since_unix = EXCLUDED.since_unix",
            (key, holder, time.time()))

    def release_instance(self, key: str, holder: str) -> None:
        self._write("DELETE FROM instance_holders WHERE key = %s AND holder = %s",
                    (key, holder))

    def instance_holders(self, key: str) -> list[str]:
        rows = self._read("SELECT holder FROM instance_holders WHERE key = %s "
                          "ORDER BY since_unix, holder", (key,))
        return [r["holder"] for r in rows]

    def claim_instance(
        self, key: str, sandbox_id: str, holder: str, *,
        was: Mapping[str, Any], alive: Callable[[str], bool],
    ) -> bool:
        with self._transaction() as conn:
            # The row locked: one program at a time decides for this key.
            rows = conn.execute(
                "SELECT sandbox_id, description FROM instances WHERE key = %s FOR UPDATE",
                (key,)).fetchall()
            if not rows or rows[0]["sandbox_id"] != sandbox_id \
                    or rows[0]["description"] != dict(was):
                return False
            others = [r["holder"] for r in conn.execute(
                "SELECT holder FROM instance_holders WHERE key = %s AND holder <> %s",
                (key, holder))]
            if any(alive(other) for other in others):
                return False
            conn.execute("DELETE FROM instance_holders WHERE key = %s", (key,))
            conn.execute("INSERT INTO instance_holders (key, holder, since_unix) "
                         "VALUES (%s, %s, %s)", (key, holder, time.time()))
            return True

    def local_dir(self, name: str) -> str:
        return os.path.join(self._local_root, name)

    def instance_sandbox_ids(self) -> set[str]:
        rows = self._read("SELECT sandbox_id FROM instances WHERE sandbox_id IS NOT NULL")
        return {r["sandbox_id"] for r in rows}

    def changes_by_others(self) -> int | None:
        return self._changes

    def instance_of_sandbox(self, sandbox_id: str) -> InstanceRow | None:
        rows = self._read("SELECT * FROM instances WHERE sandbox_id = %s ORDER BY key LIMIT 1",
                          (sandbox_id,))
        return _instance(rows[0]) if rows else None

    def note_instance_activity(self, sandbox_id: str, at_unix: float) -> None:
        self._write(
            "UPDATE instances SET last_active_unix = GREATEST(COALESCE(last_active_unix, 0), "
            "%s) WHERE sandbox_id = %s", (at_unix, sandbox_id))

    def set_instance_deadline(self, sandbox_id: str, deadline_unix: float) -> None:
        self._write("UPDATE instances SET deadline_unix = %s WHERE sandbox_id = %s",
                    (deadline_unix, sandbox_id))

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
        with self._transaction() as conn:  # compare and set, the rows locked
            rows = conn.execute(
                "SELECT key, state, description FROM instances WHERE sandbox_id = %s "
                "FOR UPDATE", (sandbox_id,)).fetchall()
            for r in rows:
                if was is not None and (r["state"] != was[0] or r["description"] != dict(was[1])):
                    continue
                conn.execute(
                    "UPDATE instances SET state = %s, description = %s, updated_at_unix = %s, "
                    "reason = %s WHERE key = %s",
                    (state, Jsonb(dict(description)), time.time(), reason, r["key"]))
                written = True
        return written

    # -- leases (the database's clock) ---------------------------------------------------
    def take_lease(self, name: str, holder: str, seconds: float) -> bool:
        with self._transaction() as conn:
            # A row to lock even for a lease never taken, so two takers queue.
            conn.execute("INSERT INTO leases (name, holder, expires_at_unix) "
                         "VALUES (%s, %s, 0) ON CONFLICT (name) DO NOTHING", (name, holder))
            row = conn.execute(
                f"SELECT holder, expires_at_unix, {_DB_NOW} AS now FROM leases "
                "WHERE name = %s FOR UPDATE", (name,)).fetchone()
            assert row is not None
            if row["holder"] != holder and row["expires_at_unix"] > row["now"] \
                    and holder_alive(row["holder"]):
                return False
            conn.execute(f"UPDATE leases SET holder = %s, expires_at_unix = {_DB_NOW} + %s "
                         "WHERE name = %s", (holder, seconds, name))
            return True

    def lease_holder(self, name: str) -> str | None:
        rows = self._read("SELECT holder, expires_at_unix FROM leases WHERE name = %s", (name,))
        if not rows or rows[0]["expires_at_unix"] == 0:
            return None  # only the row a first taker made to lock
        return str(rows[0]["holder"])

    def release_lease(self, name: str, holder: str) -> None:
        self._write("DELETE FROM leases WHERE name = %s AND holder = %s", (name, holder))


def probe(conninfo: str) -> None:
    """One connection to ``conninfo``, closed at once; StoreUnavailable if none."""
    try:
        psycopg.connect(conninfo, connect_timeout=10).close()
    except psycopg.Error as exc:
        raise StoreUnavailable(
            f"cannot reach the PostgreSQL store {_masked(conninfo)}: {str(exc).strip()}"
        ) from None


def _workspace(r: Row) -> WorkspaceRow:
    return WorkspaceRow(**{c: r[c] for c in (*_WORKSPACE_COLUMNS, *OWNED_COLUMNS)})


def _snapshot(r: Row) -> SnapshotRow:
    return SnapshotRow(**{c: r[c] for c in (*_SNAPSHOT_COLUMNS, *OWNED_COLUMNS)})


def _instance(r: Row) -> InstanceRow:
    return InstanceRow(**{c: r[c] for c in _INSTANCE_COLUMNS})


def _masked(conninfo: str) -> str:
    """The connection string without its password, for messages."""
    try:
        params = psycopg.conninfo.conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError:
        raise InvalidArgument("the store is not a PostgreSQL connection string") from None
    if "password" in params:
        params["password"] = "***"
    return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in params.items()})


def psycopg_pool_errors() -> type[Exception]:
    from psycopg_pool import PoolTimeout

    return PoolTimeout
