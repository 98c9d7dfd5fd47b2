"""The daemon itself: its event log, and whether it answers."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse, StreamingResponse

from ... import wire
from ..bodies import MAX_EVENTS
from ..errors import error_responses
from ..streaming import ndjson_lines
from . import DaemonGetter, v1_router


def router(daemon: DaemonGetter) -> APIRouter:
    v1 = v1_router()

    @v1.get("/events", response_model=wire.EventList)
    async def events(
        subject: str | None = None, limit: int = Query(default=100, gt=0, le=MAX_EVENTS)
    ) -> JSONResponse:
        return JSONResponse({"events": await daemon().astore.events(subject, limit)})

    @v1.get("/events/follow", **ndjson_lines(
        wire.Event, "NDJSON, a line an event: the newest `limit`, then each as it happens"))
    async def follow_events(
        subject: str | None = None, limit: int = Query(default=10, ge=0, le=MAX_EVENTS)
    ) -> StreamingResponse:
        """The event log followed live (of one subject, or all), until the caller goes."""
        events = daemon().event_feed.follow(subject, limit)

        async def lines() -> AsyncIterator[bytes]:
            async for event in events:
                yield json.dumps(event, separators=(",", ":")).encode() + b"\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    return v1


def health_router() -> APIRouter:
    root = APIRouter()

    @root.get("/healthz", response_model=wire.Health, responses={401: error_responses()[401]})
    async def healthz() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    return root
