"""The HTTP API (docs/wire.md) over :class:`Daemon`.

Handlers return plain dicts through ``JSONResponse``; the request models
validate input and document it in the OpenAPI schema. Every error leaves as
``{"error": {"code", "message"}}`` (and the details of errors that carry some,
``HutchError.wire``) with the status of its code.

The calls an agent makes most (exec, read a file, write a file, read a
sandbox's status, and a plain create, which a warm pool makes a few ms) are
answered by :class:`HotRoutes` once the application's own route table says
they are theirs: FastAPI resolves each endpoint's parameters (~130 µs a
request; ~1 ms for a create's free-form body), which would be most of what
the daemon adds to an exec or a pool's take. There is one route table,
FastAPI's: the fast path matches a request against it, in its order, and
answers only when the route it would take is a hot one. Anything the fast
path is not sure of falls through to the FastAPI route with the body
replayed, so both answer alike and the OpenAPI document stays the one
reference.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import (
    AsyncIterator,
    Callable,
)
from contextlib import asynccontextmanager
from typing import Any

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import _membudget
from .._errors import (
    HutchError,
    InvalidArgument,
    error_from_code,
)
from ..daemon import Daemon, default_data_dir
from ..store import open_store
from . import e2b
from .errors import error_json, unexpected_error_json
from .forward import Forward, Forwarder
from .hot import HotRoutes
from .metrics import OperationMetrics
from .middleware import BodyBudget, BodyLimit, CancelOnDisconnect, TokenAuth
from .routes import (
    definitions,
    exec,
    files,
    metrics,
    pools,
    processes,
    pty,
    refs,
    sandboxes,
    snapshots,
    ui,
    watch,
    workspaces,
)
from .routes.health import health_router
from .routes.health import router as events_router
from .settings import ServerSettings

log = logging.getLogger("hutch.server")

#: The hot routes' endpoints, by name, and the fast path's handler of each.
HOT_HANDLERS = {"exec_": "_exec", "read_file": "_read", "write_file": "_write",
                "get_sandbox": "_status", "create_sandbox": "_create"}

#: The API's routers, in the order FastAPI tries them (and the fast path walks
#: them): the busiest first.
ROUTERS = [
    exec.router, files.router, sandboxes.router, definitions.router, snapshots.router,
    refs.router, processes.router, pty.router, workspaces.router, watch.router, events_router,
    metrics.router, pools.router,
]


# -- the event loop's child watcher --------------------------------------------------------------


def use_pidfd_child_watcher() -> Callable[[], None]:
    """Learn of a child's exit from a pidfd on the loop, not a thread per child.

    Python 3.11's default watcher starts a thread per subprocess that blocks
    in waitpid() and then has to win the GIL back; on a busy daemon that is a
    large share of an exec. 3.12 chooses pidfds itself. Returns what undoes it.
    """
    if sys.version_info >= (3, 12) or not hasattr(os, "pidfd_open"):
        return lambda: None
    try:
        os.close(os.pidfd_open(os.getpid()))  # the kernel may predate pidfds (5.3)
    except OSError:
        return lambda: None
    watcher = asyncio.PidfdChildWatcher()
    watcher.attach_loop(asyncio.get_running_loop())
    asyncio.set_child_watcher(watcher)
    return lambda: asyncio.set_child_watcher(asyncio.ThreadedChildWatcher())


def create_app(
    settings: ServerSettings | None = None,
    *,
    on_ready: Callable[[Daemon], None] | None = None,
    core: Daemon | None = None,
) -> FastAPI:

    """The application; ``on_ready`` is called once the daemon has started.

    ``core``: a daemon core its caller has made and runs (an in-process
    owner serving its sandbox to the holders of its refs, see
    :mod:`hutch.server.owner`); the application answers through it and
    neither starts nor stops it, nor changes anything process-wide.
    """
    settings = settings or ServerSettings()
    # A core given is its caller's to start and stop: the app answers through
    # it at once, with no lifespan of its own (its server runs none).
    holder: dict[str, Daemon] = {} if core is None else {"daemon": core}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if core is not None:
            yield
            return
        restore_watcher = use_pidfd_child_watcher()
        # Providers that keep files on the host keep them under the daemon's data dir.
        os.environ["HUTCH_HOME"] = os.path.abspath(settings.data_dir or default_data_dir())
        # Output and uploads past their memory go to disk there too (not a
        # /tmp that may be memory itself).
        _membudget.configure(settings.memory_budget,
                             os.path.join(os.environ["HUTCH_HOME"], "spool"))

        def make_daemon() -> Daemon:
            return Daemon(
                settings.data_dir, sandbox_defaults=settings.sandbox_defaults,
                store=None if settings.store is None else open_store(
                    settings.store, os.environ["HUTCH_HOME"]),
                timeout_ceiling=settings.timeout_ceiling,
                retention_seconds=settings.retention_seconds, policy=settings.policy(),
                definitions=settings.definitions, default_provider=settings.default_provider,
                advertise_url=settings.advertise_url, meter_interval=settings.meter_interval,
            )

        # Off the loop: opening the store reads (and may migrate) it.
        daemon = await anyio.to_thread.run_sync(make_daemon)
        try:
            await daemon.start()
            await daemon.start_pools(settings.pools)  # hutch.toml's, then the API's
            holder["daemon"] = daemon
            if on_ready is not None:
                on_ready(daemon)
            yield
        finally:
            holder.pop("daemon", None)
            await forwarder.close()
            await daemon.stop()
            restore_watcher()

    app = FastAPI(
        title="hutch", version="1", lifespan=lifespan, default_response_class=JSONResponse,
        description="A self-hosted sandbox manager for AI agents.",
    )

    def daemon() -> Daemon:
        return holder["daemon"]

    @app.exception_handler(HutchError)
    async def hutch_error(_: Request, exc: HutchError) -> JSONResponse:
        return JSONResponse(error_json(exc), status_code=exc.http_status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        details = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        return JSONResponse(error_json(InvalidArgument(details)), status_code=400)

    @app.exception_handler(Exception)
    async def unexpected_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return JSONResponse(unexpected_error_json(exc), status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "invalid_argument", 401: "unauthorized"}.get(
            exc.status_code, "invalid_argument"
        )
        return JSONResponse(
            error_json(error_from_code(code, str(exc.detail))), status_code=exc.status_code
        )

    # Routes are tried in the order they are included: the busiest come first.
    hot: dict[Callable[..., Any], str] = {}
    for make in ROUTERS:
        router = make(daemon)
        hot.update((route.endpoint, HOT_HANDLERS[route.name]) for route in router.routes
                   if isinstance(route, APIRoute) and route.name in HOT_HANDLERS)
        app.include_router(router)
    app.include_router(health_router())
    ui.mount(app, settings.token)  # the dashboard: its pages and login (its data is /v1's)

    # The last added is the outermost: the token is checked before the fast path.
    app.add_middleware(
        HotRoutes, daemon=lambda: holder.get("daemon"), routes=lambda: app.router.routes,
        hot=hot,
    )
    app.add_middleware(BodyBudget)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(CancelOnDisconnect)
    app.add_middleware(OperationMetrics, daemon=lambda: holder.get("daemon"))
    # Inside the credential check: another daemon's sandbox is served by it
    # (and counted there).
    forwarder = Forwarder(lambda: holder.get("daemon"))
    app.add_middleware(Forward, forwarder=forwarder)
    app.add_middleware(TokenAuth, token=settings.token, daemon=lambda: holder.get("daemon"))
    # Outermost: E2B's requests carry E2B's credentials, not the bearer token.
    e2b.mount(app, daemon=lambda: holder.get("daemon"), token=settings.token,
              max_body_bytes=settings.max_body_bytes, forwarder=forwarder)
    return app
