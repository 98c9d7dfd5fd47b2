"""Every error body the daemon sends: ``{"error": {"code", "message", ...}}``."""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from .._errors import (
    ERRORS_BY_CODE,
    HutchError,
)
from ..wire import ErrorBody

log = logging.getLogger("hutch.server")



def error_responses(*, by_ref: bool = False) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` of every error status the API answers with,
    from the one table of codes (hutch._errors); 500 is no answer of hutch's
    but a bug, and so undocumented. ``by_ref``: as JSON whatever the route's
    media type (the model named by its schema's reference, not given)."""
    by_status: dict[int, list[str]] = {}
    for code, cls in sorted(ERRORS_BY_CODE.items()):
        if cls.http_status != 500:
            by_status.setdefault(cls.http_status, []).append(code)
    body: dict[str, Any] = (
        {"content": {"application/json": {"schema": {"$ref": ERROR_BODY_REF}}}}
        if by_ref else {"model": ErrorBody}
    )
    return {
        status: {**body, "description": "error: " + ", ".join(codes)}
        for status, codes in sorted(by_status.items())
    }


#: Where the OpenAPI document keeps the error body's schema.
ERROR_BODY_REF = "#/components/schemas/ErrorBody"


def error_json(exc: HutchError) -> dict[str, Any]:
    """Every error body the daemon sends, answers, stream lines and terminal
    messages alike: ``{"error": exc.wire()}``, with no path of the daemon's
    own data directory in its message (:func:`without_data_dir`)."""
    wire = exc.wire()
    if isinstance(wire.get("message"), str):
        wire["message"] = without_data_dir(wire["message"])
    return {"error": wire}


def without_data_dir(message: str) -> str:
    """``message`` with the daemon's data directory said by name wherever a
    path in it shows (its store, layers, images, mounts): where the daemon
    keeps its files is its operator's business. What follows it stays, so
    that a file a caller named is still named."""
    home = os.environ.get("HUTCH_HOME")
    if not home:
        return message
    for root in {os.path.abspath(home).rstrip("/"), os.path.realpath(home).rstrip("/")}:
        if root and root in message:
            message = re.sub(re.escape(root) + r"(?![^/\s'\",;:])", DATA_DIR_NAME, message)
    return message


#: What a message says in place of the daemon's data directory.
DATA_DIR_NAME = "<hutch data directory>"


def unexpected_error_json(exc: BaseException) -> dict[str, Any]:
    return error_json(HutchError(f"{type(exc).__name__}: {exc}"))

