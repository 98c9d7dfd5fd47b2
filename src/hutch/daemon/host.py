"""The definitions' host in the daemon: their sandboxes made, found and
stored as every other sandbox it holds."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from .._sandbox import (
    Sandbox,
    new_sandbox_id,
)
from ..config import SandboxSpec
from ..definitions import SandboxHost
from ..definitions.holders import (
    HELD_BY_DAEMON,
    held_elsewhere,
    live_holders,
    this_program,
)
from ..states import FINAL, HELD, SandboxState
from ..store import (
    InstanceRow,
    SnapshotRow,
)

if TYPE_CHECKING:
    from .core import Daemon


class _DaemonHost(SandboxHost):
    """Definitions' sandboxes, made and found by the daemon: tracked, stored
    and reconciled as every other sandbox it holds."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.store = daemon.store
        self.astore = daemon.astore
        #: (instance key, sandbox id) this daemon has recorded its hold of.
        self._holding: set[tuple[str, str]] = set()

    async def find_live(self, row: InstanceRow) -> Sandbox | None:
        sandbox = self.daemon.sandboxes.get(row.sandbox_id or "")
        if sandbox is None and row.sandbox_id is not None:
            # A fleet's other daemon serves the thread's sandbox: the ensure goes there.
            await self.daemon.raise_if_served_elsewhere(row.sandbox_id)
        if sandbox is None and row.description.get("held_by") != HELD_BY_DAEMON:
            sandbox = await self._take_over(row)
        if sandbox is None or sandbox.closed or sandbox.state in FINAL:
            return None
        if sandbox.state in HELD:
            await sandbox.resume()
        return sandbox

    async def _take_over(self, row: InstanceRow) -> Sandbox | None:
        """The thread's sandbox as a program made it in-process on this store:
        refused (typed) while that program lives, for it is using it; once it
        is gone, taken over as it left it, its work kept. None if it ended."""
        try:
            recorded = SandboxState(row.state)
        except ValueError:
            recorded = SandboxState.RUNNING
        if recorded in FINAL or row.sandbox_id is None:
            return None
        holders = await anyio.to_thread.run_sync(live_holders, self.store, row.key)
        if holders:
            raise held_elsewhere(row, holders[0])
        sandbox = await self.daemon.adopt_left_sandbox(
            row.sandbox_id, row.provider, row.description,
            SandboxSpec.model_validate(row.spec), recorded,
            created_unix=row.created_at_unix, deadline_unix=row.deadline_unix,
        )
        if sandbox is not None:
            row.description, row.state = self.describe(sandbox), sandbox.state.value
            row.updated_at_unix = time.time()
            await self.astore.put_instance(row)
        return sandbox

    async def hold(self, key: str, sandbox: Sandbox) -> None:
        # Recorded as any program's hold: a program on this store takes the
        # thread over only once this daemon is gone (killed: its hold dies
        # with it). Written once per sandbox of the key, and again by a
        # restarted daemon that adopts it (see Daemon._reconcile_sandbox).
        await self.daemon.setting_up(sandbox.id, made=True)  # its thread's now, on record
        if (key, sandbox.id) in self._holding:
            return
        await self.astore.hold_instance(key, this_program())
        self._holding.add((key, sandbox.id))

    async def create(self, spec: SandboxSpec) -> Sandbox:
        # A warm pool of the definition's settings gives its runtime, and its id.
        pooled = await self.daemon.take_pooled(spec)
        sandbox_id = pooled.sandbox_id if pooled is not None else new_sandbox_id()
        try:
            await self.daemon.setting_up(sandbox_id, made=False)  # before it exists: SETTING_UP
        except BaseException:
            if pooled is not None:
                await self.daemon.return_pooled(pooled)
            raise
        return await self.daemon.create_sandbox(spec, sandbox_id=sandbox_id, pooled=pooled)

    async def restore(self, snapshot: SnapshotRow, spec: SandboxSpec) -> Sandbox:
        attach = self.daemon.attach_spec(snapshot, spec.options.model_dump())
        sandbox_id = new_sandbox_id()
        await self.daemon.setting_up(sandbox_id, made=False)
        return await self.daemon.create_sandbox(attach, from_snapshot=snapshot,
                                                sandbox_id=sandbox_id)

    async def snapshot(self, sandbox: Sandbox, label: str) -> str:
        return (await self.daemon.snapshot_sandbox(sandbox.id, label)).id

    async def destroy(self, sandbox: Sandbox) -> None:
        await self.daemon.delete_sandbox(sandbox.id)
        await self.daemon.setting_up(sandbox.id, made=True)

    async def drop_snapshot(self, snapshot: SnapshotRow) -> None:
        await self.daemon.delete_snapshot(snapshot.id)  # refused while something needs it

    def describe(self, sandbox: Sandbox) -> dict[str, Any]:
        # Found again through the daemon's own sandbox table; a program
        # opening this store in-process is told whose it is.
        return {"held_by": HELD_BY_DAEMON}
