"""Files on the host over SFTP: binary-safe, any file name, no shell involved."""

from __future__ import annotations

import contextlib
import functools
import posixpath
import stat as stat_mod
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import IO, TYPE_CHECKING, TypeVar

from ..._errors import (
    HutchError,
    InvalidArgument,
    OutputLimitExceeded,
    ProviderError,
    SandboxFileExists,
    SandboxFileNotFound,
    SandboxIsADirectory,
    SandboxNotADirectory,
    SandboxPermissionDenied,
)
from ..._lazy import lazy_module
from ..._sandbox_paths import within
from ..._types import FileInfo, FileType
from ..base import SandboxFiles, bounded_pieces, require_regular
from .connection import KeptConnection, lost
from .process import run_helper

if TYPE_CHECKING:
    import asyncssh
else:
    asyncssh = lazy_module("asyncssh")  # imported at its first use: see hutch._lazy

T = TypeVar("T")

#: Paths one walk may send back, in bytes.
_MAX_WALK_BYTES = 256 << 20
#: What one SFTP write of a streamed upload carries.
_PIECE = 4 * 1024 * 1024

@functools.cache
def _connection_errors() -> tuple[type[BaseException], ...]:
    """What a lost SFTP session raises (a function: asyncssh is imported lazily)."""
    return (OSError, asyncssh.SFTPConnectionLost, asyncssh.SFTPNoConnection,
            asyncssh.ConnectionLost, asyncssh.DisconnectError, asyncssh.ChannelOpenError)


def _info(path: str, attrs: asyncssh.SFTPAttrs) -> FileInfo:
    mode = attrs.permissions or 0
    return FileInfo(
        path, FileType.of_mode(mode), attrs.size or 0, stat_mod.S_IMODE(mode),
        float(attrs.mtime or 0),
    )


def _text(name: str | bytes) -> str:
    return name if isinstance(name, str) else name.decode("utf-8", "surrogateescape")


