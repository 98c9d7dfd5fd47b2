"""Sandboxes: made, taken over, described, listed and ended; and sandbox
definitions put by API clients."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import anyio.to_thread

from .._errors import (
    HutchError,
    NotFound,
    SandboxPermissionDenied,
)
from .._sandbox import (
    Sandbox,
    live_of,
    new_sandbox_id,
)
from .._types import ProviderSnapshot
from ..config import SandboxSpec
from ..definitions import Definition, DirSource, GitSource
from ..definitions.sources import (
    Progress,
)
from ..lifecycle.state import found_state
from ..providers.base import SandboxBackend
from ..providers.registry import get_provider
from ..states import FINAL, SandboxState
from ..store import (
    SandboxRow,
    SnapshotRow,
)
from .base import Birth, transition_event
from .common import (
    REMOTE_GIT_SCHEMES,
    log,
)
from .refs import Refs


@dataclass(frozen=True)
class PooledRuntime:
    """A runtime a warm pool made ahead (see .pools): made by its provider
    under ``sandbox_id``, its row in the store ``creating``, no sandbox yet."""

    sandbox_id: str
    backend: SandboxBackend
    pool: str
    #: The version its row was written at (the next write compares it).
    version: int = 1


def _made(spec: SandboxSpec, pooled: PooledRuntime | None) -> str:
    """The event message of a sandbox's making."""
    return f"{spec.provider_name} sandbox created" + (
        f" (made ahead by warm pool {pooled.pool})" if pooled is not None else "")


