"""Files on this host's file system, with hutch's typed errors."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat as stat_mod
import threading
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import IO, TypeVar

import anyio.to_thread

from .._errors import (
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
from .._types import FileInfo, FileType, GrepMatch
from ._grep import grep_host_files
from .base import SandboxFiles, bounded_pieces, require_regular
from .watching import BackendWatch, HostInotifyWatch, host_entries

T = TypeVar("T")

#: The piece a streamed write copies at a time.
_COPY_CHUNK = 1024 * 1024
#: Past this size, file I/O moves off the event loop.
_THREAD_THRESHOLD = 1024 * 1024


def map_oserror(exc: OSError, path: str) -> HutchError:
    code = exc.errno
    if code == errno.ENOENT or code == errno.ENOTDIR:
        return SandboxFileNotFound(f"no such file or directory: {path}")
    if code == errno.EISDIR:
        return SandboxIsADirectory(f"{path} is a directory")
    if code == errno.ENOTEMPTY:  # a directory removed without recursive
        return SandboxIsADirectory(f"{path} is a non-empty directory; pass recursive=True")
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return SandboxPermissionDenied(f"permission denied: {path}")
    if code == errno.ENAMETOOLONG:
        return InvalidArgument(f"file name too long: {path}")
    return ProviderError(f"{path}: {exc.strerror or exc}")


def map_tree_error(exc: OSError, path: str) -> HutchError:
    """An OSError of a mkdir or a rename: as :func:`map_oserror`, and what
    only these meet said as such (a file where a directory must be,
    something in the way, a directory into itself, two file systems)."""
    code = exc.errno
    if code == errno.ENOTDIR:
        return SandboxNotADirectory(f"{path}: a file is where a directory must be")
    if code in (errno.EEXIST, errno.ENOTEMPTY):
        return SandboxFileExists(f"{path}: something is already there")
    if code == errno.EINVAL:
        return InvalidArgument(f"{path}: cannot move a directory into itself")
    if code == errno.EXDEV:
        return InvalidArgument(f"{path}: cannot rename across file systems; copy, then remove")
    return map_oserror(exc, path)


def call_mapped(
    fn: Callable[[], T], path: str, map_error: Callable[[OSError, str], HutchError] = map_oserror
) -> T:
    """``fn()``, with an OSError turned into hutch's typed error about ``path``."""
    try:
        return fn()
    except HutchError:
        raise
    except OSError as exc:
        raise map_error(exc, path) from None



async def run_mapped(
    fn: Callable[[], T], path: str, *, in_thread: bool,
    map_error: Callable[[OSError, str], HutchError] = map_oserror,
) -> T:
    """:func:`call_mapped`, moved off the event loop when ``in_thread`` (a
    large file: its I/O would stall every other request)."""
    if in_thread:
        return await anyio.to_thread.run_sync(lambda: call_mapped(fn, path, map_error))
    return call_mapped(fn, path, map_error)


def info_from_stat(path: str, st: os.stat_result) -> FileInfo:
    return FileInfo(
        path, FileType.of_mode(st.st_mode), st.st_size, stat_mod.S_IMODE(st.st_mode), st.st_mtime
    )


def read_open_file(fd: int, path: str, limit: int) -> bytes:
    """The bytes of the open file ``fd`` (``path``'s), a regular file of at
    most ``limit`` bytes (typed errors otherwise), read without allocating
    the whole limit up front."""
    st = os.fstat(fd)
    require_regular(st.st_mode, path)
    size = st.st_size
    if size > limit:
        raise OutputLimitExceeded(f"{path} is {size} bytes, over the read limit of {limit} bytes")
    with os.fdopen(os.dup(fd), "rb") as fh:
        # What fstat promised plus one byte to notice growth.
        data = fh.read(size + 1)
        if len(data) > size:
            data += fh.read(limit + 1 - len(data))
    if len(data) > limit:
        raise OutputLimitExceeded(f"{path} is over the read limit of {limit} bytes")
    return data


