"""The daemon's metrics in Prometheus' text format (behind the API's token)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from ..errors import error_responses
from . import DaemonGetter


def router(daemon: DaemonGetter) -> APIRouter:
    root = APIRouter()

    @root.get(
        "/metrics", response_class=Response, responses={
            200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
                  "description": "Prometheus' text exposition format"},
            401: error_responses()[401]},
    )
    async def metrics() -> Response:
        return Response(generate_latest(daemon().metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    return root
