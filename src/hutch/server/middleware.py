"""The ASGI middleware around the routes: the token (and refs), the body's
size and memory, a caller gone; and the route class that checks request text."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
from collections.abc import (
    Callable,
    Coroutine,
)
from typing import Any

import anyio
from fastapi import Request, Response
from fastapi.routing import APIRoute

from .. import _membudget
from .._errors import (
    DaemonBusy,
    HutchError,
    OutputLimitExceeded,
    SandboxPermissionDenied,
    Unauthorized,
)
from .._refwire import REF_PREFIX
from .._values import check_text
from ..daemon import Daemon
from ..store import RefRow
from .asgi import ASGIApp, Message, Receive, Scope, Send, header, is_json, render_json, respond
from .errors import error_json
from .uisession import session_authorizes

log = logging.getLogger("hutch.server")

SESSION_HEADER = "x-hutch-session"



# -- authentication -----------------------------------------------------------------------


#: Where the validated ref of a request is kept in its ASGI scope.
REF_SCOPE_KEY = "hutch.ref"


def bearer_credential(scope: Scope) -> bytes | None:
    """The credential of a request's ``Authorization: Bearer <credential>``
    (the scheme in any case, as RFC 9110 says), else None."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, credential = value.strip().partition(b" ")
            return credential.strip() if scheme.lower() == b"bearer" else None
    return None


#: What a ref may do in its sandbox: work in it and drive its lifecycle. Not
#: hand out refs, nor make daemon-wide things (snapshots, forks): a list of
#: what is allowed, so that a route added later is closed to refs until said.
REF_OPERATIONS = frozenset({
    "exec", "files", "list", "stat", "grep", "glob", "processes", "preview_url", "pty",
    "pause", "suspend", "resume", "set_timeout", "mkdir", "rename", "watch", "watchers",
    "meters",
})


def ref_route_sandbox(path: str) -> str | None:
    """The sandbox a request path names when the route is one a ref may take
    (:data:`REF_OPERATIONS` of one sandbox), else None."""
    parts = path.split("/")
    if (
        len(parts) >= 4 and parts[1] == "v1" and parts[2] == "sandboxes" and parts[3]
        and not any(p in ("..", ".") for p in parts)
        and (len(parts) == 4 or parts[4] in REF_OPERATIONS)
    ):
        return parts[3]
    return None


def _retarget(scope: Scope, named: str, target: str) -> None:
    """Send a request naming sandbox ``named`` to sandbox ``target`` instead."""
    prefix = f"/v1/sandboxes/{named}"
    scope["path"] = f"/v1/sandboxes/{target}" + scope["path"][len(prefix):]
    raw = scope.get("raw_path")
    if isinstance(raw, bytes) and raw.startswith(prefix.encode()):
        scope["raw_path"] = f"/v1/sandboxes/{target}".encode() + raw[len(prefix):]


def session_of(scope: Scope) -> str | None:
    """The session a request speaks for: a ref's sessions are the ref's own,
    so that no read of the owner's counts for them (read-before-write)."""
    session = header(scope, SESSION_HEADER.encode())
    ref: RefRow | None = scope.get(REF_SCOPE_KEY)
    if ref is None:
        return session
    return f"{ref.id}/{session or ''}"


def is_dashboard_page(path: str) -> bool:
    """Whether a path is the dashboard's own (``/ui``): its static files and
    its login, which hold no data; every call it makes for data is ``/v1``'s."""
    return (path == "/ui" or path.startswith("/ui/")) and ".." not in path.split("/")


