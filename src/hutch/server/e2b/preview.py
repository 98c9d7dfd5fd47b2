"""A port of a sandbox, reached through hutch's own port: what the E2B SDKs'
``get_host(port)`` names (``{port}-{sandbox id}.{domain}``, told apart by the
``Host`` header), and in-sandbox requests for a port other than envd's
(``E2b-Sandbox-Port``).

The request goes on, streamed both ways, to the address the sandbox's
provider gives for that port (``preview_url``); hop-by-hop headers and the
E2B wire's own credentials stay here. A websocket is opened to the sandbox's
port first and accepted here once it is.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

import anyio
from websockets.asyncio.client import connect
from websockets.exceptions import WebSocketException

from ..._errors import HutchError
from ..._lazy import lazy_module
from ..asgi import ASGIApp, Receive, Scope, Send
from .dispatch import caller_of
from .errors import control_error, send_control_error

if TYPE_CHECKING:
    import httpx
else:  # in a fleet, or for a sandbox's port, only: see hutch._lazy
    httpx = lazy_module("httpx")

#: Headers that belong to one hop (RFC 9110 §7.6.1), and the wire's own.
_NOT_FORWARDED = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
    b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length",
    b"x-access-token", b"e2b-sandbox-id", b"e2b-sandbox-port", b"e2b-traffic-access-token",
})
#: Where a request's sandbox port is kept in its ASGI scope (by the dispatch).
PORT_SCOPE_KEY = "hutch.e2b.port"


def preview_app() -> ASGIApp:
    client: list[httpx.AsyncClient] = []

    def http() -> httpx.AsyncClient:
        if not client:
            # No read timeout: a server in the sandbox may stream for as long as it likes.
            client.append(httpx.AsyncClient(
                timeout=httpx.Timeout(None, connect=10.0), follow_redirects=False,
                trust_env=False,
            ))
        return client[0]

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await _websocket(scope, receive, send)
            return
        caller = caller_of(scope)
        port: int = scope[PORT_SCOPE_KEY]
        if caller.sandbox_id is None:
            await send_control_error(send, 404, "no sandbox named")
            return
        try:
            sandbox = await caller.daemon.get(caller.sandbox_id)
            base = await sandbox.preview_url(port)
        except HutchError as exc:
            status, error = control_error(exc)
            await send_control_error(send, status if status != 500 else 502, error["message"])
            return
        target = base.rstrip("/") + scope.get("raw_path", scope["path"].encode()).decode(
            "latin-1")
        if scope.get("query_string"):
            target += "?" + scope["query_string"].decode("latin-1")
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
                   if k.lower() not in _NOT_FORWARDED]
        host = next((v for k, v in scope["headers"] if k == b"host"), None)
        if host is not None:
            headers.append(("x-forwarded-host", host.decode("latin-1")))

        async def body() -> AsyncIterator[bytes]:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                if chunk:
                    yield chunk
                if not message.get("more_body", False):
                    return

        request = http().build_request(scope["method"], target, headers=headers,
                                       content=body())
        try:
            answer = await http().send(request, stream=True)
        except httpx.HTTPError as exc:
            await send_control_error(
                send, 502, f"nothing answers on port {port} of sandbox {caller.sandbox_id}: "
                f"{type(exc).__name__}")
            return
        try:
            await send({
                "type": "http.response.start", "status": answer.status_code,
                "headers": [(k, v) for k, v in answer.headers.raw
                            if k.lower() not in _NOT_FORWARDED or k.lower() == b"content-length"],
            })
            async for chunk in answer.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await answer.aclose()

    return app


async def _target(scope: Scope) -> str | None:
    """The sandbox's address for the request's port and path, or None."""
    caller = caller_of(scope)
    if caller.sandbox_id is None:
        return None
    try:
        sandbox = await caller.daemon.get(caller.sandbox_id)
        base = await sandbox.preview_url(scope[PORT_SCOPE_KEY])
    except HutchError:
        return None
    target: str = base.rstrip("/") + scope.get("raw_path", scope["path"].encode()).decode(
        "latin-1")
    if scope.get("query_string"):
        target += "?" + scope["query_string"].decode("latin-1")
    return target


#: A websocket's own handshake headers, which its client library makes anew.
_WEBSOCKET_OWN = frozenset({
    b"sec-websocket-key", b"sec-websocket-version", b"sec-websocket-extensions",
    b"sec-websocket-protocol",
})


async def _websocket(scope: Scope, receive: Receive, send: Send) -> None:
    """A websocket to the sandbox's port: opened there first, then accepted
    here with the subprotocol the sandbox chose; messages go both ways until
    either side closes."""
    if (await receive())["type"] != "websocket.connect":
        return
    target = await _target(scope)
    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
               if k.lower() not in _NOT_FORWARDED and k.lower() not in _WEBSOCKET_OWN]
    try:
        if target is None:
            raise OSError("no such sandbox or port")
        upstream = await connect(
            "ws" + target.removeprefix("http"), subprotocols=scope.get("subprotocols") or None,
            additional_headers=headers, open_timeout=10, max_size=None, proxy=None,
        )
    except (OSError, WebSocketException, TimeoutError):
        await send({"type": "websocket.close", "code": 1011,
                    "reason": "nothing answers a websocket on that port of the sandbox"})
        return
    async with upstream:
        await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})

        async def from_client() -> None:
            while True:
                message = await receive()
                if message["type"] == "websocket.disconnect":
                    await upstream.close()
                    return
                if message.get("bytes") is not None:
                    await upstream.send(message["bytes"])
                elif message.get("text") is not None:
                    await upstream.send(message["text"])

        async def from_sandbox() -> None:
            try:
                async for data in upstream:
                    key = "bytes" if isinstance(data, bytes) else "text"
                    await send({"type": "websocket.send", key: data})
            except WebSocketException:
                pass
            await send({"type": "websocket.close", "code": upstream.close_code or 1000})

        async with anyio.create_task_group() as group:
            async def one_way(pump: Callable[[], Awaitable[None]]) -> None:
                await pump()
                group.cancel_scope.cancel()

            group.start_soon(one_way, from_client)
            group.start_soon(one_way, from_sandbox)
