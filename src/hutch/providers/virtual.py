"""``virtual``: files in memory, no processes.

For fast tests of everything that needs no real process: the lifecycle
engine, the guardrail, the daemon's bookkeeping. It declares pause and suspend
so lifecycle logic can be exercised without a container; "suspending" it
moves its files into a frozen copy, as a real provider moves state to disk.
A snapshot is an in-memory copy of the files, held by the class for as long
as this process lives (nothing of it outlives the process, as nothing of a
virtual sandbox does).
"""

from __future__ import annotations

import posixpath
import time
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict

from .._errors import (
    InvalidArgument,
    OutputLimitExceeded,
    SandboxFileExists,
    SandboxFileNotFound,
    SandboxIsADirectory,
    SandboxNotADirectory,
    SandboxUnavailable,
)
from .._types import Capabilities, FileInfo, FileType, ProviderSnapshot
from .base import NativeBackend, ProviderSettings


class VirtualConfig(ProviderSettings):
    model_config = ConfigDict(extra="forbid")

    type: Literal["virtual"] = "virtual"
    workdir: str = "/workspace"
    #: Files to start with: path -> text.
    files: dict[str, str] = {}


class VirtualSandbox(NativeBackend):
    provider = "virtual"
    capabilities = Capabilities(
        processes=False, pause=True, suspend=True, snapshot=True, fork=True
    )
    config_model = VirtualConfig
    # A branch reads its snapshot's held files and writes only its own.
    branches_concurrently = True
    #: snapshot id -> (files, directories, working directory): the captured states.
    _held: ClassVar[dict[str, tuple[dict[str, tuple[bytes, float]], set[str], str]]] = {}

    def __init__(self, sandbox_id: str, workdir: str) -> None:
        super().__init__(sandbox_id, workdir)
        self.files: dict[str, tuple[bytes, float]] = {}
        self.dirs: set[str] = {"/", workdir}
        self._add_parents(workdir)
        self.paused = False
        self._suspended: tuple[dict[str, tuple[bytes, float]], set[str]] | None = None

    @classmethod
    async def create(cls, config: VirtualConfig, sandbox_id: str) -> VirtualSandbox:
        sandbox = cls(sandbox_id, config.workdir)
        for path, text in config.files.items():
            await sandbox.write_file(posixpath.join(config.workdir, path), text.encode())
        return sandbox

    # -- state checks: a suspended or paused sandbox has no live file system ----
    def _live(self) -> None:
        if self._suspended is not None:
            raise SandboxUnavailable(f"virtual sandbox {self.sandbox_id} is suspended")
        if self.paused:
            raise SandboxUnavailable(f"virtual sandbox {self.sandbox_id} is paused")

    def _add_parents(self, path: str) -> None:
        parent = posixpath.dirname(path)
        while parent not in self.dirs:
            if parent in self.files:
                raise SandboxFileNotFound(f"a parent of {path} is not a directory")
            self.dirs.add(parent)
            parent = posixpath.dirname(parent)

    async def read_file(self, path: str, limit: int) -> bytes:
        self._live()
        if path in self.dirs:
            raise SandboxIsADirectory(f"{path} is a directory")
        try:
            data, _ = self.files[path]
        except KeyError:
            raise SandboxFileNotFound(f"no such file or directory: {path}") from None
        if len(data) > limit:
            raise OutputLimitExceeded(
                f"{path} is {len(data)} bytes, over the read limit of {limit} bytes"
            )
        return data

    async def write_file(self, path: str, data: bytes) -> None:
        self._live()
        if path in self.dirs:
            raise SandboxIsADirectory(f"{path} is a directory")
        self._add_parents(path)
        self.files[path] = (bytes(data), time.time())

    async def stat(self, path: str) -> FileInfo:
        self._live()
        if path in self.dirs:
            return FileInfo(path, FileType.DIRECTORY, 0, 0o755, 0.0)
        if path in self.files:
            data, mtime = self.files[path]
            return FileInfo(path, FileType.FILE, len(data), 0o644, mtime)
        raise SandboxFileNotFound(f"no such file or directory: {path}")

    def _children(self, path: str) -> list[str]:
        prefix = path.rstrip("/") + "/"
        names = {
            p for p in [*self.files, *self.dirs]
            if p.startswith(prefix) and p != path and "/" not in p[len(prefix):]
        }
        return sorted(names)

    async def list_dir(self, path: str) -> list[FileInfo]:
        info = await self.stat(path)
        if info.type != FileType.DIRECTORY:
            raise InvalidArgument(f"{path} is not a directory")
        return [await self.stat(p) for p in self._children(path)]

    async def remove(self, path: str, recursive: bool) -> None:
        self._live()
        if path in self.files:
            del self.files[path]
            return
        if path not in self.dirs:
            raise SandboxFileNotFound(f"no such file or directory: {path}")
        prefix = path.rstrip("/") + "/"
        inside = [p for p in self.files if p.startswith(prefix)]
        subdirs = [d for d in self.dirs if d.startswith(prefix)]
        if (inside or subdirs) and not recursive:
            raise SandboxIsADirectory(f"{path} is a non-empty directory; pass recursive=True")
        for p in inside:
            del self.files[p]
        for d in subdirs:
            self.dirs.discard(d)
        self.dirs.discard(path)

    def _parent_dir(self, path: str) -> str:
        """``path``'s parent, which must be a directory (typed errors otherwise)."""
        parent = posixpath.dirname(path)
        if parent in self.files:
            raise SandboxNotADirectory(f"{parent} is a file, not a directory")
        if parent not in self.dirs:
            raise SandboxFileNotFound(f"no such directory: {parent}")
        return parent

    async def make_dir(self, path: str, parents: bool) -> None:
        self._live()
        if path in self.dirs or path in self.files:
            raise SandboxFileExists(f"{path} already exists")
        if parents:
            walked = posixpath.dirname(path)
            missing = []
            while walked not in self.dirs:
                if walked in self.files:
                    raise SandboxNotADirectory(f"{walked} is a file, not a directory")
                missing.append(walked)
                walked = posixpath.dirname(walked)
            self.dirs.update(missing)
        else:
            self._parent_dir(path)
        self.dirs.add(path)

    async def rename(self, source: str, destination: str) -> None:
        self._live()
        await self.stat(source)
        self._parent_dir(destination)
        if source == destination:
            return
        prefix = source.rstrip("/") + "/"
        if source in self.files:
            if destination in self.dirs:
                raise SandboxIsADirectory(f"{destination} is a directory")
            self.files[destination] = self.files.pop(source)
            return
        if destination.startswith(prefix):
            raise InvalidArgument(f"cannot move {source} into itself")
        if destination in self.files:
            raise SandboxNotADirectory(f"{destination} is not a directory")
        if destination in self.dirs:
            if self._children(destination):
                raise SandboxFileExists(f"{destination} is a directory that is not empty")
            self.dirs.discard(destination)
        moved = destination.rstrip("/") + "/"
        for old in [p for p in self.files if p.startswith(prefix)]:
            self.files[moved + old[len(prefix):]] = self.files.pop(old)
        for old in [d for d in self.dirs if d.startswith(prefix)]:
            self.dirs.discard(old)
            self.dirs.add(moved + old[len(prefix):])
        self.dirs.discard(source)
        self.dirs.add(destination)

    async def walk_files(self, root: str) -> list[str]:
        self._live()
        if root in self.files:
            return [root]
        if root not in self.dirs:
            raise SandboxFileNotFound(f"no such file or directory: {root}")
        prefix = root.rstrip("/") + "/"
        return sorted(p for p in self.files if p.startswith(prefix))

    # -- lifecycle primitives ---------------------------------------------------
    async def pause(self) -> None:
        self.paused = True

    async def unpause(self) -> None:
        self.paused = False

    async def suspend(self) -> None:
        self._suspended = (self.files, self.dirs)
        self.files, self.dirs = {}, set()

    async def resume(self) -> None:
        if self._suspended is not None:
            self.files, self.dirs = self._suspended
            self._suspended = None

    # -- snapshots -------------------------------------------------------------------
    async def capture(self, snapshot_id: str, *, diff: bool = True) -> ProviderSnapshot:
        # Whatever the state: a suspended sandbox's files are in the frozen copy.
        files, dirs = self._suspended if self._suspended is not None else (self.files, self.dirs)
        # Bytes are immutable: copying the mappings is a full, independent copy.
        self._held[snapshot_id] = (dict(files), set(dirs), self.workdir)
        size = sum(len(data) for data, _ in files.values())
        return ProviderSnapshot(snapshot_id, self.provider, size)

    @classmethod
    async def create_from_snapshot(
        cls, config: Any, sandbox_id: str, snapshot: ProviderSnapshot
    ) -> VirtualSandbox:
        try:
            files, dirs, workdir = cls._held[snapshot.snapshot_id]
        except KeyError:
            raise SandboxUnavailable(
                f"virtual snapshot {snapshot.snapshot_id} is not held by this process"
            ) from None
        sandbox = cls(sandbox_id, workdir)
        sandbox.files, sandbox.dirs = dict(files), set(dirs)
        return sandbox

    @classmethod
    async def remove_snapshot(cls, snapshot: ProviderSnapshot) -> None:
        cls._held.pop(snapshot.snapshot_id, None)

    @classmethod
    async def held_snapshots(cls) -> list[str]:
        return sorted(cls._held)

    async def close(self) -> None:
        self.files.clear()
        self.dirs.clear()