class TokenAuth:
    """Pure ASGI middleware: every request, streams and websockets included,
    needs the bearer token or a ref (a credential for one sandbox), or a
    dashboard session of the token (:mod:`hutch.server.uisession`). With no
    token set, only refs are taken: nothing is answered without a credential.
    The dashboard's pages (static, no data) and its login are open."""

    def __init__(
        self, app: ASGIApp, token: str | None, daemon: Callable[[], Daemon | None]
    ) -> None:
        self.app = app
        self.expected = token.encode() if token else None
        self.daemon = daemon

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        given = bearer_credential(scope)
        if given is not None and given.startswith(REF_PREFIX.encode()):
            await self._with_ref(given, scope, receive, send)
            return
        if given is None and scope["type"] == "http" and (
            is_dashboard_page(scope["path"])
            or (self.expected is not None and session_authorizes(scope, self.expected))
        ):
            await self.app(scope, receive, send)
            return
        # Constant time: how much of a guess matched must not show in the timing.
        if (
            self.expected is None or given is None
            or not hmac.compare_digest(given, self.expected)
        ):
            await self._refuse(scope, send, Unauthorized(
                "missing or wrong token: set HUTCH_TOKEN to the daemon's token (its "
                "operator's, or the one it made in the file api-token of its data directory, "
                "which its own user's clients read on their own); clients send it as "
                "Authorization: Bearer <token>"
            ))
            return
        await self.app(scope, receive, send)

    async def _with_ref(self, given: bytes, scope: Scope, receive: Receive, send: Send) -> None:
        daemon = self.daemon()
        if daemon is None:
            await self._refuse(scope, send, Unauthorized("the daemon is not ready for refs"))
            return
        try:
            ref = await daemon.check_ref(given.decode("latin-1"))
        except HutchError as exc:
            await self._refuse(scope, send, exc)
            return
        if scope["path"] != "/healthz":
            named = ref_route_sandbox(scope["path"])
            try:
                # A ref that follows a workspace reaches the sandbox serving it now.
                target = None if named is None else await daemon.ref_target(ref, named)
            except HutchError as exc:
                await self._refuse(scope, send, exc)
                return
            if named is None or target is None:
                await self._refuse(scope, send, SandboxPermissionDenied(
                    f"ref {ref.id} works only in sandbox {ref.sandbox_id}"
                    + (f" (and those of workspace {ref.workspace})" if ref.workspace else "")
                    + ", and cannot hand out refs, snapshot or fork it"
                ))
                return
            if target != named:
                _retarget(scope, named, target)
            daemon.ref_session(ref, target, header(scope, SESSION_HEADER.encode()))
        scope[REF_SCOPE_KEY] = ref
        await self.app(scope, receive, send)

    @staticmethod
    async def _refuse(scope: Scope, send: Send, exc: HutchError) -> None:
        body = render_json(error_json(exc))
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
        if exc.http_status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        prefix = "http"
        if scope["type"] == "websocket":
            if "websocket.http.response" not in scope.get("extensions", {}):
                # A server that cannot answer a handshake with a status: a close
                # before accepting (the client sees 403), its code saying the status.
                await send({"type": "websocket.close", "code": 4000 + exc.http_status})
                return
            # The handshake answered with the error's own status and body.
            prefix = "websocket.http"
        await send({"type": f"{prefix}.response.start", "status": exc.http_status,
                    "headers": headers})
        await send({"type": f"{prefix}.response.body", "body": body})


# -- request bodies ------------------------------------------------------------------------------


class BodyLimit:
    """Pure ASGI middleware: no request body past ``max_bytes``.

    A body announced as larger is refused before a byte of it is read; one
    that grows past the cap while it arrives (chunked) is cut off there. So
    a caller's upload can never hold more than the cap of the daemon's memory.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, size: int | None) -> OutputLimitExceeded:
        told = f" ({size} bytes)" if size is not None else ""
        return OutputLimitExceeded(
            f"request body{told} is over the cap of {self.max_bytes} bytes; "
            "send large files in parts"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        announced = header(scope, b"content-length")
        if announced is not None and announced.isdigit() and int(announced) > self.max_bytes:
            exc = self._too_large(int(announced))
            await respond(send, exc.http_status, render_json(error_json(exc)),
                           b"application/json")
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise self._too_large(None)
            return message

        await self.app(scope, counted, send)


#: Memory a request body costs while its call runs, per byte of it: the
#: pieces received, joined, parsed (a JSON string), and decoded (stdin).
BODY_MEMORY_FACTOR = 4


def _streams_body(scope: Scope) -> bool:
    """Whether the route spools its body to disk as it comes (an upload):
    that body costs the spool's memory, which the spool takes itself."""
    return scope["method"] == "PUT" and str(scope["path"]).endswith("/files")


