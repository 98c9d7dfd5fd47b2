"""The daemon itself: its event log, and whether it answers."""

from __future__ import annotations

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from ... import wire
from ..bodies import MAX_EVENTS
from ..errors import error_responses
from . import DaemonGetter, v1_router


def router(daemon: DaemonGetter) -> APIRouter:
    v1 = v1_router()

    @v1.get("/events", response_model=wire.EventList)
    async def events(
        subject: str | None = None, limit: int = Query(default=100, gt=0, le=MAX_EVENTS)
    ) -> JSONResponse:
        return JSONResponse({"events": daemon().store.events(subject, limit)})

    return v1


def health_router() -> APIRouter:
    root = APIRouter()

    @root.get("/healthz", response_model=wire.Health, responses={401: error_responses()[401]})
    async def healthz() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    return root
