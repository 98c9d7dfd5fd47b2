"""The HTTP API (docs/wire.md) over :class:`Daemon`.

Handlers return plain dicts through ``JSONResponse``; the request models
validate input and document it in the OpenAPI schema. Every error leaves as
``{"error": {"code", "message"}}`` (and the details of errors that carry some,
``HutchError.wire``) with the status of its code.

The four calls an agent makes most (exec, read a file, write a file, read a
sandbox's status) are answered by :class:`HotRoutes` once the application's
own route table says they are theirs: FastAPI resolves each endpoint's
parameters (~130 µs a request), which would be most of what the daemon adds
to an exec. There is one route table, FastAPI's: the fast path matches a
request against it, in its order, and answers only when the route it would
take is a hot one. Anything the fast path is not sure of falls through to
the FastAPI route with the body replayed, so both answer alike and the
OpenAPI document stays the one reference.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import logging
import os
import re
import sys
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterator,
    Mapping,
    MutableMapping,
    Sequence,
)
from contextlib import asynccontextmanager
from typing import IO, Any
from urllib.parse import parse_qsl

import anyio
from fastapi import APIRouter, FastAPI, Query, Request, Response, WebSocket, WebSocketDisconnect
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match

from .. import _membudget
from .._errors import (
    ERRORS_BY_CODE,
    DaemonBusy,
    ExecTimeout,
    HutchError,
    InvalidArgument,
    OutputLimitExceeded,
    SandboxPermissionDenied,
    Unauthorized,
    error_from_code,
)
from .._process import ExecOutput, ExitStatus, Process, Stream, wait_output
from .._refwire import REF_PREFIX
from .._sandbox import Sandbox, exec_output, forget_process
from .._types import (
    DEFAULT_READ_LIMIT,
    DEFAULT_SEARCH_TIMEOUT,
    MAX_DURATION,
    MAX_OUTPUT_LIMIT,
    MAX_READ_LIMIT,
    ExecResult,
    FileInfo,
    OutputChunk,
)
from .._values import check_text
from ..daemon import DEFAULT_RETENTION_SECONDS, Daemon, OperatorPolicy, default_data_dir
from ..store import RefRow

log = logging.getLogger("hutch.server")

SESSION_HEADER = "x-hutch-session"
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class ServerSettings(BaseModel):
    data_dir: str | None = None
    token: str | None = None
    sandbox_defaults: dict[str, Any] = {}
    timeout_ceiling: float = 86400.0
    #: Seconds an ended sandbox stays readable (with its events) before it is pruned.
    retention_seconds: float = DEFAULT_RETENTION_SECONDS
    #: The largest request body (a file upload) taken, bytes.
    max_body_bytes: int = Field(default=MAX_READ_LIMIT, gt=0)
    #: What callers' bytes may hold of the daemon's memory at once, all
    #: calls together (hutch._membudget); output past it goes to disk, a
    #: request body past it is refused (daemon_busy).
    memory_budget: int = Field(default=_membudget.DEFAULT_MEMORY_BUDGET, gt=0)
    #: Settings that reach the host which API clients may nonetheless set.
    allow: list[str] = []
    #: Providers that run on the host (local, ssh) which API clients may nonetheless use.
    providers: list[str] = []
    #: The provider of requests that name none (``hutch serve --provider``),
    #: where the sandbox defaults name none; unset: the daemon picks one that
    #: isolates (see hutch.daemon.policy).
    default_provider: str | None = None
    #: Resource limits (memory, cpus, pids) for requests that set none, and
    #: the most a request may ask for; see hutch.daemon.policy.
    limits: dict[str, Any] = {}
    ceilings: dict[str, Any] = {}
    #: The operator's sandbox definitions (``[definitions.NAME]`` in hutch.toml).
    definitions: dict[str, dict[str, Any]] = {}

    def policy(self) -> OperatorPolicy:
        return OperatorPolicy(self.allow, self.limits, self.ceilings, self.providers)


# -- request bodies ------------------------------------------------------------------


#: The most events one listing returns.
MAX_EVENTS = 10_000


#: Lines of progress a streamed ensure holds for a slow reader before it drops output.
ENSURE_STREAM_BUFFER = 256


class ThreadBody(BaseModel):
    """Which thread (and tenant) of a definition ``ensure``/``complete`` is about."""

    model_config = ConfigDict(extra="forbid")

    thread_id: str = Field(min_length=1, max_length=256)
    tenant: str | None = Field(default=None, max_length=256)


class ExecBody(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    cmd: str | list[str]
    timeout: float | None = Field(default=None, gt=0, le=MAX_DURATION)
    cwd: str | None = None
    env: dict[str, str] | None = None
    stdin: str | None = None
    stdin_b64: str | None = None
    user: str | None = None
    output_limit: int | None = Field(default=None, gt=0, le=MAX_OUTPUT_LIMIT)

    def stdin_bytes(self) -> bytes | None:
        if self.stdin_b64 is not None:
            try:
                return base64.b64decode(self.stdin_b64, validate=True)
            except ValueError:
                raise InvalidArgument("stdin_b64 is not valid base64") from None
        if self.stdin is None:
            return None
        check_text(self.stdin, "stdin", nul=False)
        return self.stdin.encode()


class SandboxRef(BaseModel):
    sandbox: str


class RefBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: Seconds the ref may be used for; unset: until revoked or the sandbox ends.
    expires_in: float | None = Field(default=None, gt=0, le=365 * 86400, allow_inf_nan=False)


class SetTimeoutBody(BaseModel):
    # Over the wire a timeout is a positive number (NaN, 0 and below are
    # refused); one above the ceiling is the engine's timeout_too_large.
    timeout_seconds: float = Field(gt=0)


class SetTimeoutRef(SetTimeoutBody):
    sandbox: str


class WaitBody(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)

    timeout: float | None = Field(default=None, gt=0, le=MAX_DURATION)


class GrepBody(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)

    pattern: str
    path: str = "."
    glob: str | None = None
    ignore_case: bool = False
    #: Seconds before the search is stopped (exec_timeout).
    timeout: float = Field(default=DEFAULT_SEARCH_TIMEOUT, gt=0, le=MAX_DURATION)


class GlobBody(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)

    pattern: str
    path: str = "."
    timeout: float = Field(default=DEFAULT_SEARCH_TIMEOUT, gt=0, le=MAX_DURATION)


class SnapshotBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    label: str | None = Field(default=None, max_length=200)
    #: Store only what changed since the sandbox's last state, where the provider can.
    diff: bool = True


class ForkBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    label: str | None = Field(default=None, max_length=200)
    #: Branches to start from the snapshot now (more can attach later).
    count: int = Field(default=1, ge=0, le=64)
    #: Sandbox options for the branches (``idle_timeout``...), over the origin's.
    options: dict[str, Any] | None = None


class WorkspaceSuspendBody(BaseModel):
    diff: bool = False


# -- encoding helpers -------------------------------------------------------------------


def _text_or_b64(key: str, data: bytes, out: dict[str, Any]) -> None:
    try:
        out[key] = data.decode("utf-8")
    except UnicodeDecodeError:
        out[f"{key}_b64"] = base64.b64encode(data).decode()


#: An exec answer whose output is at most this is rendered whole (with a
#: Content-Length); a larger one is written out as it is read from its spool.
INLINE_OUTPUT_BYTES = _membudget.SPOOL_MEMORY_BYTES


#: JSON's escape of each control character, as ``render_json`` writes it.
_CONTROL_ESCAPES = [
    (bytes([code]), json.dumps(chr(code), ensure_ascii=False)[1:-1].encode())
    for code in range(0x20)
]
_CONTROLS = bytes(range(0x20))


def _escaped(piece: bytes) -> bytes:
    """Valid UTF-8 as inside a JSON string, exactly as ``render_json`` has
    it: with ``ensure_ascii=False`` JSON escapes only ``"``, ``\\`` and the
    control characters, all ASCII, which no byte of a multi-byte character
    can be; so bytes replaced in place (at memchr speed, not a character at
    a time) are the same, and pieces cut anywhere join up to the whole."""
    piece = (piece.replace(b"\\", b"\\\\").replace(b'"', b'\\"')
             .replace(b"\n", b"\\n").replace(b"\t", b"\\t").replace(b"\r", b"\\r"))
    if len(piece.translate(None, _CONTROLS)) != len(piece):  # rarer ones left
        for raw, escaped in _CONTROL_ESCAPES:  # an escape holds no control character
            if raw in piece:
                piece = piece.replace(raw, escaped)
    return piece


def _stream_json(output: ExecOutput, stream: Stream) -> Iterator[bytes]:
    """``,"stdout":"..."`` (or ``"stdout_b64"``) read from the spool in pieces."""
    if output.is_utf8(stream):
        yield f',"{stream}":"'.encode()
        for piece in output.pieces(stream):
            yield _escaped(piece)
    else:
        yield f',"{stream}_b64":"'.encode()
        carry = b""
        for piece in output.pieces(stream):
            data = carry + piece
            whole = len(data) - len(data) % 3  # base64 of whole groups of 3 joins up
            yield base64.b64encode(data[:whole])
            carry = data[whole:]
        yield base64.b64encode(carry)
    yield b'"'


def exec_json_pieces(output: ExecOutput) -> Iterator[bytes]:
    """An exec answer, byte for byte as ``render_json(exec_json(...))``
    would have it, in pieces of a bounded size: a large output goes out as
    it is read from its spool, never whole in memory (nor twice, as text and
    as JSON)."""
    yield b'{"exit_code":' + str(output.exit_code).encode()
    yield from _stream_json(output, "stdout")
    yield from _stream_json(output, "stderr")
    if output.oom_killed:
        yield b',"oom_killed":true'
    yield b"}"


def exec_response(output: ExecOutput) -> Response:
    """The answer of an exec (or a wait) through FastAPI; closes ``output``."""
    if output.size <= INLINE_OUTPUT_BYTES:
        with output:
            return JSONResponse(exec_json(output.result()))

    async def pieces() -> AsyncIterator[bytes]:
        with output:
            for piece in exec_json_pieces(output):
                yield piece

    return StreamingResponse(pieces(), media_type="application/json")


async def send_exec(send: Send, output: ExecOutput) -> None:
    """The answer of an exec on the fast path; closes ``output``."""
    with output:
        if output.size <= INLINE_OUTPUT_BYTES:
            await _respond(send, 200, render_json(exec_json(output.result())),
                           b"application/json")
            return
        # Chunked: the server waits for the client to take each piece
        # before the next is read (its flow control), so a slow reader
        # holds a piece, not the output.
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        for piece in exec_json_pieces(output):
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def exec_json(result: ExecResult) -> dict[str, Any]:
    out: dict[str, Any] = {"exit_code": result.exit_code}
    _text_or_b64("stdout", result.stdout_bytes, out)
    _text_or_b64("stderr", result.stderr_bytes, out)
    if result.oom_killed:
        out["oom_killed"] = True
    return out


def file_json(info: FileInfo) -> dict[str, Any]:
    return {"path": info.path, "type": info.type.value, "size": info.size,
            "mode": info.mode, "mtime": info.mtime}


class ErrorDetail(BaseModel):
    """``code`` and ``message``, and the details of errors that carry some
    (``setup_failed``: the step, its exit code and the end of its output)."""

    code: str
    message: str
    step: str | None = Field(default=None, description="setup_failed: the failing step")
    exit_code: int | None = Field(default=None, description="setup_failed: its exit code")
    output_tail: str | None = Field(
        default=None, description="setup_failed: the end of its output"
    )


class ErrorBody(BaseModel):
    """Every error's body: ``{"error": {"code", "message", ...details}}``."""

    error: ErrorDetail


