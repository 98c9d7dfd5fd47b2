"""``hutch.attach(ref)``: a non-owning session on a sandbox someone else owns.

Every ref carries where its sandbox is served: a daemon's address, or the
private unix socket of an in-process owner (:mod:`hutch.server.owner`), and
is itself the credential, so attaching needs no other configuration. A ref
handed out in this very process gives an attached :class:`hutch.Sandbox`
(no HTTP in between); any other gives a remote sandbox. ``attach`` is the
async form, ``attach_sync`` the sync one, as ``create_sandbox`` and
``create_sandbox_sync``.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from ._errors import InvalidArgument
from ._sandbox import Sandbox, attach_session

if TYPE_CHECKING:
    from .client import AsyncRemoteSandbox, RemoteSandbox


async def attach(ref: str) -> Sandbox | AsyncRemoteSandbox:
    """Attach to the sandbox ``ref`` names. Closing the session only detaches it."""
    from .server.owner import served_here

    server = served_here(ref)
    if server is not None and server.loop is asyncio.get_running_loop():
        # Revoked, expired or forged: refused as the server refuses it.
        return attach_session(server.sandbox, server.check(ref))
    # Another process's sandbox, or one served on another loop of this process
    # (whose objects cannot be used from this one): through its server.
    from .client import attach_remote_async

    return await attach_remote_async(ref)


def attach_sync(ref: str) -> RemoteSandbox:
    """``attach`` for synchronous code: the same session behind a sync face."""
    from .server.owner import served_here

    server = served_here(ref)
    if server is not None and server.loop.is_running() and _running_loop() is server.loop:
        raise InvalidArgument(
            "this ref's sandbox is served by the event loop running here, which a "
            "synchronous call would block: use `await hutch.attach(ref)`"
        )
    from .client import attach_remote

    return attach_remote(ref)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
