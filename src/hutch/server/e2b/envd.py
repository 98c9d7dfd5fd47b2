"""The in-sandbox API (envd) on the E2B wire: the Connect protocol's
``process.Process/*`` and ``filesystem.Filesystem/*``, ``/files`` and ``/health``.

The dispatch (:mod:`.dispatch`) has checked the request's ``X-Access-Token``
before it comes here; :func:`.dispatch.caller_of` says which daemon and
sandbox it is for.
"""

from __future__ import annotations

from ..asgi import ASGIApp, Receive, Scope, Send
from .errors import send_connect_error


def envd_app() -> ASGIApp:
    """The ASGI application answering the in-sandbox API."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send_connect_error(send, "unimplemented",
                                 f"{scope['path']} is not served yet on the E2B wire")

    return app
