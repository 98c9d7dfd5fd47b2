"""Durable state: one interface (:mod:`.base`), SQLite as the embedded default."""

from .aio import AsyncStore
from .base import DefinitionRow, InstanceRow, RefRow, SandboxRow, SnapshotRow, Store, WorkspaceRow
from .sqlite import SQLiteStore

__all__ = [
    "AsyncStore", "DefinitionRow", "InstanceRow", "RefRow", "SQLiteStore", "SandboxRow",
    "SnapshotRow", "Store", "WorkspaceRow",
]
