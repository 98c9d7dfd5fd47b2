"""ASGI's types, and the few things the middleware, the fast path and the
routes all do with a raw request or answer."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def header(scope: Scope, wanted: bytes) -> str | None:
    for name, value in scope["headers"]:
        if name == wanted:
            return str(value.decode("latin-1"))
    return None


def is_json(scope: Scope) -> bool:
    content_type = header(scope, b"content-type") or ""
    return content_type.split(";", 1)[0].strip().lower() == "application/json"


def render_json(content: Any) -> bytes:
    """JSON exactly as ``JSONResponse`` renders it, for the fast path."""
    return json.dumps(
        content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode("utf-8")


async def respond(send: Send, status: int, body: bytes, content_type: bytes) -> None:
    headers = [] if status == 204 else [
        (b"content-type", content_type), (b"content-length", str(len(body)).encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
