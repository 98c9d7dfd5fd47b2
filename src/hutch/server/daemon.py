"""The daemon's core, free of HTTP: sandboxes and workspaces that outlive the
process, written through the store before they are acknowledged.

Start-up reconciles the store with what really runs: sandboxes whose runtime
is alive are adopted, running workspaces whose sandbox is gone become
``stale``, half-made records (a create cut short) are dropped with whatever
they made, and hutch-labelled containers nobody knows are removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import json
import logging
import math
import os
import re
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from typing import Any

import anyio.to_thread
from pydantic import BaseModel

from .._errors import (
    CapabilityUnsupported,
    HutchError,
    InvalidArgument,
    InvalidState,
    NotFound,
    ProviderError,
    StoreUnavailable,
    Unauthorized,
)
from .._guardrail import ReadBeforeWriteGuard, session_guard
from .._paths import hutch_home
from .._refwire import DaemonRef, decode_ref
from .._sandbox import Sandbox, backend_of, check_ref_lifetime, new_sandbox_id
from ..config import SandboxSpec, resolve_spec
from ..lifecycle.engine import LifecycleEngine, expiry_error
from ..lifecycle.state import SandboxState
from ..providers.base import RuntimeNotice, SandboxBackend
from ..providers.registry import get_provider
from ..store import RefRow, SandboxRow, SQLiteStore, Store, WorkspaceRow
from .policy import OperatorPolicy

log = logging.getLogger("hutch.daemon")

WORKSPACE_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
STATE_REPOSITORY = "hutch-workspace"
#: Label on every container a daemon makes: the data directory it belongs to.
DAEMON_LABEL = "hutch.daemon"
#: Store key written by a clean stop, cleared at start: after a crash it is absent.
CLEAN_STOP = "clean_stop_unix"
#: A diff suspend on an image this deep flattens instead: overlayfs stacks at
#: most 128 layers, and every diff adds one.
MAX_DIFF_LAYERS = 100
#: A ref's use is an event at most this often (its first use after a start always is).
REF_USE_EVENT_SECONDS = 60.0
#: How long a best-effort Docker cleanup may take before it is left for later.
CLEANUP_TIMEOUT = 30.0
#: What a workspace's state image keeps of the config of the image it came from.
IMAGE_CONFIG_KEYS = ("Env", "WorkingDir", "User", "Entrypoint", "Cmd")
FINAL_STATES = (SandboxState.TERMINATED, SandboxState.FAILED)
#: How long an ended (terminated or failed) sandbox stays readable, with its events.
DEFAULT_RETENTION_SECONDS = 86400.0


def state_tag(workspace: str) -> str:
    """The one state snapshot of a workspace, overwritten on each suspend."""
    return f"{STATE_REPOSITORY}-{workspace}:state"


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
    ) -> None:
        #: What API clients may ask for: host-reaching settings, limits.
        self.policy = policy or OperatorPolicy()
        self.data_dir = os.path.abspath(data_dir or default_data_dir())
        make_private_dir(self.data_dir)
        # Providers that keep files on the host keep them under the data dir.
        os.environ["HUTCH_HOME"] = self.data_dir
        if store is None:
            store = SQLiteStore(make_private_file(os.path.join(self.data_dir, "hutch.db")))
        self.store = store
        self.sandbox_defaults = dict(sandbox_defaults or {})
        if not 0 < retention_seconds < math.inf:
            raise InvalidArgument(
                f"retention must be a positive number of seconds, got {retention_seconds!r}"
            )
        self.retention_seconds = retention_seconds
        self._pruner: asyncio.Task[None] | None = None
        #: One watcher per provider in use, telling of runtimes that die outside hutch.
        self._watchers: dict[type[SandboxBackend], asyncio.Task[None]] = {}
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
        if new in FINAL_STATES:
            self._forget(sandbox_id)
            if reason not in (None, "closed"):
                log.warning("sandbox %s reaped: %s", sandbox_id, reason)
            if row.workspace is not None:
                try:
                    self._workspace_lost_its_sandbox(row.workspace, sandbox_id, reason)
                except StoreUnavailable as exc:
                    # The next start finds the workspace's sandbox ended and marks it stale.
                    log.warning("workspace %s: could not record it stale: %s", row.workspace, exc)

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
        if sandbox._record is None:
            return
        status = sandbox.status()
        row.meter = dict(status.meter)
        row.last_active_unix = status.last_active_unix

    def _forget(self, sandbox_id: str) -> None:
        self.sandboxes.pop(sandbox_id, None)
        self.workspace_of.pop(sandbox_id, None)
        self._guards = {k: v for k, v in self._guards.items() if k[0] != sandbox_id}
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
    def spec_from_request(
        self, body: Mapping[str, Any], *, daemon_settings: Mapping[str, Any] | None = None
    ) -> SandboxSpec:
        """The spec a client's request asks for, as the operator's policy admits
        it; ``daemon_settings`` are the daemon's own (a workspace's directory),
        added after the check."""
        spec = resolve_spec(flags=body, server_defaults=self.sandbox_defaults)
        try:  # the operator's own settings for this provider, if they stand alone
            operators: BaseModel | None = resolve_spec(
                flags={"provider": spec.provider.type}, server_defaults=self.sandbox_defaults
            ).provider
        except InvalidArgument:
            operators = None  # a provider with required settings the operator left out
        provider = self.policy.admit(spec.provider, operators)
        if daemon_settings:
            provider = provider.model_copy(update=dict(daemon_settings))
        spec = spec.model_copy(update={"provider": provider})
        if spec.provider.type == "docker":
            # Mark what this daemon made, so that reconciliation only ever
            # removes its own containers, never another process's sandboxes.
            labels = {**spec.provider.labels, DAEMON_LABEL: self.data_dir}
            spec = spec.model_copy(
                update={"provider": spec.provider.model_copy(update={"labels": labels})}
            )
        return spec

    async def create_sandbox(
        self, spec: SandboxSpec, *, workspace: str | None = None, sandbox_id: str | None = None
    ) -> Sandbox:
        sid = sandbox_id or new_sandbox_id()
        now = time.time()
        row = SandboxRow(
            id=sid, provider=spec.provider.type, state=SandboxState.CREATING.value,
            spec=spec.model_dump(), workspace=workspace, created_at_unix=now,
        )
        # Intent first: a daemon killed mid-create finds this row and cleans up.
        await anyio.to_thread.run_sync(self.store.put_sandbox, row)
        backend_cls = get_provider(spec.provider.type)
        try:
            backend = await backend_cls.create(spec.provider, sid)
        except BaseException:
            self.store.delete_sandbox(sid)
            raise
        sandbox = self._wrap(backend, spec)
        self.sandboxes[sid] = sandbox
        if workspace is not None:
            self.workspace_of[sid] = workspace
        try:
            await self.engine.attach(sandbox, spec.options)
        except BaseException:
            self.sandboxes.pop(sid, None)
            await backend.close()
            self.store.delete_sandbox(sid)
            raise
        self._note(sid, "created", f"{spec.provider.type} sandbox created")
        self._watch(type(backend))
        return sandbox

    def _watch(self, provider: type[SandboxBackend]) -> None:
        """Start the provider's watcher for runtimes that die, once per provider."""
        if provider not in self._watchers:
            self._watchers[provider] = asyncio.get_running_loop().create_task(
                provider.watch_runtimes(self._runtime_notice)
            )

    async def _runtime_notice(self, notice: RuntimeNotice) -> None:
        """A provider's watcher tells what happened to a sandbox outside hutch."""
        sandbox = self.sandboxes.get(notice.sandbox_id)
        if sandbox is None:
            return  # not ours, or already ended
        if not notice.may_have_died:
            self._note(notice.sandbox_id, "runtime", notice.message)
            log.warning("sandbox %s: %s", notice.sandbox_id, notice.message)
        elif await self.engine.runtime_died(sandbox, notice.message):
            log.warning("sandbox %s failed: %s", notice.sandbox_id, notice.message)

    @staticmethod
    def _wrap(backend: Any, spec: SandboxSpec) -> Sandbox:
        return Sandbox(
            backend,
            sandbox_id=backend.sandbox_id,
            read_before_write=spec.options.read_before_write,
            output_limit=spec.options.output_limit,
        )

    def get(self, sandbox_id: str) -> Sandbox:
        try:
            return self.sandboxes[sandbox_id]
        except KeyError:
            row = self.store.get_sandbox(sandbox_id)
            if row is not None and row.state in ("terminated", "failed"):
                raise expiry_error(row.id, SandboxState(row.state), row.reason) from None
            raise NotFound(f"no sandbox {sandbox_id}") from None

    def session(self, sandbox_id: str, session: str | None) -> Sandbox:
        """The sandbox, with the calling session's read-before-write guard in effect."""
        sandbox = self.get(sandbox_id)
        if session:
            key = (sandbox_id, session)
            guard = self._guards.get(key)
            if guard is None:
                guard = self._guards[key] = ReadBeforeWriteGuard(sandbox._guard.enabled)
            session_guard.set(guard)
        return sandbox

    async def info(self, sandbox: Sandbox) -> dict[str, Any]:
        """The sandbox's own description, and what the daemon knows around it."""
        return {
            **await sandbox.info(),
            "attachments": self.attachments(sandbox.id),
            "workspace": self.workspace_of.get(sandbox.id),
            "ended_at_unix": None,
        }

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
        )
        known = self._sandbox_refs(sandbox_id)  # read before the new row is in the store
        await anyio.to_thread.run_sync(self.store.put_ref, row)
        known.append(row)
        self._refs[row.id] = row
        self.store.log_event(
            sandbox_id, "ref",
            f"ref {row.id} handed out"
            + ("" if expires_in is None else f", expires in {expires_in:g} s"),
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
            refs = [self._refs.setdefault(r.id, r) for r in self.store.list_refs(sandbox_id)]
            self._refs_of[sandbox_id] = refs
        return refs

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
        if row.revoked_at_unix is not None:
            raise Unauthorized(f"ref {row.id} was revoked by the owner of {row.sandbox_id}")
        now = time.time()
        if row.expires_at_unix is not None and now >= row.expires_at_unix:
            raise Unauthorized(
                f"ref {row.id} to {row.sandbox_id} expired; ask its owner for a new one"
            )
        if now - self._ref_used.get(row.id, -math.inf) >= REF_USE_EVENT_SECONDS:
            self._ref_used[row.id] = now
            self.store.log_event(row.sandbox_id, "ref", f"ref {row.id} used")
        return row

    def detach(self, ref: RefRow) -> None:
        """A session holding a ref closed: it leaves; the sandbox stays."""
        self.store.log_event(ref.sandbox_id, "ref", f"a session holding ref {ref.id} detached")

    def attachments(self, sandbox_id: str) -> list[dict[str, Any]]:
        """The refs that can still attach to a sandbox."""
        now = time.time()
        return [
            {"ref_id": r.id, "created_at_unix": r.created_at_unix,
             "expires_at_unix": r.expires_at_unix, "last_used_unix": self._ref_used.get(r.id)}
            for r in self._sandbox_refs(sandbox_id)
            if r.revoked_at_unix is None and (r.expires_at_unix is None or r.expires_at_unix > now)
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
            "workspace": row.workspace,
            "ended_at_unix": row.updated_at_unix,
        }

    async def describe(self, sandbox_id: str) -> dict[str, Any]:
        """A sandbox's state and reason: a live one's, or an ended one's from the store."""
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is not None:
            return await self.info(sandbox)
        row = self.store.get_sandbox(sandbox_id)
        if row is None or row.state not in FINAL_STATES:
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
            if row.state in FINAL_STATES and row.id not in self.sandboxes
        ]
        return sorted([*live, *ended], key=lambda info: float(info["created_at_unix"] or 0))

    async def delete_sandbox(self, sandbox_id: str) -> None:
        """End a sandbox. Idempotent: one that already ended (expired, failed,
        deleted) and is still on record is not an error."""
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None:
            row = self.store.get_sandbox(sandbox_id)
            if row is not None and row.state in FINAL_STATES:
                return
            raise NotFound(f"no sandbox {sandbox_id}")
        await sandbox.close()
        self._forget(sandbox_id)

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
            live_record = live._record
            if live_record is not None:
                row.last_active_unix = live.status().last_active_unix
        return {
            "name": row.name,
            "status": status,
            "provider": row.provider,
            "live_sandbox_id": row.live_sandbox_id,
            "current_state_tag": row.current_state_tag,
            "source_snapshot_tag": row.source_snapshot_tag,
            "image": row.image,
            "host_workdir": row.host_workdir,
            "created_at_unix": row.created_at_unix,
            "last_active_unix": row.last_active_unix,
        }

    def list_workspaces(self) -> list[WorkspaceRow]:
        return self.store.list_workspaces()

    def get_workspace(self, name: str) -> WorkspaceRow:
        return self._workspace(name)

    async def create_workspace(self, body: Mapping[str, Any]) -> WorkspaceRow:
        body = dict(body)
        name = str(body.pop("name", "") or "")
        if not WORKSPACE_NAME.match(name):
            raise InvalidArgument(
                f"workspace name {name!r} must be 1-63 characters of a-z, 0-9, '.', '_', '-'"
            )
        snapshot_tag = body.pop("snapshot_tag", None)
        image = body.pop("image", None)
        if bool(snapshot_tag) == bool(image):
            raise InvalidArgument("a workspace is made from exactly one of snapshot_tag or image")
        provider = body.setdefault("provider", "docker")
        if provider != "docker":
            raise CapabilityUnsupported.for_provider(str(provider), "workspaces")
        async with self._lock(name):
            if self.store.get_workspace(name) is not None:
                raise InvalidState(f"workspace {name!r} already exists")
            host_workdir = os.path.join(self.data_dir, "workspaces", name, "workspace")
            os.makedirs(host_workdir, exist_ok=True)
            spec = self.spec_from_request(
                {**body, "image": snapshot_tag or image},
                daemon_settings={"host_workdir": host_workdir},
            )
            now = time.time()
            sid = new_sandbox_id()
            row = WorkspaceRow(
                name=name, status="creating", provider="docker", spec=spec.model_dump(),
                live_sandbox_id=sid, source_snapshot_tag=snapshot_tag, image=image,
                host_workdir=host_workdir, created_at_unix=now, last_active_unix=now,
            )
            self.store.put_workspace(row)
            try:
                await self.create_sandbox(spec, workspace=name, sandbox_id=sid)
            except BaseException:
                self.store.delete_workspace(name)
                shutil.rmtree(os.path.dirname(host_workdir), ignore_errors=True)
                raise
            row.status = "running"
            self.store.put_workspace(row)
            self.store.log_event(name, "workspace", f"created from {snapshot_tag or image}")
            return row

    async def suspend_workspace(self, name: str, *, diff: bool) -> WorkspaceRow:
        """Capture the workspace's state into its one state snapshot, free the sandbox.

        ``diff``: commit only the changes since the state the sandbox started
        from (one more layer on the last snapshot). Otherwise the whole file
        system is flattened into a fresh single-layer image.
        """
        async with self._lock(name):
            row = self._workspace(name)
            sandbox = self.sandboxes.get(row.live_sandbox_id or "")
            if row.status != "running" or sandbox is None:
                raise InvalidState(
                    f"workspace {name!r} is {row.status}; only a running one suspends"
                )
            if sandbox.state in (SandboxState.SUSPENDED, SandboxState.PAUSED):
                await sandbox.resume()
            row.status = "suspending"
            self.store.put_workspace(row)
            tag = state_tag(name)
            previous = row.current_state_tag
            try:
                replaced = await self._capture_state(sandbox, tag, diff=diff)
            except BaseException:
                row.status = "running"
                self.store.put_workspace(row)
                raise
            row.status, row.current_state_tag, row.live_sandbox_id = "suspended", tag, None
            row.last_active_unix = time.time()
            self.store.put_workspace(row)
            await sandbox.close()
            self.sandboxes.pop(sandbox.id, None)
            if replaced is not None:
                # The old snapshot is replaced. Only now, with the container that
                # ran from it gone, can it go; docker keeps it while a newer layer
                # still builds on it.
                await self._remove_image(replaced)
            self.store.log_event(
                name, "workspace", f"suspended into {tag} ({'diff' if diff else 'full'})"
                + (f", replacing {previous}" if previous and previous != tag else "")
            )
            return row

    @staticmethod
    async def _remove_image(image: str, *, force: bool = False) -> None:
        from ..providers.docker import engine

        await docker_cleanup(
            f"removing image {image}", lambda: engine().remove_image(image, force=force)
        )

    async def _capture_state(self, sandbox: Sandbox, tag: str, *, diff: bool) -> str | None:
        """Write the sandbox's state to ``tag``; return the image the tag named before."""
        from ..providers.docker import DockerSandbox, engine

        backend = backend_of(sandbox)
        if not isinstance(backend, DockerSandbox) or backend.container_id is None:
            raise CapabilityUnsupported.for_provider(sandbox.provider, "workspace suspend")
        container = backend.container_id
        repository, _, label = tag.partition(":")
        api = engine()
        old_image: str | None = None
        with contextlib.suppress(Exception):
            old_image = api.inspect_image(tag)["Id"]

        def source_image() -> dict[str, Any]:
            image: dict[str, Any] = api.inspect_image(api.inspect_container(container)["Image"])
            return image

        source = await anyio.to_thread.run_sync(source_image)
        depth = len(source.get("RootFS", {}).get("Layers") or [])
        if diff and depth >= MAX_DIFF_LAYERS:
            log.info("workspace image for %s has %d layers: flattening instead of a diff",
                     tag, depth)
            diff = False
        source_config = source.get("Config") or {}
        if diff:
            # The image's own config, not the container's run config (its
            # keeper command, the mount point as working directory, the
            # sandbox's extra env): the state image is the user's image plus
            # their changes.
            conf = {key: source_config[key] for key in IMAGE_CONFIG_KEYS
                    if source_config.get(key)}
            await anyio.to_thread.run_sync(
                lambda: api.commit(container, repository=repository, tag=label, conf=conf)
            )
        else:
            changes = import_changes(source_config)

            def flatten() -> None:
                exporter = subprocess.Popen(
                    ["docker", "export", container], stdout=subprocess.PIPE
                )
                command = ["docker", "import"]
                for change in changes:
                    command += ["--change", change]
                importer = subprocess.run(
                    [*command, "-", tag], stdin=exporter.stdout, capture_output=True,
                    check=False,
                )
                exporter.wait()
                if exporter.returncode or importer.returncode:
                    raise ProviderError(
                        f"flattening {container} into {tag} failed: {importer.stderr.decode()}"
                    )

            await anyio.to_thread.run_sync(flatten)
        return old_image

    async def resume_workspace(self, name: str) -> WorkspaceRow:
        async with self._lock(name):
            row = self._workspace(name)
            live = self.sandboxes.get(row.live_sandbox_id or "")
            if row.status == "running" and live is not None:
                if live.state in (SandboxState.SUSPENDED, SandboxState.PAUSED):
                    await live.resume()
                    return row
                raise InvalidState(f"workspace {name!r} is already running")
            if row.status not in ("suspended", "stale"):
                raise InvalidState(f"workspace {name!r} is {row.status}; it cannot resume")
            image = row.current_state_tag or row.source_snapshot_tag or row.image
            spec = SandboxSpec.model_validate(row.spec)
            spec = spec.model_copy(
                update={"provider": spec.provider.model_copy(update={"image": image})}
            )
            sid = new_sandbox_id()
            row.live_sandbox_id, row.status = sid, "resuming"
            self.store.put_workspace(row)
            try:
                await self.create_sandbox(spec, workspace=name, sandbox_id=sid)
            except BaseException:
                row.live_sandbox_id, row.status = None, "stale"
                self.store.put_workspace(row)
                raise
            row.status, row.last_active_unix = "running", time.time()
            self.store.put_workspace(row)
            self.store.log_event(name, "workspace", f"resumed from {image}")
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
        # The tag is derived from the name, so a snapshot a crash left
        # unrecorded goes too.
        await self._remove_image(state_tag(row.name), force=True)
        if row.host_workdir:
            workspace_dir = os.path.dirname(row.host_workdir)
            await anyio.to_thread.run_sync(
                lambda: shutil.rmtree(workspace_dir, ignore_errors=True)
            )
        self.store.delete_workspace(row.name)
        self.store.log_event(row.name, "workspace", "deleted (its source is kept)")

    # -- start-up and shut-down ------------------------------------------------------------
    async def start(self) -> None:
        # Whether the last run stopped cleanly; from now on, until our own
        # clean stop, it did not.
        clean = self.store.get_meta(CLEAN_STOP) is not None
        self.store.set_meta(CLEAN_STOP, None)
        await self.reconcile(after_clean_stop=clean)
        self.prune_ended()
        self._pruner = asyncio.get_running_loop().create_task(self._prune_periodically())

    async def reconcile(self, *, after_clean_stop: bool = False) -> None:
        for row in self.store.list_sandboxes():
            await self._reconcile_sandbox(row, after_clean_stop=after_clean_stop)
        for ws in self.store.list_workspaces():
            await self._reconcile_workspace(ws)
        await self._remove_orphan_containers()

    async def _reconcile_sandbox(self, row: SandboxRow, *, after_clean_stop: bool) -> None:
        if row.state == SandboxState.CREATING.value:
            await self._remove_container_of(row.id, "its create was cut short")
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
        state = SandboxState(row.state)
        if state in (SandboxState.RUNNING, SandboxState.PAUSED):
            try:
                alive = await backend.is_alive()
            except HutchError as exc:
                self._mark_lost(row, f"lost: its runtime cannot be reached ({exc})")
                return
            if not alive:
                self._mark_lost(row, "lost: its runtime died while the daemon was down")
                return
        sandbox = self._wrap(backend, spec)
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
        if state is SandboxState.RUNNING and sandbox.capabilities.processes:
            await self._end_leftover_commands(sandbox)

    async def _end_leftover_commands(self, sandbox: Sandbox) -> None:
        """Commands an earlier daemon started are no one's now (their handles,
        output and timeouts died with it): they are ended, and the events say
        so, rather than left running unseen. (A suspended sandbox's ended with
        the suspend; a paused one's are frozen and not reached here.)"""
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
                if ws.host_workdir:
                    shutil.rmtree(os.path.dirname(ws.host_workdir), ignore_errors=True)
                log.warning("dropped workspace %s: its create was cut short", ws.name)
            return
        if ws.status in ("running", "suspending", "resuming") and not live:
            ws.status = "suspended" if ws.status == "suspending" and self._image_exists(
                ws.current_state_tag
            ) else "stale"
            ws.live_sandbox_id = None
            self.store.put_workspace(ws)
            log.warning("workspace %s is %s: its sandbox is gone", ws.name, ws.status)
        elif ws.status in ("suspending", "resuming") and live:
            ws.status = "running"
            self.store.put_workspace(ws)

    @staticmethod
    def _image_exists(tag: str | None) -> bool:
        if not tag:
            return False
        from ..providers.docker import engine

        try:
            engine().inspect_image(tag)
        except Exception:
            return False
        return True

    async def _remove_container_of(self, sandbox_id: str, why: str) -> None:
        from ..providers.docker import engine

        name = f"hutch-{sandbox_id}"
        if await docker_cleanup(
            f"removing container {name}", lambda: engine().remove_container(name, force=True),
            quiet_if_missing=True,
        ):
            log.warning("removed container %s: %s", name, why)

    async def _remove_orphan_containers(self) -> None:
        try:
            from ..providers.docker import engine, list_managed_containers

            containers = await anyio.to_thread.run_sync(
                functools.partial(list_managed_containers, with_labels=True)
            )
        except Exception as exc:
            log.info("no Docker Engine to reconcile with (%s)", exc)
            return
        api = engine()
        for sandbox_id, container_id, labels in containers:
            if labels.get(DAEMON_LABEL) != self.data_dir:
                continue  # another daemon's, or an in-process sandbox: not ours to judge
            sandbox = self.sandboxes.get(sandbox_id)
            backend_container = (
                getattr(backend_of(sandbox), "container_id", None) if sandbox else None
            )
            if backend_container == container_id:
                continue
            if sandbox is None:
                row = self.store.get_sandbox(sandbox_id)
                if row is not None and row.description.get("config", {}).get("preserve"):
                    continue
            if not await docker_cleanup(
                f"removing orphan container {container_id[:12]}",
                functools.partial(api.remove_container, container_id, force=True),
            ):
                continue
            self.store.log_event(sandbox_id or container_id, "orphan", "removed orphan container")
            log.warning("removed orphan container %s (sandbox %s)", container_id[:12], sandbox_id)

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
            if row is None or row.state in ("terminated", "failed"):
                continue
            self._snapshot(row, sandbox)
            rows.append(row)
        try:
            await anyio.to_thread.run_sync(self.store.put_sandboxes, rows)
            self.store.set_meta(CLEAN_STOP, str(time.time()))
        finally:
            self.store.close()


