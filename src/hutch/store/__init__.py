"""Durable state: one interface (:mod:`.base`), SQLite as the embedded default."""

from .base import SandboxRow, Store, WorkspaceRow
from .sqlite import SQLiteStore

__all__ = ["SQLiteStore", "SandboxRow", "Store", "WorkspaceRow"]
