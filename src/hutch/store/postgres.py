"""The shared store: PostgreSQL, for one daemon or several.

The same rows and queries as the embedded SQLite store (:mod:`.sql`),
through a psycopg 3 connection pool; what is PostgreSQL's own is here.
Every write is one transaction, committed before it returns; the ones that
decide between programs (claims, leases, compare and set) lock the rows
they read (``SELECT ... FOR UPDATE``). Leases expire by the database's
clock, never a daemon's, so daemons on several hosts agree on when one has
lapsed.

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
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import ConnectionPool

from .._errors import InvalidArgument, StoreUnavailable
from .base import check_off_loop
from .sql import SQLStore

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
    # Writes compare and set on the version: a stored row is at version 1 at
    # least (0 is a row not stored yet).
    (4, "".join(f"UPDATE {table} SET version = 1 WHERE version = 0;\n"
                for table in ("sandboxes", "workspaces", "snapshots"))),
)

#: The advisory lock migrations run under (any fixed number; "hutch" in ASCII).
_MIGRATION_LOCK = 0x6875746368

_DB_NOW = "EXTRACT(EPOCH FROM clock_timestamp())::double precision"

#: The longest a session of the store may sit inside a transaction between
#: two statements, and the longest a statement waits for another's lock.
#: hutch's transactions do nothing between their statements but the next
#: one (a few ms), so a session still inside one after this long belongs to
#: a program that stalled (stopped, paused, swapped out): the server ends
#: the session, its transaction is undone and its row locks freed, so a
#: stalled daemon keeps no row from the fleet (a daemon's heartbeat locks
#: every row it owns). The stalled program's next call is refused
#: (``StoreUnavailable``), never committed late.
STALLED_TRANSACTION_SECONDS = 2.0
#: Session settings every connection of the store starts with.
_SESSION = (
    f"SET idle_in_transaction_session_timeout = {int(STALLED_TRANSACTION_SECONDS * 1000)}; "
    f"SET lock_timeout = {int(STALLED_TRANSACTION_SECONDS * 1000)}"
)
#: A migration waits this long for another program's (they run in turn).
_MIGRATION_WAIT_MS = 60_000


class _Placeholders:
    """A connection that takes :mod:`.sql`'s ``?`` placeholders (psycopg's are ``%s``)."""

    def __init__(self, conn: psycopg.Connection[Row]) -> None:
        self.conn = conn

    def execute(self, sql: str, params: Sequence[Any] = (), /) -> psycopg.Cursor[Row]:
        return self.conn.execute(sql.replace("?", "%s"), params)  # type: ignore[arg-type]


class PostgresStore(SQLStore):
    """The store in a PostgreSQL database named by ``conninfo`` (a
    ``postgresql://`` URL or a libpq keyword string). ``local_root`` is the
    directory on this host for what the programs sharing the store here
    keep outside it (:meth:`local_dir`)."""

    shared = True
    #: The database's clock: daemons on several hosts agree on when a lease lapsed.
    now_sql = _DB_NOW
    for_update = " FOR UPDATE"
    skip_locked = " FOR UPDATE SKIP LOCKED"
    greatest = "GREATEST"

    def __init__(self, conninfo: str, *, local_root: str, max_connections: int = 8) -> None:
        check_off_loop("opening a PostgreSQL store")
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
                configure=_configure_session, name=self._origin,
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
            conn.execute(f"SET LOCAL lock_timeout = {_MIGRATION_WAIT_MS}")
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
        check_off_loop("a PostgreSQL round trip")
        try:
            with self._pool.connection() as conn:
                yield conn
        except psycopg.Error as exc:
            raise StoreUnavailable(
                f"the PostgreSQL store {_masked(self.conninfo)} cannot record the change: {exc}"
            ) from exc

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[_Placeholders]:
        with self._connection() as conn, conn.transaction():
            yield _Placeholders(conn)

    def _write(self, sql: str, params: Sequence[Any]) -> None:
        with self._connection() as conn:  # one statement: its own transaction
            _Placeholders(conn).execute(sql, params)

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[Mapping[str, Any]]:
        with self._connection() as conn:
            return list(_Placeholders(conn).execute(sql, params).fetchall())

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
        check_off_loop("close")
        self._closed.set()
        self._pool.close()
        self._listener.join(5)

    # -- what PostgreSQL does its own way ----------------------------------------------
    @staticmethod
    def json_in(value: Any) -> Any:
        return Jsonb(value)

    def local_dir(self, name: str) -> str:
        return os.path.join(self._local_root, name)

    def changes_by_others(self) -> int | None:
        return self._changes


def _configure_session(conn: psycopg.Connection[Row]) -> None:
    conn.execute(_SESSION)


def probe(conninfo: str) -> None:
    """One connection to ``conninfo``, closed at once; StoreUnavailable if none."""
    try:
        psycopg.connect(conninfo, connect_timeout=10).close()
    except psycopg.Error as exc:
        raise StoreUnavailable(
            f"cannot reach the PostgreSQL store {_masked(conninfo)}: {str(exc).strip()}"
        ) from None


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
