"""The E2B wire: ``hutch serve`` answers the unmodified E2B SDKs (docs/e2b.md).

:func:`mount` puts it in front of hutch's own API on the same port;
:mod:`.dispatch` says which requests are E2B's and checks their credentials,
:mod:`.control` is the control plane, :mod:`.envd` the in-sandbox API,
:mod:`.preview` the sandboxes' ports, :mod:`.keys` the credentials and
:mod:`.errors` every error body.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI

from ...daemon import Daemon
from ..asgi import ASGIApp, Receive, Scope, Send, header
from ..forward import Forwarder
from ..middleware import BodyLimit, CancelOnDisconnect
from .control import control_app
from .dispatch import E2BWire
from .envd import envd_app
from .errors import send_connect_error, send_control_error
from .preview import preview_app

Refusal = Callable[[Send, str], Awaitable[None]]


def mount(
    app: FastAPI, *, daemon: Callable[[], Daemon | None], token: str | None, max_body_bytes: int,
    forwarder: Forwarder,
) -> None:
    """Answer the E2B wire on ``app``'s port: call it after the app's other
    middleware, so that it comes first (E2B requests carry E2B's
    credentials, not hutch's bearer token). ``forwarder`` sends a request
    for another daemon's sandbox to it (a fleet)."""
    control = control_app()

    def guarded(inner: ASGIApp, refuse: Refusal) -> ASGIApp:
        # A body announced too large is refused in the wire's own error shape
        # before BodyLimit (hutch's shape) sees it; one that grows past the
        # cap raises inside the app, whose handlers give the wire's shape.
        limited = BodyLimit(inner, max_bytes=max_body_bytes)

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            announced = header(scope, b"content-length")
            if announced is not None and announced.isdigit() and int(
                    announced) > max_body_bytes:
                await refuse(send, f"request body ({announced} bytes) is over the cap of "
                             f"{max_body_bytes} bytes")
                return
            await limited(scope, receive, send)

        return CancelOnDisconnect(app)

    async def control_refusal(send: Send, message: str) -> None:
        await send_control_error(send, 413, message)

    async def envd_refusal(send: Send, message: str) -> None:
        await send_connect_error(send, "resource_exhausted", message)

    app.add_middleware(
        E2BWire, daemon=daemon, token=token, forwarder=forwarder,
        control=guarded(control, control_refusal),
        envd=guarded(envd_app(), envd_refusal), preview=CancelOnDisconnect(preview_app()),
    )


__all__ = ["mount"]
