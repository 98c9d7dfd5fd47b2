"""The HTTP API's routes, one router per resource (docs/wire.md).

Each module's ``router(daemon)`` makes its routes over the daemon core that
``daemon()`` returns once the application has started. The application
includes them in :data:`ORDER`: FastAPI tries routes in the order they are
included, and the fast path (:mod:`hutch.server.hot`) walks the same table up
to its last hot route, so the busiest come first.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Request

from ..._sandbox import Sandbox
from ...daemon import Daemon
from ..errors import error_responses
from ..middleware import TextBodiesRoute, session_of

DaemonGetter = Callable[[], Daemon]


def v1_router() -> APIRouter:
    """A router of the ``/v1`` API: every error status documented, request text checked.
    The error body by reference: as a model, FastAPI would make a field (a
    pydantic TypeAdapter) per route and status, most of what making the app
    costs; the document says the same either way."""
    return APIRouter(
        prefix="/v1", responses=error_responses(by_ref=True), route_class=TextBodiesRoute
    )


async def session_sandbox(daemon: Daemon, request: Request, sandbox_id: str) -> Sandbox:
    """The sandbox a request names, seen by the session it speaks for."""
    return await daemon.session(sandbox_id, session_of(request.scope))
