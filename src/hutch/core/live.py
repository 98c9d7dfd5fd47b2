"""The live sandbox: the seam the lifecycle engine drives.

A :class:`LiveSandbox` is what every session on one live sandbox shares: its
backend, its background commands, its open operations, the lifecycle record
and who is attached. Each :class:`hutch.Sandbox` object is one session on
it. The lifecycle engine, its gate and the programs that share a sandbox
work on this object through its methods, never on a session's private
state, so that the lifecycle needs nothing of the sandbox class.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from .._refwire import attachment_json

if TYPE_CHECKING:
    from .._process import Process
    from .._types import Capabilities
    from .._watch import Watcher
    from ..lifecycle.gate import LifecycleGate
    from ..lifecycle.records import LifecycleRecord
    from ..providers.base import SandboxBackend
    from ..states import SandboxStatus
    from ..store import RefRow
    from .refs import RefServer


@dataclass(frozen=True)
class Attachment:
    """A session of this process attached to the live sandbox through a ref."""

    session_id: str
    ref: RefRow
    attached_at_unix: float


class LiveSandbox:
    """One live sandbox, shared by every session on it (see the module docstring)."""

    def __init__(
        self, sandbox_id: str, backend: SandboxBackend, gate: LifecycleGate | None
    ) -> None:
        self.id = sandbox_id
        self.backend = backend
        self.gate = gate
        self.processes: dict[str, Process] = {}
        #: Its directories watched (``Sandbox.watch``), by id.
        self.watchers: dict[str, Watcher] = {}
        self.open_ops = 0
        self.closed = False
        #: Set once a close (or a reap) has released the backend.
        self.released = asyncio.Event()
        self.record: LifecycleRecord | None = None
        #: session id -> a session attached (non-owning) in this process.
        self.attached: dict[str, Attachment] = {}
        #: What serves it to the holders of its refs, once its owner handed one out.
        self.server: RefServer[Any] | None = None
        self.server_lock = asyncio.Lock()

    @property
    def capabilities(self) -> Capabilities:
        return self.backend.sandbox_capabilities()

    @property
    def open_operations(self) -> int:
        """Execs, streams and running background commands open right now."""
        return self.open_ops + sum(1 for p in self.processes.values() if p.running)

    # -- what a lifecycle engine (and the daemon over it) does to it -----------------
    def track(self, gate: LifecycleGate, record: LifecycleRecord) -> None:
        """Put it (every session on it) under ``gate``, which keeps ``record`` of it."""
        self.gate = gate
        self.record = record

    def rebind(self, backend: SandboxBackend) -> None:
        """Put ``backend`` under it (every session on it): the same sandbox,
        found again through its provider after another program moved it
        (suspended or resumed it), which the old backend object no longer
        describes. The old one is dropped, not closed: closing would end the
        sandbox itself."""
        self.backend = backend

    async def end_processes(self) -> None:
        """Kill every background command and forget them (a suspend that does
        not keep processes ends them)."""
        for process in list(self.processes.values()):
            await process.kill()
        self.processes.clear()

    async def end_watches(self) -> None:
        """Stop every watch of its directories (the sandbox is going away)."""
        for watcher in list(self.watchers.values()):
            await watcher.close()
        self.watchers.clear()

    async def reap(self) -> None:
        """Kill what runs and free the backend, for every session on it, once;
        a second caller waits until it is (the engine's reaping; an attached
        session's close only detaches). Shielded: a release cut by
        cancellation would leave the sandbox's runtime or its files held
        with nothing left to free them."""
        if self.closed:
            await self.released.wait()
            return
        self.closed = True
        try:
            with anyio.CancelScope(shield=True):
                await self.end_watches()
                await self.end_processes()
                await self.backend.close()
        finally:
            self.released.set()

    async def release_runtime(self) -> None:
        """Its runtime died outside hutch: end what was started in it and free
        what the runtime held, its working directory's files kept until it is
        closed (deleted). Shielded, as a reaping is."""
        with anyio.CancelScope(shield=True):
            await self.end_watches()
            await self.end_processes()
            await self.backend.release_runtime()

    def attachments_json(self) -> list[dict[str, Any]]:
        """The sessions attached now: in this process, and through the server
        that serves it to other processes (whose refs still work)."""
        server = self.server
        working = None if server is None else {r.id for r in server.open_refs()}
        here = [
            attachment_json(a.session_id, a.ref, a.attached_at_unix, None)
            for a in self.attached.values()
            if working is None or a.ref.id in working
        ]
        return here + ([] if server is None else server.attachments())

    def info_json(
        self, status: SandboxStatus, memory: int | None, disk: int | None = None
    ) -> dict[str, Any]:
        """What the sandbox is and how it is (``Sandbox.info``), with its
        ``status``, ``memory`` and ``disk`` as its session read them."""
        return {
            "id": self.id,
            "provider": self.backend.provider,
            "state": status.state.value,
            "reason": status.reason,
            "workdir": self.backend.workdir,
            "capabilities": self.capabilities.as_dict(),
            "created_at_unix": status.created_at_unix,
            "last_active_unix": status.last_active_unix,
            "idle_seconds": status.idle_seconds,
            "deadline_unix": status.deadline_unix,
            "meter": status.meter,
            "memory_bytes": memory,
            "disk_bytes": disk,
            "open_operations": self.open_operations,
            "attachments": self.attachments_json(),
            "refs": [] if self.server is None else self.server.refs_json(),
        }


def closed_message(sandbox_id: str) -> str:
    """Why a closed sandbox answers no more, to its owner and to attached sessions."""
    return (
        f"sandbox {sandbox_id} has been closed: its owner's cleanup ended it "
        "(make a new sandbox, or attach to a live one)"
    )
