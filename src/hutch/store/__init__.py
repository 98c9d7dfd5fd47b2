"""Durable state: one interface (:mod:`.base`), SQLite as the embedded default."""

from .base import SandboxRow, SnapshotRow, Store, WorkspaceRow
from .sqlite import SQLiteStore

__all__ = ["SQLiteStore", "SandboxRow", "SnapshotRow", "Store", "WorkspaceRow"]
