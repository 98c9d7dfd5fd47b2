"""Workspaces: named, suspendable state that outlives its sandboxes."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from .._errors import (
    CapabilityUnsupported,
    InvalidArgument,
    InvalidState,
    NotFound,
)
from .._faults import fault_point
from .._sandbox import (
    lifecycle_record,
    new_sandbox_id,
)
from ..config import SandboxSpec
from ..providers.registry import get_provider
from ..states import HELD, RESUMABLE, SandboxState, WorkspaceStatus
from ..store import (
    OwnershipLost,
    SnapshotRow,
    WorkspaceRow,
)
from .common import (
    WORKSPACE_NAME,
)
from .snapshots import Snapshots


def _state_label(workspace: str) -> str:
    """The label of a workspace's state snapshots."""
    return f"workspace {workspace} state"


class Workspaces(Snapshots):
    async def _save_workspace_state(self, name: str, sandbox_id: str, *, diff: bool) -> str:
        """Snapshot a workspace's sandbox as the workspace's one state snapshot,
        replacing (and releasing) the last one. Under the workspace's lock."""
        row = await self._workspace(name)
        previous = row.state_snapshot_id
        state = await self.snapshot_sandbox(sandbox_id, f"workspace {name} state", diff=diff)
        row = await self._workspace(name)
        row.state_snapshot_id = state.id
        await self.astore.put_workspace(row)
        await self._release_snapshot(previous)
        return state.id

    def workspace_json(self, row: WorkspaceRow) -> dict[str, Any]:
        status = row.status
        live = self.sandboxes.get(row.live_sandbox_id or "")
        if status == WorkspaceStatus.RUNNING and live is not None:
            if live.state is SandboxState.SUSPENDED:
                status = WorkspaceStatus.SUSPENDED  # suspended on idle; the next call resumes it
            if lifecycle_record(live) is not None:
                row.last_active_unix = live.status().last_active_unix
        return {
            "name": row.name,
            "status": status,
            "provider": row.provider,
            "live_sandbox_id": row.live_sandbox_id,
            "state_snapshot_id": row.state_snapshot_id,
            "source_snapshot_id": row.source_snapshot_id,
            "created_at_unix": row.created_at_unix,
            "last_active_unix": row.last_active_unix,
        }

    async def list_workspaces(self) -> list[WorkspaceRow]:
        return await self.astore.list_workspaces()

    async def get_workspace(self, name: str) -> WorkspaceRow:
        row = await self.astore.get_workspace(name)
        if row is None:
            raise NotFound(f"no workspace {name!r}")
        return row

    async def create_workspace(self, body: Mapping[str, Any]) -> WorkspaceRow:
        """A workspace from a snapshot (``snapshot_tag``, a snapshot id) or
        fresh from sandbox settings (``provider`` and its settings)."""
        body = dict(body)
        name = body.pop("name", "")
        if not isinstance(name, str):
            # A number is no name: 1e999 would become "inf".
            raise InvalidArgument(f"name: a workspace name is a string, not {type(name).__name__}")
        if not WORKSPACE_NAME.fullmatch(name):
            raise InvalidArgument(
                f"workspace name {name!r} must be 1-63 characters of a-z, 0-9, '.', '_', '-'"
            )
        source_id = body.pop("snapshot_tag", None) or body.pop("from_snapshot", None)
        source: SnapshotRow | None = None
        if source_id is not None:
            if not isinstance(source_id, str):
                raise InvalidArgument("snapshot_tag: a snapshot id (a string)")
            source = await self.get_snapshot(source_id)
            self.admit_provider(source.provider)
            spec = self.attach_spec(source, body)
        else:
            spec = self.spec_from_request(body)
        provider = get_provider(spec.provider_name)
        if not provider.capabilities.snapshot:
            raise CapabilityUnsupported.for_provider(spec.provider_name, "workspaces (snapshot)")
        async with self._lock(name):
            if await self.astore.get_workspace(name) is not None:
                raise InvalidState(f"workspace {name!r} already exists")
            now = time.time()
            sid = new_sandbox_id()
            row = WorkspaceRow(
                name=name, status=WorkspaceStatus.CREATING, provider=spec.provider_name,
                spec=spec.model_dump(), live_sandbox_id=sid,
                source_snapshot_id=source.id if source else None,
                created_at_unix=now, last_active_unix=now,
            )
            try:
                await self.astore.put_workspace(row)
            except OwnershipLost:
                # Another daemon of the fleet made it between the look and
                # this write (the lock above is this daemon's only): its row.
                if await self.astore.get_workspace(name) is not None:
                    raise InvalidState(f"workspace {name!r} already exists") from None
                raise
            try:
                await self.create_sandbox(spec, workspace=name, sandbox_id=sid,
                                          from_snapshot=source)
            except BaseException:
                await self.astore.delete_workspace(name)
                raise
            row.status = WorkspaceStatus.RUNNING
            await self.astore.put_workspace(row)
            await self.astore.log_event(
                name, "workspace",
                f"created from snapshot {source.id}" if source else
                f"created fresh on {spec.provider_name}",
            )
            return row

    async def suspend_workspace(self, name: str, *, diff: bool) -> WorkspaceRow:
        """Capture the workspace's state into its one state snapshot (a new
        snapshot that replaces the last), and free its sandbox.

        ``diff``: the provider may store only what changed since the state
        the sandbox started from (a layer on the last state); otherwise the
        state is written whole.
        """
        async with self._lock(name):
            row = await self._workspace(name)
            sandbox = self.sandboxes.get(row.live_sandbox_id or "")
            if row.status != WorkspaceStatus.RUNNING or sandbox is None:
                raise InvalidState(
                    f"workspace {name!r} is {row.status}; only a running one suspends"
                )
            row.status = WorkspaceStatus.SUSPENDING
            await self.astore.put_workspace(row)
            fault_point("workspace-suspend.marked")
            previous = row.state_snapshot_id
            try:
                state = await self.snapshot_sandbox(sandbox.id, _state_label(name), diff=diff)
            except BaseException:
                row.status = WorkspaceStatus.RUNNING
                await self.astore.put_workspace(row)
                raise
            fault_point("workspace-suspend.captured")
            row.status, row.state_snapshot_id, row.live_sandbox_id = (
                WorkspaceStatus.SUSPENDED, state.id, None)
            row.last_active_unix = time.time()
            await self.astore.put_workspace(row)
            fault_point("workspace-suspend.recorded")
            await sandbox.close()
            self._forget(sandbox.id)
            # The old state goes unless something else was made from it (a
            # workspace, a branch): then it stays, as their source.
            await self._release_snapshot(previous)
            await self.astore.log_event(
                name, "workspace", f"suspended into {state.id} ({'diff' if diff else 'full'})"
                + (f", replacing {previous}" if previous else "")
            )
            return row

    async def resume_workspace(self, name: str) -> WorkspaceRow:
        async with self._lock(name):
            row = await self._workspace(name)
            live = self.sandboxes.get(row.live_sandbox_id or "")
            if row.status == WorkspaceStatus.RUNNING and live is not None:
                if live.state in HELD:
                    await live.resume()
                    return row
                raise InvalidState(f"workspace {name!r} is already running")
            if row.status not in RESUMABLE:
                raise InvalidState(f"workspace {name!r} is {row.status}; it cannot resume")
            start_id = row.state_snapshot_id or row.source_snapshot_id
            start = await self.astore.get_snapshot(start_id) if start_id else None
            spec = SandboxSpec.model_validate(row.spec)
            sid = new_sandbox_id()
            row.live_sandbox_id, row.status = sid, WorkspaceStatus.RESUMING
            await self.astore.put_workspace(row)
            fault_point("workspace-resume.marked")
            try:
                await self.create_sandbox(spec, workspace=name, sandbox_id=sid,
                                          from_snapshot=start)
            except BaseException:
                row.live_sandbox_id, row.status = None, WorkspaceStatus.STALE
                await self.astore.put_workspace(row)
                raise
            fault_point("workspace-resume.created")
            row.status, row.last_active_unix = WorkspaceStatus.RUNNING, time.time()
            await self.astore.put_workspace(row)
            await self.astore.log_event(
                name, "workspace",
                f"resumed from {start.id}" if start else "resumed fresh (no state kept)",
            )
            return row

    async def delete_workspace(self, name: str) -> None:
        async with self._lock(name):
            row = await self._workspace(name)
            # Recorded first: a daemon killed half-way finishes the delete at start.
            row.status = WorkspaceStatus.DELETING
            await self.astore.put_workspace(row)
            await self._finish_delete(row)

    async def _finish_delete(self, row: WorkspaceRow) -> None:
        live = self.sandboxes.get(row.live_sandbox_id or "")
        if live is not None:
            await live.close()
            self._forget(live.id)
        state = row.state_snapshot_id
        await self.astore.delete_workspace(row.name)
        # Its own state goes, unless another workspace or a branch was made
        # from it; the snapshot it was made from is never its to remove.
        await self._release_snapshot(state)
        await self.astore.log_event(row.name, "workspace", "deleted (its source is kept)")