async def docker_cleanup(
    what: str,
    call: Callable[[], object],
    *,
    timeout: float = CLEANUP_TIMEOUT,
    quiet_if_missing: bool = False,
) -> bool:
    """Run a best-effort Docker call; True if it did what it was asked.

    Bounded: a Docker Engine wedged on one container (an exec frozen by a
    pause holds that container's lock, and image removal waits on it) must
    not hang a suspend, a delete or the daemon's start. What is left is
    found again by the next reconciliation.
    """
    with anyio.move_on_after(timeout) as scope:
        try:
            await anyio.to_thread.run_sync(call, abandon_on_cancel=True)
        except Exception as exc:
            missing = getattr(getattr(exc, "response", None), "status_code", None) == 404
            if not (quiet_if_missing and missing):
                log.info("%s failed: %s", what, exc)
            return False
        return True
    if scope.cancelled_caught:
        log.warning("%s: the Docker Engine did not answer in %.0f s; left for later",
                    what, timeout)
    return False


def import_changes(config: Mapping[str, Any]) -> list[str]:
    """Dockerfile lines that give an imported (flattened) image its source's config.

    ``docker import`` keeps files only; without these the state image would
    lose the image's environment, working directory, user and command.
    """

    def quoted(value: str) -> str:
        # Double-quoted, with what ENV would otherwise interpret escaped.
        escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$")
        return f'"{escaped}"'

    changes = []
    for item in config.get("Env") or []:
        key, _, value = str(item).partition("=")
        changes.append(f"ENV {key}={quoted(value)}")
    if config.get("WorkingDir"):
        changes.append(f"WORKDIR {config['WorkingDir']}")
    if config.get("User"):
        changes.append(f"USER {config['User']}")
    if config.get("Entrypoint"):
        changes.append(f"ENTRYPOINT {json.dumps(config['Entrypoint'])}")
    if config.get("Cmd"):
        changes.append(f"CMD {json.dumps(config['Cmd'])}")
    return changes