class BodyBudget:
    """Pure ASGI middleware: a request body held in memory (a JSON body,
    exec's ``stdin_b64`` with it) is taken from the process's memory budget
    (hutch._membudget) as it comes, and given back when the call ends.

    A body the budget has no room for is refused with ``daemon_busy`` before
    anything is done: announced, before a byte of it is read; chunked, when
    the piece that does not fit comes (whatever the route made of that, the
    caller is told ``daemon_busy``; nothing has started by then: a handler
    reads its whole body first).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _streams_body(scope):
            await self.app(scope, receive, send)
            return
        budget = _membudget.budget()
        what = f"the body of {scope['method']} {scope['path']}"
        taken = 0
        announced = header(scope, b"content-length")
        if announced is not None and announced.isdigit() and int(announced) > 0:
            taken = int(announced) * BODY_MEMORY_FACTOR
            try:
                budget.take(taken, what)
            except DaemonBusy as exc:
                await respond(send, exc.http_status, render_json(error_json(exc)),
                               b"application/json")
                return
        received = 0
        refused: DaemonBusy | None = None
        started = False

        async def counted() -> Message:
            nonlocal received, taken, refused
            message = await receive()
            received += len(message.get("body", b""))
            more = received * BODY_MEMORY_FACTOR - taken
            if more > 0:
                try:
                    budget.take(more, what)
                except DaemonBusy as exc:
                    refused = exc
                    raise
                taken += more
            return message

        async def sending(message: Message) -> None:
            nonlocal started
            if refused is not None and not started:
                return  # the route's answer to a refused body: ours goes instead
            started = True
            await send(message)

        try:
            await self.app(scope, counted, sending)
        except Exception:
            if refused is None or started:
                raise
        finally:
            budget.give(taken)
        if refused is not None and not started:
            await respond(send, refused.http_status, render_json(error_json(refused)),
                           b"application/json")


# -- a caller gone ------------------------------------------------------------------------------


class _BodyHandoff:
    """The request's messages from the pump to the handler, one waiting at
    most (an upload is read only as fast as it is consumed); once the pump
    has ended, what waits, then ``http.disconnect`` to every read."""

    def __init__(self) -> None:
        self._waiting: asyncio.Queue[Message] = asyncio.Queue(1)
        self._ended = False

    async def put(self, message: Message) -> None:
        await self._waiting.put(message)

    def end(self) -> None:
        self._ended = True
        if self._waiting.empty():
            self._waiting.put_nowait({"type": "http.disconnect"})  # wakes a read waiting

    async def get(self) -> Message:
        if self._ended and self._waiting.empty():
            return {"type": "http.disconnect"}
        return await self._waiting.get()


def _pump_ended(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("reading a request failed: %r", task.exception())


class CancelOnDisconnect:
    """Pure ASGI middleware: a request whose client goes away is cancelled.

    Every HTTP request, whatever its method and whether its handler reads a
    body or not: a pump owns the server's ``receive`` from the start, hands
    the body on to the handler (one message at a time, so an upload is still
    read only as fast as it is consumed), and once the body is in, waits for
    the disconnect. If it comes before the response is complete, the handler
    is cancelled, so what the call started inside a sandbox (a command, a
    grep, a helper a listing or a removal runs) is killed rather than left
    running for no one. Transitions shield themselves (see the lifecycle
    engine): a pause or a suspend whose caller left still finishes.

    The handler runs in the request's own task, under a cancel scope (which
    what it shields is safe from); the pump is a plain task of its own that
    only listens, ended when the handler is: on every request, a task
    group and a memory stream cost several times the rest of this.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        handoff = _BodyHandoff()
        cancel = anyio.CancelScope()
        answered = False

        async def answering(message: Message) -> None:
            nonlocal answered
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                answered = True
            await send(message)

        async def pump() -> None:
            try:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        # After the answer the server says "disconnect" to
                        # every receive: only before it is the caller gone.
                        if not answered:
                            cancel.cancel()
                        return
                    await handoff.put(message)
            finally:
                handoff.end()

        pumping = asyncio.get_running_loop().create_task(pump())
        pumping.add_done_callback(_pump_ended)
        try:
            with cancel:
                await self.app(scope, handoff.get, answering)
        finally:
            pumping.cancel()  # done with the body, answered or failed: nothing to listen for


# -- text in request bodies ---------------------------------------------------------------------

#: A JSON escape of a UTF-16 surrogate: the only way a body can carry a lone one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def may_hold_surrogate(body: bytes) -> bool:
    """Whether a JSON body may spell a lone surrogate (:class:`TextBodiesRoute`
    checks those; a fast path leaves such a body to it)."""
    return _SURROGATE_ESCAPE.search(body) is not None


class TextBodiesRoute(APIRoute):
    """A route whose JSON body holds no string a system call refuses (a lone
    surrogate, which JSON can spell and no UTF-8 encodes): ``invalid_argument``
    naming the field, for every route and field at once, before the handler
    or any model sees the body."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            if is_json(request.scope):
                body = await request.body()  # kept: the handler reads it again
                if may_hold_surrogate(body):
                    try:
                        data = json.loads(body)
                    except ValueError:
                        data = None  # the handler's own error says what is wrong
                    check_text(data, "", nul=False)
            return await handler(request)

        return checked

