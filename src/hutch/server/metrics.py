"""Operations counted by route: one ASGI middleware times every HTTP request
and files it under the route template it took (``/v1/sandboxes/{sandbox_id}/exec``),
so no route counts itself and a route added later is counted too."""

from __future__ import annotations

import time
from collections.abc import Callable

from ..daemon import Daemon
from .asgi import ASGIApp, Message, Receive, Scope, Send

#: The label of a request no route took (a 404, or one refused before routing).
UNMATCHED = "unmatched"


class OperationMetrics:
    """Times each HTTP request to the end of its answer (a stream's last
    byte), by method, route template and outcome: ``ok`` below 400, else the
    status. The route is the one the router (or the fast path) put in the
    scope as ``route``."""

    def __init__(self, app: ASGIApp, daemon: Callable[[], Daemon | None]) -> None:
        self.app = app
        self.daemon = daemon

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # what the caller sees if the app raises before it answers
        started = time.perf_counter()

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            daemon = self.daemon()
            if daemon is not None:
                route = getattr(scope.get("route"), "path", None) or UNMATCHED
                daemon.metrics.operation(
                    scope["method"], route, "ok" if status < 400 else str(status),
                    time.perf_counter() - started)
