"""The daemon's core, free of HTTP: sandboxes and workspaces that outlive the
process, written through the store before they are acknowledged.

Start-up reconciles the store with what really runs: sandboxes whose runtime
is alive are adopted, running workspaces whose sandbox is gone become
``stale``, half-made records (a create cut short) are dropped with whatever
they made, snapshots are made to agree with what each provider holds, and
each provider frees what it made for sandboxes no record names. Nothing here
knows a provider: state capture, workspaces and reconciliation go through the
provider seam (``hutch.providers.base``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import math
import os
import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import anyio.to_thread
from pydantic import BaseModel

from .._api import spec_for_attach
from .._errors import (
    CapabilityUnsupported,
    HutchError,
    InvalidArgument,
    InvalidState,
    NotFound,
    SandboxPermissionDenied,
    SandboxUnavailable,
    StoreUnavailable,
    Unauthorized,
)
from .._faults import fault_point
from .._guardrail import ReadBeforeWriteGuard, session_guard
from .._paths import hutch_home
from .._refwire import DaemonRef, attachment_json, check_ref_lifetime, decode_ref
from .._sandbox import (
    Sandbox,
    backend_of,
    guard_enabled,
    lifecycle_record,
    new_sandbox_id,
)
from .._snapshots import Snapshot, SnapshotDependent, new_snapshot_id
from ..config import OPTION_KEYS, SandboxSpec, requested_provider, resolve_spec
from ..definitions import Definition, Definitions, DirSource, GitSource, SandboxHost
from ..definitions.ensure import (
    HELD_BY_DAEMON,
    Progress,
    held_elsewhere,
    live_holders,
    program_alive,
    this_program,
)
from ..lifecycle.engine import LifecycleEngine, expiry_error
from ..lifecycle.state import found_state
from ..providers.base import ProviderSnapshot, RuntimeNotice, SandboxBackend
from ..providers.registry import available_providers, get_provider
from ..states import FINAL, HELD, SandboxState
from ..store import (
    InstanceRow,
    RefRow,
    SandboxRow,
    SnapshotRow,
    SQLiteStore,
    Store,
    WorkspaceRow,
)
from .policy import OperatorPolicy, pick_default_provider

log = logging.getLogger("hutch.daemon")

WORKSPACE_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
#: Store key written by a clean stop, cleared at start: after a crash it is absent.
CLEAN_STOP = "clean_stop_unix"
#: Store key: the sandboxes a definition's ensure is making (a JSON list),
#: not yet recorded as its thread's: a daemon killed part-way leaves them
#: half set up, and its next start removes them.
SETTING_UP = "definition_setups"
#: A ref's use is an event at most this often (its first use after a start always is).
REF_USE_EVENT_SECONDS = 60.0
#: The git sources an API client may give a definition (nothing on the host).
REMOTE_GIT_SCHEMES = ("https://", "http://", "git://")
#: How soon a change the store could not keep (a runtime's death) is recorded again.
STORE_RETRY_SECONDS = 2.0
#: A runtime's notices of a sandbox (not deaths) that say the same with
#: less than this many seconds between them are noted once, with their count.
NOTICE_BURST_SECONDS = 1.0
#: Longest snapshot label, and most branches one fork request makes.
MAX_LABEL = 200
MAX_FORK = 64
#: How long an ended (terminated or failed) sandbox stays readable, with its events.
DEFAULT_RETENTION_SECONDS = 86400.0


#: Sessions listed as attached to one sandbox at most (past it the stalest is
#: forgotten: a client that vanished never detaches), and a session id's length.
MAX_SESSIONS = 1024
MAX_SESSION_ID = 64


@dataclass
class AttachedSession:
    """A session working in a sandbox through a ref (a client's session id)."""

    ref_id: str
    session: str
    attached_at_unix: float
    last_used_unix: float


def default_data_dir() -> str:
    return hutch_home()


def make_private_dir(path: str) -> None:
    """Create ``path`` (if need be) as its owner's alone: 0700, whatever it was.

    Sandboxes write into working directories below it (a setuid copy of a
    shell, links to host files); no other host user may reach them.
    """
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)


def make_private_file(path: str) -> str:
    """Create ``path`` 0600 if it is missing, else make it 0600; return it.

    SQLite creates its -wal and -shm files with the database's mode.
    """
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o600))
    os.chmod(path, 0o600)
    return path


