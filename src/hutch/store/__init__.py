"""Durable state: one interface (:mod:`.base`), SQLite as the embedded default."""

from .base import DefinitionRow, InstanceRow, RefRow, SandboxRow, SnapshotRow, Store, WorkspaceRow
from .sqlite import SQLiteStore

__all__ = [
    "DefinitionRow", "InstanceRow", "RefRow", "SQLiteStore", "SandboxRow", "SnapshotRow",
    "Store", "WorkspaceRow",
]
