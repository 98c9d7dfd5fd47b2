"""Snapshots and forks: captured with their intent recorded first, removed
only when nothing needs them."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import Any

import anyio
import anyio.to_thread

from .._api import spec_for_attach
from .._errors import (
    InvalidArgument,
    InvalidState,
    NotFound,
)
from .._faults import fault_point
from .._sandbox import (
    Sandbox,
    backend_of,
    live_of,
)
from .._snapshots import new_snapshot_id
from .._types import ProviderSnapshot, Snapshot, SnapshotDependent
from ..config import OPTION_KEYS, SandboxSpec
from ..providers.registry import get_provider
from ..states import SnapshotStatus
from ..store import (
    SandboxRow,
    SnapshotRow,
)
from .common import (
    MAX_FORK,
    MAX_LABEL,
    log,
)
from .pools import Pooling


class Snapshots(Pooling):
    # -- snapshots and forks -------------------------------------------------------------
    async def get_snapshot(self, snapshot_id: str) -> SnapshotRow:
        row = await self.astore.get_snapshot(snapshot_id)
        if row is None or row.status != SnapshotStatus.READY:
            raise NotFound(f"no snapshot {snapshot_id}")
        return row

    async def list_snapshots(self) -> list[SnapshotRow]:
        return [r for r in await self.astore.list_snapshots()
                if r.status == SnapshotStatus.READY]

    @staticmethod
    def snapshot_json(row: SnapshotRow) -> dict[str, Any]:
        """The wire form, as :meth:`Snapshot.as_dict` has it (the one builder)."""
        return Snapshot(
            id=row.id, label=row.label, sandbox_id=row.sandbox_id, parent_id=row.parent_id,
            size_bytes=row.size_bytes, created_at_unix=row.created_at_unix, provider=row.provider,
        ).as_dict()

    async def snapshot_sandbox(
        self, sandbox_id: str, label: str | None, *, diff: bool = True
    ) -> SnapshotRow:
        """Capture a sandbox's state. The intent is recorded first: a daemon
        killed mid-capture frees whatever the provider wrote, at start."""
        sandbox = await self.get(sandbox_id)
        sandbox.require("snapshot")
        if label is not None and (not isinstance(label, str) or len(label) > MAX_LABEL):
            raise InvalidArgument(f"a snapshot label is a string of at most {MAX_LABEL} characters")
        row = SnapshotRow(
            id=new_snapshot_id(), provider=sandbox.provider, status=SnapshotStatus.CAPTURING,
            label=label,
            sandbox_id=sandbox_id, parent_id=sandbox.base_snapshot_id,
            created_at_unix=time.time(),
            spec=sandbox.spec.model_dump() if sandbox.spec is not None else {},
        )
        await self.astore.put_snapshot(row)
        fault_point("snapshot.recorded")
        previous_base = sandbox.base_snapshot_id
        try:
            # Held as it is (no transition meanwhile), as Sandbox.snapshot does.
            async with self.engine.held(live_of(sandbox)):
                handle = await backend_of(sandbox).capture(row.id, diff=diff)
            fault_point("snapshot.captured")
            row.status, row.size_bytes, row.handle = (
                SnapshotStatus.READY, handle.size_bytes, handle.as_dict())
            await self._name_base(sandbox, row.id)
            await self.astore.put_snapshot(row)
        except BaseException:
            # A caller gone (cancelled) or a failure: nothing of it stays,
            # and the sandbox's base is the one it had.
            await self._undo_snapshot(row, sandbox, previous_base)
            raise
        await self._note(
            sandbox_id, "snapshot", f"captured {row.id}" + (f" ({label})" if label else "")
        )
        return row

    async def _name_base(self, sandbox: Sandbox, snapshot_id: str | None) -> None:
        """Make ``snapshot_id`` the state ``sandbox`` stands on (the parent of
        its next snapshot), in memory and in its record."""
        sandbox.base_snapshot_id = snapshot_id

        def name_base(row: SandboxRow) -> bool:
            changed = row.base_snapshot_id != snapshot_id
            row.base_snapshot_id = snapshot_id
            return changed

        await self._rewrite_sandbox(sandbox.id, name_base)

    async def _undo_snapshot(
        self, row: SnapshotRow, sandbox: Sandbox, previous_base: str | None
    ) -> None:
        """Remove a snapshot whose caller will never hear of it (cancelled,
        or a step after it failed), and give its sandbox back its base.
        Shielded: it runs to the end even as its caller is cancelled."""
        with anyio.CancelScope(shield=True):
            try:
                if sandbox.base_snapshot_id == row.id:
                    await self._name_base(sandbox, previous_base)
                row.status = SnapshotStatus.REMOVING  # a daemon killed now finishes it at start
                await self.astore.put_snapshot(row)
                await self._free_snapshot_storage(row)
                await self.astore.delete_snapshot(row.id)
            except Exception as exc:  # the next start's reconciliation frees it
                log.warning("snapshot %s: undoing it failed: %s", row.id, exc)

    def attach_spec(self, snapshot: SnapshotRow, body: Mapping[str, Any]) -> SandboxSpec:
        """The settings of a sandbox started from ``snapshot``: its origin's,
        with the sandbox options ``body`` gives."""
        unknown = sorted(set(body) - OPTION_KEYS)
        if unknown:
            raise InvalidArgument(
                f"a sandbox started from a snapshot takes sandbox options only, not {unknown}"
            )
        record = self._snapshot_of(snapshot)
        return spec_for_attach(record, body)

    @staticmethod
    def _snapshot_of(row: SnapshotRow) -> Snapshot:
        return Snapshot(
            id=row.id, label=row.label, sandbox_id=row.sandbox_id, parent_id=row.parent_id,
            size_bytes=row.size_bytes, created_at_unix=row.created_at_unix,
            provider=row.provider, handle=ProviderSnapshot.from_dict(row.handle), spec=row.spec,
        )

    async def create_from_snapshot(
        self, snapshot_id: str, body: Mapping[str, Any]
    ) -> Sandbox:
        snapshot = await self.get_snapshot(snapshot_id)
        self.admit_provider(snapshot.provider)
        spec = self.attach_spec(snapshot, body)
        sandbox = await self.create_sandbox(spec, from_snapshot=snapshot)
        await self.astore.log_event(sandbox.id, "attached", f"started from snapshot {snapshot.id}")
        return sandbox

    async def fork_sandbox(
        self, sandbox_id: str, label: str | None, count: int, options: Mapping[str, Any]
    ) -> tuple[SnapshotRow, list[Sandbox]]:
        """Snapshot + ``count`` sandboxes started from it."""
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_FORK:
            raise InvalidArgument(f"fork count must be an integer from 0 to {MAX_FORK}")
        origin = await self.get(sandbox_id)
        origin.require("fork")
        self.admit_provider(origin.provider)
        previous_base = origin.base_snapshot_id
        snapshot = await self.snapshot_sandbox(sandbox_id, label)
        branches: list[Sandbox] = []
        try:
            fault_point("fork.captured")
            spec = self.attach_spec(snapshot, options)
            if count > 1 and get_provider(origin.provider).branches_concurrently:
                await self._branch_together(spec, snapshot, count, branches)
            else:
                for _ in range(count):
                    branches.append(await self.create_sandbox(spec, from_snapshot=snapshot))
                    fault_point("fork.branched")
        except BaseException:
            # All or nothing: a caller gone (cancelled) never learns of the
            # branches or the snapshot, so neither stays to leak.
            with anyio.CancelScope(shield=True):
                for branch in branches:
                    with contextlib.suppress(Exception):
                        await self.delete_sandbox(branch.id)
                await self._undo_snapshot(snapshot, origin, previous_base)
            raise
        return snapshot, branches

    async def _branch_together(
        self, spec: SandboxSpec, snapshot: SnapshotRow, count: int, branches: list[Sandbox]
    ) -> None:
        """``count`` branches started at once (a provider whose branches may
        start side by side), each put in ``branches`` as it is made; the
        first failure raised once every start has ended."""
        failures: list[Exception] = []

        async def one() -> None:
            try:
                branches.append(await self.create_sandbox(spec, from_snapshot=snapshot))
                fault_point("fork.branched")
            except Exception as exc:  # raised below, once every start has ended
                failures.append(exc)

        async with anyio.create_task_group() as group:
            for _ in range(count):
                group.start_soon(one)
        if failures:
            raise failures[0]

    async def snapshot_dependents(
        self, snapshot_id: str, *, children: bool = True
    ) -> list[SnapshotDependent]:
        """What still needs a snapshot: child snapshots, workspaces made from
        it or kept in it, live sandboxes started from it. (A child's storage
        never needs its parent's record: providers keep shared layers alive.)"""
        needs = [SnapshotDependent("snapshot", r.id) for r in await self.astore.list_snapshots()
                 if children and r.parent_id == snapshot_id and r.status != SnapshotStatus.REMOVING]
        for ws in await self.astore.list_workspaces():
            if snapshot_id in (ws.source_snapshot_id, ws.state_snapshot_id):
                needs.append(SnapshotDependent("workspace", ws.name))
        # A branch started from it that has not captured a state of its own since.
        needs += [SnapshotDependent("sandbox", sid) for sid, sb in self.sandboxes.items()
                  if sb.origin_snapshot_id == snapshot_id == sb.base_snapshot_id]
        return needs

    async def delete_snapshot(
        self, snapshot_id: str, *, force: bool = False
    ) -> list[SnapshotDependent]:
        """Remove a snapshot and free its provider storage; refused while
        something depends on it unless ``force``. Returns what it broke (what
        needed it and was removed from under)."""
        row = await self.get_snapshot(snapshot_id)
        needs = await self.snapshot_dependents(snapshot_id)
        named = ", ".join(map(str, needs))
        if needs and not force:
            raise InvalidState(
                f"snapshot {snapshot_id} is still needed by {named}; "
                "remove those first or pass force=true"
            )
        await self._remove_snapshot(row)
        if needs:
            await self.astore.log_event(snapshot_id, "snapshot",
                                 f"removed by force; it was needed by {named}")
        return needs

    async def _remove_snapshot(self, row: SnapshotRow) -> None:
        """Remove one snapshot: recorded first, storage freed, row dropped;
        its children take its parent as theirs, so the tree stays whole."""
        row.status = SnapshotStatus.REMOVING
        await self.astore.put_snapshot(row)
        await self._free_snapshot_storage(row)
        for child in await self.astore.list_snapshots():
            if child.parent_id == row.id:
                child.parent_id = row.parent_id
                await self.astore.put_snapshot(child)
        await self.astore.delete_snapshot(row.id)
        await self.astore.log_event(row.id, "snapshot", "removed")

    async def _release_snapshot(self, snapshot_id: str | None) -> None:
        """Drop a snapshot hutch made for its own use (a workspace's state)
        unless something else now depends on it."""
        if not snapshot_id:
            return
        row = await self.astore.get_snapshot(snapshot_id)
        if row is None or await self.snapshot_dependents(snapshot_id, children=False):
            return
        await self._remove_snapshot(row)

    @staticmethod
    async def _free_snapshot_storage(row: SnapshotRow) -> None:
        handle = (ProviderSnapshot.from_dict(row.handle) if row.handle
                  else ProviderSnapshot(row.id, row.provider, 0))
        await get_provider(row.provider).remove_snapshot(handle)
