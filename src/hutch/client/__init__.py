"""The Python SDK: ``hutch.Client`` and ``hutch.AsyncClient``.

Both faces are generated from one table of operations (:mod:`._core`, by
``scripts/gen_sync.py`` into :mod:`._generated_async` and
:mod:`._generated_sync`), so they have the same methods with the same
signatures, typed, and the sandboxes they return behave like in-process
:class:`hutch.Sandbox` objects: the same results, the same typed errors.
``HUTCH_URL`` and ``HUTCH_TOKEN`` are read when not given."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

from .._errors import Unauthorized
from .._refwire import DaemonRef, decode_ref
from ._answers import EnsureProgress
from ._core import ClientOps, SandboxOps
from ._generated_async import (
    AsyncClientFace,
    AsyncForkFace,
    AsyncProcessFace,
    AsyncSandboxFace,
    AsyncWatcherFace,
)
from ._generated_sync import ClientFace, ForkFace, ProcessFace, SandboxFace, WatcherFace
from ._handles import ForkOps, ProcessOps, WatcherOps
from ._http import Call
from ._refs import RemoteEnsured
from ._transports import AsyncTransport, SyncTransport

if TYPE_CHECKING:
    from .._types import FileEvent, Snapshot


def _parse_ref(ref: str) -> DaemonRef:
    decoded = decode_ref(ref) if isinstance(ref, str) else None
    if decoded is None:
        raise Unauthorized("this is not a hutch ref: ask the sandbox's owner for one")
    return decoded


class _ProcessState(ProcessOps):
    def __init__(self, transport: Any, sandbox_id: str, info: dict[str, Any]) -> None:
        self._transport = transport
        self.sandbox_id = sandbox_id
        self.id = str(info["id"])
        self.command = str(info.get("command", ""))
        self._running = bool(info.get("running", True))
        self._exit_code = info.get("exit_code")
        self._stdin_open = bool(info.get("stdin_open", False))

    def __repr__(self) -> str:
        return f"<remote process {self.id} in {self.sandbox_id}>"


class _WatcherState(WatcherOps):
    def __init__(self, transport: Any, sandbox_id: str, info: dict[str, Any]) -> None:
        self._transport = transport
        self.sandbox_id = sandbox_id
        self.id = str(info["id"])
        self.path = str(info["path"])
        self.recursive = bool(info["recursive"])
        self.kind = str(info["kind"])
        self._active = bool(info["active"])

    def __repr__(self) -> str:
        return f"<remote watch {self.id} of {self.path} in {self.sandbox_id}>"


class _SandboxState(SandboxOps):
    def __init__(self, transport: Any, info: dict[str, Any]) -> None:
        self._transport = transport
        self.id = str(info["id"])
        self._info = info

    def __repr__(self) -> str:
        return f"<remote sandbox {self.id} provider={self._info.get('provider')}>"


class _ForkState(ForkOps):
    def __init__(self, transport: Any, snapshot: Snapshot, branches: list[Any]) -> None:
        self._transport = transport
        self.snapshot = snapshot
        #: The branches started with the fork (``count``) and by ``attach``.
        self.branches = branches

    def __repr__(self) -> str:
        return f"<remote fork of {self.snapshot.id} ({len(self.branches)} branches)>"


class AsyncRemoteFork(AsyncForkFace, _ForkState):
    """A fork through the daemon, from async code."""


class RemoteFork(ForkFace, _ForkState):
    """A fork through the daemon, from sync code."""


class AsyncRemoteProcess(AsyncProcessFace, _ProcessState):
    """A background command through the daemon, from async code."""


class RemoteProcess(ProcessFace, _ProcessState):
    """A background command through the daemon, from sync code."""


class AsyncRemoteWatcher(AsyncWatcherFace, _WatcherState):
    """A watch the daemon holds, from async code: ``async for event in watcher``."""

    async def __aiter__(self) -> AsyncIterator[FileEvent]:
        while batch := await self.events(wait=None):
            for event in batch:
                yield event

    async def __aenter__(self) -> AsyncRemoteWatcher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class RemoteWatcher(WatcherFace, _WatcherState):
    """A watch the daemon holds, from sync code: ``for event in watcher``."""

    def __iter__(self) -> Iterator[FileEvent]:
        while batch := self.events(wait=None):
            yield from batch

    def __enter__(self) -> RemoteWatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncRemoteSandbox(AsyncSandboxFace, _SandboxState):
    """A sandbox owned by the daemon, used from async code."""

    #: A session attached with a ref has a connection of its own, closed with it.
    _own_transport: AsyncTransport | None = None

    async def close(self) -> None:  # type: ignore[override]  # the face's, not the operation
        await super().close()
        if self._own_transport is not None:
            await self._own_transport.close()

    async def __aenter__(self) -> AsyncRemoteSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class RemoteSandbox(SandboxFace, _SandboxState):
    """A sandbox owned by the daemon, used from sync code."""

    _own_transport: SyncTransport | None = None

    def close(self) -> None:  # type: ignore[override]  # the face's, not the operation
        super().close()
        if self._own_transport is not None:
            self._own_transport.close()

    def __enter__(self) -> RemoteSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _attach_async(url: str, ref: str) -> AsyncRemoteSandbox:
    decoded = _parse_ref(ref)
    transport = AsyncTransport(
        url, ref, {"sandbox": AsyncRemoteSandbox, "process": AsyncRemoteProcess,
                    "watcher": AsyncRemoteWatcher}
    )
    try:
        info = await transport.send(Call("GET", f"/v1/sandboxes/{decoded.sandbox_id}"))
    except BaseException:
        await transport.close()
        raise
    sandbox = AsyncRemoteSandbox(transport, info)
    sandbox._attached, sandbox._own_transport = True, transport
    return sandbox


def _attach_sync(url: str, ref: str) -> RemoteSandbox:
    decoded = _parse_ref(ref)
    transport = SyncTransport(url, ref, {"sandbox": RemoteSandbox, "process": RemoteProcess,
                    "watcher": RemoteWatcher})
    try:
        info = transport.send(Call("GET", f"/v1/sandboxes/{decoded.sandbox_id}"))
    except BaseException:
        transport.close()
        raise
    sandbox = RemoteSandbox(transport, info)
    sandbox._attached, sandbox._own_transport = True, transport
    return sandbox


def attach_remote(ref: str) -> RemoteSandbox:
    """``hutch.attach_sync`` through the server a ref names (a daemon, or an
    in-process owner's socket): the ref says where it is."""
    return _attach_sync(_parse_ref(ref).url, ref)


async def attach_remote_async(ref: str) -> AsyncRemoteSandbox:
    """``hutch.attach`` through the server a ref names."""
    return await _attach_async(_parse_ref(ref).url, ref)


class _ClientState(ClientOps):
    pass


class AsyncClient(AsyncClientFace, _ClientState):
    """The daemon, from async code: ``async with hutch.AsyncClient() as client``."""

    def __init__(self, url: str | None = None, *, token: str | None = None) -> None:
        self._transport = AsyncTransport(
            url, token, {"sandbox": AsyncRemoteSandbox, "process": AsyncRemoteProcess,
             "fork": AsyncRemoteFork, "watcher": AsyncRemoteWatcher}
        )

    @property
    def url(self) -> str:
        return str(self._transport.url)

    async def attach(self, ref: str) -> AsyncRemoteSandbox:
        """A non-owning session, through this client's daemon address, on the
        sandbox ``ref`` names; the ref is its credential. Its close only detaches."""
        return await _attach_async(self.url, ref)

    async def aclose(self) -> None:
        await self._transport.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class Client(ClientFace, _ClientState):
    """The daemon, from sync code: ``with hutch.Client() as client``."""

    def __init__(self, url: str | None = None, *, token: str | None = None) -> None:
        self._transport = SyncTransport(
            url, token, {"sandbox": RemoteSandbox, "process": RemoteProcess, "fork": RemoteFork,
                         "watcher": RemoteWatcher}
        )

    @property
    def url(self) -> str:
        return str(self._transport.url)

    def attach(self, ref: str) -> RemoteSandbox:
        """A non-owning session, through this client's daemon address, on the
        sandbox ``ref`` names; the ref is its credential. Its close only detaches."""
        return _attach_sync(self.url, ref)

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "EnsureProgress", "RemoteEnsured",
    "AsyncClient", "AsyncRemoteFork", "AsyncRemoteProcess", "AsyncRemoteSandbox", "Client",
    "AsyncRemoteWatcher", "RemoteFork", "RemoteProcess", "RemoteSandbox", "RemoteWatcher",
    "attach_remote", "attach_remote_async",
]
