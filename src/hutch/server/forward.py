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

import asyncio
import contextlib
import json
import logging
import urllib.parse
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import anyio

from .._errors import HutchError, SandboxUnavailable
from .._lazy import lazy_module
from ..daemon import Daemon
from .asgi import ASGIApp, Message, Receive, Scope, Send, header, render_json
from .errors import error_json
from .peers import Peers, PeerUnreachable

if TYPE_CHECKING:
    import httpx
else:  # in a fleet, or for a sandbox's port, only: see hutch._lazy
    httpx = lazy_module("httpx")

log = logging.getLogger("hutch.server")

FORWARDED_HEADER = b"x-hutch-forwarded"
_FORWARDED_NAME = FORWARDED_HEADER.decode()
#: Hop-by-hop headers (RFC 9110 §7.6.1) and those the next hop sets itself.
#: ``host`` goes on as the client gave it: the owner answers as the daemon
#: the client asked (its base URL in the refs it hands out, the E2B wire's
#: ``{port}-{id}.{domain}`` hosts).
_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
    b"trailer", b"transfer-encoding", b"upgrade", b"content-length",
})
_WS_HANDSHAKE = frozenset({
    b"sec-websocket-key", b"sec-websocket-version", b"sec-websocket-extensions",
    b"sec-websocket-protocol", b"sec-websocket-accept", b"host",
})
#: Calls of hutch's API (all POST) that name what they act on in their JSON
#: body, not their path: the kind of row, and the body's keys that may name it
#: (a sandbox for the seed-named lifecycle calls; the snapshot a sandbox or
#: workspace is made from, whose files its owner holds).
NAMED_IN_BODY: dict[str, tuple[str, tuple[str, ...]]] = {
    "/v1/pause": ("sandbox", ("sandbox",)),
    "/v1/resume": ("sandbox", ("sandbox",)),
    "/v1/set_timeout": ("sandbox", ("sandbox",)),
    "/v1/sandboxes": ("snapshot", ("from_snapshot",)),
    "/v1/workspaces": ("snapshot", ("snapshot_tag", "from_snapshot")),
}
#: The most of such a body read to find the sandbox it names: theirs are a
#: few dozen bytes; a larger one goes on to the route, which refuses it.
_NAMING_BODY_BYTES = 64 * 1024


class _Call:
    """One forwarded call under way: cut if its owner's registration lapses, or
    its caller hangs up."""

    __slots__ = ("lapsed", "scope", "started")

    def __init__(self, scope: anyio.CancelScope) -> None:
        self.scope = scope
        self.started = False
        self.lapsed: HutchError | None = None


