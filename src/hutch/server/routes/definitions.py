"""Sandbox definitions: put, list, ensure (whole or streamed), complete."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ... import wire
from ..._errors import HutchError
from ...daemon.fleet import ServedElsewhere
from ...definitions.model import Definition
from ..bodies import ENSURE_STREAM_BUFFER, ThreadBody
from ..errors import error_json
from ..forward import call_owner, stream_owner
from ..streaming import ndjson_lines
from . import DaemonGetter, v1_router


def router(daemon: DaemonGetter) -> APIRouter:
    v1 = v1_router()

    @v1.put("/definitions/{definition_id}", response_model=Definition)
    async def put_definition(definition_id: str, body: dict[str, Any]) -> JSONResponse:
        d = daemon()
        return JSONResponse(d.definition_json(await d.put_definition(definition_id, body)))

    @v1.get("/definitions", response_model=wire.DefinitionList)
    async def list_definitions() -> JSONResponse:
        d = daemon()
        return JSONResponse(
            {"definitions": [d.definition_json(x) for x in await d.definitions.listed()]}
        )

    @v1.post("/definitions/{definition_id}/ensure", response_model=wire.EnsureAnswer)
    async def ensure(definition_id: str, body: ThreadBody, request: Request) -> Response:
        d = daemon()
        try:
            return JSONResponse(await d.ensure(definition_id, body.thread_id, body.tenant))
        except ServedElsewhere as elsewhere:
            # The thread's sandbox is another daemon's of the fleet: it ensures.
            answer = await call_owner(request.scope["headers"], d.daemon_id or "",
                                      elsewhere.url + request.url.path,
                                      body.model_dump_json().encode())
            return Response(answer.content, status_code=answer.status_code,
                            media_type=answer.headers.get("content-type"))

    @v1.post(
        "/definitions/{definition_id}/ensure/stream",
        **ndjson_lines(wire.EnsureLine, "NDJSON: steps, setup output, then the result"),
    )
    async def ensure_stream(
        definition_id: str, body: ThreadBody, request: Request
    ) -> StreamingResponse:
        """As ensure, told as it goes in NDJSON: ``{"step"}`` as each step
        starts, ``{"output"}`` as setup prints, then ``{"result": <as ensure>}``
        or ``{"error"}``. Output a slow reader cannot take is dropped (the
        steps and the result never are), so the daemon holds a bounded amount."""
        d = daemon()
        await d.definitions.find(definition_id)  # a 404 before the 200
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
                except ServedElsewhere as elsewhere:
                    # The thread's sandbox is another daemon's: its lines, as they come.
                    async for chunk in stream_owner(
                            request.scope["headers"], d.daemon_id or "",
                            elsewhere.url + request.url.path, body.model_dump_json().encode()):
                        await send.send(chunk)

        async def events() -> AsyncIterator[bytes]:
            async with anyio.create_task_group() as tg, receive:
                tg.start_soon(run)
                async for chunk in receive:
                    yield chunk

        return StreamingResponse(events(), media_type="application/x-ndjson")

    @v1.post("/definitions/{definition_id}/complete", response_model=wire.Completed)
    async def complete(definition_id: str, body: ThreadBody, request: Request) -> Response:
        d = daemon()
        try:
            destroyed = await d.definitions.complete(definition_id, body.thread_id, body.tenant)
        except ServedElsewhere as elsewhere:
            # The thread's sandbox is another daemon's of the fleet: it ends it.
            answer = await call_owner(request.scope["headers"], d.daemon_id or "",
                                      elsewhere.url + request.url.path,
                                      body.model_dump_json().encode())
            return Response(answer.content, status_code=answer.status_code,
                            media_type=answer.headers.get("content-type"))
        return JSONResponse({"destroyed": destroyed})

    return v1