class Daemon:
    def __init__(
        self,
        data_dir: str | None = None,
        *,
        sandbox_defaults: Mapping[str, Any] | None = None,
        timeout_ceiling: float = 86400.0,
        retention_seconds: float = DEFAULT_RETENTION_SECONDS,
        store: Store | None = None,
        policy: OperatorPolicy | None = None,
        definitions: Mapping[str, Mapping[str, Any]] | None = None,
        default_provider: str | None = None,
    ) -> None:
        #: What API clients may ask for: host-reaching settings, limits.
        self.policy = policy or OperatorPolicy()
        self.data_dir = os.path.abspath(data_dir or default_data_dir())
        make_private_dir(self.data_dir)
        if store is None:
            store = SQLiteStore(make_private_file(os.path.join(self.data_dir, "hutch.db")))
        self.store = store
        self.sandbox_defaults = dict(sandbox_defaults or {})
        #: The provider of requests that name none (see default_provider()).
        self._default_provider = default_provider
        if not 0 < retention_seconds < math.inf:
            raise InvalidArgument(
                f"retention must be a positive number of seconds, got {retention_seconds!r}"
            )
        self.retention_seconds = retention_seconds
        self._pruner: asyncio.Task[None] | None = None
        #: One watcher per provider in use, telling of runtimes that die outside hutch.
        self._watchers: dict[type[SandboxBackend], asyncio.Task[None]] = {}
        #: Sandboxes adopted paused, whose earlier daemon's commands are ended on resume.
        self._leftovers: set[str] = set()
        #: (sandbox id, message) -> [times a runtime said it in the burst open
        #: now, when it last did (monotonic)].
        self._notice_bursts: dict[tuple[str, str], list[float]] = {}
        self.engine = LifecycleEngine(
            timeout_ceiling=timeout_ceiling, on_transition=self._persist_transition,
            on_deadline=self._persist_deadline,
        )
        self.sandboxes: dict[str, Sandbox] = {}
        #: sandbox id -> the workspace it serves, for the sandboxes that serve one.
        self.workspace_of: dict[str, str] = {}
        self._guards: dict[tuple[str, str], ReadBeforeWriteGuard] = {}
        self._workspace_locks: dict[str, asyncio.Lock] = {}
        #: ref id -> its row, as last read or written (the store is the truth).
        self._refs: dict[str, RefRow] = {}
        #: sandbox id -> its refs (the same rows), read once: status reads stay off the disk.
        self._refs_of: dict[str, list[RefRow]] = {}
        #: ref id -> when its use was last an event.
        self._ref_used: dict[str, float] = {}
        #: sandbox id -> "ref id/session" -> a session attached through a ref.
        self._sessions: dict[str, dict[str, AttachedSession]] = {}
        #: Sandboxes this process made outside the daemon and serves (see host()).
        self._hosted: set[str] = set()
        #: Sandbox definitions (SPEC §6): those PUT earlier (in the store), then
        #: the operator's own from hutch.toml, which may use the host.
        self.definitions = Definitions(_DaemonHost(self))
        for name, table in (definitions or {}).items():
            if "provider" not in table:  # the daemon's default, with the operator's settings
                provider = resolve_spec(server_defaults=self.sandbox_defaults,
                                        default_provider=self.default_provider()).provider
                table = {**table, "provider": provider.model_dump(mode="json", exclude_unset=True)
                         | {"type": provider.type}}
            self.definitions.put(Definition.parse(table, definition_id=name))

    # -- persistence of transitions ---------------------------------------------------
    async def _persist_transition(
        self, sandbox_id: str, old: SandboxState, new: SandboxState, reason: str | None
    ) -> None:
        """Write a transition durably; the engine acknowledges it only after this."""
        row = self.store.get_sandbox(sandbox_id)
        sandbox = self.sandboxes.get(sandbox_id)
        if row is None:
            return
        row.state, row.reason = new.value, reason
        if sandbox is not None:
            row.description = backend_of(sandbox).describe()
            self._snapshot(row, sandbox)
        event = ("transition", f"{old.value} -> {new.value}" + (f" ({reason})" if reason else ""))
        # The row and its event in one transaction; StoreUnavailable if the
        # store cannot keep them, and then the engine undoes the transition.
        await anyio.to_thread.run_sync(self.store.put_sandbox, row, event)
        # Durable from here: nothing below may undo it.
        if sandbox_id in self._leftovers and new is not SandboxState.PAUSED:
            self._leftovers.discard(sandbox_id)
            if new is SandboxState.RUNNING and sandbox is not None:
                # Within the resume, before it is acknowledged: no new command
                # can have started that this would take for a leftover.
                await self._end_leftover_commands(sandbox)
        if new in FINAL:
            self._forget(sandbox_id)
            if reason not in (None, "closed"):
                log.warning("sandbox %s reaped: %s", sandbox_id, reason)
            if row.workspace is not None:
                if new is SandboxState.FAILED and sandbox is not None:
                    # Before it is marked stale: a resume then starts from what it kept.
                    await self._salvage_failed_workspace(row, sandbox)
                try:
                    self._workspace_lost_its_sandbox(row.workspace, sandbox_id, reason)
                except StoreUnavailable as exc:
                    # The next start finds the workspace's sandbox ended and marks it stale.
                    log.warning("workspace %s: could not record it stale: %s", row.workspace, exc)

    async def _salvage_failed_workspace(self, row: SandboxRow, sandbox: Sandbox) -> None:
        """A workspace's sandbox whose runtime died outside hutch kept its
        working directory (``release_runtime``): that becomes the workspace's
        state, as after a death found at start. Never raises: the failure
        is recorded already, and the last state stays if this cannot be done."""
        ws = self.store.get_workspace(row.workspace or "")
        if ws is None or ws.live_sandbox_id != row.id or ws.status != "running":
            return  # a suspend or a delete under way lets it go on purpose
        try:
            await self._salvage_workspace(row, backend_of(sandbox))
        except Exception:
            log.exception("workspace %s: keeping what its failed sandbox %s held failed",
                          ws.name, row.id)

    async def _free_failed(self, row: SandboxRow) -> None:
        """Free what a failed sandbox kept (SPEC §3: its working directory,
        until it is deleted): its backend found again from its record and
        closed. Idempotent: what is gone already is skipped."""
        if row.state != SandboxState.FAILED.value or not row.description:
            return
        try:
            backend = await get_provider(row.provider).reconnect(row.id, row.description)
            await backend.close()
        except (HutchError, KeyError, ValueError, OSError) as exc:
            log.warning("sandbox %s: freeing what it kept after it failed: %s", row.id, exc)

    async def _persist_deadline(self, sandbox_id: str, deadline_unix: float) -> None:
        """Record a set_timeout deadline; the engine applies it only after this."""
        await anyio.to_thread.run_sync(self.store.set_sandbox_deadline, sandbox_id, deadline_unix)

    def _note(self, subject: str, kind: str, message: str) -> None:
        """Log an event that tells of a change already recorded (best effort:
        a store that cannot take it loses the note, never the change)."""
        try:
            self.store.log_event(subject, kind, message)
        except StoreUnavailable as exc:
            log.warning("event for %s not recorded (%s: %s): %s", subject, kind, message, exc)

    @staticmethod
    def _snapshot(row: SandboxRow, sandbox: Sandbox) -> None:
        """Copy what the engine knows and the store should outlive us with."""
        if lifecycle_record(sandbox) is None:
            return
        status = sandbox.status()
        row.meter = dict(status.meter)
        row.last_active_unix = status.last_active_unix

    def _forget(self, sandbox_id: str) -> None:
        self.sandboxes.pop(sandbox_id, None)
        self.workspace_of.pop(sandbox_id, None)
        self._guards = {k: v for k, v in self._guards.items() if k[0] != sandbox_id}
        self._sessions.pop(sandbox_id, None)
        for ref in self._refs_of.pop(sandbox_id, []):  # the store still answers for them
            self._refs.pop(ref.id, None)
            self._ref_used.pop(ref.id, None)

    def _workspace_lost_its_sandbox(
        self, name: str, sandbox_id: str, reason: str | None
    ) -> None:
        """A workspace whose sandbox ended (reaped, deleted) is stale, not running."""
        ws = self.store.get_workspace(name)
        # A suspend or a delete under way lets the sandbox go on purpose, and
        # has already moved the row on.
        if ws is None or ws.live_sandbox_id != sandbox_id or ws.status != "running":
            return
        ws.status, ws.live_sandbox_id = "stale", None
        self.store.put_workspace(ws)
        self.store.log_event(
            name, "workspace",
            f"stale: its sandbox {sandbox_id} ended ({reason}); "
            "resume brings it back from its last state",
        )
        log.warning("workspace %s is stale: its sandbox %s ended (%s)", name, sandbox_id, reason)

    # -- sandboxes ---------------------------------------------------------------------
    def default_provider(self) -> str:
        """The provider of a request that names none: the operator's (``provider``
        in the server's sandbox defaults, else ``hutch serve --provider``), else
        the first isolating provider whose engine answers here. Never one that
        runs on the host (``local``) unless the operator chose it; in-process
        use keeps ``local`` as its built-in default (hutch.config)."""
        named = self.sandbox_defaults.get("provider")
        if named:
            return str(named)
        if self._default_provider is None:
            self._default_provider = pick_default_provider()
        return self._default_provider

    def admit_provider(self, name: str) -> None:
        """Refuse ``name`` to an API client if it runs on the host and the
        operator has not allowed it (see hutch.server.policy)."""
        self.policy.admit_provider(name, self.default_provider())

    def spec_from_request(
        self, body: Mapping[str, Any], *, daemon_settings: Mapping[str, Any] | None = None
    ) -> SandboxSpec:
        """The spec a client's request asks for, as the operator's policy admits
        it; ``daemon_settings`` are the daemon's own (a workspace's directory),
        added after the check."""
        default = self.default_provider()
        self.admit_provider(requested_provider(
            flags=body, server_defaults=self.sandbox_defaults, default_provider=default
        ))
        spec = resolve_spec(flags=body, server_defaults=self.sandbox_defaults,
                            default_provider=default)
        try:  # the operator's own settings for this provider, if they stand alone
            operators: BaseModel | None = resolve_spec(
                flags={"provider": spec.provider_name}, server_defaults=self.sandbox_defaults
            ).provider
        except InvalidArgument:
            operators = None  # a provider with required settings the operator left out
        provider = self.policy.admit(spec.provider, operators)
        if daemon_settings:
            provider = provider.model_copy(update=dict(daemon_settings))
        spec = spec.model_copy(update={"provider": provider})
        return spec

    async def create_sandbox(
        self,
        spec: SandboxSpec,
        *,
        workspace: str | None = None,
        sandbox_id: str | None = None,
        from_snapshot: SnapshotRow | None = None,
    ) -> Sandbox:
        """Make a sandbox from ``spec``, or start one from ``from_snapshot``
        (whose own settings ``spec`` then is, with its options as asked)."""
        sid = sandbox_id or new_sandbox_id()
        now = time.time()
        row = SandboxRow(
            id=sid, provider=spec.provider_name, state=SandboxState.CREATING.value,
            spec=spec.model_dump(), workspace=workspace, created_at_unix=now,
            base_snapshot_id=from_snapshot.id if from_snapshot else None,
            origin_snapshot_id=from_snapshot.id if from_snapshot else None,
        )
        # Intent first: a daemon killed mid-create finds this row and cleans up.
        await anyio.to_thread.run_sync(self.store.put_sandbox, row)
        backend_cls = get_provider(spec.provider_name)
        try:
            if from_snapshot is not None:
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
                self.store.delete_sandbox(sid)
            raise
        sandbox = self._wrap(backend, spec)
        sandbox.base_snapshot_id = row.base_snapshot_id
        sandbox.origin_snapshot_id = row.origin_snapshot_id
        self.sandboxes[sid] = sandbox
        if workspace is not None:
            self.workspace_of[sid] = workspace
        try:
            await self.engine.attach(sandbox, spec.options)
        except BaseException:
            self.sandboxes.pop(sid, None)
            with anyio.CancelScope(shield=True):
                await backend.close()
                self.store.delete_sandbox(sid)
            raise
        self._note(sid, "created", f"{spec.provider_name} sandbox created")
        self._watch(type(backend))
        return sandbox

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
        await anyio.to_thread.run_sync(self.store.put_sandbox, row)
        sandbox = self._wrap(backend, spec)
        self.sandboxes[sandbox_id] = sandbox
        try:
            await self.engine.attach(sandbox, spec.options, state=state,
                                     created_unix=row.created_at_unix,
                                     deadline_unix=deadline_unix)
        except BaseException:
            self.sandboxes.pop(sandbox_id, None)
            self.store.delete_sandbox(sandbox_id)
            raise
        self._note(sandbox_id, "adopted",
                   f"taken over as {state.value} from the program that made it, now gone")
        log.info("took over sandbox %s (%s) from a program that ended", sandbox_id, state.value)
        self._watch(type(backend))
        if sandbox.capabilities.processes:
            if state is SandboxState.RUNNING:
                await self._end_leftover_commands(sandbox)
            elif state is SandboxState.PAUSED:
                self._leftovers.add(sandbox_id)
        return sandbox

    def _watch(self, provider: type[SandboxBackend]) -> None:
        """Start the provider's watcher for runtimes that die, once per provider."""
        if provider not in self._watchers:
            self._watchers[provider] = asyncio.get_running_loop().create_task(
                provider.watch_runtimes(self._runtime_notice)
            )

    async def _tell_once_a_burst(self, sandbox_id: str, message: str) -> None:
        """Note what a runtime said of a sandbox once for a burst of the same
        (the OOM killer ends a flood's processes by the dozen), with how many
        times it came: the events stay readable, and the store is written once.
        A burst ends after a quiet :data:`NOTICE_BURST_SECONDS` (or ten of them)."""
        key = (sandbox_id, message)
        burst = self._notice_bursts.get(key)
        if burst is not None:
            burst[0] += 1
            burst[1] = time.monotonic()
            return
        began = time.monotonic()
        burst = self._notice_bursts[key] = [1, began]
        try:
            while True:
                quiet = time.monotonic() - burst[1]
                if quiet >= NOTICE_BURST_SECONDS or time.monotonic() - began >= 10 * (
                    NOTICE_BURST_SECONDS
                ):
                    break
                await anyio.sleep(NOTICE_BURST_SECONDS - quiet)
        finally:
            del self._notice_bursts[key]
        count, took = int(burst[0]), burst[1] - began
        told = message if count == 1 else f"{message} ({count} times in {took:.0f} s)"
        if sandbox_id in self.sandboxes:
            self._note(sandbox_id, "runtime", told)
        log.warning("sandbox %s: %s", sandbox_id, told)

    async def _runtime_notice(self, notice: RuntimeNotice) -> None:
        """A provider's watcher tells what happened to a sandbox outside hutch."""
        sandbox = self.sandboxes.get(notice.sandbox_id)
        if sandbox is None:
            return  # not ours, or already ended
        if not notice.may_have_died:
            await self._tell_once_a_burst(notice.sandbox_id, notice.message)
            return
        while True:
            try:
                failed = await self.engine.runtime_died(
                    sandbox, notice.message, of_suspended=notice.of_suspended
                )
            except StoreUnavailable as exc:
                # Not recorded, so not failed yet: tried again until the store
                # takes it (or the sandbox ends some other way meanwhile).
                log.warning("sandbox %s: its runtime died, but %s; trying again in %.0f s",
                            notice.sandbox_id, exc, STORE_RETRY_SECONDS)
                await anyio.sleep(STORE_RETRY_SECONDS)
                if self.sandboxes.get(notice.sandbox_id) is not sandbox:
                    return
                continue
            if failed:
                log.warning("sandbox %s failed: %s", notice.sandbox_id, notice.message)
            return

    @staticmethod
    def _wrap(backend: SandboxBackend, spec: SandboxSpec) -> Sandbox:
        sandbox = Sandbox(
            backend,
            sandbox_id=backend.sandbox_id,
            read_before_write=spec.options.read_before_write,
            output_limit=spec.options.output_limit,
        )
        sandbox.spec = spec
        return sandbox

    # -- sandbox definitions ---------------------------------------------------------------
    def put_definition(self, definition_id: str, body: Mapping[str, Any]) -> Definition:
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
        return self.definitions.put(d)

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

    # -- snapshots and forks -------------------------------------------------------------
    def get_snapshot(self, snapshot_id: str) -> SnapshotRow:
        row = self.store.get_snapshot(snapshot_id)
        if row is None or row.status != "ready":
            raise NotFound(f"no snapshot {snapshot_id}")
        return row

    def list_snapshots(self) -> list[SnapshotRow]:
        return [r for r in self.store.list_snapshots() if r.status == "ready"]

    @staticmethod
    def snapshot_json(row: SnapshotRow) -> dict[str, Any]:
        return {
            "id": row.id, "label": row.label, "sandbox_id": row.sandbox_id,
            "parent_id": row.parent_id, "size_bytes": row.size_bytes,
            "created_at_unix": row.created_at_unix, "provider": row.provider,
        }

    async def snapshot_sandbox(
        self, sandbox_id: str, label: str | None, *, diff: bool = True
    ) -> SnapshotRow:
        """Capture a sandbox's state. The intent is recorded first: a daemon
        killed mid-capture frees whatever the provider wrote, at start."""
        sandbox = self.get(sandbox_id)
        sandbox.require("snapshot")
        if label is not None and (not isinstance(label, str) or len(label) > MAX_LABEL):
            raise InvalidArgument(f"a snapshot label is a string of at most {MAX_LABEL} characters")
        row = SnapshotRow(
            id=new_snapshot_id(), provider=sandbox.provider, status="capturing", label=label,
            sandbox_id=sandbox_id, parent_id=sandbox.base_snapshot_id,
            created_at_unix=time.time(),
            spec=sandbox.spec.model_dump() if sandbox.spec is not None else {},
        )
        await anyio.to_thread.run_sync(self.store.put_snapshot, row)
        fault_point("snapshot.recorded")
        previous_base = sandbox.base_snapshot_id
        try:
            # Held as it is (no transition meanwhile), as Sandbox.snapshot does.
            async with self.engine.held(sandbox):
                handle = await backend_of(sandbox).capture(row.id, diff=diff)
            fault_point("snapshot.captured")
            row.status, row.size_bytes, row.handle = "ready", handle.size_bytes, handle.as_dict()
            await self._name_base(sandbox, row.id)
            await anyio.to_thread.run_sync(self.store.put_snapshot, row)
        except BaseException:
            # A caller gone (cancelled) or a failure: nothing of it stays,
            # and the sandbox's base is the one it had.
            await self._undo_snapshot(row, sandbox, previous_base)
            raise
        self._note(
            sandbox_id, "snapshot", f"captured {row.id}" + (f" ({label})" if label else "")
        )
        return row

    async def _name_base(self, sandbox: Sandbox, snapshot_id: str | None) -> None:
        """Make ``snapshot_id`` the state ``sandbox`` stands on (the parent of
        its next snapshot), in memory and in its record."""
        sandbox.base_snapshot_id = snapshot_id
        sandbox_row = self.store.get_sandbox(sandbox.id)
        if sandbox_row is not None and sandbox_row.base_snapshot_id != snapshot_id:
            sandbox_row.base_snapshot_id = snapshot_id
            await anyio.to_thread.run_sync(self.store.put_sandbox, sandbox_row)

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
                row.status = "removing"  # a daemon killed now finishes it at start
                await anyio.to_thread.run_sync(self.store.put_snapshot, row)
                await self._free_snapshot_storage(row)
                self.store.delete_snapshot(row.id)
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
        snapshot = self.get_snapshot(snapshot_id)
        self.admit_provider(snapshot.provider)
        spec = self.attach_spec(snapshot, body)
        sandbox = await self.create_sandbox(spec, from_snapshot=snapshot)
        self.store.log_event(sandbox.id, "attached", f"started from snapshot {snapshot.id}")
        return sandbox

    async def fork_sandbox(
        self, sandbox_id: str, label: str | None, count: int, options: Mapping[str, Any]
    ) -> tuple[SnapshotRow, list[Sandbox]]:
        """Snapshot + ``count`` sandboxes started from it."""
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_FORK:
            raise InvalidArgument(f"fork count must be an integer from 0 to {MAX_FORK}")
        origin = self.get(sandbox_id)
        origin.require("fork")
        self.admit_provider(origin.provider)
        previous_base = origin.base_snapshot_id
        snapshot = await self.snapshot_sandbox(sandbox_id, label)
        branches: list[Sandbox] = []
        try:
            fault_point("fork.captured")
            spec = self.attach_spec(snapshot, options)
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

    def snapshot_dependents(
        self, snapshot_id: str, *, children: bool = True
    ) -> list[SnapshotDependent]:
        """What still needs a snapshot: child snapshots, workspaces made from
        it or kept in it, live sandboxes started from it. (A child's storage
        never needs its parent's record: providers keep shared layers alive.)"""
        needs = [SnapshotDependent("snapshot", r.id) for r in self.store.list_snapshots()
                 if children and r.parent_id == snapshot_id and r.status != "removing"]
        for ws in self.store.list_workspaces():
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
        row = self.get_snapshot(snapshot_id)
        needs = self.snapshot_dependents(snapshot_id)
        named = ", ".join(map(str, needs))
        if needs and not force:
            raise InvalidState(
                f"snapshot {snapshot_id} is still needed by {named}; "
                "remove those first or pass force=true"
            )
        await self._remove_snapshot(row)
        if needs:
            self.store.log_event(snapshot_id, "snapshot",
                                 f"removed by force; it was needed by {named}")
        return needs

    async def _remove_snapshot(self, row: SnapshotRow) -> None:
        """Remove one snapshot: recorded first, storage freed, row dropped;
        its children take its parent as theirs, so the tree stays whole."""
        row.status = "removing"
        await anyio.to_thread.run_sync(self.store.put_snapshot, row)
        await self._free_snapshot_storage(row)
        for child in self.store.list_snapshots():
            if child.parent_id == row.id:
                child.parent_id = row.parent_id
                self.store.put_snapshot(child)
        self.store.delete_snapshot(row.id)
        self.store.log_event(row.id, "snapshot", "removed")

    async def _release_snapshot(self, snapshot_id: str | None) -> None:
        """Drop a snapshot hutch made for its own use (a workspace's state)
        unless something else now depends on it."""
        if not snapshot_id:
            return
        row = self.store.get_snapshot(snapshot_id)
        if row is None or self.snapshot_dependents(snapshot_id, children=False):
            return
        await self._remove_snapshot(row)

    @staticmethod
    async def _free_snapshot_storage(row: SnapshotRow) -> None:
        handle = (ProviderSnapshot.from_dict(row.handle) if row.handle
                  else ProviderSnapshot(row.id, row.provider, 0))
        await get_provider(row.provider).remove_snapshot(handle)

    def get(self, sandbox_id: str) -> Sandbox:
        try:
            return self.sandboxes[sandbox_id]
        except KeyError:
            row = self.store.get_sandbox(sandbox_id)
            if row is not None and row.state in FINAL:
                raise expiry_error(row.id, SandboxState(row.state), row.reason) from None
            raise NotFound(f"no sandbox {sandbox_id}") from None

    def host(self, sandbox: Sandbox) -> None:
        """Answer for ``sandbox``, which this process made outside the daemon
        (an in-process owner serving it to the holders of its refs): its
        owner closes it; it is never stored, reconciled or reaped here."""
        self.sandboxes[sandbox.id] = sandbox
        self._hosted.add(sandbox.id)

    def session(self, sandbox_id: str, session: str | None) -> Sandbox:
        """The sandbox, with the calling session's read-before-write guard in effect."""
        sandbox = self.get(sandbox_id)
        if session:
            key = (sandbox_id, session)
            guard = self._guards.get(key)
            if guard is None:
                guard = self._guards[key] = ReadBeforeWriteGuard(guard_enabled(sandbox))
            session_guard.set(guard)
        return sandbox

    async def info(self, sandbox: Sandbox) -> dict[str, Any]:
        """The sandbox's own description, and what the daemon knows around it."""
        info = await sandbox.info()
        if sandbox.id not in self._hosted:  # a hosted one's own lists come from here already
            info["attachments"] = self.attachments(sandbox.id)
            info["refs"] = self.refs_json(sandbox.id)
        return {**info, "workspace": self.workspace_of.get(sandbox.id), "ended_at_unix": None}

    # -- refs: credentials scoped to one sandbox ----------------------------------------
    async def create_ref(
        self, sandbox_id: str, expires_in: float | None, daemon_url: str
    ) -> dict[str, Any]:
        """Hand out a ref to a live sandbox; only a hash of its secret is kept."""
        self.get(sandbox_id)  # a live sandbox, or the typed error of why not
        if expires_in is not None:
            check_ref_lifetime(expires_in)
        now = time.time()
        secret = secrets.token_urlsafe(32)
        row = RefRow(
            id="ref-" + secrets.token_hex(8), sandbox_id=sandbox_id,
            secret_sha256=hashlib.sha256(secret.encode()).hexdigest(), created_at_unix=now,
            expires_at_unix=None if expires_in is None else now + expires_in,
            workspace=self.workspace_of.get(sandbox_id),
        )
        known = self._sandbox_refs(sandbox_id)  # read before the new row is in the store
        await anyio.to_thread.run_sync(self.store.put_ref, row)
        known.append(row)
        self._refs[row.id] = row
        self.store.log_event(
            sandbox_id, "ref",
            f"ref {row.id} handed out"
            + ("" if expires_in is None else f", expires in {expires_in:g} s")
            + ("" if row.workspace is None else f", following workspace {row.workspace}"),
        )
        token = DaemonRef(daemon_url.rstrip("/"), sandbox_id, row.id, secret).encode()
        return {"ref": token, "ref_id": row.id, "sandbox_id": sandbox_id,
                "expires_at_unix": row.expires_at_unix}

    async def revoke_ref(self, sandbox_id: str, ref_id: str) -> None:
        """End a ref: it is refused from now on. Idempotent."""
        row = self._ref_row(ref_id)
        if row is None or row.sandbox_id != sandbox_id:
            raise NotFound(f"no ref {ref_id} for sandbox {sandbox_id}")
        if row.revoked_at_unix is not None:
            return
        row.revoked_at_unix = time.time()
        await anyio.to_thread.run_sync(self.store.put_ref, row)
        self.store.log_event(sandbox_id, "ref", f"ref {ref_id} revoked")

    def _sandbox_refs(self, sandbox_id: str) -> list[RefRow]:
        refs = self._refs_of.get(sandbox_id)
        if refs is None:
            refs = [self._refs.setdefault(r.id, r) for r in
                    self.store.list_refs(sandbox_id, self.workspace_of.get(sandbox_id))]
            self._refs_of[sandbox_id] = refs
        return refs

    def ref_target(self, ref: RefRow, sandbox_id: str) -> str | None:
        """The sandbox a request through ``ref`` that names ``sandbox_id`` is
        for; None when the ref does not reach it.

        A ref handed out for a workspace's sandbox follows the workspace: a
        request naming any sandbox that served it goes to the one serving it
        now (after a suspend and resume, a new one), and while none does it
        fails saying why.
        """
        if ref.workspace is None:
            return sandbox_id if sandbox_id == ref.sandbox_id else None
        if sandbox_id != ref.sandbox_id and self.workspace_of.get(sandbox_id) != ref.workspace:
            row = self.store.get_sandbox(sandbox_id)
            if row is None or row.workspace != ref.workspace:
                return None
        return self._serving(ref.workspace)

    def _serving(self, workspace: str) -> str:
        """The live sandbox serving ``workspace``, or the typed error of why none is."""
        for sandbox_id, name in self.workspace_of.items():
            if name == workspace:
                return sandbox_id
        row = self.store.get_workspace(workspace)
        if row is None:
            raise SandboxUnavailable(
                f"workspace {workspace} was deleted: its owner's cleanup ended it"
            )
        if row.status in ("suspended", "stale"):
            raise SandboxUnavailable(
                f"workspace {workspace} is {row.status}: its sandbox comes back when its "
                f"owner resumes it (hutch workspace resume {workspace})"
            )
        raise SandboxUnavailable(
            f"workspace {workspace} is {row.status}: no sandbox serves it yet; try again"
        )

    def _ref_row(self, ref_id: str) -> RefRow | None:
        row = self._refs.get(ref_id)
        if row is None:
            row = self.store.get_ref(ref_id)
            if row is not None:
                self._refs[ref_id] = row
        return row

    def check_ref(self, token: str) -> RefRow:
        """The ref ``token`` presents, if it is genuine, unrevoked and unexpired.

        Its use is an event (at most once a minute a ref).
        """
        ref = decode_ref(token)
        row = None if ref is None else self._ref_row(ref.ref_id)
        digest = hashlib.sha256((ref.secret if ref else "").encode()).hexdigest()
        # Constant time, whatever part is wrong.
        if (
            ref is None or row is None
            or not hmac.compare_digest(digest, row.secret_sha256)
            or row.sandbox_id != ref.sandbox_id
        ):
            raise Unauthorized("this ref is not one this daemon handed out")
        now = time.time()
        row.check_usable(now)
        if now - self._ref_used.get(row.id, -math.inf) >= REF_USE_EVENT_SECONDS:
            self._ref_used[row.id] = now
            self.store.log_event(row.sandbox_id, "ref", f"ref {row.id} used")
        return row

    def ref_session(self, ref: RefRow, sandbox_id: str, session: str | None) -> None:
        """A request through ``ref`` for ``sandbox_id``: the session making it
        is attached there (and listed) until it detaches or the sandbox ends."""
        sessions = self._sessions.setdefault(sandbox_id, {})
        key = f"{ref.id}/{(session or '')[:MAX_SESSION_ID]}"
        now = time.time()
        known = sessions.get(key)
        if known is not None:
            known.last_used_unix = now
            return
        if len(sessions) >= MAX_SESSIONS:  # sessions that never detached: the stalest goes
            del sessions[min(sessions, key=lambda k: sessions[k].last_used_unix)]
        sessions[key] = AttachedSession(ref.id, (session or "")[:MAX_SESSION_ID], now, now)

    def detach(self, ref: RefRow, sandbox_id: str, session: str | None) -> None:
        """A session holding a ref closed: it leaves; the sandbox stays."""
        self._sessions.get(sandbox_id, {}).pop(f"{ref.id}/{(session or '')[:MAX_SESSION_ID]}",
                                               None)
        self.store.log_event(ref.sandbox_id, "ref", f"a session holding ref {ref.id} detached")

    def open_refs(self, sandbox_id: str) -> list[RefRow]:
        """The refs that can still attach to a sandbox (unrevoked, unexpired)."""
        now = time.time()
        return [
            r for r in self._sandbox_refs(sandbox_id)
            if r.revoked_at_unix is None and (r.expires_at_unix is None or r.expires_at_unix > now)
        ]

    def refs_json(self, sandbox_id: str) -> list[dict[str, Any]]:
        return [
            {"ref_id": r.id, "created_at_unix": r.created_at_unix,
             "expires_at_unix": r.expires_at_unix, "last_used_unix": self._ref_used.get(r.id),
             "workspace": r.workspace}
            for r in self.open_refs(sandbox_id)
        ]

    def attachments(self, sandbox_id: str) -> list[dict[str, Any]]:
        """The sessions attached to a sandbox through refs that still work."""
        refs = {r.id: r for r in self.open_refs(sandbox_id)}
        return [
            attachment_json(s.session, refs[s.ref_id], s.attached_at_unix, s.last_used_unix)
            for s in self._sessions.get(sandbox_id, {}).values() if s.ref_id in refs
        ]

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
            "open_operations": 0,
            "attachments": [],
            "refs": [],
            "workspace": row.workspace,
            "ended_at_unix": row.updated_at_unix,
        }

    async def describe(self, sandbox_id: str) -> dict[str, Any]:
        """A sandbox's state and reason: a live one's, or an ended one's from the store."""
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is not None:
            return await self.info(sandbox)
        row = self.store.get_sandbox(sandbox_id)
        if row is None or row.state not in FINAL:
            raise NotFound(f"no sandbox {sandbox_id}")
        return self.ended_info(row)

    async def list_infos(self, *, include_ended: bool = False) -> list[dict[str, Any]]:
        """Live sandboxes; with ``include_ended`` also those that ended within
        the retention period, oldest first."""
        live = [await self.info(s) for s in list(self.sandboxes.values())]
        if not include_ended:
            return live
        ended = [
            self.ended_info(row) for row in self.store.list_sandboxes(include_final=True)
            if row.state in FINAL and row.id not in self.sandboxes
        ]
        return sorted([*live, *ended], key=lambda info: float(info["created_at_unix"] or 0))

    async def delete_sandbox(self, sandbox_id: str) -> None:
        """End a sandbox. Idempotent: one that already ended (expired, failed,
        deleted) and is still on record is not an error. A workspace's work is
        not lost with its sandbox: its state is captured first, and the
        workspace (stale) resumes from it."""
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None:
            row = self.store.get_sandbox(sandbox_id)
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

    async def _save_workspace_state(self, name: str, sandbox_id: str, *, diff: bool) -> str:
        """Snapshot a workspace's sandbox as the workspace's one state snapshot,
        replacing (and releasing) the last one. Under the workspace's lock."""
        row = self._workspace(name)
        previous = row.state_snapshot_id
        state = await self.snapshot_sandbox(sandbox_id, f"workspace {name} state", diff=diff)
        row = self._workspace(name)
        row.state_snapshot_id = state.id
        self.store.put_workspace(row)
        await self._release_snapshot(previous)
        return state.id
    async def _free_failed_to_be_pruned(self) -> None:
        """The failed sandboxes the next prune forgets free what they kept first."""
        cutoff = time.time() - self.retention_seconds
        for row in self.store.list_sandboxes(include_final=True):
            if row.state == SandboxState.FAILED.value and row.updated_at_unix < cutoff:
                await self._free_failed(row)

    def prune_ended(self) -> None:
        """Forget sandboxes that ended longer ago than the retention period."""
        pruned = self.store.prune_ended(time.time() - self.retention_seconds)
        if pruned:
            log.info("pruned %d sandboxes that ended over %.0f s ago",
                     len(pruned), self.retention_seconds)

    async def _prune_periodically(self) -> None:
        # Often enough that nothing outlives its retention by more than ~10 %.
        interval = min(600.0, max(0.5, self.retention_seconds / 10))
        while True:
            await anyio.sleep(interval)
            try:
                await self._free_failed_to_be_pruned()
                await anyio.to_thread.run_sync(self.prune_ended)
            except Exception:
                log.exception("pruning ended sandboxes failed; tried again in %.0f s", interval)

    async def set_timeout(self, sandbox_id: str, seconds: float) -> float:
        """Set the deadline; it takes effect once recorded, and outlives a restart."""
        return await self.get(sandbox_id).set_timeout(seconds)

    # -- workspaces ----------------------------------------------------------------------
    def _lock(self, name: str) -> asyncio.Lock:
        return self._workspace_locks.setdefault(name, asyncio.Lock())

    def _workspace(self, name: str) -> WorkspaceRow:
        row = self.store.get_workspace(name)
        if row is None:
            raise NotFound(f"no workspace {name!r}")
        return row

    def workspace_json(self, row: WorkspaceRow) -> dict[str, Any]:
        status = row.status
        live = self.sandboxes.get(row.live_sandbox_id or "")
        if status == "running" and live is not None:
            if live.state is SandboxState.SUSPENDED:
                status = "suspended"  # suspended on idle; the next call resumes it
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

    def list_workspaces(self) -> list[WorkspaceRow]:
        return self.store.list_workspaces()

    def get_workspace(self, name: str) -> WorkspaceRow:
        return self._workspace(name)

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
            source = self.get_snapshot(source_id)
            self.admit_provider(source.provider)
            spec = self.attach_spec(source, body)
        else:
            spec = self.spec_from_request(body)
        provider = get_provider(spec.provider_name)
        if not provider.capabilities.snapshot:
            raise CapabilityUnsupported.for_provider(spec.provider_name, "workspaces (snapshot)")
        async with self._lock(name):
            if self.store.get_workspace(name) is not None:
                raise InvalidState(f"workspace {name!r} already exists")
            now = time.time()
            sid = new_sandbox_id()
            row = WorkspaceRow(
                name=name, status="creating", provider=spec.provider_name,
                spec=spec.model_dump(), live_sandbox_id=sid,
                source_snapshot_id=source.id if source else None,
                created_at_unix=now, last_active_unix=now,
            )
            self.store.put_workspace(row)
            try:
                await self.create_sandbox(spec, workspace=name, sandbox_id=sid,
                                          from_snapshot=source)
            except BaseException:
                self.store.delete_workspace(name)
                raise
            row.status = "running"
            self.store.put_workspace(row)
            self.store.log_event(
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
            row = self._workspace(name)
            sandbox = self.sandboxes.get(row.live_sandbox_id or "")
            if row.status != "running" or sandbox is None:
                raise InvalidState(
                    f"workspace {name!r} is {row.status}; only a running one suspends"
                )
            row.status = "suspending"
            self.store.put_workspace(row)
            fault_point("workspace-suspend.marked")
            previous = row.state_snapshot_id
            try:
                state = await self.snapshot_sandbox(sandbox.id, _state_label(name), diff=diff)
            except BaseException:
                row.status = "running"
                self.store.put_workspace(row)
                raise
            fault_point("workspace-suspend.captured")
            row.status, row.state_snapshot_id, row.live_sandbox_id = "suspended", state.id, None
            row.last_active_unix = time.time()
            self.store.put_workspace(row)
            fault_point("workspace-suspend.recorded")
            await sandbox.close()
            self._forget(sandbox.id)
            # The old state goes unless something else was made from it (a
            # workspace, a branch): then it stays, as their source.
            await self._release_snapshot(previous)
            self.store.log_event(
                name, "workspace", f"suspended into {state.id} ({'diff' if diff else 'full'})"
                + (f", replacing {previous}" if previous else "")
            )
            return row

    async def resume_workspace(self, name: str) -> WorkspaceRow:
        async with self._lock(name):
            row = self._workspace(name)
            live = self.sandboxes.get(row.live_sandbox_id or "")
            if row.status == "running" and live is not None:
                if live.state in HELD:
                    await live.resume()
                    return row
                raise InvalidState(f"workspace {name!r} is already running")
            if row.status not in ("suspended", "stale"):
                raise InvalidState(f"workspace {name!r} is {row.status}; it cannot resume")
            start_id = row.state_snapshot_id or row.source_snapshot_id
            start = self.store.get_snapshot(start_id) if start_id else None
            spec = SandboxSpec.model_validate(row.spec)
            sid = new_sandbox_id()
            row.live_sandbox_id, row.status = sid, "resuming"
            self.store.put_workspace(row)
            fault_point("workspace-resume.marked")
            try:
                await self.create_sandbox(spec, workspace=name, sandbox_id=sid,
                                          from_snapshot=start)
            except BaseException:
                row.live_sandbox_id, row.status = None, "stale"
                self.store.put_workspace(row)
                raise
            fault_point("workspace-resume.created")
            row.status, row.last_active_unix = "running", time.time()
            self.store.put_workspace(row)
            self.store.log_event(
                name, "workspace",
                f"resumed from {start.id}" if start else "resumed fresh (no state kept)",
            )
            return row

    async def delete_workspace(self, name: str) -> None:
        async with self._lock(name):
            row = self._workspace(name)
            # Recorded first: a daemon killed half-way finishes the delete at start.
            row.status = "deleting"
            self.store.put_workspace(row)
            await self._finish_delete(row)

    async def _finish_delete(self, row: WorkspaceRow) -> None:
        live = self.sandboxes.get(row.live_sandbox_id or "")
        if live is not None:
            await live.close()
            self._forget(live.id)
        state = row.state_snapshot_id
        self.store.delete_workspace(row.name)
        # Its own state goes, unless another workspace or a branch was made
        # from it; the snapshot it was made from is never its to remove.
        await self._release_snapshot(state)
        self.store.log_event(row.name, "workspace", "deleted (its source is kept)")

    # -- start-up and shut-down ------------------------------------------------------------
    async def start(self) -> None:
        # Whether the last run stopped cleanly; from now on, until our own
        # clean stop, it did not.
        clean = self.store.get_meta(CLEAN_STOP) is not None
        self.store.set_meta(CLEAN_STOP, None)
        default = await anyio.to_thread.run_sync(self.default_provider)
        log.info("requests that name no provider get %r", default)
        await self.reconcile(after_clean_stop=clean)
        await self._free_failed_to_be_pruned()
        self.prune_ended()
        self._pruner = asyncio.get_running_loop().create_task(self._prune_periodically())

    async def reconcile(self, *, after_clean_stop: bool = False) -> None:
        for row in self.store.list_sandboxes():
            await self._reconcile_sandbox(row, after_clean_stop=after_clean_stop)
        await self._drop_cut_setups()
        await self._reconcile_snapshots()
        for ws in self.store.list_workspaces():
            await self._reconcile_workspace(ws)
        await self._reap_orphans()

    def setting_up(self, sandbox_id: str, *, made: bool) -> None:
        """Record that a definition's ensure is making ``sandbox_id`` (until
        it is its thread's, or gone: ``made``)."""
        ids = set(json.loads(self.store.get_meta(SETTING_UP) or "[]"))
        ids = ids - {sandbox_id} if made else ids | {sandbox_id}
        self.store.set_meta(SETTING_UP, json.dumps(sorted(ids)) if ids else None)

    async def _drop_cut_setups(self) -> None:
        """Remove the sandboxes an ensure cut short by the restart was making:
        half set up, and no thread's (one it recorded as its thread's stays)."""
        for sandbox_id in json.loads(self.store.get_meta(SETTING_UP) or "[]"):
            if sandbox_id in self.sandboxes and self.store.instance_of_sandbox(sandbox_id) is None:
                log.warning("sandbox %s: a definition's setup was cut short; removing it",
                            sandbox_id)
                with contextlib.suppress(HutchError):
                    await self.delete_sandbox(sandbox_id)
                self._note(sandbox_id, "setup", "removed: the ensure making it was cut short")
            self.setting_up(sandbox_id, made=True)

    def _providers_in_use(self) -> list[type[SandboxBackend]]:
        """Every provider that can be loaded here, each asked about what it holds."""
        found = []
        for name in available_providers():
            try:
                found.append(get_provider(name))
            except HutchError:
                continue  # not installed here: it holds nothing of ours
        return found

    async def _reconcile_snapshots(self) -> None:
        """Make the store and the providers agree on snapshots: a capture or a
        removal cut short is finished (its storage freed, its row dropped), a
        row whose storage is gone is dropped, storage no row names is freed."""
        rows = {r.id: r for r in self.store.list_snapshots()}
        for row in list(rows.values()):
            if row.status in ("capturing", "removing"):
                log.warning("snapshot %s: its %s was cut short; freeing what it left",
                            row.id, "capture" if row.status == "capturing" else "removal")
                with contextlib.suppress(HutchError):
                    await self._free_snapshot_storage(row)
                self.store.delete_snapshot(row.id)
                del rows[row.id]
        for provider in self._providers_in_use():
            try:
                held = set(await provider.held_snapshots())
            except HutchError as exc:
                log.info("cannot ask %s what snapshots it holds (%s)", provider.provider, exc)
                continue
            for snapshot_id in sorted(held - set(rows)):
                log.warning("freeing %s snapshot %s: no record names it",
                            provider.provider, snapshot_id)
                with contextlib.suppress(HutchError):
                    await provider.remove_snapshot(
                        ProviderSnapshot(snapshot_id, provider.provider, 0)
                    )
            for row in rows.values():
                if row.provider == provider.provider and row.id not in held:
                    log.warning("snapshot %s is gone from %s; dropping its record",
                                row.id, row.provider)
                    self.store.delete_snapshot(row.id)
                    self.store.log_event(row.id, "snapshot", "lost: its storage is gone")

    async def _reap_orphans(self) -> None:
        """Ask every provider to free what it made for sandboxes no row names
        (nor an instance: a program on this store holds it in-process, or
        left it for the next ``ensure`` of its thread)."""
        known = {r.id for r in self.store.list_sandboxes(include_final=True)}
        known |= self.store.instance_sandbox_ids()
        for provider in self._providers_in_use():
            try:
                removed = await provider.reap_orphans(known)
            except HutchError as exc:
                log.info("cannot reconcile with %s (%s)", provider.provider, exc)
                continue
            for what in removed:
                self.store.log_event(what, "orphan", f"removed an orphan {provider.provider} "
                                     "resource")
                log.warning("removed orphan %s resource %s", provider.provider, what)

    async def _reconcile_sandbox(self, row: SandboxRow, *, after_clean_stop: bool) -> None:
        instance = self.store.instance_of_sandbox(row.id)
        if instance is not None and not self.store.claim_instance(
            instance.key, row.id, this_program(), was={"held_by": HELD_BY_DAEMON},
            alive=program_alive,
        ):
            # A program took the thread's sandbox over in-process while the
            # daemon was down (it found the earlier daemon dead): its now,
            # not this daemon's to adopt, nor to free.
            self.store.delete_sandbox(row.id)
            log.info("sandbox %s: a program on this store holds it now; not adopted", row.id)
            return
        if row.state == SandboxState.CREATING.value:
            with contextlib.suppress(HutchError):
                await get_provider(row.provider).discard(row.id)
            self.store.delete_sandbox(row.id)
            log.warning("dropped sandbox %s: its create was cut short", row.id)
            return
        try:
            backend_cls = get_provider(row.provider)
            backend = await backend_cls.reconnect(row.id, row.description)
            spec = SandboxSpec.model_validate(row.spec)
        except (HutchError, KeyError, ValueError) as exc:
            self._mark_lost(row, f"lost: cannot reconnect after a restart ({exc})")
            return
        recorded = SandboxState(row.state)
        try:
            state = found_state(recorded, await backend.observed_state())
        except HutchError as exc:
            if recorded is not SandboxState.SUSPENDED:
                self._mark_lost(row, f"lost: its runtime cannot be reached ({exc})")
                return
            state = recorded  # its state is on disk: resume tells what is wrong
        if state is None:
            # As a death seen while the daemon runs: what the runtime held
            # goes, its working directory stays (a workspace's becomes its
            # state) until the sandbox is deleted (``_free_failed``).
            with contextlib.suppress(HutchError):
                await backend.release_runtime()
            row.description = backend.describe()
            self._mark_lost(row, "lost: its runtime died while the daemon was down")
            if row.workspace is not None:
                await self._salvage_workspace(row, backend)
            return
        if state is not recorded:
            # A step cut short between the provider and the store (a suspend
            # killed while the container was frozen, a resume killed before
            # its record): the runtime's own state is the truth, recorded now.
            row.state, row.reason, row.description = state.value, None, backend.describe()
            told = (f"found {state.value} though recorded {recorded.value}: a step was cut "
                    "short by the restart")
            await anyio.to_thread.run_sync(self.store.put_sandbox, row, ("adopted", told))
            log.warning("sandbox %s %s", row.id, told)
        sandbox = self._wrap(backend, spec)
        sandbox.base_snapshot_id = row.base_snapshot_id
        sandbox.origin_snapshot_id = row.origin_snapshot_id
        self.sandboxes[row.id] = sandbox
        if row.workspace is not None:
            self.workspace_of[row.id] = row.workspace
        # The meter was written with the row; the time since went to the state
        # the row names (every transition is written before it is acknowledged).
        meter = dict(row.meter)
        if row.updated_at_unix:
            key = f"{state.value}_s"
            meter[key] = meter.get(key, 0.0) + max(0.0, time.time() - row.updated_at_unix)
        await self.engine.attach(
            sandbox, spec.options, state=state, created_unix=row.created_at_unix,
            deadline_unix=row.deadline_unix, meter=meter,
            # After a crash the last activity on record may be long out of
            # date (activity is not written per call): the idle clock starts
            # again rather than reaping work that may have gone on until the end.
            last_active_unix=row.last_active_unix if after_clean_stop else None,
        )
        self._note(row.id, "adopted", f"adopted after restart as {state.value}")
        log.info("adopted sandbox %s (%s)", row.id, state.value)
        self._watch(type(backend))
        if sandbox.capabilities.processes:
            if state is SandboxState.RUNNING:
                await self._end_leftover_commands(sandbox)
            elif state is SandboxState.PAUSED:
                # Frozen now: ended when it is resumed, before anything new runs.
                self._leftovers.add(row.id)

    async def _end_leftover_commands(self, sandbox: Sandbox) -> None:
        """Commands an earlier daemon started are no one's now (their handles,
        output and timeouts died with it): they are ended, and the events say
        so, rather than left running unseen. (A suspended sandbox's ended with
        the suspend; a paused one's are ended when it is resumed.)"""
        try:
            ended = await backend_of(sandbox).runtime.end_leftover_commands()
        except Exception as exc:
            self._note(sandbox.id, "adopted",
                       f"could not end the commands left running before the restart: {exc}")
            log.warning("sandbox %s: could not end leftover commands: %s", sandbox.id, exc)
            return
        if ended:
            self._note(sandbox.id, "adopted",
                       f"killed {ended} processes of commands started before the restart "
                       "(their output and exit cannot be re-attached)")
            log.warning("sandbox %s: killed %d leftover processes", sandbox.id, ended)

    async def _salvage_workspace(self, row: SandboxRow, backend: SandboxBackend) -> None:
        """A workspace's sandbox died with the daemon down: what of its state
        survives (a working directory on the host) becomes the workspace's
        state, where the provider can capture it; otherwise the last state stays."""
        name = row.workspace
        ws = self.store.get_workspace(name) if name else None
        if ws is None or not backend.capabilities.snapshot:
            return
        snap = SnapshotRow(
            id=new_snapshot_id(), provider=row.provider, status="capturing",
            label=f"workspace {ws.name} state (salvaged)", sandbox_id=row.id,
            parent_id=row.base_snapshot_id, created_at_unix=time.time(), spec=row.spec,
        )
        self.store.put_snapshot(snap)
        try:
            handle = await backend.capture(snap.id, diff=True)
        except Exception as exc:
            log.warning("workspace %s: nothing of its lost sandbox could be kept (%s)",
                        ws.name, exc)
            await self._free_snapshot_storage(snap)
            self.store.delete_snapshot(snap.id)
            return
        snap.status, snap.size_bytes, snap.handle = "ready", handle.size_bytes, handle.as_dict()
        self.store.put_snapshot(snap)
        previous, ws.state_snapshot_id = ws.state_snapshot_id, snap.id
        self.store.put_workspace(ws)
        await self._release_snapshot(previous)
        self.store.log_event(ws.name, "workspace",
                             f"kept what survived of its lost sandbox {row.id} as {snap.id}")

    def _mark_lost(self, row: SandboxRow, reason: str) -> None:
        row.state, row.reason = SandboxState.FAILED.value, reason
        self.store.put_sandbox(row)
        self.store.log_event(row.id, "lost", reason)
        log.warning("sandbox %s %s", row.id, reason)

    async def _reconcile_workspace(self, ws: WorkspaceRow) -> None:
        live = ws.live_sandbox_id in self.sandboxes
        if ws.status == "deleting":
            log.warning("finishing the delete of workspace %s, cut short", ws.name)
            await self._finish_delete(ws)
            return
        if ws.status == "creating":
            if ws.live_sandbox_id and ws.live_sandbox_id in self.sandboxes:
                ws.status = "running"  # the create finished; only its last write did not
                self.store.put_workspace(ws)
            else:
                self.store.delete_workspace(ws.name)
                log.warning("dropped workspace %s: its create was cut short", ws.name)
            return
        if ws.status == "suspending":
            await self._settle_cut_suspend(ws, live=live)
        if ws.status in ("running", "suspending", "resuming") and not live:
            # A suspend whose state snapshot was written is a suspend; one cut
            # short left the last state (or none), from which resume starts.
            ws.status = "stale"
            ws.live_sandbox_id = None
            self.store.put_workspace(ws)
            log.warning("workspace %s is %s: its sandbox is gone", ws.name, ws.status)
        elif ws.status in ("suspending", "resuming") and live:
            ws.status = "running"
            self.store.put_workspace(ws)
        if ws.state_snapshot_id and self.store.get_snapshot(ws.state_snapshot_id) is None:
            log.warning("workspace %s: its state snapshot %s is gone", ws.name,
                        ws.state_snapshot_id)
            ws.state_snapshot_id = None
            self.store.put_workspace(ws)

    async def _settle_cut_suspend(self, ws: WorkspaceRow, *, live: bool) -> None:
        """A suspend cut short after it recorded the new state snapshot and
        before the workspace named it: with its sandbox alive, that snapshot
        goes (the sandbox has all of it, and goes on); with the sandbox gone,
        it is the latest state there is, and becomes the workspace's."""
        cut = [s for s in self.store.list_snapshots()
               if s.status == "ready" and s.sandbox_id == ws.live_sandbox_id
               and s.label == _state_label(ws.name)
               and s.id not in (ws.state_snapshot_id, ws.source_snapshot_id)]
        if not cut:
            return
        newest = max(cut, key=lambda s: s.created_at_unix)
        if not live:
            previous, ws.state_snapshot_id = ws.state_snapshot_id, newest.id
            self.store.put_workspace(ws)
            log.warning("workspace %s: its suspend was cut short; its state is %s",
                        ws.name, newest.id)
            await self._release_snapshot(previous)
            cut.remove(newest)
        for row in cut:
            log.warning("workspace %s: dropping %s, the state of a suspend cut short",
                        ws.name, row.id)
            await self._release_snapshot(row.id)

    async def stop(self) -> None:
        """Stop the daemon, leaving every sandbox running for the next start to adopt.

        What the engine knows beyond the last transition (meter, last
        activity) is written first, in one transaction, and the stop is
        marked clean, so the next start goes on exactly from here.
        """
        for task in [self._pruner, *self._watchers.values()]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._watchers.clear()
        await self.engine.close()
        rows = []
        for sandbox_id, sandbox in list(self.sandboxes.items()):
            row = self.store.get_sandbox(sandbox_id)
            if row is None or row.state in FINAL:
                continue
            self._snapshot(row, sandbox)
            rows.append(row)
        try:
            await anyio.to_thread.run_sync(self.store.put_sandboxes, rows)
            self.store.set_meta(CLEAN_STOP, str(time.time()))
        finally:
            self.store.close()


def _state_label(workspace: str) -> str:
    """The label of a workspace's state snapshots."""
    return f"workspace {workspace} state"


class _DaemonHost(SandboxHost):
    """Definitions' sandboxes, made and found by the daemon: tracked, stored
    and reconciled as every other sandbox it holds."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.store = daemon.store
        #: (instance key, sandbox id) this daemon has recorded its hold of.
        self._holding: set[tuple[str, str]] = set()

    async def find_live(self, row: InstanceRow) -> Sandbox | None:
        sandbox = self.daemon.sandboxes.get(row.sandbox_id or "")
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
            await anyio.to_thread.run_sync(self.store.put_instance, row)
        return sandbox

    async def hold(self, key: str, sandbox: Sandbox) -> None:
        # Recorded as any program's hold: a program on this store takes the
        # thread over only once this daemon is gone (killed: its hold dies
        # with it). Written once per sandbox of the key, and again by a
        # restarted daemon that adopts it (see Daemon._reconcile_sandbox).
        self.daemon.setting_up(sandbox.id, made=True)  # its thread's now, on record
        if (key, sandbox.id) in self._holding:
            return
        await anyio.to_thread.run_sync(self.store.hold_instance, key, this_program())
        self._holding.add((key, sandbox.id))

    async def create(self, spec: SandboxSpec) -> Sandbox:
        sandbox_id = new_sandbox_id()
        self.daemon.setting_up(sandbox_id, made=False)  # before it exists: see SETTING_UP
        return await self.daemon.create_sandbox(spec, sandbox_id=sandbox_id)

    async def restore(self, snapshot: SnapshotRow, spec: SandboxSpec) -> Sandbox:
        attach = self.daemon.attach_spec(snapshot, spec.options.model_dump())
        sandbox_id = new_sandbox_id()
        self.daemon.setting_up(sandbox_id, made=False)
        return await self.daemon.create_sandbox(attach, from_snapshot=snapshot,
                                                sandbox_id=sandbox_id)

    async def snapshot(self, sandbox: Sandbox, label: str) -> str:
        return (await self.daemon.snapshot_sandbox(sandbox.id, label)).id

    async def destroy(self, sandbox: Sandbox) -> None:
        await self.daemon.delete_sandbox(sandbox.id)
        self.daemon.setting_up(sandbox.id, made=True)

    async def drop_snapshot(self, snapshot: SnapshotRow) -> None:
        await self.daemon.delete_snapshot(snapshot.id)  # refused while something needs it

    def describe(self, sandbox: Sandbox) -> dict[str, Any]:
        # Found again through the daemon's own sandbox table; a program
        # opening this store in-process is told whose it is.
        return {"held_by": HELD_BY_DAEMON}
