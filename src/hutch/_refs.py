"""The in-process half of ``hutch.attach(ref)``: a ref handed out by a
sandbox this process owns, on this loop, gives an attached
:class:`hutch.Sandbox` (no HTTP in between). Any other ref goes through the
client (:mod:`hutch._attach` composes the two).
"""

from __future__ import annotations

import asyncio

from ._errors import InvalidArgument
from ._sandbox import Sandbox, attach_session
from .core.refs import served_here


async def attach_here(ref: str) -> Sandbox | None:
    """An attached session if ``ref`` is served in this process on the
    running loop; None if it must be attached through its server."""
    server = served_here(ref)
    if server is not None and server.loop is asyncio.get_running_loop():
        # Revoked, expired or forged: refused as the server refuses it.
        return attach_session(server.sandbox, await server.check(ref))
    # Another process's sandbox, or one served on another loop of this process
    # (whose objects cannot be used from this one): through its server.
    return None


def refuse_sync_here(ref: str) -> None:
    """Refuse a synchronous attach that would block the loop serving ``ref``."""
    server = served_here(ref)
    if server is not None and server.loop.is_running() and _running_loop() is server.loop:
        raise InvalidArgument(
            "this ref's sandbox is served by the event loop running here, which a "
            "synchronous call would block: use `await hutch.attach(ref)`"
        )


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
