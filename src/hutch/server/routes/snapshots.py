"""Snapshots and forks."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from ... import wire
from ..bodies import ForkBody, SnapshotBody
from . import DaemonGetter, v1_router


def router(daemon: DaemonGetter) -> APIRouter:
    v1 = v1_router()

    @v1.post("/sandboxes/{sandbox_id}/snapshots", status_code=201,
             response_model=wire.SnapshotInfo)
    async def create_snapshot(sandbox_id: str, body: SnapshotBody | None = None) -> JSONResponse:
        d = daemon()
        body = body or SnapshotBody()
        row = await d.snapshot_sandbox(sandbox_id, body.label, diff=body.diff)
        return JSONResponse(d.snapshot_json(row), status_code=201)

    @v1.post("/sandboxes/{sandbox_id}/fork", status_code=201, response_model=wire.ForkAnswer)
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

    @v1.get("/snapshots", response_model=wire.SnapshotList)
    async def list_snapshots() -> JSONResponse:
        d = daemon()
        return JSONResponse({"snapshots": [d.snapshot_json(r) for r in await d.list_snapshots()]})

    @v1.get("/snapshots/{snapshot_id}", response_model=wire.SnapshotInfo)
    async def get_snapshot(snapshot_id: str) -> JSONResponse:
        d = daemon()
        return JSONResponse(d.snapshot_json(await d.get_snapshot(snapshot_id)))

    @v1.delete("/snapshots/{snapshot_id}", status_code=204, responses={
        200: {"model": wire.ForcedRemoval,
              "description": "Removed by force from under what needed it"},
    })
    async def delete_snapshot(snapshot_id: str, force: bool = False) -> Response:
        broken = await daemon().delete_snapshot(snapshot_id, force=force)
        if broken:
            # What a forced removal broke, for the caller (the event log says it too).
            return JSONResponse({"id": snapshot_id, "broken": [b.as_dict() for b in broken]})
        return Response(status_code=204)

    return v1
