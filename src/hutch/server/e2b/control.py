"""The E2B control plane (REST, JSON): create, connect, list, pause, kill,
timeouts, snapshots and forks, as the E2B SDKs' generated client parses them."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ..._errors import HutchError
from .errors import control_body, control_error


def control_app() -> FastAPI:
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    @app.exception_handler(HutchError)
    async def hutch_error(_: Request, exc: HutchError) -> JSONResponse:
        status, body = control_error(exc)
        return JSONResponse(body, status_code=status)

    @app.exception_handler(404)
    async def no_route(request: Request, _: Exception) -> JSONResponse:
        return JSONResponse(control_body(404, f"no route {request.url.path}"), 404)

    return app
