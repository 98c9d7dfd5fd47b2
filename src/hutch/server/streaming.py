"""Answers written as the daemon's wire has them: exec results whole or in
pieces from their spool, NDJSON event lines, files in pieces."""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Iterator,
)
from typing import IO, Any

import anyio
from fastapi import Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from .. import _membudget, wire
from .._errors import (
    ExecTimeout,
    HutchError,
)
from .._process import ExecOutput, Process, Stream
from .._sandbox import Sandbox, exec_output
from .._types import (
    ExecResult,
    ExitStatus,
    FileInfo,
    OutputChunk,
)
from ..core.commands import ExecCall
from .asgi import Send, render_json, respond
from .bodies import ExecBody
from .errors import error_json, error_responses

log = logging.getLogger("hutch.server")

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
            await respond(send, 200, render_json(exec_json(output.result())),
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
            "command": process.command, "stdin_open": process.stdin_open}


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
    return await exec_output(sandbox, ExecCall(
        body.cmd, cwd=body.cwd, env=body.env, stdin=body.stdin_bytes(), user=body.user,
        timeout=body.timeout, output_limit=body.output_limit,
    ))



#: Request body a spool keeps in memory; past it, the rest is on disk.
SPOOL_MEMORY_BYTES = 1024 * 1024


def new_spool() -> IO[bytes]:
    """Where an upload lands as it arrives: memory for a small one, disk past
    :data:`SPOOL_MEMORY_BYTES` or once the memory budget says so (an unlinked
    temporary file, the daemon's own)."""
    return _membudget.Spool(SPOOL_MEMORY_BYTES)




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





# -- how the OpenAPI document tells the answers that are not one JSON body -------------------


class NDJSONLines(JSONResponse):
    """The response class a route that answers NDJSON declares, so that the
    OpenAPI document gives its lines' model under ``application/x-ndjson``;
    the route itself answers with a :class:`StreamingResponse` of them."""

    media_type = "application/x-ndjson"


class FileBytes(Response):
    """The response class of a file's bytes, for the OpenAPI document."""

    media_type = "application/octet-stream"


def ndjson_lines(line: type[BaseModel], description: str) -> dict[str, Any]:
    """A route's arguments for an answer of NDJSON lines of ``line``. Its
    errors (before the stream starts) are JSON: referred to by hand, since
    FastAPI gives an error model the route's own media type."""
    return {
        "response_class": NDJSONLines, "response_model": line,
        "response_description": description, "responses": error_responses(by_ref=True),
    }


#: A route's arguments for an answer of a stream's events.
NDJSON_LINES = ndjson_lines(
    wire.StreamLine, "NDJSON, a line an event: output, then the exit (or an error)"
)

#: A route's arguments for an answer of a file's bytes.
FILE_BYTES: dict[str, Any] = {
    "response_class": FileBytes, "response_description": "the file's bytes",
    "responses": {**error_responses(by_ref=True), 200: {"content": {"application/octet-stream": {
        "schema": {"type": "string", "format": "binary"}}}}},
}
