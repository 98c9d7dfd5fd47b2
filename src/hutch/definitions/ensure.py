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

import abc
import asyncio
import contextlib
import functools
import json
import logging
import os
import shlex
import subprocess
import tarfile
import tempfile
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import anyio.to_thread

from .._errors import HutchError, InvalidArgument, NotFound, SandboxUnavailable, SetupFailed
from .._faults import fault_point
from .._inflight import CallMark, InFlightCalls
from .._liveness import still_running, this_process
from .._process import ExitStatus
from .._sandbox import Sandbox, backend_of, rebind
from .._snapshots import Snapshot
from ..config import SandboxOptions, SandboxSpec
from ..lifecycle.engine import DEFAULT_TIMEOUT_CEILING, LifecycleEngine
from ..lifecycle.shared import SharedLimits, SharedView
from ..lifecycle.state import found_state
from ..providers.base import ProviderSnapshot
from ..providers.registry import get_provider
from ..states import FINAL, HELD, SandboxState, SnapshotStatus
from ..store import DefinitionRow, InstanceRow, SnapshotRow, Store
from .model import Definition, DirSource, GitSource

log = logging.getLogger("hutch.definitions")

Path = Literal["resumed", "restored", "created"]
#: How long a lease on a key lasts before another process may take it over
#: (a holder of this host that died frees it at once).
LEASE_SECONDS = 1800.0
#: How much of a failed setup step's output its error carries.
OUTPUT_TAIL_BYTES = 4096
#: An instance whose sandbox a daemon holds says so in its description.
HELD_BY_DAEMON = "daemon"
#: How long a program's claim to act on a sandbox's idleness lasts (a
#: holder of this host that died frees it at once).
CLAIM_SECONDS = 600.0
#: Where the source is unpacked on its way in (removed once unpacked).
_SOURCE_ARCHIVE = ".hutch-source.tar"


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


#: Told of progress: ("step", name) as a step starts, ("output", text) as setup prints.
Progress = Callable[[str, str], None]


