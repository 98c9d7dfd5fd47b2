"""The store interface the daemon writes through.

Every state transition is written (and committed durably) before it is
acknowledged, so that a daemon killed at any point restarts from a store
that never claims more than happened. Another database (PostgreSQL, for
several daemons) joins by implementing :class:`Store`.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._errors import StoreUnavailable, Unauthorized
from .._liveness import still_running


@dataclass
class SandboxRow:
    id: str
    provider: str
    state: str
    spec: dict[str, Any]
    #: What the provider needs to find the sandbox again (``backend.describe()``).
    description: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None
    workspace: str | None = None
    created_at_unix: float = 0.0
    #: When the row was last written; the meter below is as of this moment.
    updated_at_unix: float = 0.0
    #: The set_timeout deadline, if one was set (max_lifetime counts from creation).
    deadline_unix: float | None = None
    last_active_unix: float | None = None
    #: Seconds spent per state (``running_s``, ``paused_s``, ``suspended_s``).
    meter: dict[str, float] = field(default_factory=dict)
    #: The snapshot it was started from or last captured (its next snapshot's parent).
    base_snapshot_id: str | None = None
    #: The snapshot it was started from, if it was (a branch, a resumed workspace).
    origin_snapshot_id: str | None = None
    #: Who owns the row (a daemon's id; None: no daemon yet, a legacy row),
    #: until when by the store's clock (its owner's heartbeat renews it),
    #: how many times it changed hands (``epoch``) and was written (``version``).
    owner: str | None = None
    lease_expires_at_unix: float | None = None
    epoch: int = 0
    version: int = 0


@dataclass
class WorkspaceRow:
    """A name over a live sandbox, its current state snapshot and its source.

    Provider-neutral: the state is a snapshot (``state_snapshot_id``), the
    source the snapshot it was made from (``source_snapshot_id``) or, when it
    was made fresh, the settings in ``spec``.
    """

    name: str
    status: str
    provider: str
    spec: dict[str, Any]
    live_sandbox_id: str | None = None
    state_snapshot_id: str | None = None
    source_snapshot_id: str | None = None
    created_at_unix: float = 0.0
    last_active_unix: float = 0.0
    #: Who owns the row (a daemon's id; None: no daemon yet, a legacy row),
    #: until when by the store's clock (its owner's heartbeat renews it),
    #: how many times it changed hands (``epoch``) and was written (``version``).
    owner: str | None = None
    lease_expires_at_unix: float | None = None
    epoch: int = 0
    version: int = 0


@dataclass
class SnapshotRow:
    """A snapshot in the lineage tree. ``status`` is ``capturing`` from the
    moment the capture is intended until the provider has finished it (a row
    still ``capturing`` after a restart was cut short: its storage is freed
    and the row dropped), then ``ready``; ``removing`` once its removal began."""

    id: str
    provider: str
    status: str
    label: str | None = None
    sandbox_id: str | None = None
    parent_id: str | None = None
    size_bytes: int = 0
    created_at_unix: float = 0.0
    #: The provider's handle (``ProviderSnapshot.as_dict()``).
    handle: dict[str, Any] = field(default_factory=dict)
    #: The settings of the sandbox it was taken of (a ``SandboxSpec`` dump).
    spec: dict[str, Any] = field(default_factory=dict)
    #: Who owns the row (a daemon's id; None: no daemon yet, a legacy row),
    #: until when by the store's clock (its owner's heartbeat renews it),
    #: how many times it changed hands (``epoch``) and was written (``version``).
    owner: str | None = None
    lease_expires_at_unix: float | None = None
    epoch: int = 0
    version: int = 0


#: The columns that say who owns a sandbox, workspace or snapshot row.
OWNED_COLUMNS = ("owner", "lease_expires_at_unix", "epoch", "version")


class OwnershipLost(StoreUnavailable):
    """A write to a row this daemon no longer owns (another daemon took it
    over, or this one's lease lapsed): refused, nothing of it kept. The
    writer stops serving the row (without touching its runtime)."""


class WriteConflict(StoreUnavailable):
    """A write of a sandbox, workspace or snapshot row from a version another
    writer has changed since it was read (or of a new row whose key is taken,
    or of a row removed since): refused, nothing of it kept, the other
    writer's change whole. The writer reads the row again and makes its
    change on that (or reports the conflict)."""


class StoreCallOnLoop(RuntimeError):
    """A store call made on the thread running an event loop, while
    ``HUTCH_STORE_OFF_LOOP_CHECK`` asks for them to be refused: a bug (the
    call belongs behind :class:`~hutch.store.aio.AsyncStore` or a worker
    thread), never an answer to a client."""


#: Whether a store call on an event loop's thread is refused (set in tests:
#: a daemon that makes one fails the request, and says so in its log).
_REFUSE_ON_LOOP = os.environ.get("HUTCH_STORE_OFF_LOOP_CHECK") == "1"
_log = logging.getLogger("hutch.store")


def check_off_loop(what: str) -> None:
    """Refuse (``StoreCallOnLoop``) a store call on the thread running an
    event loop, when the check is on: a disk or a database round trip there
    stalls every other request. Each store's calls pass through here."""
    if not _REFUSE_ON_LOOP:
        return
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return  # a worker thread, or a program with no loop
    _log.error("store call on the event loop: %s", what, stack_info=True)
    raise StoreCallOnLoop(f"store call on the event loop's thread: {what}")


@dataclass
class DaemonRow:
    """A daemon of a fleet sharing one store: where it is reached, and until
    when its heartbeat holds (the store's clock)."""

    id: str
    url: str
    expires_at_unix: float
    #: Whether its heartbeat holds now, by the store's clock.
    alive: bool


def check_fence(
    what: str,
    writer: str,
    found: Mapping[str, Any],
    row: SandboxRow | WorkspaceRow | SnapshotRow | None,
    now: float,
) -> None:
    """Refuse (``OwnershipLost``) ``writer``'s write of ``row`` over the stored
    ``found`` (its owner, epoch and lease): only the owner whose lease holds
    writes, and only from the epoch it read (an ownerless row is anyone's)."""
    owner = found["owner"]
    if owner is None:
        return
    if owner != writer:
        raise OwnershipLost(f"{what} is served by daemon {owner} now, not by {writer}")
    if row is not None and row.owner is not None and row.epoch != found["epoch"]:
        raise OwnershipLost(f"{what} changed hands since daemon {writer} read it "
                            f"(epoch {row.epoch}, now {found['epoch']})")
    lease = found["lease_expires_at_unix"]
    if lease is not None and lease < now:
        raise OwnershipLost(f"daemon {writer}'s lease of {what} lapsed; it may no longer "
                            "write it")


@dataclass
class RefRow:

    """A reference to one sandbox, handed out by its owner: a credential for it alone.

    Only a hash of its secret is kept, so the store does not hold a usable
    credential."""

    id: str
    sandbox_id: str
    secret_sha256: str
    created_at_unix: float
    expires_at_unix: float | None = None
    revoked_at_unix: float | None = None
    #: The workspace whose sandbox it was handed out for: it follows the
    #: workspace to the sandboxes that serve it later (after a suspend and resume).
    workspace: str | None = None

    def check_usable(self, now: float) -> None:
        """Refuse (``Unauthorized``) a ref its owner revoked or that has expired."""
        if self.revoked_at_unix is not None:
            raise Unauthorized(f"ref {self.id} was revoked by the owner of {self.sandbox_id}")
        if self.expires_at_unix is not None and now >= self.expires_at_unix:
            raise Unauthorized(
                f"ref {self.id} to {self.sandbox_id} expired; ask its owner for a new one"
            )


@dataclass
class InstanceRow:
    """The sandbox one thread of one definition runs in (SPEC §6), by its
    instance key. ``description`` is the backend's ``describe()`` and
    ``state`` its lifecycle state (``running``, ``paused``, ``suspended``,
    ``terminated``, ``failed``), both as of its last transition, so that
    another program finds the sandbox again as it is (a suspended one by its
    own suspended state, not the snapshot taken after setup)."""

    key: str
    definition_id: str
    thread_id: str
    tenant: str | None
    provider: str
    sandbox_id: str | None = None
    description: dict[str, Any] = field(default_factory=dict)
    spec: dict[str, Any] = field(default_factory=dict)
    updated_at_unix: float = 0.0
    state: str = "running"
    #: The latest activity of any program holding the sandbox (Unix time):
    #: what every program's idle rule reads (see ``lifecycle.shared``).
    last_active_unix: float | None = None
    #: When the sandbox was made (Unix time): every program's max_lifetime
    #: counts from here, not from when it found the sandbox.
    created_at_unix: float | None = None
    #: The sandbox's set_timeout deadline (Unix time), whichever program set
    #: it last: every program's timer goes by this one.
    deadline_unix: float | None = None
    #: Why the sandbox's last transition happened (an ended one: its expiry).
    reason: str | None = None


@dataclass
class DefinitionRow:
    id: str
    body: dict[str, Any]
    updated_at_unix: float = 0.0


class Store(abc.ABC):
    #: Whether several daemons may serve this store at once (a fleet).
    shared: bool = False
    #: The daemon writing through this store (set by :meth:`act_as`), and how
    #: long a write holds the rows it writes.
    writer: str | None = None
    lease_seconds: float = 30.0

    def act_as(self, daemon_id: str | None, lease_seconds: float = 30.0) -> None:
        """From now on write as ``daemon_id``: the sandbox, workspace and
        snapshot rows it makes are its own, and its writes are fenced (a
        row another daemon owns, or whose lease lapsed, raises
        ``OwnershipLost``). None: unfenced (a program in-process, tests)."""
        self.writer, self.lease_seconds = daemon_id, lease_seconds

    # -- the fleet -------------------------------------------------------------------------
    @abc.abstractmethod
    def register_daemon(self, daemon_id: str, url: str, seconds: float) -> None:
        """The daemon's heartbeat: it lives, reached at ``url``, for
        ``seconds`` more (the store's clock); the leases of the rows it owns
        are renewed with it."""

    @abc.abstractmethod
    def daemons(self) -> list[DaemonRow]:
        """Every registered daemon, alive or not, by id."""

    @abc.abstractmethod
    def lapsed_sandboxes(self) -> list[SandboxRow]:
        """Sandboxes not ended whose owner's lease lapsed: for a live daemon
        to take over (or to record failed)."""

    @abc.abstractmethod
    def take_over(self, kind: str, key: str) -> bool:
        """The writer takes the row (``kind``: sandbox, workspace or snapshot)
        if it is ownerless, its own, or its owner's lease lapsed: owner set,
        epoch bumped, lease renewed. Whether it is now the writer's: not
        while another transaction holds the row (its owner may be stalled in
        its heartbeat), which is passed over at once, not waited on."""

    @abc.abstractmethod
    def take_over_lapsed(self, kind: str) -> list[str]:
        """The writer takes every row of ``kind`` (workspace, snapshot) whose
        owner's lease lapsed, at once (each goes to one taker); their keys.
        Rows another transaction holds are passed over, as by :meth:`take_over`."""

    # -- sandboxes ---------------------------------------------------------------------
    @abc.abstractmethod
    def put_sandbox(self, row: SandboxRow, *events: tuple[str, str]) -> None:
        """Write a sandbox row, durably, as a compare and set; sets
        ``updated_at_unix``, and the row's version (counted up), owner,
        lease and epoch as written. A new row (``version`` 0) is inserted
        only where none is stored; a stored one is written only from the
        version the writer read: another write since, a row removed since or
        a key taken is ``WriteConflict`` (read it again, make the change on
        that); a row another daemon owns, or whose lease lapsed, is
        ``OwnershipLost``.

        ``events`` (each a kind and a message) are logged for the sandbox, in
        order, in the same transaction: the row and they are kept, or none.
        A store that cannot write raises ``StoreUnavailable`` and keeps
        nothing of the call.
        """

    @abc.abstractmethod
    def put_sandboxes(self, rows: Sequence[SandboxRow]) -> None:
        """Write many rows (each as :meth:`put_sandbox` does) in one durable
        transaction: all of them, or none."""

    @abc.abstractmethod
    def set_sandbox_deadline(self, sandbox_id: str, deadline_unix: float | None) -> None:
        """Record a set_timeout deadline, durably, touching nothing else."""

    @abc.abstractmethod
    def get_sandbox(self, sandbox_id: str) -> SandboxRow | None: ...

    @abc.abstractmethod
    def list_sandboxes(
        self, *, include_final: bool = False, not_held_by: str | None = None
    ) -> list[SandboxRow]:
        """Sandboxes not yet terminated or failed (all of them with ``include_final``),
        oldest first. With ``not_held_by`` (a daemon's id), only those that
        daemon holds no live object for: another daemon's rows, no daemon's,
        and rows still being made (``creating``: its own too)."""

    @abc.abstractmethod
    def delete_sandbox(self, sandbox_id: str) -> None: ...

    @abc.abstractmethod
    def prune_ended(self, ended_before_unix: float) -> list[str]:
        """Drop terminated and failed sandboxes last written before the given
        time, with their events, in one transaction; return their ids."""

    # -- workspaces --------------------------------------------------------------------
    @abc.abstractmethod
    def put_workspace(self, row: WorkspaceRow) -> None:
        """Write a workspace row, durably, as a compare and set (see :meth:`put_sandbox`)."""

    @abc.abstractmethod
    def get_workspace(self, name: str) -> WorkspaceRow | None: ...

    @abc.abstractmethod
    def list_workspaces(self) -> list[WorkspaceRow]: ...

    @abc.abstractmethod
    def delete_workspace(self, name: str) -> None: ...

    # -- snapshots ---------------------------------------------------------------------
    @abc.abstractmethod
    def put_snapshot(self, row: SnapshotRow) -> None:
        """Write a snapshot row, durably, as a compare and set (see :meth:`put_sandbox`)."""

    @abc.abstractmethod
    def get_snapshot(self, snapshot_id: str) -> SnapshotRow | None: ...

    @abc.abstractmethod
    def list_snapshots(self) -> list[SnapshotRow]:
        """Every snapshot row, oldest first."""

    @abc.abstractmethod
    def delete_snapshot(self, snapshot_id: str) -> None: ...

    # -- events and the daemon's own facts ------------------------------------------------
    @abc.abstractmethod
    def log_event(self, subject: str, kind: str, message: str) -> None:
        """Append what happened to a sandbox or workspace, and why."""

    @abc.abstractmethod
    def events(self, subject: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """The newest ``limit`` events (of one subject), oldest first."""

    @abc.abstractmethod
    def get_meta(self, key: str) -> str | None: ...

    @abc.abstractmethod
    def set_meta(self, key: str, value: str | None) -> None:
        """Set a daemon-wide fact durably; ``None`` removes it."""

    @abc.abstractmethod
    def close(self) -> None: ...

    # -- refs --------------------------------------------------------------------------
    @abc.abstractmethod
    def put_ref(self, row: RefRow) -> None:
        """Insert or replace a ref, durably."""

    @abc.abstractmethod
    def get_ref(self, ref_id: str) -> RefRow | None: ...

    @abc.abstractmethod
    def list_refs(self, sandbox_id: str, workspace: str | None = None) -> list[RefRow]:
        """A sandbox's refs, revoked and expired ones included, oldest first;
        with ``workspace``, also the refs that follow that workspace."""

    # -- definitions and their instances ------------------------------------------------
    @abc.abstractmethod
    def put_definition(self, row: DefinitionRow) -> None: ...

    @abc.abstractmethod
    def list_definitions(self) -> list[DefinitionRow]: ...

    @abc.abstractmethod
    def put_instance(self, row: InstanceRow) -> None: ...

    @abc.abstractmethod
    def get_instance(self, key: str) -> InstanceRow | None: ...

    @abc.abstractmethod
    def delete_instance(self, key: str) -> None: ...

    @abc.abstractmethod
    def hold_instance(self, key: str, holder: str) -> None:
        """``holder`` (a program, ``host:pid:start``) holds the instance's
        sandbox in-process: no other program may take the thread over while
        it lives. Dropped with the instance."""

    @abc.abstractmethod
    def release_instance(self, key: str, holder: str) -> None: ...

    @abc.abstractmethod
    def instance_holders(self, key: str) -> list[str]:
        """The programs recorded as holding the instance's sandbox, the
        earliest first (those since dead included: the caller judges)."""

    @abc.abstractmethod
    def claim_instance(
        self, key: str, sandbox_id: str, holder: str, *,
        was: Mapping[str, Any], alive: Callable[[str], bool],
    ) -> bool:
        """``holder`` takes the instance's sandbox for its own, atomically
        across programs: only if the instance still names ``sandbox_id``
        with the description ``was`` (no other program has taken it since)
        and no other holder lives (``alive`` judges each). The dead holders'
        holds are dropped and ``holder``'s recorded. Whether it is now
        ``holder``'s (False: another holder lives, or the record moved)."""

    @abc.abstractmethod
    def local_dir(self, name: str) -> str:
        """A directory beside the store (not made here) for what the programs
        sharing it on this host keep outside it (lock files)."""

    @abc.abstractmethod
    def instance_sandbox_ids(self) -> set[str]:
        """The sandboxes the instances name: a program's, or left by one
        for the next ``ensure`` to find, never orphans."""

    @abc.abstractmethod
    def changes_by_others(self) -> int | None:
        """A number that changes whenever another program has committed a
        change to the store since; cheap (no disk read), for a look on every
        operation. None when it cannot be read at once (this program is
        writing): the caller then looks the slow way."""

    @abc.abstractmethod
    def instance_of_sandbox(self, sandbox_id: str) -> InstanceRow | None:
        """The instance ``sandbox_id`` runs, if it runs one."""

    @abc.abstractmethod
    def note_instance_activity(self, sandbox_id: str, at_unix: float) -> None:
        """Activity on ``sandbox_id`` at ``at_unix``, seen by one of the
        programs holding it: the instances it runs keep the latest of
        every program's (an older time never moves it back)."""

    @abc.abstractmethod
    def set_instance_deadline(self, sandbox_id: str, deadline_unix: float) -> None:
        """A set_timeout deadline of ``sandbox_id``, made by one of the
        programs holding it: the instances it runs record it (the latest
        call's stands, earlier or later than the one it replaces)."""

    @abc.abstractmethod
    def record_instance_sandbox(
        self,
        sandbox_id: str,
        state: str,
        description: Mapping[str, Any],
        *,
        was: tuple[str, Mapping[str, Any]] | None = None,
        reason: str | None = None,
    ) -> bool:
        """A transition of ``sandbox_id``: the instances it runs record its
        new state, description and ``reason`` (an expiry's, for the other
        programs' handles to give the same typed error). With ``was`` (the state and description
        the writer last knew), only where the record still says so: a
        program whose handle is out of date (another program took the
        sandbox over since) never overwrites what that one wrote. Whether
        any was written."""

    @abc.abstractmethod
    def take_lease(self, name: str, holder: str, seconds: float) -> bool:
        """Take the lease ``name`` for ``holder`` for ``seconds`` if it is free,
        expired, or held by a process of this host that is gone; whether it
        is now ``holder``'s. Atomic across processes sharing the store."""

    @abc.abstractmethod
    def lease_holder(self, name: str) -> str | None:
        """Who holds the lease ``name`` now (expired or not), if anyone."""

    @abc.abstractmethod
    def release_lease(self, name: str, holder: str) -> None:
        """Give the lease back (only ``holder``'s own)."""


def holder_alive(holder: str) -> bool:
    """A holder is ``host:pid:start:nonce`` (``host:pid:nonce`` from an older
    hutch); one of this host whose process is gone left its lease behind (it
    was killed): the lease is free. With its start time, a pid the kernel
    has since given to another process does not hold it either."""
    host, *fields = holder.split(":")
    pid_text = fields[0] if fields else ""
    if host != os.uname().nodename or not pid_text.isdigit():
        return True  # another host's: only its expiry frees it
    if len(fields) == 3 and fields[1].isdigit():
        return still_running(int(pid_text), int(fields[1]))
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
