"""Exec: a command run to its end, its output answered whole (the busiest route)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from ... import wire
from ..bodies import ExecBody
from ..streaming import exec_response, run_exec
from . import DaemonGetter, session_sandbox, v1_router


def router(daemon: DaemonGetter) -> APIRouter:
    v1 = v1_router()

    @v1.post("/sandboxes/{sandbox_id}/exec", response_model=wire.ExecAnswer)
    async def exec_(request: Request, sandbox_id: str, body: ExecBody) -> Response:
        sandbox = await session_sandbox(daemon(), request, sandbox_id)
        return exec_response(await run_exec(sandbox, body))

    return v1