def error_responses() -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` of every error status the API answers with,
    from the one table of codes (hutch._errors); 500 is no answer of hutch's
    but a bug, and so undocumented."""
    by_status: dict[int, list[str]] = {}
    for code, cls in sorted(ERRORS_BY_CODE.items()):
        if cls.http_status != 500:
            by_status.setdefault(cls.http_status, []).append(code)
    return {
        status: {"model": ErrorBody, "description": "error: " + ", ".join(codes)}
        for status, codes in sorted(by_status.items())
    }


def error_json(exc: HutchError) -> dict[str, Any]:
    """Every error body the daemon sends, answers, stream lines and terminal
    messages alike: ``{"error": exc.wire()}``, with no path of the daemon's
    own data directory in its message (:func:`without_data_dir`)."""
    wire = exc.wire()
    if isinstance(wire.get("message"), str):
        wire["message"] = without_data_dir(wire["message"])
    return {"error": wire}


def without_data_dir(message: str) -> str:
    """``message`` with the daemon's data directory said by name wherever a
    path in it shows (its store, layers, images, mounts): where the daemon
    keeps its files is its operator's business. What follows it stays, so
    that a file a caller named is still named."""
    home = os.environ.get("HUTCH_HOME")
    if not home:
        return message
    for root in {os.path.abspath(home).rstrip("/"), os.path.realpath(home).rstrip("/")}:
        if root and root in message:
            message = re.sub(re.escape(root) + r"(?![^/\s'\",;:])", DATA_DIR_NAME, message)
    return message


#: What a message says in place of the daemon's data directory.
DATA_DIR_NAME = "<hutch data directory>"


def unexpected_error_json(exc: BaseException) -> dict[str, Any]:
    return error_json(HutchError(f"{type(exc).__name__}: {exc}"))


def render_json(content: Any) -> bytes:
    """JSON exactly as ``JSONResponse`` renders it, for the fast path."""
    return json.dumps(
        content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode("utf-8")


def event_line(event: OutputChunk | ExitStatus) -> bytes:
    if isinstance(event, ExitStatus):
        status: dict[str, Any] = {"exit_code": event.exit_code}
        if event.oom_killed:
            status["oom_killed"] = True
        return json.dumps(status).encode() + b"\n"
    out: dict[str, Any] = {"stream": event.stream}
    _text_or_b64("data", event.data, out)
    return json.dumps(out).encode() + b"\n"


def process_json(process: Process) -> dict[str, Any]:
    return {"id": process.id, "running": process.running, "exit_code": process.exit_code,
            "command": process.command}


async def ndjson(process: Process, timeout: float | None) -> AsyncIterator[bytes]:
    """A process's events as NDJSON; a failure midway is the last line."""
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        stream = process.stream()
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                with anyio.fail_after(remaining):
                    event = await anext(stream)
            except StopAsyncIteration:
                return
            except TimeoutError:
                await process.kill()
                yield json.dumps(error_json(ExecTimeout(
                    f"command timed out after {timeout} s; its whole process tree was killed"
                ))).encode() + b"\n"
                return
            yield event_line(event)
    except HutchError as exc:
        yield json.dumps(error_json(exc)).encode() + b"\n"
    finally:
        if process.running and timeout is not None:
            await process.kill()


# -- what the FastAPI routes and the fast path share -------------------------------------


async def run_exec(sandbox: Sandbox, body: ExecBody) -> ExecOutput:
    return await exec_output(
        sandbox, body.cmd, cwd=body.cwd, env=body.env, stdin=body.stdin_bytes(), user=body.user,
        timeout=body.timeout, output_limit=body.output_limit,
    )


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
    "pause", "suspend", "resume", "set_timeout",
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
    session = _header(scope, SESSION_HEADER.encode())
    ref: RefRow | None = scope.get(REF_SCOPE_KEY)
    if ref is None:
        return session
    return f"{ref.id}/{session or ''}"


class TokenAuth:
    """Pure ASGI middleware: every request, streams and websockets included,
    needs the bearer token or a ref (a credential for one sandbox). With no
    token set, only refs are taken: nothing is answered without a credential."""

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
            ref = daemon.check_ref(given.decode("latin-1"))
        except HutchError as exc:
            await self._refuse(scope, send, exc)
            return
        if scope["path"] != "/healthz":
            named = ref_route_sandbox(scope["path"])
            try:
                # A ref that follows a workspace reaches the sandbox serving it now.
                target = None if named is None else daemon.ref_target(ref, named)
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
            daemon.ref_session(ref, target, _header(scope, SESSION_HEADER.encode()))
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
        announced = _header(scope, b"content-length")
        if announced is not None and announced.isdigit() and int(announced) > self.max_bytes:
            exc = self._too_large(int(announced))
            await _respond(send, exc.http_status, render_json(error_json(exc)),
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
        announced = _header(scope, b"content-length")
        if announced is not None and announced.isdigit() and int(announced) > 0:
            taken = int(announced) * BODY_MEMORY_FACTOR
            try:
                budget.take(taken, what)
            except DaemonBusy as exc:
                await _respond(send, exc.http_status, render_json(error_json(exc)),
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
            await _respond(send, refused.http_status, render_json(error_json(refused)),
                           b"application/json")


# -- a caller gone ------------------------------------------------------------------------------


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
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # One message may wait for the handler: the last piece of a body it
        # has not read (a GET's empty one) waits there while the pump listens.
        handed, taken = anyio.create_memory_object_stream[Message](1)
        answered = False

        async def answering(message: Message) -> None:
            nonlocal answered
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                answered = True
            await send(message)

        async def body() -> Message:
            try:
                return await taken.receive()
            except anyio.EndOfStream:
                return {"type": "http.disconnect"}

        failure: Exception | None = None
        async with anyio.create_task_group() as group:

            async def pump() -> None:
                async with handed:
                    while True:
                        message = await receive()
                        if message["type"] == "http.disconnect":
                            # After the answer the server says "disconnect"
                            # to every receive: only before it is the caller gone.
                            if not answered:
                                group.cancel_scope.cancel()
                            return
                        try:
                            await handed.send(message)
                        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                            return  # the handler is done with the body

            group.start_soon(pump)
            try:
                async with taken:
                    await self.app(scope, body, answering)
            except Exception as exc:
                failure = exc  # raised as itself below, not inside a group
            finally:
                group.cancel_scope.cancel()
        if failure is not None:
            raise failure


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


#: Request body a spool keeps in memory; past it, the rest is on disk.
SPOOL_MEMORY_BYTES = 1024 * 1024


def new_spool() -> IO[bytes]:
    """Where an upload lands as it arrives: memory for a small one, disk past
    :data:`SPOOL_MEMORY_BYTES` or once the memory budget says so (an unlinked
    temporary file, the daemon's own)."""
    return _membudget.Spool(SPOOL_MEMORY_BYTES)


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


async def opened_file(
    pieces: AsyncGenerator[bytes, None],
) -> tuple[bytes, AsyncGenerator[bytes, None] | None]:
    """A file's first piece, and the rest to stream (None when the first is all).

    What can go wrong with a read (no such file, over the limit) goes wrong
    here, before an answer has started, so it is answered as a typed error.
    """
    try:
        first = await anext(pieces, b"")
        second = await anext(pieces, None)
    except BaseException:
        await pieces.aclose()
        raise
    if second is None:
        await pieces.aclose()
        return first, None

    async def rest() -> AsyncGenerator[bytes, None]:
        try:
            yield second
            async for piece in pieces:
                yield piece
        finally:
            await pieces.aclose()

    return first, rest()


async def _respond(send: Send, status: int, body: bytes, content_type: bytes) -> None:
    headers = [] if status == 204 else [
        (b"content-type", content_type), (b"content-length", str(len(body)).encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, wanted: bytes) -> str | None:
    for name, value in scope["headers"]:
        if name == wanted:
            return str(value.decode("latin-1"))
    return None


def _is_json(scope: Scope) -> bool:
    content_type = _header(scope, b"content-type") or ""
    return content_type.split(";", 1)[0].strip().lower() == "application/json"


class HotRoutes:
    """Answers exec, file read/write and status reads without FastAPI's
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
        handler, sandbox_id = found
        try:
            await handler(daemon, sandbox_id, scope, receive, send)
        except _FallThrough as fall:
            body = fall.args[0] if fall.args else None
            await self.app(scope, receive if body is None else _replaying(body, receive), send)
        except HutchError as exc:
            await _respond(send, exc.http_status, render_json(error_json(exc)),
                           b"application/json")
        except Exception as exc:
            log.exception("unexpected error")
            await _respond(send, 500, render_json(unexpected_error_json(exc)),
                           b"application/json")

    def _handler(self, scope: Scope) -> tuple[_HotHandler, str] | None:
        """The hot handler of the route FastAPI would take, and its sandbox id."""
        probe = dict(scope)  # matching may note things in the scope: not in the real one
        for route, handler in self._route_table():
            match, child = route.matches(probe)
            if match is Match.FULL:
                sandbox_id = (child.get("path_params") or {}).get("sandbox_id")
                if handler is None or not isinstance(sandbox_id, str):
                    return None
                return handler, sandbox_id
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
        await _respond(send, 200, render_json(info), b"application/json")

    async def _exec(
        self, daemon: Daemon, sandbox_id: str, scope: Scope, receive: Receive, send: Send
    ) -> None:
        if not _is_json(scope):
            raise _FallThrough()
        raw = await _read_body(receive)
        if raw is None:
            return
        try:
            body = ExecBody.model_validate_json(raw)
        except ValidationError:
            raise _FallThrough(raw) from None
        sandbox = daemon.session(sandbox_id, self._session(scope))
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
        sandbox = daemon.session(sandbox_id, self._session(scope))
        first, rest = await opened_file(sandbox.read_pieces(path, limit=limit))
        if rest is None:
            await _respond(send, 200, first, b"application/octet-stream")
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
            sandbox = daemon.session(sandbox_id, self._session(scope))
            await sandbox.write_from(path, spool, overwrite=overwrite == "true")
        await _respond(send, 204, b"", b"")


# -- text in request bodies ---------------------------------------------------------------------

#: A JSON escape of a UTF-16 surrogate: the only way a body can carry a lone one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class TextBodiesRoute(APIRoute):
    """A route whose JSON body holds no string a system call refuses (a lone
    surrogate, which JSON can spell and no UTF-8 encodes): ``invalid_argument``
    naming the field, for every route and field at once, before the handler
    or any model sees the body."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            if _is_json(request.scope):
                body = await request.body()  # kept: the handler reads it again
                if _SURROGATE_ESCAPE.search(body):
                    try:
                        data = json.loads(body)
                    except ValueError:
                        data = None  # the handler's own error says what is wrong
                    check_text(data, "", nul=False)
            return await handler(request)

        return checked


# -- the event loop's child watcher --------------------------------------------------------------


def use_pidfd_child_watcher() -> Callable[[], None]:
    """Learn of a child's exit from a pidfd on the loop, not a thread per child.

    Python 3.11's default watcher starts a thread per subprocess that blocks
    in waitpid() and then has to win the GIL back; on a busy daemon that is a
    large share of an exec. 3.12 chooses pidfds itself. Returns what undoes it.
    """
    if sys.version_info >= (3, 12) or not hasattr(os, "pidfd_open"):
        return lambda: None
    try:
        os.close(os.pidfd_open(os.getpid()))  # the kernel may predate pidfds (5.3)
    except OSError:
        return lambda: None
    watcher = asyncio.PidfdChildWatcher()
    watcher.attach_loop(asyncio.get_running_loop())
    asyncio.set_child_watcher(watcher)
    return lambda: asyncio.set_child_watcher(asyncio.ThreadedChildWatcher())


# -- the application ---------------------------------------------------------------------------


class PtyStart(BaseModel):
    """The first message on a terminal's websocket."""

    model_config = ConfigDict(extra="forbid")

    cmd: str | list[str] | None = None
    rows: int = Field(default=24, ge=1, le=999)
    cols: int = Field(default=80, ge=1, le=999)
    cwd: str | None = None
    env: dict[str, str] = {}
    user: str | None = None


def pty_resize(text: str) -> tuple[int, int] | None:
    """``{"resize": [rows, cols]}`` read from a client's message, or None for
    anything else (ignored: a terminal's keystrokes never come as text)."""
    try:
        message = json.loads(text)
    except ValueError:
        return None
    size = message.get("resize") if isinstance(message, dict) else None
    if (isinstance(size, list) and len(size) == 2
            and all(type(n) is int and 0 < n < 1000 for n in size)):
        return size[0], size[1]
    return None


def create_app(
    settings: ServerSettings | None = None,
    *,
    on_ready: Callable[[Daemon], None] | None = None,
    core: Daemon | None = None,
) -> FastAPI:
    """The application; ``on_ready`` is called once the daemon has started.

    ``core``: a daemon core its caller has made and runs (an in-process
    owner serving its sandbox to the holders of its refs, see
    :mod:`hutch.server.owner`); the application answers through it and
    neither starts nor stops it, nor changes anything process-wide.
    """
    settings = settings or ServerSettings()
    # A core given is its caller's to start and stop: the app answers through
    # it at once, with no lifespan of its own (its server runs none).
    holder: dict[str, Daemon] = {} if core is None else {"daemon": core}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if core is not None:
            yield
            return
        restore_watcher = use_pidfd_child_watcher()
        # Providers that keep files on the host keep them under the daemon's data dir.
        os.environ["HUTCH_HOME"] = os.path.abspath(settings.data_dir or default_data_dir())
        # Output and uploads past their memory go to disk there too (not a
        # /tmp that may be memory itself).
        _membudget.configure(settings.memory_budget,
                             os.path.join(os.environ["HUTCH_HOME"], "spool"))
        daemon = Daemon(
            settings.data_dir, sandbox_defaults=settings.sandbox_defaults,
            timeout_ceiling=settings.timeout_ceiling,
            retention_seconds=settings.retention_seconds, policy=settings.policy(),
            definitions=settings.definitions, default_provider=settings.default_provider,
        )
        try:
            await daemon.start()
            holder["daemon"] = daemon
            if on_ready is not None:
                on_ready(daemon)
            yield
        finally:
            holder.pop("daemon", None)
            await daemon.stop()
            restore_watcher()

    app = FastAPI(
        title="hutch", version="1", lifespan=lifespan, default_response_class=JSONResponse,
        description="A self-hosted sandbox manager for AI agents.",
    )

    def daemon() -> Daemon:
        return holder["daemon"]

    def sandbox_for(request: Request, sandbox_id: str) -> Sandbox:
        return daemon().session(sandbox_id, session_of(request.scope))

    @app.exception_handler(HutchError)
    async def hutch_error(_: Request, exc: HutchError) -> JSONResponse:
        return JSONResponse(error_json(exc), status_code=exc.http_status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        details = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        return JSONResponse(error_json(InvalidArgument(details)), status_code=400)

    @app.exception_handler(Exception)
    async def unexpected_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return JSONResponse(unexpected_error_json(exc), status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "invalid_argument", 401: "unauthorized"}.get(
            exc.status_code, "invalid_argument"
        )
        return JSONResponse(
            error_json(error_from_code(code, str(exc.detail))), status_code=exc.status_code
        )

    # Routes are tried in the order they are declared: the busiest come first.
    v1 = APIRouter(prefix="/v1", responses=error_responses(), route_class=TextBodiesRoute)

    # -- exec --
    @v1.post("/sandboxes/{sandbox_id}/exec")
    async def exec_(request: Request, sandbox_id: str, body: ExecBody) -> Response:
        return exec_response(await run_exec(sandbox_for(request, sandbox_id), body))

    # -- files --
    @v1.get("/sandboxes/{sandbox_id}/files")
    async def read_file(
        request: Request, sandbox_id: str, path: str = Query(),
        limit: int = Query(default=DEFAULT_READ_LIMIT, gt=0, le=MAX_READ_LIMIT),
    ) -> Response:
        sandbox = sandbox_for(request, sandbox_id)
        first, rest = await opened_file(sandbox.read_pieces(path, limit=limit))
        if rest is None:
            return Response(first, media_type="application/octet-stream")

        async def whole() -> AsyncIterator[bytes]:
            yield first
            async for piece in rest:
                yield piece

        return StreamingResponse(whole(), media_type="application/octet-stream")

    @v1.put("/sandboxes/{sandbox_id}/files", status_code=204)
    async def write_file(
        request: Request, sandbox_id: str, path: str = Query(),
        overwrite: bool = Query(default=False, description=(
            "Replace an existing file even if this session has not read it "
            "(read_before_write is for agents; a person's copy overwrites).")),
    ) -> Response:
        sandbox = sandbox_for(request, sandbox_id)
        with new_spool() as spool:
            async for piece in request.stream():
                spool.write(piece)
            spool.seek(0)
            await sandbox.write_from(path, spool, overwrite=overwrite)
        return Response(status_code=204)

    @v1.delete("/sandboxes/{sandbox_id}/files", status_code=204)
    async def remove_file(
        request: Request, sandbox_id: str, path: str = Query(), recursive: bool = False
    ) -> Response:
        await sandbox_for(request, sandbox_id).remove(path, recursive=recursive)
        return Response(status_code=204)

    @v1.get("/sandboxes/{sandbox_id}/stat")
    async def stat(request: Request, sandbox_id: str, path: str = Query()) -> JSONResponse:
        return JSONResponse(file_json(await sandbox_for(request, sandbox_id).stat(path)))

    @v1.get("/sandboxes/{sandbox_id}/list")
    async def list_dir(request: Request, sandbox_id: str, path: str = ".") -> JSONResponse:
        entries = await sandbox_for(request, sandbox_id).list_dir(path)
        return JSONResponse({"entries": [file_json(e) for e in entries]})

    @v1.post("/sandboxes/{sandbox_id}/grep")
    async def grep(request: Request, sandbox_id: str, body: GrepBody) -> JSONResponse:
        matches = await sandbox_for(request, sandbox_id).grep(
            body.pattern, body.path, glob=body.glob, ignore_case=body.ignore_case,
            timeout=body.timeout,
        )
        return JSONResponse({"matches": [
            {"path": m.path, "line_number": m.line_number, "line": m.line} for m in matches
        ]})

    @v1.get("/sandboxes/{sandbox_id}/preview_url")
    async def preview_url(
        request: Request, sandbox_id: str, port: int = Query(gt=0, lt=65536)
    ) -> JSONResponse:
        return JSONResponse({"url": await sandbox_for(request, sandbox_id).preview_url(port)})

    @v1.post("/sandboxes/{sandbox_id}/glob")
    async def glob(request: Request, sandbox_id: str, body: GlobBody) -> JSONResponse:
        paths = await sandbox_for(request, sandbox_id).glob(
            body.pattern, body.path, timeout=body.timeout
        )
        return JSONResponse({"paths": paths})

    # -- sandboxes --
    @v1.get("/sandboxes/{sandbox_id}")
    async def get_sandbox(sandbox_id: str) -> JSONResponse:
        return JSONResponse(await daemon().describe(sandbox_id))

    @v1.get("/sandboxes")
    async def list_sandboxes(
        all: bool = Query(default=False, description=(
            "Also list sandboxes that ended (terminated or failed) within the retention "
            "period, with their state and reason."
        )),
    ) -> JSONResponse:
        return JSONResponse({"sandboxes": await daemon().list_infos(include_ended=all)})

    @v1.post("/sandboxes", status_code=201)
    async def create_sandbox(body: dict[str, Any]) -> JSONResponse:
        d = daemon()
        body = dict(body)
        from_snapshot = body.pop("from_snapshot", None)
        if from_snapshot is not None:
            if not isinstance(from_snapshot, str):
                raise InvalidArgument("from_snapshot is a snapshot id (a string)")
            sandbox = await d.create_from_snapshot(from_snapshot, body)
        else:
            sandbox = await d.create_sandbox(d.spec_from_request(body))
        return JSONResponse(await d.info(sandbox), status_code=201)

    # -- sandbox definitions --
    @v1.put("/definitions/{definition_id}")
    async def put_definition(definition_id: str, body: dict[str, Any]) -> JSONResponse:
        d = daemon()
        return JSONResponse(d.definition_json(d.put_definition(definition_id, body)))

    @v1.get("/definitions")
    async def list_definitions() -> JSONResponse:
        d = daemon()
        return JSONResponse(
            {"definitions": [d.definition_json(x) for x in d.definitions.all()]}
        )

    @v1.post("/definitions/{definition_id}/ensure")
    async def ensure(definition_id: str, body: ThreadBody) -> JSONResponse:
        return JSONResponse(await daemon().ensure(definition_id, body.thread_id, body.tenant))

    @v1.post(
        "/definitions/{definition_id}/ensure/stream", response_class=StreamingResponse,
        responses={200: {"description": "NDJSON: steps, setup output, then the result",
                         "content": {"application/x-ndjson": {"schema": {"type": "string"}}}}},
    )
    async def ensure_stream(definition_id: str, body: ThreadBody) -> StreamingResponse:
        """As ensure, told as it goes in NDJSON: ``{"step"}`` as each step
        starts, ``{"output"}`` as setup prints, then ``{"result": <as ensure>}``
        or ``{"error"}``. Output a slow reader cannot take is dropped (the
        steps and the result never are), so the daemon holds a bounded amount."""
        d = daemon()
        d.definitions.get(definition_id)  # a 404 before the 200
        send, receive = anyio.create_memory_object_stream[bytes](ENSURE_STREAM_BUFFER)

        def line(value: Any) -> bytes:
            return json.dumps(value).encode() + b"\n"

        def told(kind: str, text: str) -> None:
            with contextlib.suppress(anyio.WouldBlock):
                send.send_nowait(line({kind: text}))

        async def run() -> None:
            async with send:
                try:
                    answer = await d.ensure(definition_id, body.thread_id, body.tenant,
                                            progress=told)
                    await send.send(line({"result": answer}))
                except HutchError as exc:
                    await send.send(line(error_json(exc)))

        async def events() -> AsyncIterator[bytes]:
            async with anyio.create_task_group() as tg, receive:
                tg.start_soon(run)
                async for chunk in receive:
                    yield chunk

        return StreamingResponse(events(), media_type="application/x-ndjson")

    @v1.post("/definitions/{definition_id}/complete")
    async def complete(definition_id: str, body: ThreadBody) -> JSONResponse:
        destroyed = await daemon().definitions.complete(definition_id, body.thread_id,
                                                        body.tenant)
        return JSONResponse({"destroyed": destroyed})

    # -- snapshots and forks --
    @v1.post("/sandboxes/{sandbox_id}/snapshots", status_code=201)
    async def create_snapshot(sandbox_id: str, body: SnapshotBody | None = None) -> JSONResponse:
        d = daemon()
        body = body or SnapshotBody()
        row = await d.snapshot_sandbox(sandbox_id, body.label, diff=body.diff)
        return JSONResponse(d.snapshot_json(row), status_code=201)

    @v1.post("/sandboxes/{sandbox_id}/fork", status_code=201)
    async def fork(sandbox_id: str, body: ForkBody | None = None) -> JSONResponse:
        d = daemon()
        body = body or ForkBody()
        snapshot, branches = await d.fork_sandbox(
            sandbox_id, body.label, body.count, body.options or {}
        )
        return JSONResponse(
            {"snapshot": d.snapshot_json(snapshot),
             "sandboxes": [await d.info(b) for b in branches]},
            status_code=201,
        )

    @v1.get("/snapshots")
    async def list_snapshots() -> JSONResponse:
        d = daemon()
        return JSONResponse({"snapshots": [d.snapshot_json(r) for r in d.list_snapshots()]})

    @v1.get("/snapshots/{snapshot_id}")
    async def get_snapshot(snapshot_id: str) -> JSONResponse:
        d = daemon()
        return JSONResponse(d.snapshot_json(d.get_snapshot(snapshot_id)))

    @v1.delete("/snapshots/{snapshot_id}", status_code=204, responses={
        200: {"description": "Removed by force from under what needed it: "
                             "`{\"id\", \"broken\": [{\"kind\", \"id\"}]}`"},
    })
    async def delete_snapshot(snapshot_id: str, force: bool = False) -> Response:
        broken = await daemon().delete_snapshot(snapshot_id, force=force)
        if broken:
            # What a forced removal broke, for the caller (the event log says it too).
            return JSONResponse({"id": snapshot_id, "broken": [b.as_dict() for b in broken]})
        return Response(status_code=204)

    @v1.delete("/sandboxes/{sandbox_id}", status_code=204)
    async def delete_sandbox(request: Request, sandbox_id: str) -> Response:
        ref: RefRow | None = request.scope.get(REF_SCOPE_KEY)
        if ref is not None:
            # An attached session leaves; the owner's sandbox stays.
            daemon().detach(ref, sandbox_id, _header(request.scope, SESSION_HEADER.encode()))
        else:
            await daemon().delete_sandbox(sandbox_id)
        return Response(status_code=204)

    @v1.post("/sandboxes/{sandbox_id}/refs", status_code=201)
    async def create_ref(
        request: Request, sandbox_id: str, body: RefBody | None = None
    ) -> JSONResponse:
        answer = await daemon().create_ref(
            sandbox_id, body.expires_in if body else None, str(request.base_url)
        )
        return JSONResponse(answer, status_code=201)

    @v1.delete("/sandboxes/{sandbox_id}/refs/{ref_id}", status_code=204)
    async def revoke_ref(sandbox_id: str, ref_id: str) -> Response:
        await daemon().revoke_ref(sandbox_id, ref_id)
        return Response(status_code=204)

    async def lifecycle(sandbox_id: str, action: str) -> JSONResponse:
        d = daemon()
        sandbox = d.get(sandbox_id)
        await getattr(sandbox, action)()
        return JSONResponse(await d.info(sandbox))

    @v1.post("/sandboxes/{sandbox_id}/pause")
    async def pause(sandbox_id: str) -> JSONResponse:
        return await lifecycle(sandbox_id, "pause")

    @v1.post("/sandboxes/{sandbox_id}/suspend")
    async def suspend(sandbox_id: str) -> JSONResponse:
        return await lifecycle(sandbox_id, "suspend")

    @v1.post("/sandboxes/{sandbox_id}/resume")
    async def resume(sandbox_id: str) -> JSONResponse:
        return await lifecycle(sandbox_id, "resume")

    @v1.post("/sandboxes/{sandbox_id}/set_timeout")
    async def set_timeout(sandbox_id: str, body: SetTimeoutBody) -> JSONResponse:
        deadline = await daemon().set_timeout(sandbox_id, body.timeout_seconds)
        return JSONResponse({"deadline_unix": deadline})

    # The seed-named endpoints other tools already speak.
    @v1.post("/set_timeout")
    async def set_timeout_named(body: SetTimeoutRef) -> JSONResponse:
        deadline = await daemon().set_timeout(body.sandbox, body.timeout_seconds)
        return JSONResponse({"deadline_unix": deadline})

    @v1.post("/pause")
    async def pause_named(body: SandboxRef) -> JSONResponse:
        return await lifecycle(body.sandbox, "pause")

    @v1.post("/resume")
    async def resume_named(body: SandboxRef) -> JSONResponse:
        return await lifecycle(body.sandbox, "resume")

    # -- streams and background commands --
    async def start_process(request: Request, sandbox_id: str, body: ExecBody) -> Process:
        sandbox = sandbox_for(request, sandbox_id)
        return await sandbox.start(
            body.cmd, cwd=body.cwd, env=body.env, stdin=body.stdin_bytes(), user=body.user,
            output_limit=body.output_limit,
        )

    @v1.post("/sandboxes/{sandbox_id}/exec/stream")
    async def exec_stream(request: Request, sandbox_id: str, body: ExecBody) -> StreamingResponse:
        # Started before the response, so that a command that cannot start
        # answers with its error's status rather than a 200 and an error line.
        process = await start_process(request, sandbox_id, body)
        sandbox = daemon().get(sandbox_id)

        async def events() -> AsyncIterator[bytes]:
            try:
                async for line in ndjson(process, body.timeout):
                    yield line
            finally:
                if process.running:
                    await process.kill()
                forget_process(sandbox, process.id)

        return StreamingResponse(events(), media_type="application/x-ndjson")

    @v1.post("/sandboxes/{sandbox_id}/processes", status_code=201)
    async def start(request: Request, sandbox_id: str, body: ExecBody) -> JSONResponse:
        process = await start_process(request, sandbox_id, body)
        return JSONResponse(process_json(process), status_code=201)

    @v1.websocket("/sandboxes/{sandbox_id}/pty")
    async def pty(websocket: WebSocket, sandbox_id: str) -> None:
        """An interactive command (a shell by default) on a pseudo-terminal
        (``hutch shell``, ``Sandbox.pty`` through the SDK).

        The first message is text, :class:`PtyStart` as JSON. Then binary
        messages are bytes: typed ones in, the terminal's out. Text messages
        are JSON: ``{"resize": [rows, cols]}`` in; ``{"exit": code}`` or
        ``{"error": {"code", "message"}}`` out, last, before the close.
        """
        await websocket.accept()
        try:
            try:
                with anyio.fail_after(30):
                    first = await websocket.receive_text()
                start = PtyStart.model_validate_json(first)
            except (ValidationError, TimeoutError, KeyError) as exc:
                raise InvalidArgument(f"a terminal starts with a PtyStart message: {exc}") from None
            sandbox = daemon().get(sandbox_id)
            async with sandbox.pty(
                start.cmd, rows=start.rows, cols=start.cols, cwd=start.cwd, env=start.env,
                user=start.user,
            ) as proc, anyio.create_task_group() as tg:

                async def typed() -> None:
                    while True:
                        message = await websocket.receive()
                        if message["type"] == "websocket.disconnect":
                            tg.cancel_scope.cancel()
                            return
                        if message.get("bytes"):
                            await proc.write(message["bytes"])
                        elif message.get("text"):
                            size = pty_resize(message["text"])
                            if size is not None:
                                await proc.resize(*size)

                tg.start_soon(typed)
                while (chunk := await proc.read()) is not None:
                    await websocket.send_bytes(chunk.data)
                await websocket.send_text(json.dumps({"exit": await proc.wait()}))
                tg.cancel_scope.cancel()
            await websocket.close()
        except WebSocketDisconnect:
            return
        except HutchError as exc:
            with contextlib.suppress(Exception):
                await websocket.send_text(json.dumps(error_json(exc)))
                await websocket.close(code=1011)

    @v1.get("/sandboxes/{sandbox_id}/processes")
    async def processes(sandbox_id: str) -> JSONResponse:
        sandbox = daemon().get(sandbox_id)
        return JSONResponse({"processes": [process_json(p) for p in sandbox.processes()]})

    @v1.get("/sandboxes/{sandbox_id}/processes/{process_id}")
    async def process(sandbox_id: str, process_id: str) -> JSONResponse:
        return JSONResponse(process_json(daemon().get(sandbox_id).process(process_id)))

    @v1.post("/sandboxes/{sandbox_id}/processes/{process_id}/wait")
    async def wait(sandbox_id: str, process_id: str, body: WaitBody) -> Response:
        process = daemon().get(sandbox_id).process(process_id)
        return exec_response(await wait_output(process, timeout=body.timeout))

    @v1.get("/sandboxes/{sandbox_id}/processes/{process_id}/stream")
    async def process_stream(sandbox_id: str, process_id: str) -> StreamingResponse:
        proc = daemon().get(sandbox_id).process(process_id)
        return StreamingResponse(ndjson(proc, None), media_type="application/x-ndjson")

    @v1.post("/sandboxes/{sandbox_id}/processes/{process_id}/kill", status_code=204)
    async def kill(sandbox_id: str, process_id: str) -> Response:
        await daemon().get(sandbox_id).process(process_id).kill()
        return Response(status_code=204)

    # -- workspaces --
    @v1.get("/workspaces")
    async def list_workspaces() -> JSONResponse:
        d = daemon()
        return JSONResponse({"workspaces": [d.workspace_json(w) for w in d.list_workspaces()]})

    @v1.post("/workspaces", status_code=201)
    async def create_workspace(body: dict[str, Any]) -> JSONResponse:
        d = daemon()
        row = await d.create_workspace(body)
        return JSONResponse(d.workspace_json(row), status_code=201)

    @v1.get("/workspaces/{name}")
    async def get_workspace(name: str) -> JSONResponse:
        d = daemon()
        return JSONResponse(d.workspace_json(d.get_workspace(name)))

    @v1.delete("/workspaces/{name}", status_code=204)
    async def delete_workspace(name: str) -> Response:
        await daemon().delete_workspace(name)
        return Response(status_code=204)

    @v1.post("/workspaces/{name}/suspend")
    async def suspend_workspace(
        name: str, body: WorkspaceSuspendBody | None = None
    ) -> JSONResponse:
        d = daemon()
        row = await d.suspend_workspace(name, diff=bool(body and body.diff))
        return JSONResponse(d.workspace_json(row))

    @v1.post("/workspaces/{name}/resume")
    async def resume_workspace(name: str) -> JSONResponse:
        d = daemon()
        return JSONResponse(d.workspace_json(await d.resume_workspace(name)))

    @v1.get("/events")
    async def events(
        subject: str | None = None, limit: int = Query(default=100, gt=0, le=MAX_EVENTS)
    ) -> JSONResponse:
        return JSONResponse({"events": daemon().store.events(subject, limit)})

    app.include_router(v1)

    @app.get("/healthz", responses={401: error_responses()[401]})
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    # The last added is the outermost: the token is checked before the fast path.
    app.add_middleware(
        HotRoutes, daemon=lambda: holder.get("daemon"), routes=lambda: app.router.routes,
        hot={exec_: "_exec", read_file: "_read", write_file: "_write", get_sandbox: "_status"},
    )
    app.add_middleware(BodyBudget)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(CancelOnDisconnect)
    app.add_middleware(TokenAuth, token=settings.token, daemon=lambda: holder.get("daemon"))
    return app
