"""``hutch.attach(ref)``: a non-owning session on a sandbox someone else owns.

Every ref carries where its sandbox is served: a daemon's address, or the
private unix socket of an in-process owner (:mod:`hutch.server.owner`), and
is itself the credential, so attaching needs no other configuration. A ref
handed out in this very process gives an attached :class:`hutch.Sandbox`
(no HTTP in between, :mod:`hutch._refs`); any other gives a remote sandbox
(:mod:`hutch.client`). ``attach`` is the async form, ``attach_sync`` the sync
one, as ``create_sandbox`` and ``create_sandbox_sync``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._refs import attach_here, refuse_sync_here

if TYPE_CHECKING:
    from ._sandbox import Sandbox
    from .client import AsyncRemoteSandbox, RemoteSandbox


async def attach(ref: str) -> Sandbox | AsyncRemoteSandbox:
    """Attach to the sandbox ``ref`` names. Closing the session only detaches it."""
    here = await attach_here(ref)
    if here is not None:
        return here
    from .client import attach_remote_async

    return await attach_remote_async(ref)


def attach_sync(ref: str) -> RemoteSandbox:
    """``attach`` for synchronous code: the same session behind a sync face."""
    refuse_sync_here(ref)
    from .client import attach_remote

    return attach_remote(ref)
