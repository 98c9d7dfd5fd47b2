"""Watching a sandbox's directories: watchers read by polling (made, their
events since the last look, closed) and a stream (NDJSON) of one watch."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from ... import wire
from ..._errors import HutchError
from ..._types import FileEvent
from ..._watch import Watcher
from ..bodies import WatchBody
from ..errors import error_json
from ..streaming import ndjson_lines
from . import DaemonGetter, session_sandbox, v1_router

#: The longest one look at a watcher's events waits for the first (seconds).
MAX_WAIT = 60.0

WATCH_LINES = ndjson_lines(
    wire.WatchLine, "NDJSON, a line each: the watch, then its events (or an error)"
)


def watcher_json(watcher: Watcher) -> dict[str, Any]:
    return {"id": watcher.id, "path": watcher.path, "recursive": watcher.recursive,
            "kind": watcher.kind, "active": watcher.active}


def event_json(event: FileEvent) -> dict[str, Any]:
    line: dict[str, Any] = {"type": event.type, "path": event.path}
    if event.new_path is not None:
        line["new_path"] = event.new_path
    return line


def router(daemon: DaemonGetter) -> APIRouter:
    v1 = v1_router()

    @v1.post("/sandboxes/{sandbox_id}/watchers", status_code=201,
             response_model=wire.WatcherInfo)
    async def create_watcher(request: Request, sandbox_id: str, body: WatchBody) -> JSONResponse:
        """Watch a directory from now on; read its events with ``.../events``."""
        sandbox = await session_sandbox(daemon(), request, sandbox_id)
        watcher = await sandbox.watch(body.path, recursive=body.recursive)
        return JSONResponse(watcher_json(watcher), status_code=201)

    @v1.get("/sandboxes/{sandbox_id}/watchers/{watcher_id}",
            response_model=wire.WatcherInfo)
    async def get_watcher(sandbox_id: str, watcher_id: str) -> JSONResponse:
        """A watch made earlier (by this caller or another session), by its id."""
        return JSONResponse(watcher_json((await daemon().get(sandbox_id)).watcher(watcher_id)))

    @v1.get("/sandboxes/{sandbox_id}/watchers/{watcher_id}/events",
            response_model=wire.WatchEvents)
    async def watcher_events(
        sandbox_id: str, watcher_id: str,
        wait: float = Query(default=0.0, ge=0, le=MAX_WAIT, allow_inf_nan=False, description=(
            "Seconds to wait for the first event when there is none yet.")),
    ) -> JSONResponse:
        """The events since the last look (each told once)."""
        watcher = (await daemon().get(sandbox_id)).watcher(watcher_id)
        events = await watcher.events(wait=wait)
        return JSONResponse({"events": [event_json(e) for e in events],
                             "active": watcher.active})

    @v1.delete("/sandboxes/{sandbox_id}/watchers/{watcher_id}", status_code=204)
    async def close_watcher(sandbox_id: str, watcher_id: str) -> Response:
        await (await daemon().get(sandbox_id)).watcher(watcher_id).close()
        return Response(status_code=204)

    @v1.get("/sandboxes/{sandbox_id}/watch", **WATCH_LINES)
    async def watch_stream(
        request: Request, sandbox_id: str, path: str = Query(default="."),
        recursive: bool = Query(default=False),
    ) -> StreamingResponse:
        """One watch as a stream, closed when the caller goes."""
        # Started before the answer: a missing directory is its status, not a line.
        sandbox = await session_sandbox(daemon(), request, sandbox_id)
        watcher = await sandbox.watch(path, recursive=recursive)

        async def lines() -> AsyncIterator[bytes]:
            try:
                yield _line({"watching": watcher_json(watcher)})
                while True:
                    events = await watcher.events(wait=None)
                    if not events:
                        return
                    for event in events:
                        yield _line(event_json(event))
            except HutchError as exc:
                yield _line(error_json(exc))
            finally:
                await watcher.close()

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    return v1


def _line(value: dict[str, Any]) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode() + b"\n"
