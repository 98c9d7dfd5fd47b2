"""Background processes and streamed exec: started, listed, waited on, streamed, killed."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from ... import wire
from ..._process import Process, wait_output
from ..._sandbox import forget_process
from ..bodies import ExecBody, StartBody, WaitBody
from ..streaming import NDJSON_LINES, exec_response, ndjson, process_json
from . import DaemonGetter, session_sandbox, v1_router


def router(daemon: DaemonGetter) -> APIRouter:
    v1 = v1_router()

    async def start_process(
        request: Request, sandbox_id: str, body: ExecBody, *, keep_stdin: bool = False
    ) -> Process:
        sandbox = await session_sandbox(daemon(), request, sandbox_id)
        return await sandbox.start(
            body.cmd, cwd=body.cwd, env=body.env, stdin=body.stdin_bytes(), user=body.user,
            output_limit=body.output_limit, keep_stdin=keep_stdin,
        )

    @v1.post("/sandboxes/{sandbox_id}/exec/stream", **NDJSON_LINES)
    async def exec_stream(request: Request, sandbox_id: str, body: ExecBody) -> StreamingResponse:
        # Started before the response, so that a command that cannot start
        # answers with its error's status rather than a 200 and an error line.
        process = await start_process(request, sandbox_id, body)
        sandbox = await daemon().get(sandbox_id)

        async def events() -> AsyncIterator[bytes]:
            try:
                async for line in ndjson(process, body.timeout):
                    yield line
            finally:
                if process.running:
                    await process.kill()
                forget_process(sandbox, process.id)

        return StreamingResponse(events(), media_type="application/x-ndjson")

    @v1.post("/sandboxes/{sandbox_id}/processes", status_code=201,
             response_model=wire.ProcessInfo)
    async def start(request: Request, sandbox_id: str, body: StartBody) -> JSONResponse:
        process = await start_process(request, sandbox_id, body, keep_stdin=body.keep_stdin)
        return JSONResponse(process_json(process), status_code=201)

    @v1.get("/sandboxes/{sandbox_id}/processes", response_model=wire.ProcessList)
    async def processes(sandbox_id: str) -> JSONResponse:
        sandbox = await daemon().get(sandbox_id)
        return JSONResponse({"processes": [process_json(p) for p in sandbox.processes()]})

    @v1.get("/sandboxes/{sandbox_id}/processes/{process_id}", response_model=wire.ProcessInfo)
    async def process(sandbox_id: str, process_id: str) -> JSONResponse:
        return JSONResponse(process_json((await daemon().get(sandbox_id)).process(process_id)))

    @v1.post("/sandboxes/{sandbox_id}/processes/{process_id}/wait",
             response_model=wire.ExecAnswer)
    async def wait(sandbox_id: str, process_id: str, body: WaitBody) -> Response:
        process = (await daemon().get(sandbox_id)).process(process_id)
        return exec_response(await wait_output(process, timeout=body.timeout))

    @v1.get("/sandboxes/{sandbox_id}/processes/{process_id}/stream", **NDJSON_LINES)
    async def process_stream(sandbox_id: str, process_id: str) -> StreamingResponse:
        proc = (await daemon().get(sandbox_id)).process(process_id)
        return StreamingResponse(ndjson(proc, None), media_type="application/x-ndjson")

    @v1.post("/sandboxes/{sandbox_id}/processes/{process_id}/kill", status_code=204)
    async def kill(sandbox_id: str, process_id: str) -> Response:
        await (await daemon().get(sandbox_id)).process(process_id).kill()
        return Response(status_code=204)

    @v1.post("/sandboxes/{sandbox_id}/processes/{process_id}/stdin", status_code=204,
             openapi_extra=STDIN_BYTES)
    async def write_stdin(request: Request, sandbox_id: str, process_id: str) -> Response:
        """The request's body (bytes) written to the command's stdin, kept
        open at its start (``keep_stdin``); answered once its pipe took them."""
        process = (await daemon().get(sandbox_id)).process(process_id)
        await process.write_stdin(await request.body())
        return Response(status_code=204)

    @v1.delete("/sandboxes/{sandbox_id}/processes/{process_id}/stdin", status_code=204)
    async def close_stdin(sandbox_id: str, process_id: str) -> Response:
        """Close the command's stdin: it reads its end of file."""
        await (await daemon().get(sandbox_id)).process(process_id).close_stdin()
        return Response(status_code=204)

    return v1


#: The stdin route's body in the OpenAPI document: the bytes, as they are.
STDIN_BYTES = {"requestBody": {"required": True, "content": {
    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}
