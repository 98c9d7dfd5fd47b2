"""``hutch mcp``: a hutch sandbox served as MCP tools, over stdio or
streamable HTTP, built on the official ``mcp`` SDK (``pip install
'hutch[mcp]'``).

A front end above the client, like the CLI: it speaks to the daemon through
``hutch.AsyncClient`` and imports no core, provider or server module (an
import contract says so). The tools are in :mod:`.tools`; what a command's
output keeps is in :mod:`.output`.

Over HTTP the server asks every request for a bearer token (hutch's rule:
every route needs a credential), given as ``HUTCH_MCP_TOKEN`` or made at
start and printed on stderr; it binds to loopback unless told otherwise.
The clients of one HTTP server share its current sandbox and its session
(the sandboxes it made, the files read before a write).
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import signal
import sys
from typing import Any

import anyio

from .._limits import SERVER_IDLE_SECONDS
from .tools import DEFAULT_EXEC_TIMEOUT, HutchTools, ServerDefaults, add_tools

__all__ = ["DEFAULT_EXEC_TIMEOUT", "HutchTools", "ServerDefaults", "serve"]

INSTRUCTIONS = (
    "These tools run commands and edit files in a hutch sandbox: an isolated machine of its "
    "own. Tools act on the current sandbox (made on first use, or by sandbox_create; picked "
    "by sandbox_use). Read a file before replacing it with write_file; prefer edit_file for "
    "changes. Big command output is cut in the middle with a note: redirect it to a file "
    "and grep or read that file."
)


def build(tools: HutchTools) -> Any:
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("hutch", instructions=INSTRUCTIONS, log_level="WARNING")
    add_tools(server, tools)
    return server


def serve(
    defaults: ServerDefaults,
    *,
    url: str | None = None,
    token: str | None = None,
    http: bool = False,
    host: str = "127.0.0.1",
    port: int = 8790,
) -> None:
    """Serve until the client goes (stdio: its end of the pipe closes) or a
    signal comes; then kill the sandboxes this server made, unless kept."""
    anyio.run(_serve, defaults, url, token, http, host, port)


async def _serve(
    defaults: ServerDefaults, url: str | None, token: str | None, http: bool, host: str,
    port: int,
) -> None:
    from ..client import AsyncClient

    async with AsyncClient(url, token=token) as client:
        tools = HutchTools(client, defaults)
        server = build(tools)
        try:
            if http:
                await _serve_http(server, host, port)
            else:
                await _serve_stdio(server, tools)
        finally:
            with anyio.CancelScope(shield=True):
                await tools.close()


async def _serve_stdio(server: Any, tools: HutchTools) -> None:
    async def on_signal() -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                # stdin is read in a worker thread no cancellation reaches:
                # end what was made here, then go.
                with anyio.CancelScope(shield=True):
                    await tools.close()
                os._exit(0)

    async with anyio.create_task_group() as group:
        group.start_soon(on_signal)
        await server.run_stdio_async()
        group.cancel_scope.cancel()


async def _serve_http(server: Any, host: str, port: int) -> None:
    import uvicorn

    secret = os.environ.get("HUTCH_MCP_TOKEN") or ""
    if not secret:
        secret = secrets.token_urlsafe(24)
        print(f"hutch mcp: the bearer token of http://{host}:{port}/mcp is {secret}",
              file=sys.stderr, flush=True)
    app = BearerToken(server.streamable_http_app(host=host), secret)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                            timeout_keep_alive=SERVER_IDLE_SECONDS)
    # uvicorn answers SIGTERM and SIGINT by stopping, then raises the signal
    # again under the handler it found: a quiet one lets the sandboxes made
    # here be killed before the process ends.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    await uvicorn.Server(config).serve()


class BearerToken:
    """An ASGI wrapper: every HTTP request must carry ``Authorization:
    Bearer <secret>`` (compared in constant time), else 401."""

    def __init__(self, app: Any, secret: str) -> None:
        self.app = app
        self.expected = f"Bearer {secret}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                body = json.dumps({"error": {
                    "code": "unauthorized",
                    "message": "hutch mcp needs 'Authorization: Bearer <token>' "
                               "(HUTCH_MCP_TOKEN)"}}).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
