"""A port of a sandbox, reached through hutch's own port: what the E2B SDKs'
``get_host(port)`` names (``{port}-{sandbox id}.{domain}``, told apart by the
``Host`` header), and in-sandbox requests for a port other than envd's
(``E2b-Sandbox-Port``).

The request goes on, streamed both ways, to the address the sandbox's
provider gives for that port (``preview_url``); hop-by-hop headers and the
E2B wire's own credentials stay here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx

from ..._errors import HutchError
from ..asgi import ASGIApp, Receive, Scope, Send
from .dispatch import caller_of
from .errors import control_error, send_control_error

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
        if scope["type"] != "http":
            await send({"type": "websocket.close", "code": 1011,
                        "reason": "websockets are not proxied to sandbox ports"})
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
