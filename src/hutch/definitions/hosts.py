"""Where ``ensure`` makes and finds sandboxes: the :class:`SandboxHost`
interface, and :class:`LocalHost`, in-process over ``create_sandbox`` and
the durable store (the daemon's core is the other)."""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import os
import time
import weakref
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractContextManager, asynccontextmanager
from typing import Any

import anyio

from .._errors import HutchError, SandboxUnavailable
from .._inflight import CallMark, InFlightCalls
from .._sandbox import Sandbox, backend_of, live_of
from .._types import ProviderSnapshot, Snapshot
from ..config import SandboxSpec
from ..core.live import LiveSandbox
from ..lifecycle.engine import DEFAULT_TIMEOUT_CEILING, LifecycleEngine
from ..lifecycle.shared import SharedLimits, SharedView
from ..lifecycle.state import found_state
from ..providers.registry import get_provider
from ..states import FINAL, HELD, SandboxState, SnapshotStatus
from ..store import InstanceRow, SnapshotRow, Store
from ..store.aio import AsyncStore
from .holders import (
    CLAIM_SECONDS,
    HELD_BY_DAEMON,
    claim_name,
    lease_holder,
    program_alive,
    this_program,
)

log = logging.getLogger("hutch.definitions")


class SandboxHost(abc.ABC):
    """Where ensure makes and finds sandboxes and their snapshots."""

    store: Store
    #: The store's async face: what async code calls, off the event loop.
    astore: AsyncStore

    @abc.abstractmethod
    async def find_live(self, row: InstanceRow) -> Sandbox | None:
        """The live sandbox ``row`` names, running again, or None if it is gone."""

    @abc.abstractmethod
    async def create(self, spec: SandboxSpec) -> Sandbox: ...

    @abc.abstractmethod
    async def restore(self, snapshot: SnapshotRow, spec: SandboxSpec) -> Sandbox: ...

    @abc.abstractmethod
    async def snapshot(self, sandbox: Sandbox, label: str) -> str:
        """Capture ``sandbox`` and record the snapshot as good; its id."""

    @abc.abstractmethod
    async def destroy(self, sandbox: Sandbox) -> None: ...

    @abc.abstractmethod
    async def drop_snapshot(self, snapshot: SnapshotRow) -> None:
        """Remove a snapshot a newer one replaced, if nothing depends on it."""

    def describe(self, sandbox: Sandbox) -> dict[str, Any]:
        """What the instance row keeps to find ``sandbox`` again."""
        return {}

    async def hold(self, key: str, sandbox: Sandbox) -> None:
        """This host holds ``sandbox``, instance ``key``'s, now (ensure gave
        it). Nothing is written by default: a daemon's instances say whose
        they are in their description."""
        return None


