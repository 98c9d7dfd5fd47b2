"""Durable state: one interface (:mod:`.base`), SQLite as the embedded
default, PostgreSQL (:mod:`.postgres`, the ``postgres`` extra) to share."""

from __future__ import annotations

import os

from .._errors import InvalidArgument
from .aio import AsyncStore
from .base import (
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
)
from .sqlite import SQLiteStore

__all__ = [
    "AsyncStore", "DaemonRow", "DefinitionRow", "InstanceRow", "OwnershipLost", "RefRow",
    "SQLiteStore", "SandboxRow", "SnapshotRow", "Store", "WorkspaceRow", "WriteConflict",
    "check_store_location", "open_store", "reach_store",
]

_POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def check_store_location(location: str) -> None:
    """Refuse, before anything starts, a store location hutch cannot open."""
    if not location.startswith(_POSTGRES_SCHEMES):
        raise InvalidArgument(
            "the store is a postgresql:// URL (postgresql://USER[:PASSWORD]@HOST[:PORT]/DB, "
            "or ?host=/socket/dir for a local socket); leave it unset for SQLite in the "
            "data directory"
        )
    try:
        import psycopg  # noqa: F401
        import psycopg_pool  # noqa: F401
    except ImportError:
        raise InvalidArgument(
            "a PostgreSQL store needs psycopg 3 and its pool: pip install 'hutch[postgres]'"
        ) from None


def reach_store(location: str) -> None:
    """Connect once to the store at ``location``, or raise StoreUnavailable
    saying why: a daemon finds out before it listens, not in its log."""
    check_store_location(location)
    from .postgres import probe

    probe(location)


def open_store(location: str, data_dir: str) -> Store:
    """The store at ``location`` (see :func:`check_store_location`); what the
    programs sharing it keep on this host goes under ``data_dir``."""
    check_store_location(location)
    from .postgres import PostgresStore

    return PostgresStore(location, local_root=os.path.join(data_dir, "store-local"))
