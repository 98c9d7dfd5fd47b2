"""Every error the E2B wire answers, in one place.

The control plane (the SDKs' generated REST client) parses every error
status as JSON ``{"code": <the status>, "message": ...}``: a body of any
other shape crashes its parser. The in-sandbox API speaks the Connect
protocol, whose errors name a code (``not_found``, ``deadline_exceeded``).
hutch's own typed errors map onto both here, so that no route spells a
status or a code of its own.
"""

from __future__ import annotations

from typing import Any

from ..._errors import HutchError
from ..asgi import Send, render_json, respond
from ..errors import without_data_dir

#: hutch's error codes and the HTTP status the E2B control plane answers
#: them with: the statuses its SDKs declare (400, 401, 403, 404, 409, 429,
#: 500) and know what to make of (404 is "not found", 409 "already paused").
CONTROL_STATUS: dict[str, int] = {
    "not_found": 404,
    "file_not_found": 404,
    "invalid_argument": 400,
    "timeout_too_large": 400,
    "is_a_directory": 400,
    "unauthorized": 401,
    "permission_denied": 403,
    "sandbox_unavailable": 409,
    "invalid_state": 409,
    "read_before_write": 409,
    "idle_timeout": 404,
    "max_lifetime_exceeded": 404,
    "timeout_expired": 404,
    "sandbox_expired": 404,
    "daemon_busy": 429,
    "resource_exhausted": 429,
    "capability_unsupported": 400,
    "output_limit_exceeded": 413,
}


def control_body(status: int, message: str) -> dict[str, Any]:
    """The control plane's error body for ``status``."""
    return {"code": status, "message": without_data_dir(message)}


def control_error(exc: HutchError) -> tuple[int, dict[str, Any]]:
    """The status and body the control plane answers ``exc`` with."""
    status = CONTROL_STATUS.get(exc.code, 500)
    return status, control_body(status, exc.message)


async def send_control_error(send: Send, status: int, message: str) -> None:
    await respond(send, status, render_json(control_body(status, message)),
                  b"application/json")


#: hutch's error codes and the Connect code the in-sandbox API answers them
#: with (connectrpc.com/docs/protocol, "Error Codes").
CONNECT_CODE: dict[str, str] = {
    "not_found": "not_found",
    "file_not_found": "not_found",
    "invalid_argument": "invalid_argument",
    "is_a_directory": "invalid_argument",
    "timeout_too_large": "invalid_argument",
    "permission_denied": "permission_denied",
    "unauthorized": "unauthenticated",
    "exec_timeout": "deadline_exceeded",
    "output_limit_exceeded": "resource_exhausted",
    "resource_exhausted": "resource_exhausted",
    "daemon_busy": "resource_exhausted",
    "sandbox_unavailable": "unavailable",
    "idle_timeout": "unavailable",
    "max_lifetime_exceeded": "unavailable",
    "timeout_expired": "unavailable",
    "sandbox_expired": "unavailable",
    "read_before_write": "failed_precondition",
    "invalid_state": "failed_precondition",
    "capability_unsupported": "unimplemented",
    "provider_error": "internal",
}

#: The HTTP status of each Connect code on a unary call (the protocol's table).
CONNECT_HTTP_STATUS: dict[str, int] = {
    "canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504,
    "not_found": 404, "already_exists": 409, "permission_denied": 403,
    "resource_exhausted": 429, "failed_precondition": 400, "aborted": 409,
    "out_of_range": 400, "unimplemented": 501, "internal": 500, "unavailable": 503,
    "data_loss": 500, "unauthenticated": 401,
}


def connect_error(exc: HutchError) -> tuple[int, dict[str, Any]]:
    """The HTTP status and Connect error body (``{"code", "message"}``) of ``exc``
    on a unary call; a stream's end-of-stream frame carries the same body."""
    code = CONNECT_CODE.get(exc.code, "unknown")
    return CONNECT_HTTP_STATUS[code], {"code": code, "message": without_data_dir(exc.message)}


async def send_connect_error(send: Send, code: str, message: str) -> None:
    body = {"code": code, "message": without_data_dir(message)}
    await respond(send, CONNECT_HTTP_STATUS.get(code, 500), render_json(body),
                  b"application/json")
