"""envd's plain HTTP routes: ``GET /files`` (a file's bytes), ``POST /files``
(one or several files up, as multipart parts or one octet-stream body,
gzipped or not) and ``GET /health``."""

from __future__ import annotations

import posixpath
import zlib
from collections.abc import AsyncIterator
from typing import IO, Any

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ...._errors import (
    HutchError,
    InvalidArgument,
    NotFound,
    OutputLimitExceeded,
    ResourceExhausted,
    SandboxExpired,
    SandboxUnavailable,
)
from ...._sandbox import Sandbox
from ...._types import MAX_READ_LIMIT
from ....states import FINAL, HELD
from ...asgi import render_json
from ...streaming import new_spool, opened_file
from .calls import user_of
from .connect import ConnectError
from .ownership import hand_over, missing_parents
from .watch import WatchHub

#: Files one multipart upload may carry.
MAX_UPLOAD_FILES = 1000

#: The most a gzipped upload may inflate to.
MAX_INFLATED_BYTES = MAX_READ_LIMIT


def error_response(status: int, message: str) -> Response:
    """An error of the plain routes, as envd answers it: ``{"code", "message"}``."""
    return Response(render_json({"code": status, "message": message}), status_code=status,
                    media_type="application/json")


def gone_response(sandbox_id: str, why: str = "") -> Response:
    """A sandbox that is no more: 502 with the words the SDKs look for."""
    return error_response(502, f"The sandbox {sandbox_id} was not found{why}")


def hutch_error_response(exc: HutchError) -> Response:
    if isinstance(exc, NotFound | SandboxExpired | SandboxUnavailable):
        return error_response(502, f"{exc.message} (the sandbox was not found)")
    if isinstance(exc, FileNotFoundError):
        return error_response(404, exc.message)
    if isinstance(exc, IsADirectoryError | InvalidArgument):
        return error_response(400, exc.message)
    if isinstance(exc, OutputLimitExceeded | ResourceExhausted):
        return error_response(429 if isinstance(exc, ResourceExhausted) else 400, exc.message)
    return error_response(exc.http_status, exc.message)


async def health(sandbox: Sandbox) -> Response:
    """204 while the sandbox runs; 502 once it has ended or is held (paused,
    suspended), as E2B's proxy answers for a sandbox it cannot reach. A
    read of its state: it resumes nothing."""
    state = sandbox.state
    if state in FINAL or state in HELD:
        return gone_response(sandbox.id, f" ({state.value})")
    return Response(status_code=204)


def _wants_gzip(request: Request) -> bool:
    """Whether the caller asked for gzip itself: the SDKs send
    ``Accept-Encoding: gzip`` alone when told to (``gzip=True``); an HTTP
    client's default list (``gzip, deflate, ...``) is not a request to spend
    the daemon's CPU on it."""
    accepted = [part.split(";")[0].strip().lower()
                for part in request.headers.get("accept-encoding", "").split(",") if part.strip()]
    return accepted == ["gzip"]


async def read_file(request: Request, sandbox: Sandbox) -> Response:
    path = request.query_params.get("path")
    if not path:
        return error_response(400, "path is required")
    try:
        first, rest = await opened_file(sandbox.read_pieces(path, limit=MAX_READ_LIMIT))
    except HutchError as exc:
        return hutch_error_response(exc)
    if _wants_gzip(request):
        async def gzipped() -> AsyncIterator[bytes]:
            packer = zlib.compressobj(wbits=31)
            yield packer.compress(first)
            if rest is not None:
                async for piece in rest:
                    yield packer.compress(piece)
            yield packer.flush()

        return StreamingResponse(gzipped(), media_type="application/octet-stream",
                                 headers={"content-encoding": "gzip"})
    if rest is None:
        return Response(first, media_type="application/octet-stream")

    async def whole() -> AsyncIterator[bytes]:
        yield first
        async for piece in rest:
            yield piece

    return StreamingResponse(whole(), media_type="application/octet-stream")


class Writer:
    """Where an upload's files go: each written, given to the user the
    upload names (``username``, or a Basic authorization) with the
    directories made for it, and told to the watches."""

    def __init__(self, request: Request, sandbox: Sandbox, hub: WatchHub) -> None:
        self.sandbox = sandbox
        self.hub = hub
        self.user = request.query_params.get("username") or user_of(request.scope)

    async def write(self, path: str, source: IO[bytes]) -> dict[str, Any]:
        full = self.sandbox.path(path)
        made = await missing_parents(self.sandbox, full) if self.user else []
        await self.sandbox.write_from(full, source, overwrite=True)
        await hand_over(self.sandbox, self.user, [*made, full])
        await self.hub.wrote(self.sandbox, full)
        return {"name": posixpath.basename(full), "type": "file", "path": full}


async def write_files(request: Request, sandbox: Sandbox, hub: WatchHub) -> Response:
    path = request.query_params.get("path") or None
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    try:
        writer = Writer(request, sandbox, hub)
        if content_type == "multipart/form-data":
            return await _write_parts(request, writer, path)
        if path is None:
            return error_response(400, "path is required for an octet-stream upload")
        written = await _write_body(request, writer, path)
        return Response(render_json([written]), media_type="application/json")
    except ConnectError as exc:
        return error_response(exc.http_status, exc.message)
    except HutchError as exc:
        return hutch_error_response(exc)


async def _write_body(request: Request, writer: Writer, path: str) -> dict[str, Any]:
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity", "gzip"):
        raise InvalidArgument(f"Content-Encoding {encoding!r} is not taken (gzip is)")
    unpacker = zlib.decompressobj(wbits=31) if encoding == "gzip" else None
    with new_spool() as spool:
        size = 0
        async for piece in request.stream():
            if unpacker is not None:
                try:
                    piece = unpacker.decompress(piece, MAX_INFLATED_BYTES + 1 - size)
                except zlib.error as exc:
                    raise InvalidArgument(f"the upload is not valid gzip: {exc}") from None
            size += len(piece)
            if size > MAX_INFLATED_BYTES:
                raise OutputLimitExceeded(
                    f"the upload inflates past the limit of {MAX_INFLATED_BYTES} bytes"
                )
            spool.write(piece)
        if unpacker is not None and not unpacker.eof:
            raise InvalidArgument("the gzipped upload ends before its end")
        spool.seek(0)
        return await writer.write(path, spool)


async def _write_parts(request: Request, writer: Writer, path: str | None) -> Response:
    async with request.form(max_files=MAX_UPLOAD_FILES) as form:
        uploads = [value for _, value in form.multi_items() if isinstance(value, UploadFile)]
        if not uploads:
            return error_response(400, "the upload holds no file part")
        written = []
        for upload in uploads:
            # One file goes to ``path`` when it is given; several each to
            # their part's file name (the SDKs put the whole path there).
            target = path if path is not None and len(uploads) == 1 else upload.filename
            if not target:
                return error_response(400, "a file part has no file name to write it to")
            written.append(await writer.write(target, upload.file))
    return Response(render_json(written), media_type="application/json")
