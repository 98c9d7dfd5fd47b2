"""A port of a sandbox, reached through hutch's own port: what the E2B SDKs'
``get_host(port)`` names (``{port}-{sandbox id}.{domain}``), and in-sandbox
requests for a port other than envd's (``E2b-Sandbox-Port``)."""

from __future__ import annotations

from ..asgi import ASGIApp, Receive, Scope, Send
from .errors import send_control_error


def preview_app() -> ASGIApp:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send_control_error(send, 502, "sandbox ports are not proxied yet")

    return app
