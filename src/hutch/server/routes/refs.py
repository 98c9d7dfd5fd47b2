"""Refs: a sandbox handed to others, and taken back."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from ... import wire
from ..bodies import RefBody
from . import DaemonGetter, v1_router


def router(daemon: DaemonGetter) -> APIRouter:
    v1 = v1_router()

    @v1.post("/sandboxes/{sandbox_id}/refs", status_code=201, response_model=wire.RefHandedOut)
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

    return v1