class SftpFiles(SandboxFiles):
    """File operations on one destination, through its kept connection."""

    def __init__(self, kept: KeptConnection) -> None:
        self._kept = kept
        self._dest = kept.target.destination

    def _error(self, exc: asyncssh.SFTPError, path: str) -> HutchError:
        if isinstance(exc, asyncssh.SFTPNoSuchFile | asyncssh.SFTPNoSuchPath):
            return SandboxFileNotFound(f"no such file or directory on {self._dest}: {path}")
        if isinstance(exc, asyncssh.SFTPNotADirectory):
            return SandboxFileNotFound(f"a parent of {path} is not a directory on {self._dest}")
        if isinstance(exc, asyncssh.SFTPPermissionDenied | asyncssh.SFTPWriteProtect):
            return SandboxPermissionDenied(f"permission denied on {self._dest}: {path}")
        if isinstance(exc, asyncssh.SFTPFileIsADirectory):
            return SandboxIsADirectory(f"{path} is a directory")
        return ProviderError(f"ssh {self._dest}: {path}: {exc.reason}")

    async def _call(self, path: str, op: Callable[[asyncssh.SFTPClient], Awaitable[T]]) -> T:
        sftp = await self._kept.sftp()
        try:
            return await op(sftp)
        except HutchError:
            raise
        except (asyncssh.SFTPConnectionLost, asyncssh.SFTPNoConnection) as exc:
            self._kept.forget_sftp(sftp)
            raise lost(self._kept.target, exc) from None
        except asyncssh.SFTPError as exc:
            raise self._error(exc, path) from None
        except _connection_errors() as exc:
            self._kept.forget_sftp(sftp)
            raise lost(self._kept.target, exc) from None

    @staticmethod
    async def _readable_size(sftp: asyncssh.SFTPClient, path: str, limit: int) -> int:
        attrs = await sftp.stat(path)
        # A FIFO or a device would hold the host's one SFTP server (and
        # every file call after it) until something wrote to it.
        require_regular(attrs.permissions or 0, path)
        size = attrs.size or 0
        if size > limit:
            raise OutputLimitExceeded(
                f"{path} is {size} bytes, over the read limit of {limit} bytes"
            )
        return size

    async def read_file_pieces(self, path: str, limit: int) -> AsyncGenerator[bytes, None]:
        """The file in pieces of :data:`_PIECE` bytes as SFTP brings them: a
        large file is never whole in memory. Errors come before the first."""

        async def opened(sftp: asyncssh.SFTPClient) -> asyncssh.SFTPClientFile:
            await self._readable_size(sftp, path, limit)
            return await sftp.open(path, "rb")

        fh = await self._call(path, opened)
        async def read() -> bytes:
            piece: bytes = await self._call(path, lambda _: fh.read(_PIECE))
            return piece

        try:
            async for piece in bounded_pieces(read, path, limit):
                yield piece
        finally:
            with contextlib.suppress(*_connection_errors(), asyncssh.SFTPError):
                await fh.close()

    async def read_file(self, path: str, limit: int) -> bytes:
        async def op(sftp: asyncssh.SFTPClient) -> bytes:
            size = await self._readable_size(sftp, path, limit)
            async with sftp.open(path, "rb") as fh:
                # What stat promised plus one byte, to notice a file that grew.
                data: bytes = await fh.read(size + 1)
                if len(data) > size:
                    more: bytes = await fh.read(limit + 1 - len(data))
                    data += more
            if len(data) > limit:
                raise OutputLimitExceeded(f"{path} is over the read limit of {limit} bytes")
            return data

        return await self._call(path, op)

    async def _create(self, sftp: asyncssh.SFTPClient, path: str) -> asyncssh.SFTPClientFile:
        """``path`` opened for writing (truncated), its parents made if missing."""
        try:
            return await sftp.open(path, "wb")
        except asyncssh.SFTPNoSuchFile:
            pass  # a parent is missing: make it, then open
        except asyncssh.SFTPFailure:
            # OpenSSH answers a plain failure when the path is a directory.
            if stat_mod.S_ISDIR((await sftp.stat(path)).permissions or 0):
                raise SandboxIsADirectory(f"{path} is a directory") from None
            raise
        try:
            await sftp.makedirs(posixpath.dirname(path), exist_ok=True)
        except asyncssh.SFTPFailure:
            raise SandboxFileNotFound(
                f"a parent of {path} is not a directory on {self._dest}"
            ) from None
        return await sftp.open(path, "wb")

    async def write_file(self, path: str, data: bytes) -> None:
        async def op(sftp: asyncssh.SFTPClient) -> None:
            fh = await self._create(sftp, path)
            try:
                await fh.write(data)
            finally:
                await fh.close()

        await self._call(path, op)

    async def write_file_from(self, path: str, source: IO[bytes]) -> None:
        """Copy ``source`` to ``path`` a piece at a time: never whole in memory."""

        async def op(sftp: asyncssh.SFTPClient) -> None:
            fh = await self._create(sftp, path)
            try:
                while piece := source.read(_PIECE):
                    await fh.write(piece)
            finally:
                await fh.close()

        await self._call(path, op)

    async def stat(self, path: str) -> FileInfo:
        async def op(sftp: asyncssh.SFTPClient) -> FileInfo:
            return _info(path, await sftp.lstat(path))

        return await self._call(path, op)

    async def list_dir(self, path: str) -> list[FileInfo]:
        async def op(sftp: asyncssh.SFTPClient) -> list[FileInfo]:
            attrs = await sftp.stat(path)
            if not stat_mod.S_ISDIR(attrs.permissions or 0):
                raise InvalidArgument(f"{path} is not a directory")
            base = path.rstrip("/")
            names: Sequence[asyncssh.SFTPName] = await sftp.readdir(path)
            return sorted(
                (
                    _info(f"{base}/{name}", entry.attrs)
                    for entry in names
                    if (name := _text(entry.filename)) not in (".", "..")
                ),
                key=lambda info: info.path,
            )

        return await self._call(path, op)

    async def remove(self, path: str, recursive: bool) -> None:
        async def op(sftp: asyncssh.SFTPClient) -> None:
            attrs = await sftp.lstat(path)
            if not stat_mod.S_ISDIR(attrs.permissions or 0):
                await sftp.remove(path)
                return
            if recursive:
                await sftp.rmtree(path)
                return
            try:
                await sftp.rmdir(path)
            except (asyncssh.SFTPFailure, asyncssh.SFTPDirNotEmpty):
                if [n for n in await sftp.listdir(path) if n not in (".", "..")]:
                    raise SandboxIsADirectory(
                        f"{path} is a non-empty directory; pass recursive=True"
                    ) from None
                raise

        await self._call(path, op)

    async def makedirs(self, path: str) -> None:
        async def op(sftp: asyncssh.SFTPClient) -> None:
            await sftp.makedirs(path, exist_ok=True)

        await self._call(path, op)

    async def make_dir(self, path: str, parents: bool) -> None:
        async def op(sftp: asyncssh.SFTPClient) -> None:
            try:
                if parents:
                    await sftp.makedirs(path, attrs=asyncssh.SFTPAttrs(permissions=0o755))
                else:
                    await sftp.mkdir(path, asyncssh.SFTPAttrs(permissions=0o755))
            except (asyncssh.SFTPFailure, asyncssh.SFTPFileAlreadyExists,
                    asyncssh.SFTPNoSuchFile, asyncssh.SFTPNoSuchPath) as exc:
                # SFTP v3 says "failure" for what is in the way: look.
                raise await self._tree_error(sftp, path, exc) from None

        await self._call(path, op)

    async def rename(self, source: str, destination: str) -> None:
        async def op(sftp: asyncssh.SFTPClient) -> None:
            try:
                # OpenSSH's posix-rename: rename(2), replacing as it does.
                await sftp.posix_rename(source, destination)
            except (asyncssh.SFTPFailure, asyncssh.SFTPFileAlreadyExists,
                    asyncssh.SFTPNoSuchFile, asyncssh.SFTPNoSuchPath) as exc:
                raise await self._tree_error(sftp, destination, exc, source) from None

        await self._call(source, op)

    async def _tree_error(
        self, sftp: asyncssh.SFTPClient, path: str, exc: asyncssh.SFTPError,
        source: str | None = None,
    ) -> HutchError:
        """What stopped a mkdir or a rename at ``path``, found by looking: SFTP
        v3 names few errors (a "failure" is anything)."""
        if source is not None and not await sftp.exists(source):
            return SandboxFileNotFound(f"no such file or directory on {self._dest}: {source}")
        parent = posixpath.dirname(path.rstrip("/")) or "/"
        walked = "/"
        for part in [p for p in parent.split("/") if p]:
            walked = posixpath.join(walked, part)
            try:
                attrs = await sftp.stat(walked)
            except (asyncssh.SFTPNoSuchFile, asyncssh.SFTPNoSuchPath):
                return SandboxFileNotFound(f"no such directory on {self._dest}: {walked}")
            if not stat_mod.S_ISDIR(attrs.permissions or 0):
                return SandboxNotADirectory(f"{walked} is a file, not a directory")
        try:
            attrs = await sftp.lstat(path)
        except (asyncssh.SFTPNoSuchFile, asyncssh.SFTPNoSuchPath):
            return self._error(exc, path)
        if source is not None:
            source_is_dir = await sftp.isdir(source)
            here_is_dir = stat_mod.S_ISDIR(attrs.permissions or 0)
            if here_is_dir and not source_is_dir:
                return SandboxIsADirectory(f"{path} is a directory")
            if source_is_dir and not here_is_dir:
                return SandboxNotADirectory(f"{path} is not a directory")
            if source_is_dir and within(path, source):
                return InvalidArgument(f"cannot move {source} into itself")
            return SandboxFileExists(f"{path} is a directory that is not empty")
        return SandboxFileExists(f"{path} already exists")

    async def walk_files(self, root: str) -> list[str]:
        """The regular files below ``root`` and links to them (never a FIFO or a
        device, whose read may never end), without entering linked
        directories. One ``find`` on the host, not a round trip per directory."""
        await self.stat(root)  # a missing root is file_not_found
        _code, out, _err = await run_helper(
            self._kept,
            ["find", root, "-mindepth", "1", "-xtype", "f", "-print0"],
            timeout=600,
        )
        # find exits 1 when it met an unreadable directory; os.walk skips those.
        return [p.decode("utf-8", "surrogateescape") for p in out.split(b"\0") if p]
