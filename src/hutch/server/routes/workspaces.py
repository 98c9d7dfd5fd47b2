"""Workspaces: a sandbox's working state kept by name."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from ... import wire
from ..bodies import WorkspaceSuspendBody
from . import DaemonGetter, v1_router


def router(daemon: DaemonGetter) -> APIRouter:
    v1 = v1_router()

    @v1.get("/workspaces", response_model=wire.WorkspaceList)
    async def list_workspaces() -> JSONResponse:
        d = daemon()
        rows = await d.list_workspaces()
        return JSONResponse({"workspaces": [d.workspace_json(w) for w in rows]})

    @v1.post("/workspaces", status_code=201, response_model=wire.WorkspaceInfo)
    async def create_workspace(body: dict[str, Any]) -> JSONResponse:
        d = daemon()
        row = await d.create_workspace(body)
        return JSONResponse(d.workspace_json(row), status_code=201)

    @v1.get("/workspaces/{name}", response_model=wire.WorkspaceInfo)
    async def get_workspace(name: str) -> JSONResponse:
        d = daemon()
        return JSONResponse(d.workspace_json(await d.get_workspace(name)))

    @v1.delete("/workspaces/{name}", status_code=204)
    async def delete_workspace(name: str) -> Response:
        await daemon().delete_workspace(name)
        return Response(status_code=204)

    @v1.post("/workspaces/{name}/suspend", response_model=wire.WorkspaceInfo)
    async def suspend_workspace(
        name: str, body: WorkspaceSuspendBody | None = None
    ) -> JSONResponse:
        d = daemon()
        row = await d.suspend_workspace(name, diff=bool(body and body.diff))
        return JSONResponse(d.workspace_json(row))

    @v1.post("/workspaces/{name}/resume", response_model=wire.WorkspaceInfo)
    async def resume_workspace(name: str) -> JSONResponse:
        d = daemon()
        return JSONResponse(d.workspace_json(await d.resume_workspace(name)))

    return v1