class Sandboxes(Refs):
    async def create_sandbox(
        self,
        spec: SandboxSpec,
        *,
        workspace: str | None = None,
        sandbox_id: str | None = None,
        from_snapshot: SnapshotRow | None = None,
        pooled: PooledRuntime | None = None,
    ) -> Sandbox:
        """Make a sandbox from ``spec``, or start one from ``from_snapshot``
        (whose own settings ``spec`` then is, with its options as asked), or
        from ``pooled`` (a warm pool's runtime taken for ``spec``, under its id).

        A plain create (no id, workspace nor snapshot) of a warm pool's
        settings takes that pool's runtime: what the provider made ahead
        becomes this sandbox with one store write, as a made one does from
        there (its options, its clocks from now)."""
        if pooled is None and sandbox_id is None and workspace is None and from_snapshot is None:
            pooled = await self._take_pooled(spec)
        if pooled is not None:  # in the room its pool held
            return await self._create(spec, workspace, from_snapshot, pooled.sandbox_id, pooled)
        async with self._room():
            return await self._create(spec, workspace, from_snapshot,
                                      sandbox_id or new_sandbox_id(), None)

    async def _create(
        self, spec: SandboxSpec, workspace: str | None, from_snapshot: SnapshotRow | None,
        sid: str, pooled: PooledRuntime | None,
    ) -> Sandbox:
        now = time.time()
        row = SandboxRow(
            id=sid, provider=spec.provider_name, state=SandboxState.CREATING.value,
            spec=spec.model_dump(), workspace=workspace, created_at_unix=now,
            base_snapshot_id=from_snapshot.id if from_snapshot else None,
            origin_snapshot_id=from_snapshot.id if from_snapshot else None,
        )
        written: asyncio.Future[None] | None = None
        if pooled is not None:
            # Its row was written as the pool made it: the running one
            # follows on that, with the events of its making. All of it is
            # known now, so the write is handed to a worker thread now,
            # beside the bookkeeping below; its transition is acknowledged
            # (and the create answered) only once it is durable, as any
            # sandbox's.
            row.version = pooled.version
            row.state, row.last_active_unix = SandboxState.RUNNING.value, now
            row.description = pooled.backend.describe()
            written = self.astore.start_put_sandbox(
                row, transition_event(SandboxState.CREATING, SandboxState.RUNNING, None),
                ("created", _made(spec, pooled)))
        backend_cls = get_provider(spec.provider_name)
        if pooled is None:
            # Intent first: a daemon killed mid-create finds this row and
            # cleans up (a pooled runtime's row was written when it was made).
            await self.astore.put_sandbox(row)
        try:
            if pooled is not None:
                backend = pooled.backend
            elif from_snapshot is not None:
                backend = await backend_cls.create_from_snapshot(
                    spec.provider, sid, ProviderSnapshot.from_dict(from_snapshot.handle)
                )
            else:
                backend = await backend_cls.create(spec.provider, sid)
        except BaseException:
            # Failed or cancelled (a caller gone) part-way: what it made goes
            # now, not at the next start (shielded, or a cancel would skip it).
            with anyio.CancelScope(shield=True):
                with contextlib.suppress(HutchError):
                    await backend_cls.discard(sid)
                await self.astore.delete_sandbox(sid)
            raise
        sandbox = self._wrap(backend, spec)
        sandbox.base_snapshot_id = row.base_snapshot_id
        sandbox.origin_snapshot_id = row.origin_snapshot_id
        self.sandboxes[sid] = sandbox
        if workspace is not None:
            self.workspace_of[sid] = workspace
        else:
            # A new id has no refs yet (a workspace's may): its info, the
            # create's answer, need not read the store for them.
            self._refs_of[sid] = []
        # Its running state and the events of its making: one store write.
        self._births[sid] = Birth(row, (("created", _made(spec, pooled)),), written)
        try:
            await self.engine.attach(live_of(sandbox), spec.options)
        except BaseException:
            self.sandboxes.pop(sid, None)
            self._refs_of.pop(sid, None)
            with anyio.CancelScope(shield=True):
                await backend.close()
                if written is not None:
                    # Done first: a write landing after the delete would bring the row back.
                    with contextlib.suppress(Exception):
                        await written
                await self.astore.delete_sandbox(sid)
            raise
        finally:
            self._births.pop(sid, None)
        self._watch(type(backend))
        return sandbox

    def _room(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Room for one more sandbox under the operator's limits, held while
        it is made (see .pools)."""
        return contextlib.nullcontext()

    async def take_pooled(self, spec: SandboxSpec) -> PooledRuntime | None:
        """A warm pool's runtime for ``spec``, for a create that needs its id
        first (a definition's ensure records it before it makes it)."""
        return await self._take_pooled(spec)

    def _pooled_ids(self) -> set[str]:
        """The ids of the runtimes warm pools keep ready (see .pools)."""
        return set()

    async def _take_pooled(self, spec: SandboxSpec) -> PooledRuntime | None:
        """A warm pool's runtime made with ``spec``'s provider settings (see .pools)."""
        return None

    async def return_pooled(self, pooled: PooledRuntime) -> None:
        """Free a runtime taken from a warm pool that no sandbox became (see .pools)."""

    async def adopt_left_sandbox(
        self, sandbox_id: str, provider: str, description: Mapping[str, Any],
        spec: SandboxSpec, state: SandboxState, *,
        created_unix: float | None = None, deadline_unix: float | None = None,
    ) -> Sandbox | None:
        """Take over a sandbox a program on this store made in-process and
        left when it ended (killed, crashed): tracked, stored and reaped as
        the daemon's own from here, in the state it was left in (a suspended
        one by its own suspended state), its time limits as that program
        recorded them (max_lifetime from ``created_unix``, the set_timeout
        ``deadline_unix``). None if nothing of it is left."""
        try:
            backend = await get_provider(provider).reconnect(sandbox_id, dict(description))
            # What it is now (another program may have suspended it since it
            # was recorded, or died in the middle of a step).
            found = found_state(state, await backend.observed_state())
            if found is None:
                return None
            state = found
        except HutchError as exc:
            log.info("sandbox %s a program left cannot be found again: %s", sandbox_id, exc)
            return None
        row = SandboxRow(
            id=sandbox_id, provider=provider, spec=spec.model_dump(),
            description=backend.describe(),
            created_at_unix=created_unix if created_unix is not None else time.time(),
            deadline_unix=deadline_unix,
            # A running one comes up through the engine, as a new one does.
            state=(SandboxState.CREATING if state is SandboxState.RUNNING else state).value,
        )
        await self.astore.put_sandbox(row)
        sandbox = self._wrap(backend, spec)
        self.sandboxes[sandbox_id] = sandbox
        try:
            await self.engine.attach(live_of(sandbox), spec.options, state=state,
                                     created_unix=row.created_at_unix,
                                     deadline_unix=deadline_unix)
        except BaseException:
            self.sandboxes.pop(sandbox_id, None)
            await self.astore.delete_sandbox(sandbox_id)
            raise
        await self._note(sandbox_id, "adopted",
                   f"taken over as {state.value} from the program that made it, now gone")
        log.info("took over sandbox %s (%s) from a program that ended", sandbox_id, state.value)
        self._watch(type(backend))
        if sandbox.capabilities.processes:
            if state is SandboxState.RUNNING:
                await self._end_leftover_commands(sandbox)
            elif state is SandboxState.PAUSED:
                self._leftovers.add(sandbox_id)
        return sandbox

    # -- sandbox definitions ---------------------------------------------------------------
    async def put_definition(self, definition_id: str, body: Mapping[str, Any]) -> Definition:
        """A definition from an API client: its provider settings as the
        operator's policy admits them; a source on the daemon's host (a
        directory, a file:// repository) is the operator's alone."""
        d = Definition.parse(body, definition_id=definition_id)
        source = d.workspace.source
        if isinstance(source, DirSource) or (
            isinstance(source, GitSource)
            and not source.git.lower().startswith(REMOTE_GIT_SCHEMES)
        ):
            # A directory, a local path or file:// reads the host's files; ssh
            # and scp-like addresses use its keys; ext:: runs its commands.
            raise SandboxPermissionDenied(
                f"definition {definition_id!r}: source {source} reaches the daemon's host; "
                f"an API client may give a git URL of {', '.join(REMOTE_GIT_SCHEMES)} only. "
                "Other sources are the operator's: put the definition in the daemon's hutch.toml"
            )
        settings = d.provider.model_dump(exclude_unset=True, exclude={"type"})
        # A definition that names no provider gets the daemon's default, not
        # the in-process one (local).
        named = {"provider": d.provider.type} if "provider" in d.model_fields_set else {}
        admitted = self.spec_from_request({**settings, **named})
        d = d.model_copy(update={"provider": admitted.provider})
        return await self.definitions.add(d)

    @staticmethod
    def definition_json(d: Definition) -> dict[str, Any]:
        return d.model_dump(mode="json")

    async def ensure(
        self, definition_id: str, thread_id: str, tenant: str | None,
        *, progress: Progress | None = None,
    ) -> dict[str, Any]:
        ensured = await self.definitions.ensure(definition_id, thread_id, tenant,
                                                progress=progress)
        return {
            "sandbox": await self.info(ensured.sandbox),
            "path": ensured.path,
            "steps": [step.as_dict() for step in ensured.steps],
            "snapshot_id": ensured.snapshot_id,
        }

    async def info(self, sandbox: Sandbox) -> dict[str, Any]:
        """The sandbox's own description, and what the daemon knows around it."""
        info = await sandbox.info()
        if sandbox.id not in self._hosted:  # a hosted one's own lists come from here already
            await self._load_refs(sandbox.id)
            info["attachments"] = self.attachments(sandbox.id)
            info["refs"] = self.refs_json(sandbox.id)
        return {**info, "workspace": self.workspace_of.get(sandbox.id), "ended_at_unix": None,
                "origin_snapshot_id": sandbox.origin_snapshot_id}

    @classmethod
    def stored_info(cls, row: SandboxRow) -> dict[str, Any]:
        """What :meth:`info` answers for a sandbox another daemon of a fleet
        serves (or that ended), as the store has it."""
        info = cls.ended_info(row)
        if row.state not in FINAL:
            info["ended_at_unix"] = None
        return info

    @staticmethod
    def ended_info(row: SandboxRow) -> dict[str, Any]:
        """What :meth:`info` answers, for a sandbox that ended and is known
        only from the store (for the retention period)."""
        try:
            capabilities = get_provider(row.provider).capabilities.as_dict()
        except (HutchError, KeyError):
            capabilities = {}
        return {
            "id": row.id,
            "provider": row.provider,
            "state": row.state,
            "reason": row.reason,
            "workdir": row.description.get("workdir"),
            "capabilities": capabilities,
            "created_at_unix": row.created_at_unix,
            "last_active_unix": row.last_active_unix,
            "idle_seconds": None,
            "deadline_unix": None,
            "meter": dict(row.meter),
            "memory_bytes": None,
            "disk_bytes": None,
            "open_operations": 0,
            "attachments": [],
            "refs": [],
            "workspace": row.workspace,
            "ended_at_unix": row.updated_at_unix,
            "origin_snapshot_id": row.origin_snapshot_id,
        }

    async def describe(self, sandbox_id: str) -> dict[str, Any]:
        """A sandbox's state and reason: a live one's, or an ended one's from the store."""
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is not None:
            return await self.info(sandbox)
        row = await self.astore.get_sandbox(sandbox_id)
        if row is None or row.state not in FINAL:
            raise NotFound(f"no sandbox {sandbox_id}")
        return self.ended_info(row)

    async def meter_history(self, sandbox_id: str) -> dict[str, Any]:
        """A sandbox's memory and disk over time, as the daemon sampled them
        (see .meters): a live one's last hour; none of one that ended."""
        if sandbox_id not in self.sandboxes:
            row = await self.astore.get_sandbox(sandbox_id)
            if row is None or row.state not in FINAL:
                raise NotFound(f"no sandbox {sandbox_id}")
        return self.meters.history_json(sandbox_id)

    async def list_infos(self, *, include_ended: bool = False) -> list[dict[str, Any]]:
        """Live sandboxes; with ``include_ended`` also those that ended within
        the retention period, oldest first."""
        live = [await self.info(s) for s in list(self.sandboxes.values())]
        kept_ready = self._pooled_ids()  # made ahead, not sandboxes until taken
        # A fleet's other daemons' sandboxes, ones being made (and ended ones),
        # as the store has them: every sandbox once, whoever serves it. The
        # rows this daemon holds live are left in the store (reading them
        # cost 40 ms per 1000, the listing 1.6 times bc2d03a's).
        rows = await self.astore.list_sandboxes(
            include_final=include_ended, not_held_by=None if include_ended else self.daemon_id)
        others = [self.stored_info(row) for row in rows
                  if row.id not in self.sandboxes and row.id not in kept_ready]
        return sorted([*live, *others], key=lambda info: float(info["created_at_unix"] or 0))

    async def delete_sandbox(self, sandbox_id: str) -> None:
        """End a sandbox. Idempotent: one that already ended (expired, failed,
        deleted) and is still on record is not an error. A workspace's work is
        not lost with its sandbox: its state is captured first, and the
        workspace (stale) resumes from it."""
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None:
            row = await self.astore.get_sandbox(sandbox_id)
            if row is not None and row.state in FINAL:
                await self._free_failed(row)  # its kept working directory goes now
                return
            raise NotFound(f"no sandbox {sandbox_id}")
        workspace = self.workspace_of.get(sandbox_id)
        if workspace is not None and sandbox.capabilities.snapshot:
            async with self._lock(workspace):
                with contextlib.suppress(HutchError):
                    await self._save_workspace_state(workspace, sandbox_id, diff=True)
                await sandbox.close()
        else:
            await sandbox.close()
        self._forget(sandbox_id)

    async def set_timeout(self, sandbox_id: str, seconds: float) -> float:
        """Set the deadline; it takes effect once recorded, and outlives a restart."""
        return await (await self.get(sandbox_id)).set_timeout(seconds)
