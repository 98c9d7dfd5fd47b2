"""The fast path: hot routes answered on FastAPI's own route table."""

from __future__ import annotations

import json
import logging
from collections.abc import (
    Awaitable,
    Callable,
    Mapping,
    Sequence,
)
from typing import IO, Any
from urllib.parse import parse_qsl

from pydantic import ValidationError
from starlette.routing import BaseRoute, Match

from .._errors import (
    HutchError,
)
from .._types import (
    DEFAULT_READ_LIMIT,
    MAX_READ_LIMIT,
)
from ..daemon import Daemon
from .asgi import ASGIApp, Message, Receive, Scope, Send, is_json, render_json, respond
from .bodies import ExecBody
from .errors import error_json, unexpected_error_json
from .middleware import may_hold_surrogate, session_of
from .streaming import new_spool, opened_file, run_exec, send_exec

log = logging.getLogger("hutch.server")

# -- the fast path -----------------------------------------------------------------------------


#: A hot route's handler: (daemon, sandbox id, scope, receive, send).
_HotHandler = Callable[["Daemon", str, Scope, Receive, Send], Awaitable[None]]


class _FallThrough(Exception):
    """The fast path is not sure of this request: FastAPI answers it."""


def _replaying(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the already-read body over again, then the real one."""
    replayed = False

    async def again() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body; None if the client went away."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)




async def _spool_body(receive: Receive) -> IO[bytes] | None:
    """The request body in a spool, rewound; None if the client went away."""
    spool = new_spool()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            spool.close()
            return None
        spool.write(message.get("body", b""))
        if not message.get("more_body", False):
            spool.seek(0)
            return spool




class HotRoutes:
    """Answers exec, file read/write, status reads and plain creates without FastAPI's
    parameter resolution, on FastAPI's own routes.

    Sits inside :class:`TokenAuth` (the token is checked first). A request is
    matched against the application's route table, in the order FastAPI
    tries it (included routers entered in place), up to the last hot route:
    when the first route that matches it whole is a hot one (``hot``: its
    endpoint -> the name of its handler here), that handler answers, calling
    the same :class:`Daemon` methods as the endpoint; otherwise FastAPI does.
    A handler takes a request only when it is sure of it: well-formed query
    parameters, a JSON body that validates. Otherwise FastAPI answers, with
    the body replayed, so its errors are the errors.
    """

    def __init__(
        self,
        app: ASGIApp,
        daemon: Callable[[], Daemon | None],
        routes: Callable[[], Sequence[BaseRoute]],
        hot: Mapping[Callable[..., Any], str],
    ) -> None:
        self.app = app
        self.daemon = daemon
        self._routes = routes
        self._hot = hot
        self._table: list[tuple[BaseRoute, _HotHandler | None]] | None = None

    def _route_table(self) -> list[tuple[BaseRoute, _HotHandler | None]]:
        """The routes in the order FastAPI tries them, each with its hot
        handler (or None), cut after the last hot one (made on first use:
        the table is complete once the application serves)."""
        if self._table is None:
            flat: list[tuple[BaseRoute, _HotHandler | None]] = []

            def walk(routes: Sequence[BaseRoute]) -> None:
                for route in routes:
                    included = getattr(route, "original_router", None)  # an included router
                    if included is not None:
                        walk(included.routes)
                        continue
                    name = self._hot.get(getattr(route, "endpoint", None))  # type: ignore[arg-type]
                    flat.append((route, getattr(self, name) if name else None))

            walk(self._routes())
            last = max((i for i, (_, h) in enumerate(flat) if h is not None), default=-1)
            self._table = flat[:last + 1]
        return self._table

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        daemon = self.daemon() if scope["type"] == "http" else None
        found = self._handler(scope) if daemon is not None else None
        if daemon is None or found is None:
            await self.app(scope, receive, send)
            return
        handler, sandbox_id, route = found
        scope["route"] = route  # as the router would: the route taken, for the metrics
        try:
            await handler(daemon, sandbox_id, scope, receive, send)
        except _FallThrough as fall:
            body = fall.args[0] if fall.args else None
            await self.app(scope, receive if body is None else _replaying(body, receive), send)
        except HutchError as exc:
            await respond(send, exc.http_status, render_json(error_json(exc)),
                           b"application/json")
        except Exception as exc:
            log.exception("unexpected error")
            await respond(send, 500, render_json(unexpected_error_json(exc)),
                           b"application/json")

    def _handler(self, scope: Scope) -> tuple[_HotHandler, str, BaseRoute] | None:
        """The hot handler of the route FastAPI would take, and its sandbox id."""
        probe = dict(scope)  # matching may note things in the scope: not in the real one
        for route, handler in self._route_table():
            match, child = route.matches(probe)
            if match is Match.FULL:
                # A route of no sandbox (create) has "" for its id.
                sandbox_id = (child.get("path_params") or {}).get("sandbox_id", "")
                if handler is None or not isinstance(sandbox_id, str):
                    return None
                return handler, sandbox_id, route
        return None

    @staticmethod
    def _session(scope: Scope) -> str | None:
        return session_of(scope)

    @staticmethod
    def _query(scope: Scope) -> dict[str, str]:
        # As Starlette reads it: the last of repeated keys wins.
        return dict(parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True))

    async def _status(
        self, daemon: Daemon, sandbox_id: str, scope: Scope, receive: Receive, send: Send
    ) -> None:
        info = await daemon.describe(sandbox_id)
        await respond(send, 200, render_json(info), b"application/json")

    async def _create(
        self, daemon: Daemon, sandbox_id: str, scope: Scope, receive: Receive, send: Send
    ) -> None:
        # A plain create (a warm pool's take is ~2 ms of daemon work: FastAPI's
        # body resolution would be half as much again); one from a snapshot,
        # or a body that is not a JSON object, is FastAPI's.
        if not is_json(scope):
            raise _FallThrough()
        raw = await _read_body(receive)
        if raw is None:
            return
        if may_hold_surrogate(raw):
            raise _FallThrough(raw)  # TextBodiesRoute says which field
        try:
            body = json.loads(raw)
        except ValueError:
            raise _FallThrough(raw) from None
        if not isinstance(body, dict) or "from_snapshot" in body:
            raise _FallThrough(raw)
        sandbox = await daemon.create_sandbox(daemon.spec_from_request(body))
        await respond(send, 201, render_json(await daemon.info(sandbox)), b"application/json")

    async def _exec(
        self, daemon: Daemon, sandbox_id: str, scope: Scope, receive: Receive, send: Send
    ) -> None:
        if not is_json(scope):
            raise _FallThrough()
        raw = await _read_body(receive)
        if raw is None:
            return
        try:
            body = ExecBody.model_validate_json(raw)
        except ValidationError:
            raise _FallThrough(raw) from None
        sandbox = await daemon.session(sandbox_id, self._session(scope))
        await send_exec(send, await run_exec(sandbox, body))

    async def _read(
        self, daemon: Daemon, sandbox_id: str, scope: Scope, receive: Receive, send: Send
    ) -> None:
        query = self._query(scope)
        path, limit_text = query.get("path"), query.get("limit")
        if path is None or (limit_text is not None and not limit_text.isdigit()):
            raise _FallThrough()
        limit = int(limit_text) if limit_text is not None else DEFAULT_READ_LIMIT
        if not 0 < limit <= MAX_READ_LIMIT:
            raise _FallThrough()
        sandbox = await daemon.session(sandbox_id, self._session(scope))
        first, rest = await opened_file(sandbox.read_pieces(path, limit=limit))
        if rest is None:
            await respond(send, 200, first, b"application/octet-stream")
            return
        # A large file goes out as it is read (chunked), never whole in memory.
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/octet-stream")]})
            await send({"type": "http.response.body", "body": first, "more_body": True})
            async for piece in rest:
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await rest.aclose()

    async def _write(
        self, daemon: Daemon, sandbox_id: str, scope: Scope, receive: Receive, send: Send
    ) -> None:
        query = self._query(scope)
        path = query.get("path")
        overwrite = query.get("overwrite", "false")
        if path is None or overwrite not in ("true", "false"):
            raise _FallThrough()  # FastAPI's route answers, or says what is wrong
        spool = await _spool_body(receive)
        if spool is None:
            return
        with spool:
            sandbox = await daemon.session(sandbox_id, self._session(scope))
            await sandbox.write_from(path, spool, overwrite=overwrite == "true")
        await respond(send, 204, b"", b"")

