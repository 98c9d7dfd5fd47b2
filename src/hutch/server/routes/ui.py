"""The dashboard at ``/ui``: static pages shipped in the package, and its login.

The pages hold no data: they are open, as the login form must be. Every
figure they show comes from the ``/v1`` API, called by the page's scripts
with the dashboard's session (:mod:`hutch.server.uisession`), which the
credential check takes as it takes the bearer token. The login takes the
token in a POST body (never in a URL) and answers with the session cookie.
"""

from __future__ import annotations

import hmac
from importlib.resources import files
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response
from starlette.staticfiles import StaticFiles

from ..._errors import InvalidArgument, Unauthorized
from ..asgi import ASGIApp, Message, Receive, Scope, Send, header, is_json
from ..errors import error_json
from ..uisession import UI_HEADER, clear_cookie_header, new_session, set_cookie_header

#: Where the dashboard's files are, in the installed package.
STATIC_DIR = Path(str(files("hutch.server") / "ui"))

#: What every dashboard answer says to the browser: its scripts and styles
#: only from here, no frame of it on another site, no address sent elsewhere.
SECURITY_HEADERS = [
    (b"content-security-policy",
     b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
     b"connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
     b"frame-ancestors 'none'"),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-cache"),
]


class WithSecurityHeaders:
    """Pure ASGI wrapper: :data:`SECURITY_HEADERS` on every answer of ``app``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
            await send(message)

        await self.app(scope, receive, sending)


def _over_tls(request: Request) -> bool:
    return request.url.scheme == "https"


def router(token: str | None) -> APIRouter:
    expected = token.encode() if token else None
    ui = APIRouter(prefix="/ui", include_in_schema=False)

    @ui.get("")
    async def root() -> RedirectResponse:
        return RedirectResponse("/ui/", status_code=308)

    @ui.get("/")
    async def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers={
            k.decode(): v.decode() for k, v in SECURITY_HEADERS})

    @ui.post("/login")
    async def login(request: Request) -> Response:
        """The token, in a JSON body ``{"token": ...}``, for a session cookie."""
        body = None
        # JSON only: a form of another site (text/plain, urlencoded) cannot log a browser in.
        if is_json(request.scope):
            try:
                body = await request.json()
            except ValueError:
                body = None
        given = body.get("token") if isinstance(body, dict) else None
        if not isinstance(given, str) or not given:
            exc: InvalidArgument | Unauthorized = InvalidArgument(
                'the login takes a JSON body {"token": "<the daemon\'s token>"}')
            return JSONResponse(error_json(exc), status_code=exc.http_status)
        # Constant time, as the bearer token's check.
        if expected is None or not hmac.compare_digest(given.encode(), expected):
            exc = Unauthorized("wrong token: give the daemon's token (HUTCH_TOKEN)")
            return JSONResponse(error_json(exc), status_code=exc.http_status)
        answer = Response(status_code=204)
        answer.headers["set-cookie"] = set_cookie_header(
            new_session(expected), secure=_over_tls(request))
        return answer

    @ui.post("/logout")
    async def logout(request: Request) -> Response:
        if header(request.scope, UI_HEADER) is None:
            # The dashboard's own call only: another site's form cannot end a session.
            exc = InvalidArgument(f"the logout is the dashboard's: it sends {UI_HEADER.decode()}")
            return JSONResponse(error_json(exc), status_code=exc.http_status)
        answer = Response(status_code=204)
        answer.headers["set-cookie"] = clear_cookie_header(secure=_over_tls(request))
        return answer

    return ui


def mount(app: FastAPI, token: str | None) -> None:
    """The dashboard's routes and files on ``app``, under ``/ui``."""
    app.include_router(router(token))
    app.mount("/ui/static", WithSecurityHeaders(StaticFiles(directory=STATIC_DIR)),
              name="ui-static")