class Forwarder:
    """Sends a request to the daemon of the fleet that serves what it names,
    and its answer back. One per application: its connections to the other
    daemons are kept between calls, and one watcher cuts the calls of an
    owner whose registration lapsed (it died, or stalled), instead of a
    watcher per call."""

    def __init__(self, daemon: Callable[[], Daemon | None]) -> None:
        self.daemon = daemon
        self.peers = Peers()
        #: The calls under way, by the daemon they went to.
        self._calls: dict[str, set[_Call]] = {}
        self._watcher: asyncio.Task[None] | None = None

    def fleet_daemon(self, scope: Scope) -> Daemon | None:
        """The daemon, where ``scope`` may be forwarded: a request (HTTP or
        websocket) to a daemon of a fleet that no daemon forwarded already."""
        daemon = self.daemon()
        if (
            scope["type"] not in ("http", "websocket") or daemon is None
            or not daemon.store.shared or header(scope, FORWARDED_HEADER) is not None
        ):
            return None
        return daemon

    async def forwarded(
        self, kind: str, key: str, scope: Scope, receive: Receive, send: Send,
    ) -> bool:
        """Forward the request if another daemon serves the ``kind`` named
        ``key`` (see :meth:`Fleet.owner_serving`); False where this one answers."""
        daemon = self.fleet_daemon(scope)
        if daemon is None:
            return False
        try:
            served = await daemon.owner_serving(kind, key)
        except HutchError as exc:
            await _refuse(scope, receive, send, exc)
            return True
        if served is None:
            return False
        await self.forward(daemon, served, scope, receive, send)
        return True

    async def forwarded_by_body(
        self, kind: str, keys: tuple[str, ...], scope: Scope, receive: Receive, send: Send,
        here: ASGIApp,
    ) -> None:
        """Forward a call that names the ``kind`` it acts on in its JSON body
        (under one of ``keys``) to the daemon that serves it, or let ``here``
        answer it (the body read for the look replayed to it)."""
        daemon = self.fleet_daemon(scope)
        length = header(scope, b"content-length")
        if daemon is None or scope["type"] != "http" or scope["method"] != "POST" or (
                length is None or not length.isdigit() or int(length) > _NAMING_BODY_BYTES):
            await here(scope, receive, send)
            return
        body = await _whole_body(receive)
        key = _named(body, keys)
        try:
            served = None if key is None else await daemon.owner_serving(kind, key)
        except HutchError as exc:
            await _refuse(scope, receive, send, exc)
            return
        if served is not None:
            await self.forward(daemon, served, scope, receive, send, body)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await here(scope, replay, send)

    async def close(self) -> None:
        """Close the connections to the other daemons."""
        await self.peers.close()

    async def forward(
        self, daemon: Daemon, served: tuple[str, str], scope: Scope, receive: Receive,
        send: Send, body: bytes | None = None,
    ) -> None:
        """Send the request to ``served`` (the owner's id and URL) and its
        answer back; ``body``: the request's body where it was read already."""
        owner, target = served
        assert daemon.daemon_id is not None
        with anyio.CancelScope() as cancel:
            call = _Call(cancel)
            self._calls.setdefault(owner, set()).add(call)
            self._watch(daemon)
            try:
                if scope["type"] == "http":
                    await self._forward_http(
                        target, daemon.daemon_id, call, scope, receive, send, body)
                else:
                    # The handshake is the owner's to answer; one cut short just closes.
                    call.started = True
                    await _forward_websocket(target, daemon.daemon_id, scope, receive, send)
            finally:
                calls = self._calls.get(owner)
                if calls is not None:
                    calls.discard(call)
                    if not calls:
                        del self._calls[owner]
        if call.lapsed is not None and not call.started:
            await _refuse(scope, receive, send, call.lapsed)

    def _watch(self, daemon: Daemon) -> None:
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch_owners(daemon))

    async def _watch_owners(self, daemon: Daemon) -> None:
        """While calls are under way: a second apart, cut those whose owner
        stopped answering (its registration lapsed), so none hangs on it."""
        while self._calls:
            await anyio.sleep(1.0)
            for owner in list(self._calls):
                try:
                    await daemon.daemon_url(owner)
                except HutchError as exc:
                    for call in self._calls.get(owner, ()):
                        call.lapsed = exc
                        call.scope.cancel()
                except Exception:  # the store's trouble: tried again next time
                    log.exception("could not tell whether daemon %s still answers", owner)

    async def _forward_http(
        self, target: str, me: str, call: _Call, scope: Scope, receive: Receive, send: Send,
        whole: bytes | None,
    ) -> None:
        query: bytes = scope.get("query_string", b"")
        path: bytes = scope.get("raw_path") or scope["path"].encode()
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
                   if k not in _HOP]
        headers.append((_FORWARDED_NAME, me))
        length = header(scope, b"content-length")
        body: bytes | AsyncIterator[bytes] | None
        if whole is not None:
            body = whole
        elif length is None and header(scope, b"transfer-encoding") is None:
            body = None  # none (a GET): never sent chunked, which would cost a round trip
        elif length is not None and length.isdigit() and int(length) <= 1 << 20:
            body = await _whole_body(receive)
        else:
            body = _body_stream(receive)
        url = target + (path + (b"?" + query if query else b"")).decode("latin-1")
        async with anyio.create_task_group() as watching:
            if not isinstance(body, AsyncIterator):
                # The request is read whole: what the caller sends next is its
                # hang-up, which cuts the call (a streamed body's end is a
                # hang-up the owner sees already).
                watching.start_soon(_cut_when_gone, receive, call.scope)
            try:
                await self._relay(target, url, headers, body, call, scope, receive, send)
            finally:
                watching.cancel_scope.cancel()

    async def _relay(
        self, target: str, url: str, headers: list[tuple[str, str]],
        body: bytes | AsyncIterator[bytes] | None, call: _Call, scope: Scope, receive: Receive,
        send: Send,
    ) -> None:
        try:
            answer = await self.peers.request(scope["method"], url, headers, body)
        except PeerUnreachable as exc:
            await _refuse(scope, receive, send, SandboxUnavailable(
                f"the daemon serving it ({target}) cannot be reached: {exc}; a live "
                "daemon takes its sandboxes over once its lease lapses"))
            return
        call.started = True
        whole = False
        try:
            await send({
                "type": "http.response.start", "status": answer.status,
                "headers": [(k, v) for k, v in answer.raw_headers
                            if k.lower() not in _HOP or k.lower() == b"content-length"],
            })
            async for chunk in answer.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            whole = True
            await send({"type": "http.response.body", "body": b""})
        finally:
            if whole:
                answer.release()
            else:  # the call cut: the owner sees the hang-up as its caller's
                answer.close()


