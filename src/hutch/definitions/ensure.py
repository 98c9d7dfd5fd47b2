"""``ensure``: the sandbox for one thread of a definition, made once and reused.

The order (SPEC §6): resume the live sandbox for the instance key (a
suspended one is resumed); else start from the newest snapshot for the key
younger than ``snapshot_max_age`` (setup skipped); else create, fetch the
source, run setup, snapshot. One ``ensure`` per key runs at a time: an
``anyio`` lock within a process, a lease in the store across processes.

Where sandboxes are made and found is a :class:`SandboxHost`: in-process
(:class:`LocalHost`, over ``create_sandbox`` and the durable store) or the
daemon's core; the order and the report are written once, here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import weakref
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import anyio.to_thread

from .._errors import HutchError, InvalidArgument, NotFound
from .._faults import fault_point
from .._sandbox import Sandbox
from ..config import SandboxOptions, SandboxSpec
from ..providers.registry import get_provider
from ..states import SnapshotStatus
from ..store import DefinitionRow, InstanceRow, SnapshotRow, Store
from .holders import (
    HELD_BY_DAEMON,
    held_elsewhere,
    lease_holder,
    live_holders,
    program_alive,
    this_program,
)
from .hosts import LocalHost, SandboxHost
from .model import Definition
from .sources import Progress, fetch_source, run_setup_step

log = logging.getLogger("hutch.definitions")

#: Re-exported: their homes are the modules beside this one.
__all__ = [
    "HELD_BY_DAEMON", "Definitions", "Ensured", "LocalHost", "Progress", "SandboxHost", "Step",
    "fetch_source", "held_elsewhere", "label_for", "live_holders", "open_definitions",
    "program_alive", "run_setup_step", "this_program",
]

Path = Literal["resumed", "restored", "created"]
#: How long a lease on a key lasts before another process may take it over
#: (a holder of this host that died frees it at once).
LEASE_SECONDS = 1800.0


@dataclass
class Step:
    name: str
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "seconds": round(self.seconds, 4)}


@dataclass
class Ensured:
    """What ``ensure`` gives: the sandbox, the path it took, and its steps."""

    sandbox: Sandbox
    path: Path
    key: str
    steps: list[Step] = field(default_factory=list)
    snapshot_id: str | None = None



def label_for(key: str) -> str:
    """The label of the snapshots taken for an instance key."""
    return f"definition:{key}"


class Definitions:
    """Definitions by id, and ``ensure``/``complete`` over a host."""

    def __init__(self, host: SandboxHost, *, lease_seconds: float = LEASE_SECONDS) -> None:
        self.host = host
        #: How long a key's lease lasts unless renewed (it is, while held).
        self.lease_seconds = lease_seconds
        #: Removals of replaced snapshots under way (see :meth:`settle`).
        self._cleanups: set[asyncio.Task[None]] = set()
        self._definitions: dict[str, Definition] = {}
        self._locks: weakref.WeakValueDictionary[str, anyio.Lock] = weakref.WeakValueDictionary()
        for row in host.store.list_definitions():
            try:
                self._definitions[row.id] = Definition.parse(row.body, definition_id=row.id)
            except InvalidArgument as exc:  # kept by an older hutch: say so, start anyway
                log.warning("stored definition %s is not valid now, left out: %s", row.id, exc)

    # -- the definitions -------------------------------------------------------------
    def put(self, definition: Definition | Mapping[str, Any]) -> Definition:
        if not isinstance(definition, Definition):
            definition = Definition.parse(definition)
        self.host.store.put_definition(
            DefinitionRow(definition.id, definition.model_dump(mode="json"), time.time())
        )
        self._definitions[definition.id] = definition
        return definition

    async def add(self, definition: Definition | Mapping[str, Any]) -> Definition:
        """:meth:`put`, its store write in a worker thread (off the event loop)."""
        return await anyio.to_thread.run_sync(self.put, definition)

    def get(self, definition_id: str) -> Definition:
        if definition_id not in self._definitions:
            self._reload(definition_id)
        return self._known(definition_id)

    async def find(self, definition_id: str) -> Definition:
        """:meth:`get`, its store read (a definition not known here yet, or
        any in a fleet, where another daemon may have put a new version
        since) in a worker thread (off the event loop)."""
        if self.host.store.shared or definition_id not in self._definitions:
            await anyio.to_thread.run_sync(self._reload, definition_id)
        return self._known(definition_id)

    async def listed(self) -> list[Definition]:
        """:meth:`all`; in a fleet, as the store has them now (read off the
        event loop): put through any of its daemons."""
        if self.host.store.shared:
            await anyio.to_thread.run_sync(self._reload, None)
        return self.all()

    def _reload(self, definition_id: str | None) -> None:
        """Read ``definition_id`` (None: every one) from the store: put since
        through another program on the store (a fleet's daemon)."""
        for row in self.host.store.list_definitions():
            if definition_id is None or row.id == definition_id:
                with contextlib.suppress(InvalidArgument):
                    self._definitions[row.id] = Definition.parse(row.body, definition_id=row.id)

    def _known(self, definition_id: str) -> Definition:
        try:
            return self._definitions[definition_id]
        except KeyError:
            raise NotFound(f"no definition {definition_id!r}") from None

    def all(self) -> list[Definition]:
        return [self._definitions[k] for k in sorted(self._definitions)]

    # -- ensure ------------------------------------------------------------------
    @asynccontextmanager
    async def _key_held(self, key: str) -> AsyncIterator[InstanceRow | None]:
        """The key held (this program's lock, then the store's lease), its
        instance as the store has it then: read with the lease taken, in the
        same hand-off to a store worker (the resumed path's cost is mostly
        such hand-offs)."""
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = anyio.Lock()
        async with lock:
            holder = lease_holder()
            name = f"instance:{key}"
            delay = 0.02
            store, seconds = self.host.astore, self.lease_seconds

            def take_lease_and_read(sync: Store) -> tuple[bool, InstanceRow | None]:
                if not sync.take_lease(name, holder, seconds):
                    return False, None
                return True, sync.get_instance(key)

            taken, row = await store.batch(take_lease_and_read)
            while not taken:
                await anyio.sleep(delay)
                delay = min(delay * 2, 0.5)
                taken, row = await store.batch(take_lease_and_read)

            async def renew() -> None:
                # A setup longer than the lease keeps it: renewed well before it ends.
                while True:
                    try:
                        await store.take_lease(name, holder, seconds)
                    except HutchError as exc:  # the store hiccups: try again next round
                        log.warning("lease %s not renewed: %s", name, exc)
                    await anyio.sleep(seconds / 3)

            # A task of its own, not a task group around the body: the body's
            # errors reach the caller as they are, not in an exception group.
            # Started only once the first renewal is due: a body shorter than
            # that (a resumed sandbox's) makes no task.
            loop = asyncio.get_running_loop()
            renewing: list[asyncio.Task[None]] = []
            due = loop.call_later(seconds / 3, lambda: renewing.append(loop.create_task(renew())))
            try:
                yield row
            finally:
                due.cancel()
                with anyio.CancelScope(shield=True):
                    for task in renewing:
                        task.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await task
                    await store.release_lease(name, holder)

    async def ensure(
        self,
        definition: Definition | str,
        thread_id: str,
        tenant: str | None = None,
        *,
        progress: Progress | None = None,
    ) -> Ensured:
        d = definition if isinstance(definition, Definition) else await self.find(definition)
        if not isinstance(thread_id, str) or not thread_id or len(thread_id) > 256:
            raise InvalidArgument("thread_id must be a non-empty string of at most 256 characters")
        key = d.instance_key(thread_id, tenant)
        tell = progress or (lambda kind, text: None)
        async with self._key_held(key) as row:
            steps: list[Step] = []
            if d.lifecycle.reuse == "thread" and row is not None and row.sandbox_id is not None:
                tell("step", "resume")
                started = time.monotonic()
                sandbox = await self.host.find_live(row)
                if sandbox is not None:
                    steps.append(Step("resume", time.monotonic() - started))
                    await self.host.hold(key, sandbox)
                    return Ensured(sandbox, "resumed", key, steps)
            spec = self._spec(d)
            snapshot = await anyio.to_thread.run_sync(self._newest_snapshot, d, key)
            if snapshot is not None:
                tell("step", "restore")
                started = time.monotonic()
                sandbox = await self.host.restore(snapshot, spec)
                steps.append(Step("restore", time.monotonic() - started))
                await self._record(d, key, thread_id, tenant, sandbox)
                await self.host.hold(key, sandbox)
                return Ensured(sandbox, "restored", key, steps, snapshot.id)
            sandbox, snapshot_id = await self._bootstrap(d, key, spec, steps, tell)
            await self._record(d, key, thread_id, tenant, sandbox)
            fault_point("definition-ensure.recorded")
            await self.host.hold(key, sandbox)
            return Ensured(sandbox, "created", key, steps, snapshot_id)

    def _spec(self, d: Definition) -> SandboxSpec:
        """The definition's settings, keep_alive made an idle rule of the lifecycle
        engine: idle-suspend where the provider can suspend, else reap."""
        options = SandboxOptions(max_lifetime=d.lifecycle.max_lifetime)
        keep_alive = d.lifecycle.keep_alive
        if keep_alive is not None:
            if get_provider(d.provider.type).capabilities.suspend:
                options = options.model_copy(update={"idle_suspend_after": keep_alive})
            else:
                options = options.model_copy(update={"idle_timeout": keep_alive})
        return SandboxSpec(provider=d.provider, options=options)

    def _newest_snapshot(self, d: Definition, key: str) -> SnapshotRow | None:
        label = label_for(key)
        oldest = time.time() - d.lifecycle.snapshot_max_age if d.lifecycle.snapshot_max_age \
            else -1.0
        good = [
            s for s in self.host.store.list_snapshots()
            if s.label == label and s.status == SnapshotStatus.READY and s.created_at_unix > oldest
        ]
        return max(good, key=lambda s: s.created_at_unix) if good else None

    async def _bootstrap(
        self, d: Definition, key: str, spec: SandboxSpec, steps: list[Step], tell: Progress
    ) -> tuple[Sandbox, str | None]:
        tell("step", "create")
        started = time.monotonic()
        sandbox = await self.host.create(spec)
        steps.append(Step("create", time.monotonic() - started))
        try:
            fault_point("definition-ensure.created")
            if d.workspace.source is not None:
                tell("step", "fetch")
                started = time.monotonic()
                await fetch_source(sandbox, d.workspace.source)
                steps.append(Step("fetch", time.monotonic() - started))
            for index, command in enumerate(d.workspace.setup):
                name = f"setup[{index}]"
                tell("step", f"{name}: {command}")
                started = time.monotonic()
                await run_setup_step(sandbox, name, command, tell)
                steps.append(Step(name, time.monotonic() - started))
            fault_point("definition-ensure.set-up")
            snapshot_id = None
            if d.lifecycle.snapshot == "after-setup" and sandbox.capabilities.supports("snapshot"):
                tell("step", "snapshot")
                started = time.monotonic()
                snapshot_id = await self.host.snapshot(sandbox, label_for(key))
                steps.append(Step("snapshot", time.monotonic() - started))
                fault_point("definition-ensure.snapshotted")
                await self._drop_replaced(key, snapshot_id)
        except BaseException:
            # A half-made environment is neither kept nor recorded.
            with anyio.CancelScope(shield=True):
                await self.host.destroy(sandbox)
            raise
        return sandbox, snapshot_id

    async def _drop_replaced(self, key: str, newest: str) -> None:
        """The key's older snapshots (stale, or of a sandbox since rebuilt) are
        never restored again: free them rather than keep them for ever. In the
        background: freeing storage is not on the way to the sandbox (an
        engine busy deleting images must not hold ``ensure`` up)."""
        replaced = [
            row for row in await self.host.astore.list_snapshots()
            if row.label == label_for(key) and row.id != newest
        ]
        if not replaced:
            return

        async def drop() -> None:
            for row in replaced:
                try:
                    await self.host.drop_snapshot(row)
                except Exception as exc:  # in use, gone, or the engine failed: it stays
                    log.warning("snapshot %s of %s not removed: %s", row.id, key, exc)

        task = asyncio.get_running_loop().create_task(drop())
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def settle(self) -> None:
        """Wait for the snapshot removals under way (a program about to exit,
        or a test, calls it; the storage of one cut short is freed by a
        daemon's start-up reconciliation)."""
        while self._cleanups:
            await asyncio.gather(*self._cleanups, return_exceptions=True)

    async def _record(self, d: Definition, key: str, thread_id: str, tenant: str | None,
                      sandbox: Sandbox) -> None:
        # Its creation as this program's engine knows it, asked before the
        # host records the sandbox: no other program knows of it yet, so the
        # status has no record of another's to read (on this event loop).
        created = sandbox.status().created_at_unix
        await self.host.astore.put_instance(InstanceRow(
            key=key, definition_id=d.id, thread_id=thread_id,
            tenant=tenant if tenant is not None else d.tenant, provider=d.provider.type,
            sandbox_id=sandbox.id, description=self.host.describe(sandbox),
            spec=self._spec(d).model_dump(mode="json"), updated_at_unix=time.time(),
            state=sandbox.state.value, last_active_unix=time.time(),
            # Every program's max_lifetime counts from here.
            created_at_unix=created,
        ))

    # -- the run's end ---------------------------------------------------------------
    async def complete(
        self, definition: Definition | str, thread_id: str, tenant: str | None = None
    ) -> bool:
        """The run ended: destroy the sandbox when the definition says so
        (``destroy_on_complete``, or ``reuse: none``); else it stays, under
        its keep_alive rule. Whether a sandbox was destroyed."""
        d = definition if isinstance(definition, Definition) else await self.find(definition)
        key = d.instance_key(thread_id, tenant)
        async with self._key_held(key) as row:
            if row is None or row.sandbox_id is None:
                return False
            if not (d.lifecycle.destroy_on_complete or d.lifecycle.reuse == "none"):
                return False
            sandbox = await self.host.find_live(row)
            if sandbox is not None:
                await self.host.destroy(sandbox)
            await self.host.astore.delete_instance(key)
            return sandbox is not None



def open_definitions(store_path: str | None = None) -> Definitions:
    """Definitions in-process over the durable store (by default the one in
    hutch's data directory, ``$HUTCH_HOME/hutch.db``): another program
    opening the same store finds the same threads' sandboxes."""
    from .._paths import hutch_home
    from ..store import SQLiteStore

    path = store_path or os.path.join(hutch_home(), "hutch.db")
    return Definitions(LocalHost(SQLiteStore(path)))
