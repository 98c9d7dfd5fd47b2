"""Read before write: a session may overwrite or delete an existing file only
after it has read it (or found it through grep) in that session.

Agents that write blind clobber work they never looked at; this makes them
look first. Creating a new file is always allowed.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING

from ._errors import ReadBeforeWrite, SandboxIsADirectory
from ._types import FileType

if TYPE_CHECKING:
    from .providers.base import SandboxRuntime

#: The guard of the session making the current call, when a server runs
#: several sessions over one sandbox (each has its own read set).
session_guard: ContextVar[ReadBeforeWriteGuard | None] = ContextVar(
    "hutch_session_guard", default=None
)


class ReadBeforeWriteGuard:
    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._seen: set[str] = set()

    def mark_read(self, path: str) -> None:
        self._seen.add(path)

    def forget(self, path: str) -> None:
        self._seen.discard(path)

    def needs_check(self, path: str) -> bool:
        """Whether a write to ``path`` must first check that it does not exist."""
        return self.enabled and path not in self._seen

    def refuse(self, path: str, action: str) -> ReadBeforeWrite:
        return ReadBeforeWrite(
            f"refusing to {action} {path}: it exists and this session has not read it; "
            "read it (or find it with grep) first, or turn off read_before_write"
        )

    async def check_write(
        self, runtime: Callable[[], SandboxRuntime], path: str, overwrite: bool
    ) -> None:
        """Before a write to ``path``: refused if it is a directory, or an
        existing file this session has not read (unless told to overwrite).
        ``runtime`` is asked for only when there is a check to make: finding
        it costs a write that needs none a few calls on its hot path."""
        if not self.needs_check(path):
            return
        try:
            info = await runtime().stat(path)
        except FileNotFoundError:
            return
        if info.type == FileType.DIRECTORY:
            raise SandboxIsADirectory(f"{path} is a directory")
        if not overwrite:
            raise self.refuse(path, "overwrite")

    async def check_delete(self, runtime: SandboxRuntime, path: str) -> None:
        """Before ``path`` is removed: an existing file this session has not
        read is refused (a directory is not read, so not checked);
        FileNotFoundError if it is missing."""
        if self.needs_check(path):
            info = await runtime.stat(path)
            if info.type != FileType.DIRECTORY:
                raise self.refuse(path, "delete")