class Forward:
    """Pure ASGI middleware over hutch's own API: a request that names
    another daemon's sandbox, workspace or snapshot (in its path, or for
    :data:`NAMED_IN_BODY` in its body) is answered by that daemon."""

    def __init__(self, app: ASGIApp, forwarder: Forwarder) -> None:
        self.app = app
        self.forwarder = forwarder

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        daemon = self.forwarder.fleet_daemon(scope)
        if daemon is None:
            await self.app(scope, receive, send)
            return
        named = NAMED_IN_BODY.get(scope["path"]) if scope["type"] == "http" else None
        if named is not None and scope["method"] == "POST":
            await self.forwarder.forwarded_by_body(*named, scope, receive, send, self.app)
            return
        try:
            served = await daemon.served_by(scope["path"])
        except HutchError as exc:
            await _refuse(scope, receive, send, exc)
            return
        if served is None:
            await self.app(scope, receive, send)
            return
        await self.forwarder.forward(daemon, served, scope, receive, send)


def _named(body: bytes, keys: tuple[str, ...]) -> str | None:
    """The first of ``keys`` a JSON object ``body`` holds a string at."""
    try:
        named = json.loads(body)
    except ValueError:
        return None
    if not isinstance(named, dict):
        return None
    for key in keys:
        value = named.get(key)
        if isinstance(value, str) and value:
            return value
    return None


async def _cut_when_gone(receive: Receive, call: anyio.CancelScope) -> None:
    """Cut ``call`` when its caller hangs up, as a route the owner answers
    itself is cut: what the call started there ends with it."""
    while (await receive())["type"] != "http.disconnect":
        pass
    call.cancel()


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
    owner = urllib.parse.urlsplit(target)
    # The URL names the host the client asked (its Host header goes on, as
    # for HTTP); the connection goes to the owner.
    host = header(scope, b"host") or owner.netloc
    url = ("ws" + owner.scheme.removeprefix("http") + "://" + host + scope["path"]
           + ("?" + query.decode("latin-1") if query else ""))
    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
               if k not in _HOP and k not in _WS_HANDSHAKE]
    headers.append((FORWARDED_HEADER.decode(), me))
    subprotocols: Any = scope.get("subprotocols") or None
    try:
        upstream = await connect(
            url, additional_headers=headers, subprotocols=subprotocols, max_size=None,
            open_timeout=10, compression=None, proxy=None,
            host=owner.hostname, port=owner.port or (443 if owner.scheme == "https" else 80),
            server_hostname=owner.hostname if owner.scheme == "https" else None)
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
