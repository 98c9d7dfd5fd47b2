"""The request bodies of the HTTP API: they validate input and document it in the
OpenAPI schema."""

from __future__ import annotations

import base64
import json
import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from .._errors import (
    InvalidArgument,
)
from .._types import (
    DEFAULT_SEARCH_TIMEOUT,
    MAX_DURATION,
    MAX_OUTPUT_LIMIT,
)
from .._values import check_text

log = logging.getLogger("hutch.server")



# -- request bodies ------------------------------------------------------------------


#: The most events one listing returns.
MAX_EVENTS = 10_000


#: Lines of progress a streamed ensure holds for a slow reader before it drops output.
ENSURE_STREAM_BUFFER = 256


class ThreadBody(BaseModel):
    """Which thread (and tenant) of a definition ``ensure``/``complete`` is about."""

    model_config = ConfigDict(extra="forbid")

    thread_id: str = Field(min_length=1, max_length=256)
    tenant: str | None = Field(default=None, max_length=256)


class ExecBody(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    cmd: str | list[str]
    timeout: float | None = Field(default=None, gt=0, le=MAX_DURATION)
    cwd: str | None = None
    env: dict[str, str] | None = None
    stdin: str | None = None
    stdin_b64: str | None = None
    user: str | None = None
    output_limit: int | None = Field(default=None, gt=0, le=MAX_OUTPUT_LIMIT)

    def stdin_bytes(self) -> bytes | None:
        if self.stdin_b64 is not None:
            try:
                return base64.b64decode(self.stdin_b64, validate=True)
            except ValueError:
                raise InvalidArgument("stdin_b64 is not valid base64") from None
        if self.stdin is None:
            return None
        check_text(self.stdin, "stdin", nul=False)
        return self.stdin.encode()


class StartBody(ExecBody):
    """A background command: as an exec, and its stdin kept open after
    ``stdin`` (for ``.../stdin`` writes and its close) when ``keep_stdin``."""

    keep_stdin: bool = False


class MkdirBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str
    #: Make its missing parents too.
    parents: bool = False
    #: A directory already there is no error.
    exist_ok: bool = False


class RenameBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str
    destination: str
    #: Replace what is at ``destination`` (as rename(2) does).
    overwrite: bool = False


class WatchBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: The directory to watch.
    path: str = "."
    #: Every directory below it too.
    recursive: bool = False


class SandboxRef(BaseModel):
    sandbox: str


class RefBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: Seconds the ref may be used for; unset: until revoked or the sandbox ends.
    expires_in: float | None = Field(default=None, gt=0, le=365 * 86400, allow_inf_nan=False)


class SetTimeoutBody(BaseModel):
    # Over the wire a timeout is a positive number (NaN, 0 and below are
    # refused); one above the ceiling is the engine's timeout_too_large.
    timeout_seconds: float = Field(gt=0)


class SetTimeoutRef(SetTimeoutBody):
    sandbox: str


class WaitBody(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)

    timeout: float | None = Field(default=None, gt=0, le=MAX_DURATION)


class GrepBody(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)

    pattern: str
    path: str = "."
    glob: str | None = None
    ignore_case: bool = False
    #: Seconds before the search is stopped (exec_timeout).
    timeout: float = Field(default=DEFAULT_SEARCH_TIMEOUT, gt=0, le=MAX_DURATION)


class GlobBody(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)

    pattern: str
    path: str = "."
    timeout: float = Field(default=DEFAULT_SEARCH_TIMEOUT, gt=0, le=MAX_DURATION)


class SnapshotBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    label: str | None = Field(default=None, max_length=200)
    #: Store only what changed since the sandbox's last state, where the provider can.
    diff: bool = True


class ForkBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    label: str | None = Field(default=None, max_length=200)
    #: Branches to start from the snapshot now (more can attach later).
    count: int = Field(default=1, ge=0, le=64)
    #: Sandbox options for the branches (``idle_timeout``...), over the origin's.
    options: dict[str, Any] | None = None


class WorkspaceSuspendBody(BaseModel):
    diff: bool = False



class PtyStart(BaseModel):
    """The first message on a terminal's websocket."""

    model_config = ConfigDict(extra="forbid")

    cmd: str | list[str] | None = None
    rows: int = Field(default=24, ge=1, le=999)
    cols: int = Field(default=80, ge=1, le=999)
    cwd: str | None = None
    env: dict[str, str] = {}
    user: str | None = None


def pty_resize(text: str) -> tuple[int, int] | None:
    """``{"resize": [rows, cols]}`` read from a client's message, or None for
    anything else (ignored: a terminal's keystrokes never come as text)."""
    try:
        message = json.loads(text)
    except ValueError:
        return None
    size = message.get("resize") if isinstance(message, dict) else None
    if (isinstance(size, list) and len(size) == 2
            and all(type(n) is int and 0 < n < 1000 for n in size)):
        return size[0], size[1]
    return None

