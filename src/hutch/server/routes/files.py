"""A sandbox's files: read, write, remove, stat, list, grep, glob; and its preview URLs."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from ... import wire
from ..._types import DEFAULT_READ_LIMIT, MAX_READ_LIMIT
from ..bodies import GlobBody, GrepBody, MkdirBody, RenameBody
from ..streaming import FILE_BYTES, file_json, new_spool, opened_file
from . import DaemonGetter, session_sandbox, v1_router


def router(daemon: DaemonGetter) -> APIRouter:
    v1 = v1_router()

    @v1.get("/sandboxes/{sandbox_id}/files", **FILE_BYTES)
    async def read_file(
        request: Request, sandbox_id: str, path: str = Query(),
        limit: int = Query(default=DEFAULT_READ_LIMIT, gt=0, le=MAX_READ_LIMIT),
    ) -> Response:
        sandbox = await session_sandbox(daemon(), request, sandbox_id)
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
        sandbox = await session_sandbox(daemon(), request, sandbox_id)
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
        sandbox = await session_sandbox(daemon(), request, sandbox_id)
        await sandbox.remove(path, recursive=recursive)
        return Response(status_code=204)

    @v1.post("/sandboxes/{sandbox_id}/mkdir", status_code=204)
    async def mkdir(request: Request, sandbox_id: str, body: MkdirBody) -> Response:
        """Make a directory (``parents``: and its missing parents; ``exist_ok``:
        one already there is no error)."""
        sandbox = await session_sandbox(daemon(), request, sandbox_id)
        await sandbox.mkdir(
            body.path, parents=body.parents, exist_ok=body.exist_ok)
        return Response(status_code=204)

    @v1.post("/sandboxes/{sandbox_id}/rename", status_code=204)
    async def rename(request: Request, sandbox_id: str, body: RenameBody) -> Response:
        """Move a file or a directory inside the sandbox (``overwrite``: replace
        what is at the destination, as rename(2) does)."""
        sandbox = await session_sandbox(daemon(), request, sandbox_id)
        await sandbox.rename(
            body.source, body.destination, overwrite=body.overwrite)
        return Response(status_code=204)

    @v1.get("/sandboxes/{sandbox_id}/stat", response_model=wire.FileStat)
    async def stat(request: Request, sandbox_id: str, path: str = Query()) -> JSONResponse:
        info = await (await session_sandbox(daemon(), request, sandbox_id)).stat(path)
        return JSONResponse(file_json(info))

    @v1.get("/sandboxes/{sandbox_id}/list", response_model=wire.FileList)
    async def list_dir(request: Request, sandbox_id: str, path: str = ".") -> JSONResponse:
        entries = await (await session_sandbox(daemon(), request, sandbox_id)).list_dir(path)
        return JSONResponse({"entries": [file_json(e) for e in entries]})

    @v1.post("/sandboxes/{sandbox_id}/grep", response_model=wire.GrepAnswer)
    async def grep(request: Request, sandbox_id: str, body: GrepBody) -> JSONResponse:
        matches = await (await session_sandbox(daemon(), request, sandbox_id)).grep(
            body.pattern, body.path, glob=body.glob, ignore_case=body.ignore_case,
            timeout=body.timeout,
        )
        return JSONResponse({"matches": [
            {"path": m.path, "line_number": m.line_number, "line": m.line} for m in matches
        ]})

    @v1.get("/sandboxes/{sandbox_id}/preview_url", response_model=wire.PreviewUrl)
    async def preview_url(
        request: Request, sandbox_id: str, port: int = Query(gt=0, lt=65536)
    ) -> JSONResponse:
        url = await (await session_sandbox(daemon(), request, sandbox_id)).preview_url(port)
        return JSONResponse({"url": url})

    @v1.post("/sandboxes/{sandbox_id}/glob", response_model=wire.GlobAnswer)
    async def glob(request: Request, sandbox_id: str, body: GlobBody) -> JSONResponse:
        paths = await (await session_sandbox(daemon(), request, sandbox_id)).glob(
            body.pattern, body.path, timeout=body.timeout
        )
        return JSONResponse({"paths": paths})

    return v1
