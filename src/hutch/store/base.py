"""The store interface the daemon writes through.

Every state transition is written (and committed durably) before it is
acknowledged, so that a daemon killed at any point restarts from a store
that never claims more than happened. Another database (PostgreSQL, for
several daemons) joins by implementing :class:`Store`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SandboxRow:
    id: str
    provider: str
    state: str
    spec: dict[str, Any]
    description: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None
    workspace: str | None = None
    created_at_unix: float = 0.0
    updated_at_unix: float = 0.0


@dataclass
class WorkspaceRow:
    name: str
    status: str
    provider: str
    spec: dict[str, Any]
    live_sandbox_id: str | None = None
    current_state_tag: str | None = None
    source_snapshot_tag: str | None = None
    image: str | None = None
    host_workdir: str | None = None
    created_at_unix: float = 0.0
    last_active_unix: float = 0.0


class Store(abc.ABC):
    @abc.abstractmethod
    def put_sandbox(self, row: SandboxRow) -> None:
        """Insert or replace a sandbox row, durably."""

    @abc.abstractmethod
    def get_sandbox(self, sandbox_id: str) -> SandboxRow | None: ...

    @abc.abstractmethod
    def list_sandboxes(self, *, include_final: bool = False) -> list[SandboxRow]: ...

    @abc.abstractmethod
    def delete_sandbox(self, sandbox_id: str) -> None: ...

    @abc.abstractmethod
    def put_workspace(self, row: WorkspaceRow) -> None: ...

    @abc.abstractmethod
    def get_workspace(self, name: str) -> WorkspaceRow | None: ...

    @abc.abstractmethod
    def list_workspaces(self) -> list[WorkspaceRow]: ...

    @abc.abstractmethod
    def delete_workspace(self, name: str) -> None: ...

    @abc.abstractmethod
    def log_event(self, subject: str, kind: str, message: str) -> None:
        """Append what happened to a sandbox or workspace, and why."""

    @abc.abstractmethod
    def events(self, subject: str | None = None, limit: int = 100) -> list[dict[str, Any]]: ...

    @abc.abstractmethod
    def close(self) -> None: ...
