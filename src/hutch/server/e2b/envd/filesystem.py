"""envd's filesystem service (``filesystem.Filesystem``) over hutch's sandboxes."""

from __future__ import annotations

import posixpath
from collections.abc import Callable
from typing import Any

from ...._errors import SandboxFileNotFound
from ...._sandbox import Sandbox
from ...._types import FileInfo, FileType
from .calls import Call
from .connect import ConnectError, text, uint
from .entries import entry_info
from .ownership import hand_over, missing_parents, owners
from .watch import WatchHub

#: The deepest ListDir walks (a caller's depth is bounded, as every number is).
MAX_DEPTH = 64


async def _stat(sandbox: Sandbox, path: str) -> FileInfo:
    try:
        return await sandbox.stat(path)
    except FileNotFoundError:
        raise ConnectError("not_found", f"path {path} does not exist") from None


async def _entry(sandbox: Sandbox, path: str) -> dict[str, Any]:
    info = await _stat(sandbox, path)
    return entry_info(info, (await owners(sandbox, [info.path])).get(info.path))


class FilesystemService:
    def __init__(self, hub: WatchHub) -> None:
        #: Told of every change made here, for the watches.
        self.hub = hub

    async def stat(self, call: Call, request: dict[str, Any]) -> dict[str, Any]:
        return {"entry": await _entry(call.sandbox, text(request, "path", required=True))}

    async def list_dir(self, call: Call, request: dict[str, Any]) -> dict[str, Any]:
        path = text(request, "path", required=True)
        depth = uint(request, "depth", default=1) or 1
        if depth > MAX_DEPTH:
            raise ConnectError("invalid_argument", f"depth must be at most {MAX_DEPTH}")
        top = await _stat(call.sandbox, path)
        if top.type != FileType.DIRECTORY:
            raise ConnectError("invalid_argument", f"path {path} is not a directory")
        found: list[FileInfo] = []
        level = [top.path]
        for _ in range(depth):
            below: list[str] = []
            for directory in level:
                try:
                    listed = await call.sandbox.list_dir(directory)
                except FileNotFoundError:
                    continue  # gone while the walk went on
                for info in sorted(listed, key=lambda i: i.path):
                    found.append(info)
                    if info.type == FileType.DIRECTORY:
                        below.append(info.path)
            level = below
            if not level:
                break
        whose = await owners(call.sandbox, [info.path for info in found])
        return {"entries": [entry_info(info, whose.get(info.path)) for info in found]}

    async def remove(self, call: Call, request: dict[str, Any]) -> dict[str, Any]:
        path = text(request, "path", required=True)
        try:
            await call.sandbox.remove(path, recursive=True)
        except (FileNotFoundError, SandboxFileNotFound):
            return {}  # already gone: what was asked holds
        self.hub.removed(call.sandbox, call.sandbox.path(path))
        return {}

    async def make_dir(self, call: Call, request: dict[str, Any]) -> dict[str, Any]:
        """The directory and its missing parents (``already_exists`` when it
        is there), the caller's user's when one is named."""
        full = call.sandbox.path(text(request, "path", required=True))
        made = await missing_parents(call.sandbox, full) if call.user else []
        await call.sandbox.mkdir(full, parents=True)
        await hand_over(call.sandbox, call.user, [*made, full])
        await self.hub.made_dir(call.sandbox, full)
        return {"entry": await _entry(call.sandbox, full)}

    async def move(self, call: Call, request: dict[str, Any]) -> dict[str, Any]:
        """As envd: the destination's directory made first, then a rename
        that replaces what rename(2) replaces."""
        source = call.sandbox.path(text(request, "source", required=True))
        destination = call.sandbox.path(text(request, "destination", required=True))
        await _stat(call.sandbox, source)
        parent = posixpath.dirname(destination)
        made = await missing_parents(call.sandbox, destination) if call.user else []
        await call.sandbox.mkdir(parent, parents=True, exist_ok=True)
        await hand_over(call.sandbox, call.user, made)
        await call.sandbox.rename(source, destination, overwrite=True)
        await self.hub.moved(call.sandbox, source, destination)
        return {"entry": await _entry(call.sandbox, destination)}

    def unary(self) -> dict[str, Callable[[Call, dict[str, Any]], Any]]:
        return {
            "Stat": self.stat, "ListDir": self.list_dir, "Remove": self.remove,
            "MakeDir": self.make_dir, "Move": self.move,
        }
