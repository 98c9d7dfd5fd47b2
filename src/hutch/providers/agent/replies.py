"""Reading the agent's replies: its error codes as hutch's typed errors,
numbers, file entries and listings, and watch events; each refuses a
malformed frame (AgentFailure) rather than guessing."""

from __future__ import annotations

from typing import Any

from ..._errors import (
    HutchError,
    InvalidArgument,
    KillIncomplete,
    NoSuchUser,
    OutputLimitExceeded,
    ProviderError,
    ResourceExhausted,
    SandboxFileExists,
    SandboxFileNotFound,
    SandboxIsADirectory,
    SandboxNotADirectory,
    SandboxPermissionDenied,
)
from ..._types import FileEvent, FileInfo, FileType
from .wire import AgentFailure, Header


class CrossDevice(InvalidArgument):
    """A rename the kernel refused with EXDEV (the runtime copies instead)."""


ERRORS: dict[str, type[HutchError]] = {
    "file_not_found": SandboxFileNotFound,
    "is_a_directory": SandboxIsADirectory,
    "permission_denied": SandboxPermissionDenied,
    "invalid_argument": InvalidArgument,
    "no_such_user": NoSuchUser,
    "file_exists": SandboxFileExists,
    "not_a_directory": SandboxNotADirectory,
    "cross_device": CrossDevice,
    "output_limit_exceeded": OutputLimitExceeded,
    "resource_exhausted": ResourceExhausted,
    "kill_incomplete": KillIncomplete,
}
TYPES = {t.value: t for t in FileType}

def typed_error(header: Header) -> HutchError:
    message = str(header.get("msg", ""))[:2000] or "the agent refused the request"
    return ERRORS.get(str(header.get("code")), ProviderError)(message)


def number(header: Header, key: str) -> float:
    value = header.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise AgentFailure(f"the agent sent a frame without a number {key!r}")
    return float(value)


def file_info(header: Any) -> FileInfo:
    if not isinstance(header, dict) or not isinstance(header.get("path"), str):
        raise AgentFailure("the agent sent a malformed file entry")
    kind = TYPES.get(str(header.get("type")))
    if kind is None:
        raise AgentFailure("the agent sent an unknown file type")
    return FileInfo(
        header["path"], kind, int(number(header, "size")), int(number(header, "mode")) & 0o7777,
        number(header, "mtime"),
    )


def listing(reply: Header) -> list[FileInfo]:
    entries = reply.get("entries")
    if not isinstance(entries, list):
        raise AgentFailure("the agent sent a listing without entries")
    return sorted((file_info(e) for e in entries), key=lambda e: e.path)


def predates(exc: InvalidArgument) -> bool:
    """An agent built before the operation (a sandbox started by an earlier
    hutch) says it does not know it: the runtime's command does it then."""
    return exc.message == "unknown operation"


def ok(reply: Header) -> None:
    if reply["t"] != "ok":
        raise AgentFailure(f"the agent answered {reply['t']!r} where ok was due")


def file_event(item: Any) -> FileEvent:
    if not isinstance(item, dict) or item.get("k") not in EVENT_KINDS:
        raise ProviderError("the agent sent a malformed watch event")
    path, new_path = item.get("p"), item.get("n")
    if not isinstance(path, str) or not (new_path is None or isinstance(new_path, str)):
        raise ProviderError("the agent sent a malformed watch event")
    return FileEvent(item["k"], path, new_path)


EVENT_KINDS = ("created", "written", "removed", "renamed")
