"""envd's filesystem service (``filesystem.Filesystem``) over hutch's sandboxes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...._errors import SandboxFileNotFound
from ...._sandbox import Sandbox
from ...._types import FileInfo, FileType
from .calls import Call
from .connect import ConnectError, text, uint
from .entries import entry_info
from .watch import WatchHub

#: The deepest ListDir walks (a caller's depth is bounded, as every number is).
MAX_DEPTH = 64


async def _stat(sandbox: Sandbox, path: str) -> FileInfo:
    try:
        return await sandbox.stat(path)
    except FileNotFoundError:
        raise ConnectError("not_found", f"path {path} does not exist") from None


class FilesystemService:
    def __init__(self, hub: WatchHub) -> None:
        #: Told of every change made here, for the watches.
        self.hub = hub

    async def stat(self, call: Call, request: dict[str, Any]) -> dict[str, Any]:
        path = text(request, "path", required=True)
        return {"entry": entry_info(await _stat(call.sandbox, path))}

    async def list_dir(self, call: Call, request: dict[str, Any]) -> dict[str, Any]:
        path = text(request, "path", required=True)
        depth = uint(request, "depth", default=1) or 1
        if depth > MAX_DEPTH:
            raise ConnectError("invalid_argument", f"depth must be at most {MAX_DEPTH}")
        top = await _stat(call.sandbox, path)
        if top.type != FileType.DIRECTORY:
            raise ConnectError("invalid_argument", f"path {path} is not a directory")
        entries: list[dict[str, Any]] = []
        level = [top.path]
        for _ in range(depth):
            below: list[str] = []
            for directory in level:
                try:
                    found = await call.sandbox.list_dir(directory)
                except FileNotFoundError:
                    continue  # gone while the walk went on
                for info in sorted(found, key=lambda i: i.path):
                    entries.append(entry_info(info))
                    if info.type == FileType.DIRECTORY:
                        below.append(info.path)
            level = below
            if not level:
                break
        return {"entries": entries}

    async def remove(self, call: Call, request: dict[str, Any]) -> dict[str, Any]:
        path = text(request, "path", required=True)
        try:
            await call.sandbox.remove(path, recursive=True)
        except (FileNotFoundError, SandboxFileNotFound):
            return {}  # already gone: what was asked holds
        self.hub.removed(call.sandbox, call.sandbox.path(path))
        return {}

    async def make_dir(self, call: Call, request: dict[str, Any]) -> dict[str, Any]:
        path = text(request, "path", required=True)
        if await call.sandbox.exists(path):
            raise ConnectError("already_exists", f"directory {path} already exists")
        await self._run(call, ["mkdir", "-p", "--", call.sandbox.path(path)], path)
        await self.hub.made_dir(call.sandbox, call.sandbox.path(path))
        return {"entry": entry_info(await _stat(call.sandbox, path))}

    async def move(self, call: Call, request: dict[str, Any]) -> dict[str, Any]:
        source = text(request, "source", required=True)
        destination = text(request, "destination", required=True)
        await _stat(call.sandbox, source)
        await self._run(call, ["mv", "-f", "--", call.sandbox.path(source),
                               call.sandbox.path(destination)], source)
        await self.hub.moved(call.sandbox, call.sandbox.path(source),
                             call.sandbox.path(destination))
        return {"entry": entry_info(await _stat(call.sandbox, destination))}

    @staticmethod
    async def _run(call: Call, argv: list[str], path: str) -> None:
        result = await call.sandbox.exec(argv, user=call.user, timeout=60)
        if result.exit_code:
            why = result.stderr.strip() or f"{argv[0]} exited {result.exit_code}"
            code = "permission_denied" if "ermission denied" in why else "invalid_argument"
            raise ConnectError(code, f"{path}: {why}")

    def unary(self) -> dict[str, Callable[[Call, dict[str, Any]], Any]]:
        return {
            "Stat": self.stat, "ListDir": self.list_dir, "Remove": self.remove,
            "MakeDir": self.make_dir, "Move": self.move,
        }