class SandboxHost(abc.ABC):
    """Where ensure makes and finds sandboxes and their snapshots."""

    store: Store

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

    def get(self, definition_id: str) -> Definition:
        try:
            return self._definitions[definition_id]
        except KeyError:
            raise NotFound(f"no definition {definition_id!r}") from None

    def all(self) -> list[Definition]:
        return [self._definitions[k] for k in sorted(self._definitions)]

    # -- ensure ------------------------------------------------------------------
    @asynccontextmanager
    async def _key_held(self, key: str) -> AsyncIterator[None]:
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = anyio.Lock()
        async with lock:
            holder = _holder()
            name = f"instance:{key}"
            delay = 0.02
            store, seconds = self.host.store, self.lease_seconds
            while not await anyio.to_thread.run_sync(store.take_lease, name, holder, seconds):
                await anyio.sleep(delay)
                delay = min(delay * 2, 0.5)

            async def renew() -> None:
                # A setup longer than the lease keeps it: renewed well before it ends.
                while True:
                    await anyio.sleep(seconds / 3)
                    try:
                        await anyio.to_thread.run_sync(store.take_lease, name, holder, seconds)
                    except HutchError as exc:  # the store hiccups: try again next round
                        log.warning("lease %s not renewed: %s", name, exc)

            # A task of its own, not a task group around the body: the body's
            # errors reach the caller as they are, not in an exception group.
            renewing = asyncio.get_running_loop().create_task(renew())
            try:
                yield
            finally:
                renewing.cancel()
                with anyio.CancelScope(shield=True):
                    with contextlib.suppress(asyncio.CancelledError):
                        await renewing
                    await anyio.to_thread.run_sync(store.release_lease, name, holder)

    async def ensure(
        self,
        definition: Definition | str,
        thread_id: str,
        tenant: str | None = None,
        *,
        progress: Progress | None = None,
    ) -> Ensured:
        d = definition if isinstance(definition, Definition) else self.get(definition)
        if not isinstance(thread_id, str) or not thread_id or len(thread_id) > 256:
            raise InvalidArgument("thread_id must be a non-empty string of at most 256 characters")
        key = d.instance_key(thread_id, tenant)
        tell = progress or (lambda kind, text: None)
        async with self._key_held(key):
            steps: list[Step] = []
            if d.lifecycle.reuse == "thread":
                row = self.host.store.get_instance(key)
                if row is not None and row.sandbox_id is not None:
                    tell("step", "resume")
                    started = time.monotonic()
                    sandbox = await self.host.find_live(row)
                    if sandbox is not None:
                        steps.append(Step("resume", time.monotonic() - started))
                        await self.host.hold(key, sandbox)
                        return Ensured(sandbox, "resumed", key, steps)
            spec = self._spec(d)
            snapshot = self._newest_snapshot(d, key)
            if snapshot is not None:
                tell("step", "restore")
                started = time.monotonic()
                sandbox = await self.host.restore(snapshot, spec)
                steps.append(Step("restore", time.monotonic() - started))
                self._record(d, key, thread_id, tenant, sandbox)
                await self.host.hold(key, sandbox)
                return Ensured(sandbox, "restored", key, steps, snapshot.id)
            sandbox, snapshot_id = await self._bootstrap(d, key, spec, steps, tell)
            self._record(d, key, thread_id, tenant, sandbox)
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
                self._drop_replaced(key, snapshot_id)
        except BaseException:
            # A half-made environment is neither kept nor recorded.
            with anyio.CancelScope(shield=True):
                await self.host.destroy(sandbox)
            raise
        return sandbox, snapshot_id

    def _drop_replaced(self, key: str, newest: str) -> None:
        """The key's older snapshots (stale, or of a sandbox since rebuilt) are
        never restored again: free them rather than keep them for ever. In the
        background: freeing storage is not on the way to the sandbox (an
        engine busy deleting images must not hold ``ensure`` up)."""
        replaced = [
            row for row in self.host.store.list_snapshots()
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

    def _record(self, d: Definition, key: str, thread_id: str, tenant: str | None,
                sandbox: Sandbox) -> None:
        self.host.store.put_instance(InstanceRow(
            key=key, definition_id=d.id, thread_id=thread_id,
            tenant=tenant if tenant is not None else d.tenant, provider=d.provider.type,
            sandbox_id=sandbox.id, description=self.host.describe(sandbox),
            spec=self._spec(d).model_dump(mode="json"), updated_at_unix=time.time(),
            state=sandbox.state.value, last_active_unix=time.time(),
            # Every program's max_lifetime counts from here.
            created_at_unix=sandbox.status().created_at_unix,
        ))

    # -- the run's end ---------------------------------------------------------------
    async def complete(
        self, definition: Definition | str, thread_id: str, tenant: str | None = None
    ) -> bool:
        """The run ended: destroy the sandbox when the definition says so
        (``destroy_on_complete``, or ``reuse: none``); else it stays, under
        its keep_alive rule. Whether a sandbox was destroyed."""
        d = definition if isinstance(definition, Definition) else self.get(definition)
        key = d.instance_key(thread_id, tenant)
        async with self._key_held(key):
            row = self.host.store.get_instance(key)
            if row is None or row.sandbox_id is None:
                return False
            if not (d.lifecycle.destroy_on_complete or d.lifecycle.reuse == "none"):
                return False
            sandbox = await self.host.find_live(row)
            if sandbox is not None:
                await self.host.destroy(sandbox)
            self.host.store.delete_instance(key)
            return sandbox is not None


# -- the workspace: source and setup ---------------------------------------------------
async def fetch_source(sandbox: Sandbox, source: GitSource | DirSource) -> None:
    """Clone or copy ``source`` on the host and unpack it into the sandbox's
    working directory (one upload and one ``tar`` whatever the provider)."""
    with tempfile.TemporaryDirectory(prefix="hutch-source-") as scratch:
        archive = os.path.join(scratch, "source.tar")
        await anyio.to_thread.run_sync(_pack_source, source, scratch, archive)
        packed = await anyio.to_thread.run_sync(open, archive, "rb")
        try:
            await sandbox.write_from(_SOURCE_ARCHIVE, packed)
        finally:
            packed.close()
    result = await sandbox.exec(
        ["tar", "-xf", _SOURCE_ARCHIVE, "--no-same-owner"], timeout=600
    )
    await sandbox.remove(_SOURCE_ARCHIVE)
    if result.exit_code != 0:
        raise SandboxUnavailable(
            f"sandbox {sandbox.id}: unpacking the source failed "
            f"(exit {result.exit_code}): {result.stderr[-500:]}"
        )


def _pack_source(source: GitSource | DirSource, scratch: str, archive: str) -> None:
    if isinstance(source, GitSource):
        tree = os.path.join(scratch, "tree")
        _git(["clone", "--quiet", "--no-checkout", "--", source.git, tree], source.git)
        _git(["-C", tree, "checkout", "--quiet", source.ref or "HEAD", "--"], source.git)
    else:
        tree = source.dir
        if not os.path.isdir(tree):
            raise InvalidArgument(f"source directory {tree} does not exist")
    with tarfile.open(archive, "w") as tar:
        for name in sorted(os.listdir(tree)):
            tar.add(os.path.join(tree, name), arcname=name)


def _git(args: list[str], url: str) -> None:
    done = subprocess.run(
        # ext:: would run a command the URL names; never, whatever git's default.
        ["git", "-c", "protocol.ext.allow=never", *args], capture_output=True, text=True,
        timeout=600,
        env={**os.environ, "GIT_TERMINAL_PROMPT": "0"},
    )
    if done.returncode != 0:
        raise InvalidArgument(
            f"source {url}: git {args[0] if args[0] != '-C' else args[2]} failed: "
            f"{done.stderr.strip()[-500:]}"
        )


async def run_setup_step(sandbox: Sandbox, name: str, command: str, tell: Progress) -> None:
    tail = bytearray()
    exit_code = None
    async for event in sandbox.exec_stream(command):
        if isinstance(event, ExitStatus):
            exit_code = event.exit_code
            break
        tail += event.data
        del tail[:-OUTPUT_TAIL_BYTES]
        tell("output", event.data.decode("utf-8", "replace"))
    if exit_code != 0:
        text = tail.decode("utf-8", "replace")
        raise SetupFailed(
            f"setup step {name} ({shlex.quote(command)}) exited {exit_code}; "
            f"the end of its output:\n{text}",
            step=command, exit_code=exit_code, output_tail=text,
        )


# -- in-process: over create_sandbox and the durable store -----------------------------
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
        await anyio.to_thread.run_sync(self.store.hold_instance, key, this_program())
        self._holding.add((key, sandbox.id))

    # -- the idle rule, shared with the other programs holding a sandbox ----------------
    def moved(self, sandbox_id: str) -> bool:
        known = self._recorded.get(sandbox_id)
        if known is None:
            return False  # in no instance: this program's own
        version = self.store.changes_by_others()
        if version is None:
            return True  # cannot tell at once: looked at under the claim
        if self._checked.get(sandbox_id) == version:
            return False  # no other program wrote anything since
        row = self.store.instance_of_sandbox(sandbox_id)
        if row is None or (row.state, _canonical(row.description)) != known:
            return True
        if self.store.lease_holder(_claim_name(sandbox_id)) is not None:
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
        await anyio.to_thread.run_sync(
            self.store.note_instance_activity, sandbox_id, last_active_unix
        )

    def limits(self, sandbox_id: str) -> SharedLimits | None:
        if sandbox_id not in self._recorded:
            return None  # in no instance: this program's own
        version = self.store.changes_by_others()
        if version is not None and self._limits_checked.get(sandbox_id) == version:
            return None  # no other program wrote anything since
        row = self.store.instance_of_sandbox(sandbox_id)
        if version is not None:
            self._limits_checked[sandbox_id] = version
        return None if row is None else SharedLimits(row.created_at_unix, row.deadline_unix)

    async def record_deadline(self, sandbox_id: str, deadline_unix: float) -> None:
        await anyio.to_thread.run_sync(self.store.set_instance_deadline, sandbox_id, deadline_unix)

    @asynccontextmanager
    async def claim(self, sandbox_id: str) -> AsyncIterator[SharedView | None]:
        name, holder = _claim_name(sandbox_id), _holder()
        if not await anyio.to_thread.run_sync(
            self.store.take_lease, name, holder, CLAIM_SECONDS
        ):
            yield None
            return
        try:
            row = await anyio.to_thread.run_sync(self.store.instance_of_sandbox, sandbox_id)
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
                await anyio.to_thread.run_sync(self.store.release_lease, name, holder)

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
        written = await anyio.to_thread.run_sync(functools.partial(
            self.store.record_instance_sandbox, sandbox_id, new.value, description,
            was=(known[0], json.loads(known[1])), reason=reason,
        ))
        if written:
            self._recorded[sandbox_id] = (new.value, _canonical(description))
        else:
            # Another program has written since (it took the sandbox over):
            # its record stands; this handle is dropped at the next ensure.
            log.warning("sandbox %s: %s -> %s here not recorded: another program holds it "
                        "now", sandbox_id, old.value, new.value)

    async def refresh(self, sandbox: Sandbox) -> SandboxState | None:
        row = await anyio.to_thread.run_sync(self.store.instance_of_sandbox, sandbox.id)
        if row is None or row.description.get("held_by") == HELD_BY_DAEMON:
            return None  # ended and dropped, or a daemon's now
        try:
            state = SandboxState(row.state)
        except ValueError:
            state = SandboxState.RUNNING
        if state not in FINAL:
            # The sandbox as that program left it (a container it resumed
            # from its suspend image, say), in place of what this handle knew.
            rebind(sandbox, await get_provider(row.provider).reconnect(
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
        self._calls.drop(sandbox.id, ended=False)
        self.engine().forget(sandbox)

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
        description, created_unix, deadline_unix = (
            row.description, row.created_at_unix, row.deadline_unix)
        from_daemon = row.description.get("held_by") == HELD_BY_DAEMON
        if from_daemon:
            # The daemon's while it lives (its hold is recorded as any
            # program's); one killed left it to whoever asks next: this
            # program takes it, as the daemon itself takes a dead program's.
            if not await anyio.to_thread.run_sync(functools.partial(
                self.store.claim_instance, row.key, row.sandbox_id, this_program(),
                was=row.description, alive=program_alive,
            )):
                raise SandboxUnavailable(
                    f"the sandbox of thread {row.thread_id!r} of definition "
                    f"{row.definition_id!r} ({row.sandbox_id}) is held by the hutch daemon "
                    "whose store this is: ensure it through the daemon's client "
                    "(hutch.Client(...).ensure)"
                )
            kept = await anyio.to_thread.run_sync(self.store.get_sandbox, row.sandbox_id)
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
            await anyio.to_thread.run_sync(self.store.put_instance, row)
            await anyio.to_thread.run_sync(self.store.delete_sandbox, row.sandbox_id)
        sandbox = await adopt_sandbox(
            backend, SandboxSpec.model_validate(row.spec), self.engine(), state=state,
            # Its time limits are the sandbox's, not this program's: max_lifetime
            # from its creation, the deadline another program set.
            created_unix=created_unix, deadline_unix=deadline_unix,
        )
        self._live[sandbox.id] = sandbox
        self._recorded[sandbox.id] = (row.state, _canonical(row.description))
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
        self.store.put_snapshot(SnapshotRow(
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
        self._calls.drop(sandbox.id, ended=True)

    async def drop_snapshot(self, snapshot: SnapshotRow) -> None:
        from .._api import remove_snapshot

        # The record first: a removal cut short leaves storage, never a record of nothing.
        self.store.delete_snapshot(snapshot.id)
        await remove_snapshot(_snapshot_of(snapshot))

    def describe(self, sandbox: Sandbox) -> dict[str, Any]:
        description = backend_of(sandbox).describe()
        # What the instance is recorded with (the state beside it is the sandbox's).
        self._recorded[sandbox.id] = (sandbox.state.value, _canonical(description))
        return description


def this_program() -> str:
    """This program, as the store names a holder: ``host:pid:start`` (its
    start time: a pid the kernel hands on later is not this program)."""
    pid, start = this_process()
    return f"{os.uname().nodename}:{pid}:{start}"


def program_alive(holder: str) -> bool:
    """Whether the program ``holder`` names (see :func:`this_program`) lives."""
    host, _, rest = holder.partition(":")
    pid, _, start = rest.partition(":")
    if host != os.uname().nodename:
        return True  # another host's: it cannot be looked at from here
    return pid.isdigit() and start.isdigit() and still_running(int(pid), int(start))


def live_holders(store: Store, key: str) -> list[str]:
    """The programs holding the instance's sandbox in-process now; the holds
    of programs that died (killed, crashed) are dropped on the way."""
    alive = []
    for holder in store.instance_holders(key):
        if program_alive(holder):
            alive.append(holder)
        else:
            store.release_instance(key, holder)
    return alive


def held_elsewhere(row: InstanceRow, holder: str) -> SandboxUnavailable:
    """The error of a caller that may not take over a sandbox ``holder`` holds."""
    host, _, rest = holder.partition(":")
    return SandboxUnavailable(
        f"the sandbox of thread {row.thread_id!r} of definition {row.definition_id!r} "
        f"({row.sandbox_id}) is held in-process by the program with pid "
        f"{rest.partition(':')[0]} on {host}: ensure it in that program, or end it first "
        "(its hold ends with it)"
    )


def _claim_name(sandbox_id: str) -> str:
    """The lease a program holds while it changes a shared sandbox's state."""
    return f"lifecycle:{sandbox_id}"


def _holder() -> str:
    """Who holds a lease: this program, once (``host:pid:start:nonce``)."""
    return f"{this_program()}:{uuid.uuid4().hex[:8]}"


def _canonical(description: Mapping[str, Any]) -> str:
    """A description as the store keeps it (JSON), comparable."""
    return json.dumps(description, sort_keys=True, default=str)


def _snapshot_of(row: SnapshotRow) -> Snapshot:
    return Snapshot(
        id=row.id, label=row.label, sandbox_id=row.sandbox_id, parent_id=row.parent_id,
        size_bytes=row.size_bytes, created_at_unix=row.created_at_unix, provider=row.provider,
        handle=ProviderSnapshot.from_dict(row.handle), spec=row.spec,
    )


def open_definitions(store_path: str | None = None) -> Definitions:
    """Definitions in-process over the durable store (by default the one in
    hutch's data directory, ``$HUTCH_HOME/hutch.db``): another program
    opening the same store finds the same threads' sandboxes."""
    from .._paths import hutch_home
    from ..store import SQLiteStore

    path = store_path or os.path.join(hutch_home(), "hutch.db")
    return Definitions(LocalHost(SQLiteStore(path)))
