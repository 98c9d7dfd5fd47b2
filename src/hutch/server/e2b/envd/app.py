"""The in-sandbox API (envd) as one ASGI application, for requests that name
their sandbox with ``E2b-Sandbox-Id``: the process and filesystem services in
the Connect protocol, ``/files`` and ``/health``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from starlette.requests import Request

from ...._errors import HutchError, NotFound, SandboxExpired, SandboxUnavailable
from ...._guardrail import ReadBeforeWriteGuard, session_guard
from ...._sandbox import Sandbox
from ....daemon import Daemon
from ...asgi import Receive, Scope, Send, header
from .calls import Call, sandbox_id_of
from .connect import (
    MAX_MESSAGE_BYTES,
    STREAM_JSON,
    UNARY_JSON,
    ConnectError,
    EnvelopeReader,
    connect_error,
    decode,
    encode,
    end_stream,
    envelope,
)
from .files import error_response, gone_response, health, read_file, write_files
from .filesystem import FilesystemService
from .process import ProcessService, ProcessTable
from .watch import WatchHub, WatchService

log = logging.getLogger("hutch.server.e2b")

Unary = Callable[[Call, dict[str, Any]], Awaitable[dict[str, Any]]]
ServerStream = Callable[[Call, dict[str, Any]], Awaitable[AsyncIterator[dict[str, Any]]]]
ClientStream = Callable[[Call, AsyncIterator[dict[str, Any]]], Awaitable[dict[str, Any]]]


def _media_type(scope: Scope) -> str:
    return (header(scope, b"content-type") or "").split(";", 1)[0].strip().lower()


async def _send_json(send: Send, status: int, body: bytes, media_type: str) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", media_type.encode()), (b"content-length", str(len(body)).encode()),
    ]})
    await send({"type": "http.response.body", "body": body})


async def _unary_error(send: Send, error: ConnectError) -> None:
    await _send_json(send, error.http_status, encode(error.wire()), UNARY_JSON)


async def _whole_body(receive: Receive, limit: int = MAX_MESSAGE_BYTES) -> bytes:
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectError("canceled", "the client went away")
        body.extend(message.get("body", b""))
        if len(body) > limit:
            raise ConnectError("resource_exhausted", f"the request is over {limit} bytes")
        if not message.get("more_body", False):
            return bytes(body)


class EnvdApp:
    """envd for every sandbox of a daemon, told apart by ``E2b-Sandbox-Id``.

    ``daemon`` and ``sandbox_id`` say, of a request, the daemon that answers
    it and the sandbox it is for (by default the header's: the dispatch in
    front, which checked the caller's credential, may say otherwise).
    """

    def __init__(
        self,
        daemon: Callable[[Scope], Daemon | None],
        sandbox_id: Callable[[Scope], str | None] = sandbox_id_of,
    ) -> None:
        self.daemon = daemon
        self.sandbox_id = sandbox_id
        self.processes = ProcessTable()
        process = ProcessService(self.processes)
        self.watches = WatchHub()
        filesystem = FilesystemService(self.watches)
        watch = WatchService(self.watches)
        self.unary: dict[str, Unary] = {
            **{f"/process.Process/{name}": rpc for name, rpc in process.unary().items()},
            **{f"/filesystem.Filesystem/{name}": rpc for name, rpc in filesystem.unary().items()},
            **{f"/filesystem.Filesystem/{name}": rpc for name, rpc in watch.unary().items()},
        }
        self.server_streams: dict[str, ServerStream] = {
            **{f"/process.Process/{name}": rpc for name, rpc in process.streams().items()},
            **{f"/filesystem.Filesystem/{name}": rpc for name, rpc in watch.streams().items()},
        }
        self.client_streams: dict[str, ClientStream] = {
            "/process.Process/StreamInput": process.stream_input,
        }

    async def close(self) -> None:
        await self.processes.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await error_response(404, "envd answers HTTP only")(scope, receive, send)
            return
        sandbox_id = self.sandbox_id(scope)
        daemon = self.daemon(scope)
        if not sandbox_id or daemon is None:
            await error_response(400, "E2b-Sandbox-Id names no sandbox")(scope, receive, send)
            return
        try:
            sandbox = await daemon.get(sandbox_id)
        except (NotFound, SandboxExpired, SandboxUnavailable) as exc:
            # Gone (or never there): as E2B's proxy says it, which the SDKs
            # turn into "the sandbox is not running".
            await gone_response(sandbox_id, f": {exc.message}")(scope, receive, send)
            return
        # E2B's callers know no read-before-write: their writes and removals
        # are a person's, made on purpose (this request's and what it starts).
        session_guard.set(ReadBeforeWriteGuard(enabled=False))
        path, method = scope["path"], scope["method"]
        if path == "/health":
            await (await health(sandbox))(scope, receive, send)
        elif path == "/files" and method in ("GET", "HEAD"):
            await (await read_file(Request(scope, receive), sandbox))(scope, receive, send)
        elif path == "/files" and method == "POST":
            written = await write_files(Request(scope, receive), sandbox, self.watches)
            await written(scope, receive, send)
        elif path in self.unary or path in self.server_streams or path in self.client_streams:
            await self._rpc(scope, receive, send, sandbox)
        else:
            await error_response(404, f"no route {method} {path}")(scope, receive, send)

    # -- Connect -------------------------------------------------------------------------------
    async def _rpc(self, scope: Scope, receive: Receive, send: Send, sandbox: Sandbox) -> None:
        path = scope["path"]
        if scope["method"] != "POST":
            await _unary_error(send, ConnectError("unimplemented", f"{path} takes POST only"))
            return
        try:
            call = Call.of(scope, sandbox)
        except ConnectError as exc:
            await _unary_error(send, exc)
            return
        if path in self.unary:
            await self._unary(scope, receive, send, call, self.unary[path])
        elif _media_type(scope) != STREAM_JSON:
            await _unary_error(send, ConnectError(
                "invalid_argument", f"{path} is a stream: its content type is {STREAM_JSON}"))
        elif path in self.server_streams:
            await self._server_stream(receive, send, call, self.server_streams[path])
        else:
            await self._client_stream(receive, send, call, self.client_streams[path])

    async def _unary(
        self, scope: Scope, receive: Receive, send: Send, call: Call, rpc: Unary,
    ) -> None:
        if _media_type(scope) != UNARY_JSON:
            await _send_json(send, 415, encode(ConnectError(
                "invalid_argument", f"a unary call's content type is {UNARY_JSON} (JSON only)",
            ).wire()), UNARY_JSON)
            return
        try:
            request = decode(await _whole_body(receive))
            with anyio.fail_after(call.timeout):
                answer = await rpc(call, request)
        except TimeoutError:
            await _unary_error(send, ConnectError(
                "deadline_exceeded", f"{scope['path']} ran past its deadline"))
            return
        except (ConnectError, HutchError) as exc:
            await _unary_error(send, connect_error(exc))
            return
        except Exception as exc:
            log.exception("envd call %s failed", scope["path"])
            await _unary_error(send, connect_error(exc))
            return
        await _send_json(send, 200, encode(answer), UNARY_JSON)

    @staticmethod
    async def _stream_start(send: Send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", STREAM_JSON.encode())]})

    async def _server_stream(
        self, receive: Receive, send: Send, call: Call, rpc: ServerStream,
    ) -> None:
        """One request envelope in; envelopes out as the call makes them,
        and the end of the stream (with the error, if it failed). Errors go
        in the end too, under a 200, as Connect's streams have them."""
        try:
            # The whole request before the answer starts: a server may take
            # no more of a body once its answer has begun.
            reader = EnvelopeReader()
            messages = list(reader.feed(await _whole_body(receive)))
            reader.finish()
            if len(messages) != 1 or messages[0][0] != 0:
                raise ConnectError("invalid_argument", "a server stream takes one request message")
            items = await rpc(call, decode(messages[0][1]))
        except Exception as exc:
            if not isinstance(exc, ConnectError | HutchError):
                log.exception("envd stream failed to start")
            await self._stream_start(send)
            await send({"type": "http.response.body", "body": end_stream(connect_error(exc))})
            return
        await self._stream_start(send)
        error: ConnectError | None = None
        async with anyio.create_task_group() as group:

            async def caller_gone() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                group.cancel_scope.cancel()

            group.start_soon(caller_gone)
            try:
                async for item in items:
                    await send({"type": "http.response.body", "body": envelope(item),
                                "more_body": True})
            except (ConnectError, HutchError) as exc:
                error = connect_error(exc)
            except OSError:
                group.cancel_scope.cancel()  # the caller is gone
            except Exception as exc:
                log.exception("envd stream failed")
                error = connect_error(exc)
            finally:
                with anyio.CancelScope(shield=True):
                    await _aclose(items)
            if not group.cancel_scope.cancel_called:
                await send({"type": "http.response.body", "body": end_stream(error)})
            group.cancel_scope.cancel()

    async def _client_stream(
        self, receive: Receive, send: Send, call: Call, rpc: ClientStream,
    ) -> None:
        """Request envelopes as they come; one answer envelope and the end
        (the answer starts once the request has ended, as it can only then)."""

        async def requests() -> AsyncIterator[dict[str, Any]]:
            reader = EnvelopeReader()
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ConnectError("canceled", "the client went away")
                for flags, payload in reader.feed(message.get("body", b"")):
                    if flags:
                        return
                    yield decode(payload)
                if not message.get("more_body", False):
                    reader.finish()
                    return

        try:
            with anyio.fail_after(call.timeout):
                answer = envelope(await rpc(call, requests())) + end_stream()
        except TimeoutError:
            answer = end_stream(
                ConnectError("deadline_exceeded", "the input stream ran past its deadline"))
        except Exception as exc:
            if not isinstance(exc, ConnectError | HutchError):
                log.exception("envd input stream failed")
            answer = end_stream(connect_error(exc))
        await self._stream_start(send)
        await send({"type": "http.response.body", "body": answer})


async def _aclose(items: AsyncIterator[Any]) -> None:
    close = getattr(items, "aclose", None)
    if close is not None:
        try:
            await close()
        except (Exception, asyncio.CancelledError):
            log.debug("closing an envd stream failed", exc_info=True)
