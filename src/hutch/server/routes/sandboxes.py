"""Sandboxes: read, list, create, remove; pause, suspend, resume, timeouts."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse

from ... import wire
from ..._errors import InvalidArgument
from ...store import RefRow
from ..asgi import header
from ..bodies import SandboxRef, SetTimeoutBody, SetTimeoutRef
from ..middleware import REF_SCOPE_KEY, SESSION_HEADER
from . import DaemonGetter, v1_router


def router(daemon: DaemonGetter) -> APIRouter:
    v1 = v1_router()

    @v1.get("/sandboxes/{sandbox_id}", response_model=wire.SandboxInfo)
    async def get_sandbox(sandbox_id: str) -> JSONResponse:
        return JSONResponse(await daemon().describe(sandbox_id))

    @v1.get("/sandboxes/{sandbox_id}/meters", response_model=wire.MeterHistory)
    async def meter_history(sandbox_id: str) -> JSONResponse:
        return JSONResponse(await daemon().meter_history(sandbox_id))

    @v1.get("/sandboxes", response_model=wire.SandboxList)
    async def list_sandboxes(
        all: bool = Query(default=False, description=(
            "Also list sandboxes that ended (terminated or failed) within the retention "
            "period, with their state and reason."
        )),
    ) -> JSONResponse:
        return JSONResponse({"sandboxes": await daemon().list_infos(include_ended=all)})

    @v1.post("/sandboxes", status_code=201, response_model=wire.SandboxInfo)
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

    @v1.delete("/sandboxes/{sandbox_id}", status_code=204)
    async def delete_sandbox(request: Request, sandbox_id: str) -> Response:
        ref: RefRow | None = request.scope.get(REF_SCOPE_KEY)
        if ref is not None:
            # An attached session leaves; the owner's sandbox stays.
            await daemon().detach(ref, sandbox_id, header(request.scope, SESSION_HEADER.encode()))
        else:
            await daemon().delete_sandbox(sandbox_id)
        return Response(status_code=204)

    async def lifecycle(sandbox_id: str, action: str) -> JSONResponse:
        d = daemon()
        sandbox = await d.get(sandbox_id)
        await getattr(sandbox, action)()
        return JSONResponse(await d.info(sandbox))

    @v1.post("/sandboxes/{sandbox_id}/pause", response_model=wire.SandboxInfo)
    async def pause(sandbox_id: str) -> JSONResponse:
        return await lifecycle(sandbox_id, "pause")

    @v1.post("/sandboxes/{sandbox_id}/suspend", response_model=wire.SandboxInfo)
    async def suspend(sandbox_id: str) -> JSONResponse:
        return await lifecycle(sandbox_id, "suspend")

    @v1.post("/sandboxes/{sandbox_id}/resume", response_model=wire.SandboxInfo)
    async def resume(sandbox_id: str) -> JSONResponse:
        return await lifecycle(sandbox_id, "resume")

    @v1.post("/sandboxes/{sandbox_id}/set_timeout", response_model=wire.Deadline)
    async def set_timeout(sandbox_id: str, body: SetTimeoutBody) -> JSONResponse:
        deadline = await daemon().set_timeout(sandbox_id, body.timeout_seconds)
        return JSONResponse({"deadline_unix": deadline})

    # The seed-named endpoints other tools already speak.
    @v1.post("/set_timeout", response_model=wire.Deadline)
    async def set_timeout_named(body: SetTimeoutRef) -> JSONResponse:
        deadline = await daemon().set_timeout(body.sandbox, body.timeout_seconds)
        return JSONResponse({"deadline_unix": deadline})

    @v1.post("/pause", response_model=wire.SandboxInfo)
    async def pause_named(body: SandboxRef) -> JSONResponse:
        return await lifecycle(body.sandbox, "pause")

    @v1.post("/resume", response_model=wire.SandboxInfo)
    async def resume_named(body: SandboxRef) -> JSONResponse:
        return await lifecycle(body.sandbox, "resume")

    return v1
