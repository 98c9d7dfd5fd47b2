"""The daemon's state and what every part of it uses: its store, its
lifecycle engine and the sandboxes it tracks; transitions written durably
before they are acknowledged."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from pydantic import BaseModel

from .._errors import (
    HutchError,
    InvalidArgument,
    NotFound,
    StoreUnavailable,
)
from .._guardrail import ReadBeforeWriteGuard, session_guard
from .._sandbox import (
    Sandbox,
    backend_of,
    guard_enabled,
    lifecycle_record,
    live_of,
)
from ..config import SandboxSpec, requested_provider, resolve_spec
from ..definitions import Definition, Definitions
from ..lifecycle.engine import LifecycleEngine
from ..lifecycle.records import expiry_error
from ..providers.base import SandboxBackend
from ..providers.registry import get_provider, pick_default_provider
from ..states import FINAL, SandboxState, WorkspaceStatus
from ..store import (
    AsyncStore,
    OwnershipLost,
    RefRow,
    SandboxRow,
    SQLiteStore,
    Store,
    WorkspaceRow,
    WriteConflict,
)
from .common import (
    CONFLICT_TRIES,
    DEFAULT_RETENTION_SECONDS,
    AttachedSession,
    default_data_dir,
    log,
    make_private_dir,
    make_private_file,
)
from .events import EventFeed
from .host import _DaemonHost
from .meters import DEFAULT_METER_INTERVAL, MeterHistory
from .metrics import DaemonMetrics
from .policy import OperatorPolicy

if TYPE_CHECKING:
    from .core import Daemon
    from .pools import Pool


def transition_event(old: SandboxState, new: SandboxState, reason: str | None) -> tuple[str, str]:
    """The event that tells of a transition, written with its row."""
    return ("transition", f"{old.value} -> {new.value}" + (f" ({reason})" if reason else ""))


@dataclass
class Birth:
    """A sandbox being made: its row as made and the events that tell of its
    making, which its first transition (creating -> running) writes in one
    store write rather than reading the row it just wrote and logging the
    events after it; or, for a warm pool's take, that write itself, started
    ahead (``written``), which the transition waits for."""

    row: SandboxRow
    events: tuple[tuple[str, str], ...]
    written: asyncio.Future[None] | None = None


class DaemonBase:
    if TYPE_CHECKING:  # defined by the parts below (see hutch.daemon.core.Daemon)
        async def _salvage_workspace(self, row: SandboxRow, backend: SandboxBackend) -> None: ...

        async def _save_workspace_state(
            self, name: str, sandbox_id: str, *, diff: bool
        ) -> str: ...

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
        advertise_url: str | None = None,
        meter_interval: float = DEFAULT_METER_INTERVAL,
    ) -> None:
        #: What API clients may ask for: host-reaching settings, limits.
        self.policy = policy or OperatorPolicy()
        self.data_dir = os.path.abspath(data_dir or default_data_dir())
        make_private_dir(self.data_dir)
        if store is None:
            store = SQLiteStore(make_private_file(os.path.join(self.data_dir, "hutch.db")))
        self.store = store
        #: This daemon in its fleet (the owner of the rows it writes), and
        #: where the fleet's other daemons reach it (set by start()).
        self.daemon_id: str | None = None
        self.advertise_url = advertise_url
        #: Its metrics (the server renders them at /metrics).
        self.metrics = DaemonMetrics(
            lambda: [(s.provider, s.state) for s in list(self.sandboxes.values())],
            lambda: [(p.name, p.size, len(p.ready), p.hits, p.misses)
                     for p in list(self._pools.values())])
        #: Its event log, followed live (woken by the store calls that write events).
        self.event_feed = EventFeed(lambda subject, limit: self.astore.events(subject, limit))

        def observe(call: str, seconds: float) -> None:
            self.metrics.store_call(call, seconds)
            self.event_feed.store_call(call)

        #: The same store, off the event loop: what the daemon's coroutines use.
        self.astore = AsyncStore(store, observe=observe)
        self.sandbox_defaults = dict(sandbox_defaults or {})
        #: provider -> the operator's own settings for it (see _operators_settings).
        self._operator_settings: dict[str, BaseModel | None] = {}
        #: The provider of requests that name none (see default_provider()).
        self._default_provider = default_provider
        if not 0 < retention_seconds < math.inf:
            raise InvalidArgument(
                f"retention must be a positive number of seconds, got {retention_seconds!r}"
            )
        self.retention_seconds = retention_seconds
        #: Its running sandboxes' memory and disk over time (sampled once started).
        self.meters = MeterHistory(meter_interval)
        self._pruner: asyncio.Task[None] | None = None
        #: This daemon's hold of the store (SERVING_LEASE), once started.
        self._store_holder: str | None = None
        self._store_hold: asyncio.Task[None] | None = None
        #: One watcher per provider in use, telling of runtimes that die outside hutch.
        self._watchers: dict[type[SandboxBackend], asyncio.Task[None]] = {}
        #: Sandboxes adopted paused, whose earlier daemon's commands are ended on resume.
        self._leftovers: set[str] = set()
        #: (sandbox id, message) -> [times a runtime said it in the burst open
        #: now, when it last did (monotonic)].
        self._notice_bursts: dict[tuple[str, str], list[float]] = {}
        self.engine = LifecycleEngine(
            timeout_ceiling=timeout_ceiling, on_transition=self._persist_transition,
            on_deadline=self._persist_deadline, on_note=self._note,
        )
        self.sandboxes: dict[str, Sandbox] = {}
        #: sandbox id -> what its first transition writes, for a sandbox being made.
        self._births: dict[str, Birth] = {}
        #: Warm pools by name (see .pools).
        self._pools: dict[str, Pool] = {}
        #: Creates under way outside warm pools, counted toward max_sandboxes.
        self._starting = 0
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
        self.definitions = Definitions(_DaemonHost(cast("Daemon", self)))
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
        birth = self._births.pop(sandbox_id, None) if old is SandboxState.CREATING else None
        sandbox = self.sandboxes.get(sandbox_id)

        def transition(row: SandboxRow) -> bool:
            row.state, row.reason = new.value, reason
            if sandbox is not None:
                row.description = backend_of(sandbox).describe()
                self._snapshot(row, sandbox)
            return True

        event = transition_event(old, new, reason)
        # The row and its events in one transaction; StoreUnavailable if the
        # store cannot keep them, and then the engine undoes the transition.
        try:
            if birth is not None and birth.written is not None:
                row: SandboxRow | None = await self._written_ahead(
                    birth, birth.written, transition, event)
            else:
                row = await self._rewrite_sandbox(
                    sandbox_id, transition, event, *(birth.events if birth is not None else ()),
                    known=birth.row if birth is not None else None)
        except OwnershipLost as exc:
            # Another daemon serves it now (this one stalled past its lease):
            # nothing of it is this daemon's to act on any more.
            self._forget_lost(sandbox_id, str(exc))
            raise
        if row is None:
            return
        # Durable from here: nothing below may undo it.
        self.metrics.transition(row.provider, old, new, reason)
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
                    await self._workspace_lost_its_sandbox(row.workspace, sandbox_id, reason)
                except StoreUnavailable as exc:
                    # The next start finds the workspace's sandbox ended and marks it stale.
                    log.warning("workspace %s: could not record it stale: %s", row.workspace, exc)

    async def _written_ahead(
        self, birth: Birth, written: asyncio.Future[None],
        change: Callable[[SandboxRow], bool], event: tuple[str, str],
    ) -> SandboxRow | None:
        """A birth's row, once the write started ahead of its transition is
        durable; written again from the store's row if another write came
        between (as any transition's is)."""
        try:
            await asyncio.shield(written)  # a caller gone does not cut the write short
        except WriteConflict:
            return await self._rewrite_sandbox(birth.row.id, change, event, *birth.events)
        return birth.row

    async def _rewrite_sandbox(
        self, sandbox_id: str, change: Callable[[SandboxRow], bool],
        *events: tuple[str, str], known: SandboxRow | None = None,
    ) -> SandboxRow | None:
        """Make ``change`` on the sandbox's row, ``known`` (as this daemon
        last wrote it) or as the store has it, and write it (with
        ``events``) as a compare and set: read again and made again while
        another write (a deadline set meanwhile) came between. The row as
        written (not written if ``change`` said it changed nothing), or None
        when there is none."""
        for _ in range(CONFLICT_TRIES):
            row = known if known is not None else await self.astore.get_sandbox(sandbox_id)
            known = None
            if row is None:
                return None
            if not change(row):
                return row
            try:
                await self.astore.put_sandbox(row, *events)
            except WriteConflict:
                continue
            return row
        raise WriteConflict(f"sandbox {sandbox_id} changed under each of {CONFLICT_TRIES} "
                            "writes of it; not written")

    async def _salvage_failed_workspace(self, row: SandboxRow, sandbox: Sandbox) -> None:
        """A workspace's sandbox whose runtime died outside hutch kept its
        working directory (``release_runtime``): that becomes the workspace's
        state, as after a death found at start. Never raises: the failure
        is recorded already, and the last state stays if this cannot be done."""
        ws = await self.astore.get_workspace(row.workspace or "")
        if ws is None or ws.live_sandbox_id != row.id or ws.status != WorkspaceStatus.RUNNING:
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
        await self.astore.set_sandbox_deadline(sandbox_id, deadline_unix)

    async def _note(self, subject: str, kind: str, message: str) -> None:
        """Log an event that tells of a change already recorded (best effort:
        a store that cannot take it loses the note, never the change)."""
        try:
            await self.astore.log_event(subject, kind, message)
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

    def _own(self, owner: str | None) -> bool:
        """Whether a row is this daemon's to reconcile: its own, or no
        daemon's yet (one written before daemons had owners). Another
        daemon's is that one's, or, once its lease lapses, taken over
        (``Fleet``)."""
        return owner is None or owner == self.daemon_id

    def _forget_lost(self, sandbox_id: str, why: str) -> None:
        """Stop serving ``sandbox_id`` (another daemon owns it) without touching it."""
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None:
            return
        with contextlib.suppress(HutchError, KeyError):
            self.engine.forget(live_of(sandbox))
        self._forget(sandbox_id)
        log.warning("sandbox %s: no longer served here (%s)", sandbox_id, why)

    def _forget(self, sandbox_id: str) -> None:
        self.sandboxes.pop(sandbox_id, None)
        self.meters.forget(sandbox_id)
        self.workspace_of.pop(sandbox_id, None)
        self._guards = {k: v for k, v in self._guards.items() if k[0] != sandbox_id}
        self._sessions.pop(sandbox_id, None)
        for ref in self._refs_of.pop(sandbox_id, []):  # the store still answers for them
            self._refs.pop(ref.id, None)
            self._ref_used.pop(ref.id, None)

    async def _workspace_lost_its_sandbox(
        self, name: str, sandbox_id: str, reason: str | None
    ) -> None:
        """A workspace whose sandbox ended (reaped, deleted) is stale, not running."""
        ws = await self.astore.get_workspace(name)
        # A suspend or a delete under way lets the sandbox go on purpose, and
        # has already moved the row on.
        if ws is None or ws.live_sandbox_id != sandbox_id or ws.status != WorkspaceStatus.RUNNING:
            return
        ws.status, ws.live_sandbox_id = WorkspaceStatus.STALE, None
        await self.astore.put_workspace(ws)
        await self.astore.log_event(
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
        operator has not allowed it (see hutch.daemon.policy)."""
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
        provider = self.policy.admit(spec.provider, self._operators_settings(spec.provider_name))
        if daemon_settings:
            provider = provider.model_copy(update=dict(daemon_settings))
        spec = spec.model_copy(update={"provider": provider})
        return spec

    def _operators_settings(self, provider: str) -> BaseModel | None:
        """The operator's own settings for ``provider``, if they stand alone
        (from the server defaults alone, which do not change: made once)."""
        if provider not in self._operator_settings:
            try:
                found: BaseModel | None = resolve_spec(
                    flags={"provider": provider}, server_defaults=self.sandbox_defaults
                ).provider
            except InvalidArgument:
                found = None  # a provider with required settings the operator left out
            self._operator_settings[provider] = found
        return self._operator_settings[provider]

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

    async def get(self, sandbox_id: str) -> Sandbox:
        """The live sandbox, or the typed error of why there is none (read
        from the store, off the event loop, when it is not live here)."""
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is not None:
            return sandbox
        row = await self.astore.get_sandbox(sandbox_id)
        if row is not None and row.state in FINAL:
            raise expiry_error(row.id, SandboxState(row.state), row.reason)
        raise NotFound(f"no sandbox {sandbox_id}")

    def host(self, sandbox: Sandbox) -> None:
        """Answer for ``sandbox``, which this process made outside the daemon
        (an in-process owner serving it to the holders of its refs): its
        owner closes it; it is never stored, reconciled or reaped here."""
        self.sandboxes[sandbox.id] = sandbox
        self._hosted.add(sandbox.id)

    async def session(self, sandbox_id: str, session: str | None) -> Sandbox:
        """The sandbox, with the calling session's read-before-write guard in
        effect (in the caller's context: awaited, not run as a task)."""
        sandbox = await self.get(sandbox_id)
        if session:
            key = (sandbox_id, session)
            guard = self._guards.get(key)
            if guard is None:
                guard = self._guards[key] = ReadBeforeWriteGuard(guard_enabled(sandbox))
            session_guard.set(guard)
        return sandbox

    # -- workspaces ----------------------------------------------------------------------
    def _lock(self, name: str) -> asyncio.Lock:
        return self._workspace_locks.setdefault(name, asyncio.Lock())

    async def _workspace(self, name: str) -> WorkspaceRow:
        row = await self.astore.get_workspace(name)
        if row is None:
            raise NotFound(f"no workspace {name!r}")
        return row

    async def _end_leftover_commands(self, sandbox: Sandbox) -> None:
        """Commands an earlier daemon started are no one's now (their handles,
        output and timeouts died with it): they are ended, and the events say
        so, rather than left running unseen. (A suspended sandbox's ended with
        the suspend; a paused one's are ended when it is resumed.)"""
        try:
            ended = await backend_of(sandbox).runtime.end_leftover_commands()
        except Exception as exc:
            await self._note(sandbox.id, "adopted",
                       f"could not end the commands left running before the restart: {exc}")
            log.warning("sandbox %s: could not end leftover commands: %s", sandbox.id, exc)
            return
        if ended:
            await self._note(sandbox.id, "adopted",
                       f"killed {ended} processes of commands started before the restart "
                       "(their output and exit cannot be re-attached)")
            log.warning("sandbox %s: killed %d leftover processes", sandbox.id, ended)