async def read_open_file_pieces(fd: int, path: str, limit: int) -> AsyncGenerator[bytes, None]:
    """The open file ``fd`` (``path``'s, a regular file of at most ``limit``
    bytes: typed errors, before the first piece, otherwise) in pieces read in
    a thread, so that it is never whole in memory. Closes ``fd``."""
    try:
        st = os.fstat(fd)
        require_regular(st.st_mode, path)
        if st.st_size > limit:
            raise OutputLimitExceeded(
                f"{path} is {st.st_size} bytes, over the read limit of {limit} bytes"
            )
        async def read() -> bytes:
            return await anyio.to_thread.run_sync(os.read, fd, _COPY_CHUNK)

        async for piece in bounded_pieces(read, path, limit):
            yield piece
    finally:
        os.close(fd)


class HostFiles(SandboxFiles):
    """File operations on a host directory tree that maps 1:1 to sandbox paths.

    ``to_host`` turns a sandbox path into the host path (identity for
    ``local``; a prefix for providers whose root file system lives on the host).
    """

    def __init__(self, to_host: Callable[[str], str] = lambda p: p) -> None:
        self.to_host = to_host

    def _read(self, path: str, limit: int) -> bytes:
        fd = self._open_regular(path)
        try:
            return read_open_file(fd, path, limit)
        finally:
            os.close(fd)

    async def read_file(self, path: str, limit: int) -> bytes:
        host = self.to_host(path)
        size = call_mapped(lambda: os.stat(host), path).st_size
        return await run_mapped(
            lambda: self._read(path, limit), path, in_thread=size > _THREAD_THRESHOLD
        )

    async def read_file_pieces(self, path: str, limit: int) -> AsyncGenerator[bytes, None]:
        """A small file whole (as :meth:`read`); a larger one in pieces read in
        a thread, so that it never sits whole in memory."""
        host = self.to_host(path)
        size = call_mapped(lambda: os.stat(host), path).st_size
        if size <= _THREAD_THRESHOLD:
            yield await self.read_file(path, limit)
            return
        pieces = read_open_file_pieces(
            call_mapped(lambda: self._open_regular(path), path), path, limit
        )
        try:
            async for piece in pieces:
                yield piece
        finally:
            await pieces.aclose()

    def _open_regular(self, path: str) -> int:
        """A descriptor of ``path``, a regular file (a typed error otherwise)."""
        # O_NONBLOCK: opening a FIFO must not wait for a writer.
        fd = os.open(self.to_host(path), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            info = os.fstat(fd)
        except OSError:
            os.close(fd)
            raise
        try:
            require_regular(info.st_mode, path)
        except HutchError:
            os.close(fd)
            raise
        return fd

    def _prepare_write(self, path: str) -> str:
        """The host path to write ``path`` at, its parents made."""
        host = self.to_host(path)
        parent = os.path.dirname(host)
        try:
            os.makedirs(parent, exist_ok=True)
        except FileExistsError:
            raise SandboxFileNotFound(f"a parent of {path} is not a directory") from None
        if os.path.isdir(host):
            raise SandboxIsADirectory(f"{path} is a directory")
        return host

    def _write(self, path: str, data: bytes) -> None:
        with open(self._prepare_write(path), "wb") as fh:
            fh.write(data)

    def _write_from(self, path: str, source: IO[bytes]) -> None:
        host = self._prepare_write(path)
        with open(host, "wb") as fh:
            shutil.copyfileobj(source, fh, _COPY_CHUNK)

    async def write_file_from(self, path: str, source: IO[bytes]) -> None:
        """Copy ``source`` into ``path`` in pieces, in a thread."""
        await anyio.to_thread.run_sync(
            lambda: call_mapped(lambda: self._write_from(path, source), path)
        )

    async def write_file(self, path: str, data: bytes) -> None:
        await run_mapped(
            lambda: self._write(path, data), path, in_thread=len(data) > _THREAD_THRESHOLD
        )

    async def stat(self, path: str) -> FileInfo:
        return info_from_stat(path, call_mapped(lambda: os.lstat(self.to_host(path)), path))

    async def list_dir(self, path: str) -> list[FileInfo]:
        host = self.to_host(path)

        def listing() -> list[FileInfo]:
            with os.scandir(host) as it:
                return sorted(
                    (
                        info_from_stat(
                            path.rstrip("/") + "/" + e.name, e.stat(follow_symlinks=False)
                        )
                        for e in it
                    ),
                    key=lambda i: i.path,
                )

        if not os.path.isdir(host) and os.path.exists(host):
            raise InvalidArgument(f"{path} is not a directory")
        return call_mapped(listing, path)

    async def remove(self, path: str, recursive: bool) -> None:
        host = self.to_host(path)

        def rm() -> None:
            if os.path.isdir(host) and not os.path.islink(host):
                if recursive:
                    shutil.rmtree(host)
                else:
                    os.rmdir(host)
            else:
                os.unlink(host)

        call_mapped(rm, path)

    async def make_dir(self, path: str, parents: bool) -> None:
        host = self.to_host(path)

        def make() -> None:
            if parents:
                os.makedirs(host, 0o755)
            else:
                os.mkdir(host, 0o755)

        call_mapped(make, path, map_tree_error)

    async def rename(self, source: str, destination: str) -> None:
        host_source, host_destination = self.to_host(source), self.to_host(destination)

        def move() -> None:
            try:
                os.rename(host_source, host_destination)
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
                # Two file systems (or a directory of an overlay's lower
                # layer): copied, then the source removed, as mv does.
                if os.path.isdir(host_destination) and not os.path.islink(host_destination):
                    os.rmdir(host_destination)  # replaced: empty, as rename(2) wants
                shutil.move(host_source, host_destination)

        await anyio.to_thread.run_sync(
            lambda: call_mapped(move, f"{source} -> {destination}", map_tree_error))

    async def watch(self, path: str, recursive: bool) -> BackendWatch:
        """By inotify on the host path."""
        @contextlib.contextmanager
        def host_dir(sandbox_dir: str) -> Iterator[str]:
            yield self.to_host(sandbox_dir)

        return HostInotifyWatch(
            path, recursive, host_dir, lambda p: host_entries(self.to_host(p))
        ).start()

    async def walk_files(self, root: str) -> list[str]:
        """The regular files below ``root`` (and links to them), as os.walk finds
        them, in a thread. A cancelled walk (a timeout) stops at its next
        directory rather than running on unseen."""
        host_root = self.to_host(root)
        if not os.path.exists(host_root):
            raise SandboxFileNotFound(f"no such file or directory: {root}")
        stop = threading.Event()

        def walk() -> list[str]:
            out: list[str] = []
            strip = len(host_root.rstrip("/"))
            base = root.rstrip("/")
            pending = [host_root]
            while pending and not stop.is_set():
                directory = pending.pop()
                try:
                    with os.scandir(directory) as entries:
                        for entry in entries:
                            if entry.is_dir(follow_symlinks=False):
                                pending.append(entry.path)
                            elif entry.is_file():  # a regular file, or a link to one
                                out.append(f"{base}{entry.path[strip:]}")
                except OSError:
                    continue  # unreadable or gone, as os.walk skips it
            return out

        try:
            return await anyio.to_thread.run_sync(walk, abandon_on_cancel=True)
        finally:
            stop.set()

    async def grep_files(
        self, pattern: re.Pattern[str], paths: list[str], limit: int
    ) -> list[GrepMatch]:
        """Matching lines of ``paths``, read and matched by a worker process: a
        read that blocks or a pattern that backtracks is killed with it."""
        return await grep_host_files(pattern, [(p, self.to_host(p)) for p in paths], limit)