class LocalHost(SandboxHost):
    """Sandboxes made in this process, found again by this process or another
    through the store (the backend's ``reconnect``).

    Its sandboxes' lifecycle runs on an engine of its own, whose every
    transition is written to the instances they run (state and description),
    as a daemon writes its sandboxes': a program that finds one later finds
    it as it is, a suspended one by its own suspended state. Programs holding
    the same sandbox at once share its idle rule through the store (this host
    is the engine's :class:`~hutch.lifecycle.shared.SharedActivity`): each
    writes its activity there, and a timer acts only on the latest of all,
    under a claim one program holds at a time."""

    def __init__(self, store: Store) -> None:
        self.store = store
        #: The store's async face: every call this host makes from async code
        #: runs off the caller's event loop, as the daemon's do.
        self.astore = AsyncStore(store)
        self._live: dict[str, Sandbox] = {}
        #: The state and description (canonical JSON) this host last recorded
        #: or found of each of its sandboxes: a record that says otherwise was
        #: written by another program, which has taken the sandbox over since.
        self._recorded: dict[str, tuple[str, str]] = {}
        #: sandbox id -> the store's count of others' changes when its record
        #: was last found to be what this host knows (see :meth:`moved`).
        self._checked: dict[str, int] = {}
        #: The same, for the time limits a timer last read (see :meth:`limits`).
        self._limits_checked: dict[str, int] = {}
        #: sandbox id -> (the store's count, the record read off the loop at
        #: that count): what a synchronous status takes rather than read the
        #: store on the caller's loop (see :meth:`limits_now`).
        self._seen: dict[str, tuple[int, InstanceRow | None]] = {}
        #: (instance key, sandbox id) this program has recorded its hold of.
        self._holding: set[tuple[str, str]] = set()
        #: This program's calls in flight, as the others sharing the store see them.
        self._calls = InFlightCalls(store.local_dir("calls"))
        self._engines: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, LifecycleEngine
        ] = weakref.WeakKeyDictionary()

    def engine(self) -> LifecycleEngine:
        """The lifecycle engine of this host on the running loop."""
        loop = asyncio.get_running_loop()
        engine = self._engines.get(loop)
        if engine is None:
            ceiling = os.environ.get("HUTCH_TIMEOUT_CEILING")
            engine = self._engines[loop] = LifecycleEngine(
                timeout_ceiling=float(ceiling) if ceiling else DEFAULT_TIMEOUT_CEILING,
                on_transition=self._record_transition, shared=self,
            )
        return engine

    async def hold(self, key: str, sandbox: Sandbox) -> None:
        # A daemon asked for the thread sees that this program holds it.
        # Written once per sandbox of the key (a hold of a living program
        # goes only with its instance, whose next sandbox is another).
        if (key, sandbox.id) in self._holding:
            return
        await self.astore.hold_instance(key, this_program())
        self._holding.add((key, sandbox.id))

    # -- the idle rule, shared with the other programs holding a sandbox ----------------
    async def moved(self, sandbox_id: str) -> bool:
        known = self._recorded.get(sandbox_id)
        if known is None:
            return False  # in no instance: this program's own
        # The store's counter, read at once (it never waits, nor reads the
        # disk): what follows reads the record, off the loop, only when
        # another program wrote since.
        version = self.store.changes_by_others()
        if version is None:
            return True  # cannot tell at once: looked at under the claim
        if self._checked.get(sandbox_id) == version:
            return False  # no other program wrote anything since
        row = await self.astore.instance_of_sandbox(sandbox_id)
        self._seen[sandbox_id] = (version, row)
        if row is None or (row.state, _canonical(row.description)) != known:
            return True
        if await self.astore.lease_holder(claim_name(sandbox_id)) is not None:
            # Another program is changing it now (suspending it, say): the
            # call waits for that under the claim, then follows, rather than
            # reach a container going down.
            return True
        self._checked[sandbox_id] = version
        return False

    def begin_call(self, sandbox_id: str) -> CallMark:
        return self._calls.begin(sandbox_id)

    def end_call(self, sandbox_id: str) -> None:
        self._calls.end(sandbox_id)

    def calls_held_off(self, sandbox_id: str) -> AbstractContextManager[bool]:
        return self._calls.held_off(sandbox_id)

    async def publish(self, sandbox_id: str, last_active_unix: float) -> None:
        await self.astore.note_instance_activity(sandbox_id, last_active_unix)

    async def limits(self, sandbox_id: str) -> SharedLimits | None:
        version, changed = self._limits_version(sandbox_id)
        if not changed:
            return None
        row = await self.astore.instance_of_sandbox(sandbox_id)
        if version is not None:
            self._seen[sandbox_id] = (version, row)
        return self._limits_read(sandbox_id, version, row)

    def limits_now(self, sandbox_id: str) -> SharedLimits | None:
        version, changed = self._limits_version(sandbox_id)
        if not changed:
            return None
        seen = self._seen.get(sandbox_id)
        if version is not None and seen is not None and seen[0] == version:
            # Read off the loop since the last write of another program (an
            # operation's look): the record as it is now, without a read here.
            return self._limits_read(sandbox_id, version, seen[1])
        return self._limits_read(sandbox_id, version, self.store.instance_of_sandbox(sandbox_id))

    def _limits_version(self, sandbox_id: str) -> tuple[int | None, bool]:
        """The store's counter, and whether another program may have written
        the sandbox's limits since this host last read them."""
        if sandbox_id not in self._recorded:
            return None, False  # in no instance: this program's own
        version = self.store.changes_by_others()
        return version, version is None or self._limits_checked.get(sandbox_id) != version

    def _limits_read(
        self, sandbox_id: str, version: int | None, row: InstanceRow | None
    ) -> SharedLimits | None:
        if version is not None:
            self._limits_checked[sandbox_id] = version
        return None if row is None else SharedLimits(row.created_at_unix, row.deadline_unix)

    async def record_deadline(self, sandbox_id: str, deadline_unix: float) -> None:
        await self.astore.set_instance_deadline(sandbox_id, deadline_unix)

    @asynccontextmanager
    async def claim(self, sandbox_id: str) -> AsyncIterator[SharedView | None]:
        name, holder = claim_name(sandbox_id), lease_holder()
        if not await self.astore.take_lease(name, holder, CLAIM_SECONDS):
            yield None
            return
        try:
            row = await self.astore.instance_of_sandbox(sandbox_id)
            known = self._recorded.get(sandbox_id)
            if known is None:  # in no instance: this program's own
                yield SharedView(current=True, last_active_unix=None)
            elif row is None:  # its instance is gone: another program ended it
                yield SharedView(current=False, last_active_unix=None)
            else:
                current = (row.state, _canonical(row.description)) == known
                yield SharedView(
                    current=current, last_active_unix=row.last_active_unix,
                    limits=SharedLimits(row.created_at_unix, row.deadline_unix),
                    reason=row.reason,
                )
        finally:
            with anyio.CancelScope(shield=True):
                await self.astore.release_lease(name, holder)

    async def _record_transition(
        self, sandbox_id: str, old: SandboxState, new: SandboxState, reason: str | None
    ) -> None:
        if new in FINAL:  # ended: no program calls it again
            self._calls.drop(sandbox_id, ended=True)
        sandbox = self._live.get(sandbox_id)
        known = self._recorded.get(sandbox_id)
        if sandbox is None or known is None:
            return  # not in an instance yet (being made): its record comes with it
        description = backend_of(sandbox).describe()
        written = await self.astore.record_instance_sandbox(
            sandbox_id, new.value, description, was=(known[0], json.loads(known[1])),
            reason=reason,
        )
        if written:
            self._recorded[sandbox_id] = (new.value, _canonical(description))
        else:
            # Another program has written since (it took the sandbox over):
            # its record stands; this handle is dropped at the next ensure.
            log.warning("sandbox %s: %s -> %s here not recorded: another program holds it "
                        "now", sandbox_id, old.value, new.value)

    async def refresh(self, sandbox: LiveSandbox) -> SandboxState | None:
        row = await self.astore.instance_of_sandbox(sandbox.id)
        if row is None or row.description.get("held_by") == HELD_BY_DAEMON:
            return None  # ended and dropped, or a daemon's now
        try:
            state = SandboxState(row.state)
        except ValueError:
            state = SandboxState.RUNNING
        if state not in FINAL:
            # The sandbox as that program left it (a container it resumed
            # from its suspend image, say), in place of what this handle knew.
            sandbox.rebind(await get_provider(row.provider).reconnect(
                sandbox.id, row.description))
        self._recorded[sandbox.id] = (row.state, _canonical(row.description))
        return state

    def _forget(self, sandbox: Sandbox) -> None:
        """Drop this host's handle of ``sandbox`` (it ended, or another
        program took it over), touching nothing of the sandbox itself."""
        self._live.pop(sandbox.id, None)
        self._recorded.pop(sandbox.id, None)
        self._checked.pop(sandbox.id, None)
        self._limits_checked.pop(sandbox.id, None)
        self._seen.pop(sandbox.id, None)
        self._calls.drop(sandbox.id, ended=False)
        self.engine().forget(live_of(sandbox))

    async def find_live(self, row: InstanceRow) -> Sandbox | None:
        assert row.sandbox_id is not None
        sandbox = self._live.get(row.sandbox_id)
        if sandbox is not None:
            ended = sandbox.closed or sandbox.state in FINAL
            current = (
                row.state == sandbox.state.value
                and (row.state, _canonical(row.description)) == self._recorded.get(sandbox.id)
            )
            if not ended and current:
                if sandbox.state in HELD:
                    await sandbox.resume()
                return sandbox
            self._forget(sandbox)
            if ended:
                return None
        return await self._adopt(row)

    async def _adopt(self, row: InstanceRow) -> Sandbox | None:
        """The sandbox ``row`` names, found again through its provider as the
        record says it is: running, paused, or suspended (then resumed from
        its own suspended state); None if nothing of it is left."""
        from .._api import adopt_sandbox

        assert row.sandbox_id is not None
        try:
            recorded = SandboxState(row.state)
        except ValueError:
            recorded = SandboxState.RUNNING
        if recorded in FINAL:
            return None
        # Its limits as recorded now (another program may have moved its
        # deadline since ``row`` was read), as of the store's counter read
        # first: the status of the sandbox found reads them again only once
        # another program writes after this.
        version = self.store.changes_by_others()
        latest = await self.astore.get_instance(row.key)
        limits = latest if latest is not None and latest.sandbox_id == row.sandbox_id else row
        description, created_unix, deadline_unix = (
            row.description, limits.created_at_unix, limits.deadline_unix)
        from_daemon = row.description.get("held_by") == HELD_BY_DAEMON
        if from_daemon:
            # The daemon's while it lives (its hold is recorded as any
            # program's); one killed left it to whoever asks next: this
            # program takes it, as the daemon itself takes a dead program's.
            if not await self.astore.claim_instance(
                row.key, row.sandbox_id, this_program(), was=row.description,
                alive=program_alive,
            ):
                raise SandboxUnavailable(
                    f"the sandbox of thread {row.thread_id!r} of definition "
                    f"{row.definition_id!r} ({row.sandbox_id}) is held by the hutch daemon "
                    "whose store this is: ensure it through the daemon's client "
                    "(hutch.Client(...).ensure)"
                )
            kept = await self.astore.get_sandbox(row.sandbox_id)
            if kept is None:
                return None  # the daemon ended it and was killed before it said so
            try:
                recorded = SandboxState(kept.state)
            except ValueError:
                recorded = SandboxState.RUNNING
            if recorded in FINAL:
                return None
            # Found again as the daemon recorded it, its deadline with it
            # (max_lifetime counts from its creation, as the instance says).
            description, deadline_unix = kept.description, kept.deadline_unix
            if created_unix is None:
                created_unix = kept.created_at_unix
        backend_cls = get_provider(row.provider)
        try:
            backend = await backend_cls.reconnect(row.sandbox_id, description)
            # As its runtime is now (suspended since it was recorded, or a
            # step cut short by the death of the program that held it).
            found = found_state(recorded, await backend.observed_state())
            if found is None:
                return None
            state = found
        except HutchError:
            return None
        if from_daemon:
            # This program's from here: the instance says how to find it, and
            # the dead daemon's record goes (its next start neither adopts
            # it nor frees it: an instance names it).
            row.description, row.state = backend.describe(), state.value
            row.created_at_unix, row.deadline_unix = created_unix, deadline_unix
            row.updated_at_unix = time.time()
            await self.astore.put_instance(row)
            await self.astore.delete_sandbox(row.sandbox_id)
        sandbox = await adopt_sandbox(
            backend, SandboxSpec.model_validate(row.spec), self.engine(), state=state,
            # Its time limits are the sandbox's, not this program's: max_lifetime
            # from its creation, the deadline another program set.
            created_unix=created_unix, deadline_unix=deadline_unix,
        )
        self._live[sandbox.id] = sandbox
        self._recorded[sandbox.id] = (row.state, _canonical(row.description))
        if version is not None:
            self._limits_checked[sandbox.id] = version
        if state is not SandboxState.RUNNING:
            try:
                await sandbox.resume()
            except HutchError as exc:  # its suspended state is gone after all
                log.warning("sandbox %s of %s cannot be resumed: %s", sandbox.id, row.key, exc)
                self._forget(sandbox)
                return None
        return sandbox

    async def create(self, spec: SandboxSpec) -> Sandbox:
        from .._api import create_sandbox

        sandbox = await create_sandbox(spec=spec, engine=self.engine())
        self._live[sandbox.id] = sandbox
        return sandbox

    async def restore(self, snapshot: SnapshotRow, spec: SandboxSpec) -> Sandbox:
        from .._api import create_sandbox_from_snapshot

        sandbox = await create_sandbox_from_snapshot(
            _snapshot_of(snapshot), options=spec.options, engine=self.engine()
        )
        self._live[sandbox.id] = sandbox
        return sandbox

    async def snapshot(self, sandbox: Sandbox, label: str) -> str:
        record = await sandbox.snapshot(label)
        # Recorded only once captured whole: a capture cut short names nothing.
        await self.astore.put_snapshot(SnapshotRow(
            id=record.id, provider=record.provider, status=SnapshotStatus.READY.value, label=label,
            sandbox_id=record.sandbox_id, parent_id=record.parent_id,
            size_bytes=record.size_bytes, created_at_unix=record.created_at_unix,
            handle=record.handle.as_dict() if record.handle is not None else {},
            spec=dict(record.spec),
        ))
        return record.id

    async def destroy(self, sandbox: Sandbox) -> None:
        await sandbox.close()
        self._live.pop(sandbox.id, None)
        self._recorded.pop(sandbox.id, None)
        self._checked.pop(sandbox.id, None)
        self._limits_checked.pop(sandbox.id, None)
        self._seen.pop(sandbox.id, None)
        self._calls.drop(sandbox.id, ended=True)

    async def drop_snapshot(self, snapshot: SnapshotRow) -> None:
        from .._api import remove_snapshot

        # The record first: a removal cut short leaves storage, never a record of nothing.
        await self.astore.delete_snapshot(snapshot.id)
        await remove_snapshot(_snapshot_of(snapshot))

    def describe(self, sandbox: Sandbox) -> dict[str, Any]:
        description = backend_of(sandbox).describe()
        # What the instance is recorded with (the state beside it is the sandbox's).
        self._recorded[sandbox.id] = (sandbox.state.value, _canonical(description))
        # Made here: its limits are this program's engine's, and only a later
        # write by another program (the counter moves) can change them.
        version = self.store.changes_by_others()
        if version is not None:
            self._limits_checked.setdefault(sandbox.id, version)
        return description


def _canonical(description: Mapping[str, Any]) -> str:
    """A description as the store keeps it (JSON), comparable."""
    return json.dumps(description, sort_keys=True, default=str)


def _snapshot_of(row: SnapshotRow) -> Snapshot:
    return Snapshot(
        id=row.id, label=row.label, sandbox_id=row.sandbox_id, parent_id=row.parent_id,
        size_bytes=row.size_bytes, created_at_unix=row.created_at_unix, provider=row.provider,
        handle=ProviderSnapshot.from_dict(row.handle), spec=row.spec,
    )
