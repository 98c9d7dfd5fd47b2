"""The store's SQL, written once for both databases.

:class:`SQLStore` holds every query and row mapping; a database joins by
saying how it differs, in a few small members:

- how a statement runs (:meth:`SQLStore._transaction`, :meth:`SQLStore._read`):
  SQL is written with ``?`` placeholders, each store's connection passes it
  on in its own style;
- the clock (:attr:`SQLStore.now_sql`): the time leases are taken and judged by;
- row locking (:attr:`SQLStore.for_update`): what a read that decides a write
  adds to hold the row until the transaction ends (:attr:`SQLStore.skip_locked`
  where a row another transaction holds is left for a later look);
- JSON (:meth:`SQLStore.json_in`, :meth:`SQLStore.json_out`) and the larger
  of two values (:attr:`SQLStore.greatest`).

The upsert (``INSERT ... ON CONFLICT ... DO UPDATE``) and ``RETURNING`` are the
same in both (SQLite 3.35 and later).
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar, Protocol

from .._errors import InvalidArgument
from ..states import FINAL_VALUES, SandboxState
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
    WriteConflict,
    check_fence,
    holder_alive,
)

#: A row as a database gives it: its columns by name.
Row = Mapping[str, Any]


class Executor(Protocol):
    """A connection within a transaction: runs one statement (``?`` placeholders)."""

    def execute(self, sql: str, params: Sequence[Any] = ..., /) -> Any: ...


SANDBOX_COLUMNS = (
    "id", "provider", "state", "reason", "workspace", "spec", "description",
    "created_at_unix", "updated_at_unix", "deadline_unix", "last_active_unix", "meter",
    "base_snapshot_id", "origin_snapshot_id",
)
WORKSPACE_COLUMNS = (
    "name", "status", "provider", "spec", "live_sandbox_id", "state_snapshot_id",
    "source_snapshot_id", "created_at_unix", "last_active_unix",
)
SNAPSHOT_COLUMNS = (
    "id", "provider", "status", "label", "sandbox_id", "parent_id", "size_bytes",
    "created_at_unix", "handle", "spec",
)
REF_COLUMNS = (
    "id", "sandbox_id", "secret_sha256", "created_at_unix", "expires_at_unix",
    "revoked_at_unix", "workspace",
)
INSTANCE_COLUMNS = (
    "key", "definition_id", "thread_id", "tenant", "provider", "sandbox_id", "description",
    "spec", "updated_at_unix", "state", "last_active_unix", "created_at_unix", "deadline_unix",
    "reason",
)
#: The columns that hold JSON (TEXT in SQLite, JSONB in PostgreSQL).
JSON_COLUMNS = frozenset({"spec", "description", "meter", "handle", "body"})
#: kind -> (table, key column) of the rows daemons own.
OWNED_TABLES = {"sandbox": ("sandboxes", "id"), "workspace": ("workspaces", "name"),
                "snapshot": ("snapshots", "id")}
#: table -> what one of its rows is called in an error ("sandbox sb-1").
_ROW_NOUN = {table: kind for kind, (table, _key) in OWNED_TABLES.items()}


def _row_named(table: str, ident: object) -> str:
    return f"{_ROW_NOUN[table]} {ident}"


_LOG_EVENT = "INSERT INTO events (at_unix, subject, kind, message) VALUES (?, ?, ?, ?)"
_FINAL_IN = f"({', '.join('?' for _ in FINAL_VALUES)})"


def marks(columns: Sequence[str]) -> str:
    return ", ".join("?" for _ in columns)


def upsert(table: str, columns: Sequence[str], key: str) -> str:
    """One statement writing a whole row, inserted or replacing its namesake."""
    updates = ", ".join(f"{c} = EXCLUDED.{c}" for c in columns if c not in key.split(", "))
    return (f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks(columns)}) "
            f"ON CONFLICT ({key}) DO UPDATE SET {updates}")


class SQLStore(Store):
    """Every query of the store, over a database told by the members below."""

    #: The store's clock in SQL (Unix seconds): leases are taken and judged by it.
    now_sql: ClassVar[str]
    #: What a read that decides a write adds to lock its rows ("" where the
    #: transaction itself holds the database, as SQLite's ``BEGIN IMMEDIATE``).
    for_update: ClassVar[str] = ""
    #: As :attr:`for_update`, for a takeover's reads: a row another
    #: transaction holds now is passed over (taken on a later look), not
    #: waited on. That holder may be its owner, stalled in the middle of its
    #: heartbeat: a takeover waiting on it would keep the fleet from the
    #: row, and the taker's own heartbeat with it, until the owner woke.
    skip_locked: ClassVar[str] = ""
    #: The SQL function giving the larger of two values.
    greatest: ClassVar[str] = "MAX"

    @abc.abstractmethod
    def _transaction(self) -> AbstractContextManager[Executor]:
        """One durable transaction, committed as the block ends, rolled back
        whole (and raised as ``StoreUnavailable``) if any of it fails."""

    @abc.abstractmethod
    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """The rows one query reads."""

    def _lease_transaction(self) -> AbstractContextManager[Executor]:
        """The transaction of a lease's change: :meth:`_transaction`, unless
        a database may keep it less durably (a database whose loss of it
        ends every holder too: SQLite's, of one host's processes). A fleet's
        daemons outlive their PostgreSQL server's crash, so theirs are
        durable: a lease lost with it would let two of them act at once."""
        return self._transaction()

    def _lease_write(self, sql: str, params: Sequence[Any]) -> None:
        """One statement changing a lease, as durably as :meth:`_lease_transaction`."""
        self._write(sql, params)

    @staticmethod
    def json_in(value: Any) -> Any:
        """A JSON value as a statement's parameter."""
        return value

    @staticmethod
    def json_out(value: Any) -> Any:
        """A JSON column's value as a Python one."""
        return value

    # -- plumbing ----------------------------------------------------------------------
    def _write(self, sql: str, params: Sequence[Any]) -> None:
        with self._transaction() as db:
            db.execute(sql, params)

    def _read_write(self, sql: str, params: Sequence[Any]) -> list[Row]:
        with self._transaction() as db:
            return list(db.execute(sql, params).fetchall())

    def _values(self, row: object, columns: Sequence[str]) -> tuple[Any, ...]:
        return tuple(self.json_in(getattr(row, c)) if c in JSON_COLUMNS else getattr(row, c)
                     for c in columns)

    def _fields(self, r: Row, columns: Sequence[str]) -> dict[str, Any]:
        return {c: self.json_out(r[c]) if c in JSON_COLUMNS else r[c] for c in columns}

    def _sandbox(self, r: Row) -> SandboxRow:
        fields = self._fields(r, (*SANDBOX_COLUMNS, *OWNED_COLUMNS))
        fields["meter"] = fields["meter"] or {}
        return SandboxRow(**fields)

    def _workspace(self, r: Row) -> WorkspaceRow:
        return WorkspaceRow(**self._fields(r, (*WORKSPACE_COLUMNS, *OWNED_COLUMNS)))

    def _snapshot(self, r: Row) -> SnapshotRow:
        return SnapshotRow(**self._fields(r, (*SNAPSHOT_COLUMNS, *OWNED_COLUMNS)))

    def _instance(self, r: Row) -> InstanceRow:
        return InstanceRow(**self._fields(r, INSTANCE_COLUMNS))

    # -- fenced writes of owned rows -----------------------------------------------------
    def _fenced_put(self, db: Executor, table: str, key: str, columns: Sequence[str],
                    row: SandboxRow | WorkspaceRow | SnapshotRow) -> None:
        """Write ``row`` (a sandbox, workspace or snapshot) as a compare and
        set, never a whole-row replacement: a new row (``version`` 0) only
        where none is stored; a stored one only from the version the writer
        read (``WriteConflict`` otherwise), and, for a daemon, only by its
        owner within its lease from the epoch it read (``check_fence``:
        ``OwnershipLost``). Its version is counted up, and ``row`` updated
        to what was written."""
        values = self._values(row, columns)
        ident = getattr(row, key)
        what = _row_named(table, ident)
        found = db.execute(
            f"SELECT owner, epoch, version, lease_expires_at_unix, {self.now_sql} AS now "
            f"FROM {table} WHERE {key} = ?{self.for_update}", (ident,)).fetchone()
        if found is None:
            if row.version:
                raise WriteConflict(f"{what} was removed since it was read "
                                    f"(at version {row.version})")
            self._insert(db, table, key, columns, row, values)
            return
        if self.writer is not None:
            check_fence(what, self.writer, found, row, found["now"])
        if not row.version:
            raise WriteConflict(f"{what} exists already (version {found['version']}): "
                                "another writer made it")
        if row.version != found["version"]:
            raise WriteConflict(f"{what} changed since it was read (version {row.version}, "
                                f"now {found['version']}): read it again")
        sets = ", ".join(f"{c} = ?" for c in columns[1:])
        params: tuple[Any, ...] = ()
        if self.writer is None:  # unfenced (a program in-process, a test): owner kept
            owned = ""
        else:
            owned = f", owner = ?, epoch = ?, lease_expires_at_unix = {self.now_sql} + ?"
            params = (self.writer, found["epoch"] or 1, self.lease_seconds)
        done = db.execute(
            f"UPDATE {table} SET {sets}{owned}, version = version + 1 "
            f"WHERE {key} = ? AND version = ? "
            "RETURNING owner, lease_expires_at_unix, epoch, version",
            (*values[1:], *params, ident, row.version)).fetchone()
        if done is None:  # not for a locked row; said rather than assumed
            raise WriteConflict(f"{what} changed while it was written: read it again")
        row.owner, row.lease_expires_at_unix, row.epoch, row.version = (
            done["owner"], done["lease_expires_at_unix"], done["epoch"], done["version"])

    def _insert(self, db: Executor, table: str, key: str, columns: Sequence[str],
                row: SandboxRow | WorkspaceRow | SnapshotRow, values: tuple[Any, ...]) -> None:
        """A new owned row, the writer's (unfenced: as ``row`` says), at version 1."""
        params: tuple[Any, ...]
        if self.writer is None:
            owned, params = "?, ?, ?", (row.owner, row.lease_expires_at_unix, row.epoch)
        else:
            owned = f"?, {self.now_sql} + ?, ?"
            params = (self.writer, self.lease_seconds, max(row.epoch, 1))
        done = db.execute(
            f"INSERT INTO {table} ({', '.join((*columns, *OWNED_COLUMNS))}) "
            f"VALUES ({marks(columns)}, {owned}, 1) ON CONFLICT ({key}) DO NOTHING "
            "RETURNING owner, lease_expires_at_unix, epoch, version",
            (*values, *params)).fetchone()
        if done is None:
            what = _row_named(table, getattr(row, key))
            if self.writer is not None:
                raise OwnershipLost(f"{what} was made by another daemon at once")
            raise WriteConflict(f"{what} was made by another writer at once")
        row.owner, row.lease_expires_at_unix, row.epoch, row.version = (
            done["owner"], done["lease_expires_at_unix"], done["epoch"], done["version"])

    def _fence_only(self, db: Executor, table: str, key: str, ident: str) -> bool:
        """Whether the row is stored; refused (``OwnershipLost``) if the
        writer may not write it (its owner is another, or its lease lapsed)."""
        found = db.execute(
            f"SELECT owner, epoch, lease_expires_at_unix, {self.now_sql} AS now "
            f"FROM {table} WHERE {key} = ?{self.for_update}", (ident,)).fetchone()
        if found is None:
            return False
        if self.writer is not None:
            check_fence(_row_named(table, ident), self.writer, found, None, found["now"])
        return True

    def _fenced_delete(self, table: str, key: str, ident: str) -> None:
        with self._transaction() as db:
            if self._fence_only(db, table, key, ident):
                db.execute(f"DELETE FROM {table} WHERE {key} = ?", (ident,))

    # -- the fleet -----------------------------------------------------------------------
    def register_daemon(self, daemon_id: str, url: str, seconds: float) -> None:
        with self._transaction() as db:
            db.execute("INSERT INTO daemons (id, url, expires_at_unix) "
                       f"VALUES (?, ?, {self.now_sql} + ?) ON CONFLICT (id) DO UPDATE SET "
                       "url = EXCLUDED.url, expires_at_unix = EXCLUDED.expires_at_unix",
                       (daemon_id, url, seconds))
            for table, _ in OWNED_TABLES.values():
                db.execute(f"UPDATE {table} SET lease_expires_at_unix = {self.now_sql} + ? "
                           "WHERE owner = ?", (seconds, daemon_id))

    def daemons(self) -> list[DaemonRow]:
        return [DaemonRow(r["id"], r["url"], r["expires_at_unix"], bool(r["alive"]))
                for r in self._read(f"SELECT id, url, expires_at_unix, expires_at_unix > "
                                    f"{self.now_sql} AS alive FROM daemons ORDER BY id")]

    def lapsed_sandboxes(self) -> list[SandboxRow]:
        rows = self._read(
            f"SELECT * FROM sandboxes WHERE state NOT IN {_FINAL_IN} AND owner IS NOT NULL "
            f"AND lease_expires_at_unix < {self.now_sql} ORDER BY created_at_unix, id",
            FINAL_VALUES)
        return [self._sandbox(r) for r in rows]

    def _taker(self) -> str:
        if self.writer is None:
            raise InvalidArgument("only a daemon (act_as) takes rows over")
        return self.writer

    def take_over(self, kind: str, key: str) -> bool:
        table, column = OWNED_TABLES[kind]
        writer = self._taker()
        with self._transaction() as db:
            found = db.execute(
                f"SELECT owner, COALESCE(lease_expires_at_unix, 0) < {self.now_sql} AS lapsed "
                f"FROM {table} WHERE {column} = ?{self.skip_locked}", (key,)).fetchone()
            if found is None:
                return False  # no such row, or another transaction holds it now
            if found["owner"] not in (None, writer) and not found["lapsed"]:
                return False
            db.execute(f"UPDATE {table} SET owner = ?, epoch = epoch + 1, version = version + 1, "
                       f"lease_expires_at_unix = {self.now_sql} + ? WHERE {column} = ?",
                       (writer, self.lease_seconds, key))
            return True

    def take_over_lapsed(self, kind: str) -> list[str]:
        table, column = OWNED_TABLES[kind]
        writer = self._taker()
        return [r[column] for r in self._read_write(
            f"UPDATE {table} SET owner = ?, epoch = epoch + 1, version = version + 1, "
            f"lease_expires_at_unix = {self.now_sql} + ? WHERE {column} IN ("
            f"SELECT {column} FROM {table} WHERE owner IS NOT NULL AND owner <> ? "
            f"AND lease_expires_at_unix < {self.now_sql}{self.skip_locked}) RETURNING {column}",
            (writer, self.lease_seconds, writer))]

    # -- sandboxes -----------------------------------------------------------------------
    def put_sandbox(self, row: SandboxRow, *events: tuple[str, str]) -> None:
        row.updated_at_unix = time.time()
        with self._transaction() as db:
            self._fenced_put(db, "sandboxes", "id", SANDBOX_COLUMNS, row)
            for event in events:
                db.execute(_LOG_EVENT, (time.time(), row.id, *event))

    def put_sandboxes(self, rows: Sequence[SandboxRow]) -> None:
        now = time.time()
        for row in rows:
            row.updated_at_unix = now
        # One transaction: one commit for all of them.
        with self._transaction() as db:
            for row in rows:
                self._fenced_put(db, "sandboxes", "id", SANDBOX_COLUMNS, row)

    def set_sandbox_deadline(self, sandbox_id: str, deadline_unix: float | None) -> None:
        with self._transaction() as db:
            if self._fence_only(db, "sandboxes", "id", sandbox_id):
                db.execute("UPDATE sandboxes SET deadline_unix = ?, version = version + 1 "
                           "WHERE id = ?", (deadline_unix, sandbox_id))

    def get_sandbox(self, sandbox_id: str) -> SandboxRow | None:
        rows = self._read("SELECT * FROM sandboxes WHERE id = ?", (sandbox_id,))
        return self._sandbox(rows[0]) if rows else None

    def list_sandboxes(
        self, *, include_final: bool = False, not_held_by: str | None = None
    ) -> list[SandboxRow]:
        where: list[str] = []
        params: list[Any] = []
        if not include_final:
            where.append(f"state NOT IN {_FINAL_IN}")
            params.extend(FINAL_VALUES)
        if not_held_by is not None:
            where.append("(owner IS NULL OR owner <> ? OR state = ?)")
            params.extend((not_held_by, SandboxState.CREATING.value))
        clause = f" WHERE {' AND '.join(where)}" if where else ""
        rows = self._read(f"SELECT * FROM sandboxes{clause} ORDER BY created_at_unix, id",
                          params)
        return [self._sandbox(r) for r in rows]

    def delete_sandbox(self, sandbox_id: str) -> None:
        self._fenced_delete("sandboxes", "id", sandbox_id)

    def prune_ended(self, ended_before_unix: float) -> list[str]:
        with self._transaction() as db:
            ids = [r["id"] for r in db.execute(
                f"DELETE FROM sandboxes WHERE state IN {_FINAL_IN} AND updated_at_unix < ? "
                "RETURNING id", (*FINAL_VALUES, ended_before_unix)).fetchall()]
            for sandbox_id in ids:
                db.execute("DELETE FROM events WHERE subject = ?", (sandbox_id,))
                # A ref that follows a workspace outlives the sandbox it was made for.
                db.execute("DELETE FROM refs WHERE sandbox_id = ? AND (workspace IS NULL OR "
                           "workspace NOT IN (SELECT name FROM workspaces))", (sandbox_id,))
        return sorted(ids)

    # -- workspaces ----------------------------------------------------------------------
    def put_workspace(self, row: WorkspaceRow) -> None:
        with self._transaction() as db:
            self._fenced_put(db, "workspaces", "name", WORKSPACE_COLUMNS, row)

    def get_workspace(self, name: str) -> WorkspaceRow | None:
        rows = self._read("SELECT * FROM workspaces WHERE name = ?", (name,))
        return self._workspace(rows[0]) if rows else None

    def list_workspaces(self) -> list[WorkspaceRow]:
        return [self._workspace(r) for r in self._read("SELECT * FROM workspaces ORDER BY name")]

    def delete_workspace(self, name: str) -> None:
        self._fenced_delete("workspaces", "name", name)

    # -- snapshots -----------------------------------------------------------------------
    def put_snapshot(self, row: SnapshotRow) -> None:
        with self._transaction() as db:
            self._fenced_put(db, "snapshots", "id", SNAPSHOT_COLUMNS, row)

    def get_snapshot(self, snapshot_id: str) -> SnapshotRow | None:
        rows = self._read("SELECT * FROM snapshots WHERE id = ?", (snapshot_id,))
        return self._snapshot(rows[0]) if rows else None

    def list_snapshots(self) -> list[SnapshotRow]:
        return [self._snapshot(r)
                for r in self._read("SELECT * FROM snapshots ORDER BY created_at_unix, id")]

    def delete_snapshot(self, snapshot_id: str) -> None:
        self._fenced_delete("snapshots", "id", snapshot_id)

    # -- events and meta -----------------------------------------------------------------
    def log_event(self, subject: str, kind: str, message: str) -> None:
        self._write(_LOG_EVENT, (time.time(), subject, kind, message))

    def events(self, subject: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        if subject is None:
            rows = self._read("SELECT * FROM events ORDER BY seq DESC LIMIT ?", (limit,))
        else:
            rows = self._read("SELECT * FROM events WHERE subject = ? ORDER BY seq DESC LIMIT ?",
                              (subject, limit))
        return [dict(r) for r in reversed(rows)]

    def get_meta(self, key: str) -> str | None:
        rows = self._read("SELECT value FROM meta WHERE key = ?", (key,))
        return str(rows[0]["value"]) if rows else None

    def set_meta(self, key: str, value: str | None) -> None:
        if value is None:
            self._write("DELETE FROM meta WHERE key = ?", (key,))
        else:
            self._write(upsert("meta", ("key", "value"), "key"), (key, value))

    # -- refs ----------------------------------------------------------------------------
    def put_ref(self, row: RefRow) -> None:
        self._write(upsert("refs", REF_COLUMNS, "id"), self._values(row, REF_COLUMNS))

    def get_ref(self, ref_id: str) -> RefRow | None:
        rows = self._read("SELECT * FROM refs WHERE id = ?", (ref_id,))
        return RefRow(**{c: rows[0][c] for c in REF_COLUMNS}) if rows else None

    def list_refs(self, sandbox_id: str, workspace: str | None = None) -> list[RefRow]:
        rows = self._read(
            "SELECT * FROM refs WHERE sandbox_id = ? OR (CAST(? AS TEXT) IS NOT NULL AND "
            "workspace = ?) ORDER BY created_at_unix, id", (sandbox_id, workspace, workspace))
        return [RefRow(**{c: r[c] for c in REF_COLUMNS}) for r in rows]

    # -- definitions and their instances -------------------------------------------------
    def put_definition(self, row: DefinitionRow) -> None:
        self._write(upsert("definitions", ("id", "body", "updated_at_unix"), "id"),
                    (row.id, self.json_in(row.body), row.updated_at_unix))

    def list_definitions(self) -> list[DefinitionRow]:
        return [DefinitionRow(r["id"], self.json_out(r["body"]), r["updated_at_unix"])
                for r in self._read("SELECT * FROM definitions ORDER BY id")]

    def put_instance(self, row: InstanceRow) -> None:
        self._write(upsert("instances", INSTANCE_COLUMNS, "key"),
                    self._values(row, INSTANCE_COLUMNS))

    def get_instance(self, key: str) -> InstanceRow | None:
        rows = self._read("SELECT * FROM instances WHERE key = ?", (key,))
        return self._instance(rows[0]) if rows else None

    def delete_instance(self, key: str) -> None:
        with self._transaction() as db:
            db.execute("DELETE FROM instances WHERE key = ?", (key,))
            db.execute("DELETE FROM instance_holders WHERE key = ?", (key,))

    def hold_instance(self, key: str, holder: str) -> None:
        self._write(upsert("instance_holders", ("key", "holder", "since_unix"), "key, holder"),
                    (key, holder, time.time()))

    def release_instance(self, key: str, holder: str) -> None:
        self._write("DELETE FROM instance_holders WHERE key = ? AND holder = ?", (key, holder))

    def instance_holders(self, key: str) -> list[str]:
        rows = self._read("SELECT holder FROM instance_holders WHERE key = ? "
                          "ORDER BY since_unix, holder", (key,))
        return [r["holder"] for r in rows]

    def claim_instance(
        self, key: str, sandbox_id: str, holder: str, *,
        was: Mapping[str, Any], alive: Callable[[str], bool],
    ) -> bool:
        with self._transaction() as db:  # the row locked: one program decides for this key
            found = db.execute("SELECT sandbox_id, description FROM instances WHERE key = ?"
                               f"{self.for_update}", (key,)).fetchone()
            if found is None or found["sandbox_id"] != sandbox_id \
                    or self.json_out(found["description"]) != dict(was):
                return False
            others = [r["holder"] for r in db.execute(
                "SELECT holder FROM instance_holders WHERE key = ? AND holder <> ?",
                (key, holder)).fetchall()]
            if any(alive(other) for other in others):
                return False
            db.execute("DELETE FROM instance_holders WHERE key = ?", (key,))
            db.execute("INSERT INTO instance_holders (key, holder, since_unix) VALUES (?, ?, ?)",
                       (key, holder, time.time()))
            return True

    def instance_sandbox_ids(self) -> set[str]:
        rows = self._read("SELECT sandbox_id FROM instances WHERE sandbox_id IS NOT NULL")
        return {r["sandbox_id"] for r in rows}

    def instance_of_sandbox(self, sandbox_id: str) -> InstanceRow | None:
        rows = self._read("SELECT * FROM instances WHERE sandbox_id = ? ORDER BY key LIMIT 1",
                          (sandbox_id,))
        return self._instance(rows[0]) if rows else None

    def note_instance_activity(self, sandbox_id: str, at_unix: float) -> None:
        self._write(f"UPDATE instances SET last_active_unix = "
                    f"{self.greatest}(COALESCE(last_active_unix, 0), ?) WHERE sandbox_id = ?",
                    (at_unix, sandbox_id))

    def set_instance_deadline(self, sandbox_id: str, deadline_unix: float) -> None:
        self._write("UPDATE instances SET deadline_unix = ? WHERE sandbox_id = ?",
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
        with self._transaction() as db:  # compare and set, the rows locked
            rows = db.execute("SELECT key, state, description FROM instances "
                              f"WHERE sandbox_id = ?{self.for_update}", (sandbox_id,)).fetchall()
            for r in rows:
                if was is not None and (
                    r["state"] != was[0] or self.json_out(r["description"]) != dict(was[1])
                ):
                    continue
                db.execute("UPDATE instances SET state = ?, description = ?, "
                           "updated_at_unix = ?, reason = ? WHERE key = ?",
                           (state, self.json_in(dict(description)), time.time(), reason,
                            r["key"]))
                written = True
        return written

    # -- leases (the store's clock) ------------------------------------------------------
    def take_lease(self, name: str, holder: str, seconds: float) -> bool:
        with self._lease_transaction() as db:
            found = None
            while found is None:
                # A row to lock even for a lease never taken, so two takers
                # queue; again if its holder released it (deleted the row)
                # between the two statements.
                db.execute("INSERT INTO leases (name, holder, expires_at_unix) "
                           "VALUES (?, ?, 0) ON CONFLICT (name) DO NOTHING", (name, holder))
                found = db.execute(
                    f"SELECT holder, expires_at_unix, {self.now_sql} AS now FROM leases "
                    f"WHERE name = ?{self.for_update}", (name,)).fetchone()
            if found["holder"] != holder and found["expires_at_unix"] > found["now"] \
                    and holder_alive(found["holder"]):
                return False
            db.execute(f"UPDATE leases SET holder = ?, expires_at_unix = {self.now_sql} + ? "
                       "WHERE name = ?", (holder, seconds, name))
            return True

    def lease_holder(self, name: str) -> str | None:
        rows = self._read("SELECT holder, expires_at_unix FROM leases WHERE name = ?", (name,))
        if not rows or rows[0]["expires_at_unix"] == 0:
            return None  # only the row a first taker made to lock
        return str(rows[0]["holder"])

    def release_lease(self, name: str, holder: str) -> None:
        self._lease_write("DELETE FROM leases WHERE name = ? AND holder = ?", (name, holder))
