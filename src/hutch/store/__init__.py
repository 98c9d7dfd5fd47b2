"""Durable state: one interface (:mod:`.base`), SQLite as the embedded default."""

from .base import RefRow, SandboxRow, SnapshotRow, Store, WorkspaceRow
from .sqlite import SQLiteStore

__all__ = ["RefRow", "SQLiteStore", "SandboxRow", "SnapshotRow", "Store", "WorkspaceRow"]
