"""Warm pools: list, read, set, remove (see hutch.daemon.pools)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from ... import wire
from . import DaemonGetter, v1_router


def router(daemon: DaemonGetter) -> APIRouter:
    v1 = v1_router()

    @v1.get("/pools", response_model=wire.PoolList)
    async def list_pools() -> JSONResponse:
        return JSONResponse({"pools": daemon().list_pools()})

    @v1.get("/pools/{name}", response_model=wire.Pool)
    async def get_pool(name: str) -> JSONResponse:
        return JSONResponse(daemon().get_pool(name))

    @v1.put("/pools/{name}", response_model=wire.Pool)
    async def set_pool(name: str, body: wire.PoolBody) -> JSONResponse:
        """Make or resize a pool; new settings drop the sandboxes it kept."""
        return JSONResponse(await daemon().set_pool(name, body.settings, body.size))

    @v1.delete("/pools/{name}", status_code=204)
    async def remove_pool(name: str) -> Response:
        await daemon().remove_pool(name)
        return Response(status_code=204)

    return v1
