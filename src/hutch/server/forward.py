"""A fleet's forwarding: a request for a sandbox, workspace or snapshot
another daemon owns goes to that daemon's advertised URL, and its answer
comes back as it is made (streams line by line, websockets message by
message), so a client may talk to any daemon of the fleet.

Pure ASGI middleware, inside the credential check: the request goes on with
the caller's own credential (the fleet's daemons share the token and the
refs, which live in the store). A forwarded request carries
``x-hutch-forwarded`` and is never forwarded again (an owner that has since
lost the sandbox answers not found, as any daemon would).
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import httpx

from .._errors import HutchError
from ..daemon import Daemon
from .asgi import ASGIApp, Receive, Scope, Send, header, render_json
from .errors import error_json

log = logging.getLogger("hutch.server")

FORWARDED_HEADER = b"x-hutch-forwarded"
#: Hop-by-hop headers (RFC 9110 §7.6.1) and those the next hop sets itself.
_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
    b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length",
})
_WS_HANDSHAKE = frozenset({
    b"sec-websocket-key", b"sec-websocket-version", b"sec-websocket-extensions",
    b"sec-websocket-protocol", b"sec-websocket-accept",
})


class Forward:
    def __init__(self, app: ASGIApp, daemon: Callable[[], Daemon | None]) -> None:
        self.app = app
        self.daemon = daemon
        self._client: httpx.AsyncClient | None = None
        #: Requests (by their scope) whose answer has begun going out.
        self._started: dict[int, bool] = {}

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(connect=10.0, read=None, write=60.0, pool=30.0),
                # No Nagle: a request's head and body go at once, not one
                # delayed ACK (40 ms) apart.
                transport=httpx.AsyncHTTPTransport(
                    limits=limits,
                    socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]),
            )
        return self._client

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        daemon = self.daemon()
        if (
            scope["type"] not in ("http", "websocket") or daemon is None
            or not daemon.store.shared or header(scope, FORWARDED_HEADER) is not None
        ):
            await self.app(scope, receive, send)
            return
        try:
            served = await daemon.served_by(scope["path"])
        except HutchError as exc:
            await _refuse(scope, receive, send, exc)
            return
        if served is None:
            await self.app(scope, receive, send)
            return
        owner, target = served
        assert daemon.daemon_id is not None
        me = daemon.daemon_id
        lapsed: list[HutchError] = []
        async with anyio.create_task_group() as tasks:
            async def watch_owner() -> None:
                # An owner that stalls (or dies) never answers; once its
                # registration lapses, the call is cut instead of hanging.
                while True:
                    await anyio.sleep(1.0)
                    try:
                        await daemon.daemon_url(owner)
                    except HutchError as exc:
                        lapsed.append(exc)
                        tasks.cancel_scope.cancel()
                        return

            async def forward() -> None:
                if scope["type"] == "http":
                    await self._forward_http(target, me, scope, receive, send)
                else:
                    # The handshake is the owner's to answer; one cut short just closes.
                    self._started[id(scope)] = True
                    await _forward_websocket(target, me, scope, receive, send)
                tasks.cancel_scope.cancel()

            tasks.start_soon(watch_owner)
            tasks.start_soon(forward)
        if lapsed and not self._started.get(id(scope)):
            await _refuse(scope, receive, send, lapsed[0])
        self._started.pop(id(scope), None)

    async def _forward_http(
        self, target: str, me: str, scope: Scope, receive: Receive, send: Send
    ) -> None:
        query = scope.get("query_string", b"")
        url = target + scope["path"] + ("?" + query.decode("latin-1") if query else "")
        headers = [(k, v) for k, v in scope["headers"] if k not in _HOP]
        headers.append((FORWARDED_HEADER, me.encode()))
        length = header(scope, b"content-length")
        body: bytes | AsyncIterator[bytes]
        if length is None and header(scope, b"transfer-encoding") is None:
            body = b""  # none (a GET): never sent chunked, which would cost a round trip
        elif length is not None and int(length) <= 1 << 20:
            body = await _whole_body(receive)
        else:
            body = _body_stream(receive)
        request = self._http().build_request(scope["method"], url, headers=headers, content=body)
        try:
            answer = await self._http().send(request, stream=True)
        except httpx.HTTPError as exc:
            from .._errors import SandboxUnavailable

            await _refuse(scope, receive, send, SandboxUnavailable(
                f"the daemon serving it ({target}) cannot be reached: {exc}; a live daemon "
                "takes its sandboxes over once its lease lapses"))
            return
        self._started[id(scope)] = True
        try:
            await send({
                "type": "http.response.start", "status": answer.status_code,
                "headers": [(k, v) for k, v in answer.headers.raw if k.lower() not in _HOP]
                + ([(b"content-length", answer.headers["content-length"].encode())]
                   if "content-length" in answer.headers else []),
            })
            async for chunk in answer.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await answer.aclose()


async def _whole_body(receive: Receive) -> bytes:
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(parts)


async def _body_stream(receive: Receive) -> AsyncIterator[bytes]:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        chunk = message.get("body", b"")
        if chunk:
            yield chunk
        if not message.get("more_body"):
            return


async def _refuse(scope: Scope, receive: Receive, send: Send, exc: HutchError) -> None:
    if scope["type"] == "websocket":
        await receive()  # websocket.connect
        await send({"type": "websocket.close", "code": 1011, "reason": str(exc)[:120]})
        return
    body = render_json(error_json(exc))
    await send({"type": "http.response.start", "status": exc.http_status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _forward_websocket(
    target: str, me: str, scope: Scope, receive: Receive, send: Send
) -> None:
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, InvalidStatus

    message = await receive()
    if message["type"] != "websocket.connect":
        return
    query = scope.get("query_string", b"")
    url = ("ws" + target.removeprefix("http") + scope["path"]
           + ("?" + query.decode("latin-1") if query else ""))
    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
               if k not in _HOP and k not in _WS_HANDSHAKE]
    headers.append((FORWARDED_HEADER.decode(), me))
    subprotocols: Any = scope.get("subprotocols") or None
    try:
        upstream = await connect(url, additional_headers=headers, subprotocols=subprotocols,
                                 max_size=None, open_timeout=10, compression=None)
    except (InvalidStatus, OSError, TimeoutError) as exc:
        await send({"type": "websocket.close", "code": 1011,
                    "reason": f"the daemon serving it cannot be reached: {exc}"[:120]})
        return
    await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})

    async with upstream, anyio.create_task_group() as tasks:
        async def from_client() -> None:
            while True:
                got = await receive()
                if got["type"] == "websocket.disconnect":
                    await upstream.close(got.get("code", 1000))
                    break
                data = got.get("bytes")
                await upstream.send(data if data is not None else got.get("text", ""))
            tasks.cancel_scope.cancel()

        async def from_owner() -> None:
            try:
                async for data in upstream:
                    key = "bytes" if isinstance(data, bytes) else "text"
                    await send({"type": "websocket.send", key: data})
            except ConnectionClosed:
                pass
            with contextlib.suppress(Exception):
                await send({"type": "websocket.close", "code": upstream.close_code or 1000,
                            "reason": upstream.close_reason or ""})
            tasks.cancel_scope.cancel()

        tasks.start_soon(from_client)
        tasks.start_soon(from_owner)


async def call_owner(
    request_headers: list[tuple[bytes, bytes]], me: str, url: str, body: bytes,
) -> httpx.Response:
    """One call (a JSON body) to the daemon that serves what it asks for, its
    answer read whole; for a route that learns who serves it only as it runs."""
    headers = [(k, v) for k, v in request_headers if k not in _HOP]
    headers.append((FORWARDED_HEADER, me.encode()))
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0)) as http:
        return await http.post(url, headers=headers, content=body)


async def stream_owner(
    request_headers: list[tuple[bytes, bytes]], me: str, url: str, body: bytes,
) -> AsyncIterator[bytes]:
    """As :func:`call_owner`, its answer's body as it comes."""
    headers = [(k, v) for k, v in request_headers if k not in _HOP]
    headers.append((FORWARDED_HEADER, me.encode()))
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0)) as http, \
            http.stream("POST", url, headers=headers, content=body) as answer:
        async for chunk in answer.aiter_raw():
            yield chunk
