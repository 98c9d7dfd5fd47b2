"""The file API of a bubblewrap sandbox, resolved inside the sandbox's root.

The sandbox's root file system is an overlay mounted on the host, so the
daemon can reach its files directly, without entering the sandbox. A path is
never joined to the host path and opened: a symlink made inside the sandbox
(``ln -s /etc/shadow x``, or a directory swapped for a link mid-call) would
then lead onto the host. Every lookup goes through ``openat2(2)`` with
``RESOLVE_IN_ROOT`` on a descriptor of the overlay's root: the kernel resolves
``..`` and every symlink, absolute or relative, as if the overlay were ``/``,
atomically, so no race with the sandbox can move a lookup outside it.
Magic links (``/proc/self/root`` and friends) and mount crossings are refused.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import stat as stat_mod
from collections.abc import AsyncGenerator, Callable, Iterator
from contextlib import contextmanager
from typing import IO, TypeVar

import anyio.to_thread

from ..._errors import (
    HutchError,
    InvalidArgument,
    SandboxFileNotFound,
    SandboxIsADirectory,
    SandboxNotADirectory,
    SandboxUnavailable,
)
from ..._types import FileInfo, FileType
from .._hostfs import (
    call_mapped,
    info_from_stat,
    map_oserror,
    map_tree_error,
    read_open_file,
    read_open_file_pieces,
    run_mapped,
)
from ..base import SandboxFiles
from ..watching import BackendWatch, HostInotifyWatch, WatchedEntry

T = TypeVar("T")

_SYS_OPENAT2 = 437  # the same number on every architecture (the unified table)
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10
_RESOLVE = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
#: Past this size, file I/O moves off the event loop.
_THREAD_THRESHOLD = 1024 * 1024
#: What one piece of an upload copied in holds.
_COPY_PIECE = 1024 * 1024


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


def openat2(dir_fd: int, path: str, flags: int, mode: int = 0, resolve: int = _RESOLVE) -> int:
    """``openat2(2)``: open ``path`` below ``dir_fd`` with ``resolve`` rules."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    while True:
        fd = _syscall(
            _SYS_OPENAT2, ctypes.c_int(dir_fd), os.fsencode(path), ctypes.byref(how),
            ctypes.c_size_t(ctypes.sizeof(how)),
        )
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        if err == errno.EAGAIN:  # a rename raced the lookup: the kernel asks to retry
            continue
        raise OSError(err, os.strerror(err), path)


def _relative(path: str) -> str:
    """A sandbox path (absolute) as the path below the root descriptor."""
    rel = path.lstrip("/")
    return rel or "."


def _split(path: str) -> tuple[str, str]:
    rel = _relative(path).rstrip("/")
    parent, _, name = rel.rpartition("/")
    return parent or ".", name


def _map_error(exc: OSError, path: str) -> HutchError:
    """As on the host, and a path the kernel refused to resolve inside the
    root (it would leave it, or loops) is not there."""
    if exc.errno == errno.EXDEV:
        return SandboxFileNotFound(f"{path} is outside the sandbox's files")
    if exc.errno == errno.ELOOP:
        return SandboxFileNotFound(f"{path}: too many levels of symbolic links")
    return map_oserror(exc, path)


class CrossesLayers(InvalidArgument):
    """A rename overlayfs refuses (EXDEV): a directory of a lower layer."""


def _map_tree_error(exc: OSError, path: str) -> HutchError:
    """A mkdir's or a rename's, as on the host; a path the kernel refused to
    resolve inside the root is not there (not two file systems)."""
    if exc.errno in (errno.EXDEV, errno.ELOOP):
        return _map_error(exc, path)
    return map_tree_error(exc, path)


class RootFiles(SandboxFiles):
    """File operations inside the directory tree ``root`` (the overlay's merged
    directory), never leaving it, whatever links the sandbox has made."""

    def __init__(
        self, root: Callable[[], str], verify: Callable[[], None] = lambda: None,
        owner: Callable[[], tuple[int, int] | None] = lambda: None,
    ) -> None:
        #: Where the root is now, as the host reaches it (through the keeper).
        self._root = root
        #: Called once the root is open: raises if it led somewhere else.
        self._verify = verify
        #: Whose (host uid, gid) what is made here is: root inside, where the
        #: sandbox's ids are shifted (hutch itself is the host's root).
        self._owner = owner

    def _own(self, fd: int) -> None:
        """Give a file or directory just made to root inside."""
        owner = self._owner()
        if owner is not None:
            os.fchown(fd, *owner)

    @contextmanager
    def _root_fd(self) -> Iterator[int]:
        try:
            fd = os.open(self._root(), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except (FileNotFoundError, ProcessLookupError):
            raise SandboxUnavailable("the sandbox's file system is not mounted") from None
        try:
            self._verify()
            yield fd
        finally:
            os.close(fd)

    @contextmanager
    def _open(self, path: str, flags: int, mode: int = 0) -> Iterator[int]:
        with self._root_fd() as root:
            fd = openat2(root, _relative(path), flags, mode)
        try:
            yield fd
        finally:
            os.close(fd)

    @contextmanager
    def open_path(self, path: str) -> Iterator[int]:
        """An ``O_PATH`` descriptor of ``path`` (its last link followed, in the root)."""
        with self._open(path, os.O_PATH) as fd:
            yield fd

    @contextmanager
    def _parent(self, path: str) -> Iterator[tuple[int, str]]:
        """A descriptor of ``path``'s parent directory and its last name."""
        parent, name = _split(path)
        if name in ("", ".", ".."):
            raise InvalidArgument(f"{path} names no entry")
        with self._open(parent, os.O_PATH | os.O_DIRECTORY) as fd:
            yield fd, name

    @staticmethod
    def _run(fn: Callable[[], T], path: str) -> T:
        return call_mapped(fn, path, _map_error)

    @staticmethod
    async def _maybe_thread(fn: Callable[[], T], path: str, big: bool) -> T:
        return await run_mapped(fn, path, in_thread=big, map_error=_map_error)

    # -- read ------------------------------------------------------------------
    def _read(self, path: str, limit: int) -> bytes:
        # O_NONBLOCK: opening a FIFO must not wait for a writer.
        with self._open(path, os.O_RDONLY | os.O_NONBLOCK) as fd:
            return read_open_file(fd, path, limit)

    async def read_file(self, path: str, limit: int) -> bytes:
        size = self._run(lambda: self._lstat_size(path), path)
        return await self._maybe_thread(
            lambda: self._read(path, limit), path, size > _THREAD_THRESHOLD
        )

    async def read_file_pieces(self, path: str, limit: int) -> AsyncGenerator[bytes, None]:
        """A small file whole (as :meth:`read_file`); a larger one in pieces
        read in a thread from one descriptor, never whole in memory."""
        size = self._run(lambda: self._lstat_size(path), path)
        if size <= _THREAD_THRESHOLD:
            yield await self.read_file(path, limit)
            return

        def opened() -> int:
            # O_NONBLOCK: opening a FIFO must not wait for a writer.
            with self._root_fd() as root:
                return openat2(root, _relative(path), os.O_RDONLY | os.O_NONBLOCK)

        pieces = read_open_file_pieces(self._run(opened, path), path, limit)
        try:
            async for piece in pieces:
                yield piece
        finally:
            await pieces.aclose()

    def _lstat_size(self, path: str) -> int:
        with self._open(path, os.O_PATH) as fd:
            return os.fstat(fd).st_size

    # -- write -----------------------------------------------------------------
    def _makedirs(self, root: int, rel_dir: str, path: str) -> None:
        if rel_dir in ("", "."):
            return
        parts = [p for p in rel_dir.split("/") if p not in ("", ".")]
        done = ""
        for part in parts:
            here = f"{done}/{part}" if done else part
            try:
                fd = openat2(root, here, os.O_PATH | os.O_DIRECTORY)
            except OSError as exc:
                if exc.errno == errno.ENOTDIR:
                    raise SandboxFileNotFound(f"a parent of {path} is not a directory") from None
                if exc.errno != errno.ENOENT:
                    raise
                parent = openat2(root, done or ".", os.O_PATH | os.O_DIRECTORY)
                made = True
                try:
                    os.mkdir(part, 0o755, dir_fd=parent)
                except FileExistsError:
                    made = False  # made meanwhile (or a link to one): the lookup decides
                finally:
                    os.close(parent)
                fd = openat2(root, here, os.O_RDONLY | os.O_DIRECTORY)
                if made:
                    self._own(fd)
                    os.fchmod(fd, 0o755)  # the mode asked for, whatever our umask
            os.close(fd)
            done = here

    async def makedirs(self, path: str) -> None:
        """Make directory ``path`` and its parents, inside the root."""
        def run() -> None:
            with self._root_fd() as root:
                self._makedirs(root, _relative(path), path)
        self._run(run, path)

    def _open_for_write(self, path: str) -> int:
        """``path`` opened for writing (truncated), its parents made, in the root."""
        rel = _relative(path)
        parent, _ = _split(path)
        with self._root_fd() as root:
            self._makedirs(root, parent, path)
            try:
                try:
                    fd = openat2(root, rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                    self._own(fd)
                    os.fchmod(fd, 0o644)  # a new file: the mode asked for, whatever our umask
                except FileExistsError:
                    # An existing file keeps its mode; a link is followed (and
                    # its target made if missing), in the root.
                    fd = openat2(root, rel, os.O_WRONLY | os.O_TRUNC | os.O_CREAT, 0o644)
            except OSError as exc:
                if exc.errno == errno.EISDIR:
                    raise SandboxIsADirectory(f"{path} is a directory") from None
                raise
        return fd

    @staticmethod
    def _write_all(fd: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]

    def _write(self, path: str, data: bytes) -> None:
        fd = self._open_for_write(path)
        try:
            self._write_all(fd, data)
        finally:
            os.close(fd)

    def _write_from(self, path: str, source: IO[bytes]) -> None:
        fd = self._open_for_write(path)
        try:
            while piece := source.read(_COPY_PIECE):
                self._write_all(fd, piece)
        finally:
            os.close(fd)

    async def write_file(self, path: str, data: bytes) -> None:
        await self._maybe_thread(
            lambda: self._write(path, data), path, len(data) > _THREAD_THRESHOLD
        )

    async def write_file_from(self, path: str, source: IO[bytes]) -> None:
        """Copy ``source`` into ``path`` in pieces, in a thread: an upload is
        never whole in memory."""
        await self._maybe_thread(lambda: self._write_from(path, source), path, True)

    # -- metadata --------------------------------------------------------------
    def _lstat(self, path: str) -> os.stat_result:
        if _relative(path) == ".":
            with self._root_fd() as root:
                return os.stat(root)
        with self._parent(path) as (parent, name):
            return os.stat(name, dir_fd=parent, follow_symlinks=False)

    async def stat(self, path: str) -> FileInfo:
        return info_from_stat(path, self._run(lambda: self._lstat(path), path))

    def _list(self, path: str) -> list[FileInfo]:
        with self._root_fd() as root:
            try:
                fd = openat2(root, _relative(path), os.O_RDONLY | os.O_DIRECTORY)
            except OSError as exc:
                if exc.errno == errno.ENOTDIR:
                    raise InvalidArgument(f"{path} is not a directory") from None
                raise
        try:
            base = path.rstrip("/")
            with os.scandir(fd) as entries:
                return sorted(
                    (
                        info_from_stat(f"{base}/{e.name}", e.stat(follow_symlinks=False))
                        for e in entries
                    ),
                    key=lambda i: i.path,
                )
        finally:
            os.close(fd)

    async def list_dir(self, path: str) -> list[FileInfo]:
        return self._run(lambda: self._list(path), path)

    # -- remove ----------------------------------------------------------------
    def _remove(self, path: str, recursive: bool) -> None:
        with self._parent(path) as (parent, name):
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            if not stat_mod.S_ISDIR(st.st_mode):
                os.unlink(name, dir_fd=parent)
                return
            if recursive:
                # fd-based: never follows a link, even one swapped in meanwhile.
                shutil.rmtree(name, dir_fd=parent)
                return
            os.rmdir(name, dir_fd=parent)

    async def remove(self, path: str, recursive: bool) -> None:
        await self._maybe_thread(lambda: self._remove(path, recursive), path, recursive)

    # -- mkdir and rename ---------------------------------------------------------
    def _make_dir(self, path: str, parents: bool) -> None:
        if parents:
            parent, _ = _split(path)
            with self._root_fd() as root:
                try:
                    self._makedirs(root, parent, path)
                except SandboxFileNotFound as exc:  # a file where a parent must be
                    raise SandboxNotADirectory(exc.message) from None
        with self._parent(path) as (parent_fd, name):
            os.mkdir(name, 0o755, dir_fd=parent_fd)
            with self._open(path, os.O_RDONLY | os.O_DIRECTORY) as made:
                self._own(made)
                os.fchmod(made, 0o755)  # the mode asked for, whatever our umask

    async def make_dir(self, path: str, parents: bool) -> None:
        call_mapped(lambda: self._make_dir(path, parents), path, _map_tree_error)

    def _rename(self, source: str, destination: str) -> None:
        with self._parent(source) as (from_fd, from_name), \
                self._parent(destination) as (to_fd, to_name):
            try:
                os.rename(from_name, to_name, src_dir_fd=from_fd, dst_dir_fd=to_fd)
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
                # overlayfs moves no directory of its lower layers (without
                # redirect_dir): the runtime's mv copies it instead.
                raise CrossesLayers(
                    f"cannot rename {source}: a directory from the sandbox's image, "
                    "which its overlay cannot move; copy it (mv in the sandbox does)"
                ) from None

    async def rename(self, source: str, destination: str) -> None:
        call_mapped(lambda: self._rename(source, destination),
                    f"{source} -> {destination}", _map_tree_error)

    # -- watch -----------------------------------------------------------------
    async def watch(self, path: str, recursive: bool) -> BackendWatch:
        """By inotify from the host, on each directory opened inside the root
        (a link in the sandbox never leads the watch out of it)."""
        @contextmanager
        def host_dir(sandbox_dir: str) -> Iterator[str]:
            try:
                with self._open(sandbox_dir, os.O_PATH | os.O_DIRECTORY) as fd:
                    yield f"/proc/self/fd/{fd}"
            except OSError as exc:
                raise _map_tree_error(exc, sandbox_dir) from None

        def entries(sandbox_dir: str) -> list[WatchedEntry]:
            return [WatchedEntry(info.name, info.type == FileType.DIRECTORY,
                                 info.type == FileType.FILE and info.size > 0)
                    for info in self._run(lambda: self._list(sandbox_dir), sandbox_dir)]

        return HostInotifyWatch(path, recursive, host_dir, entries).start()

    # -- walk ------------------------------------------------------------------
    def _walk(self, root_path: str) -> list[str]:
        base = root_path.rstrip("/")
        out: list[str] = []
        with self._open(root_path, os.O_RDONLY | os.O_DIRECTORY) as fd:
            # fwalk works on descriptors and does not follow links.
            for dirpath, _dirs, files, _dfd in os.fwalk(".", dir_fd=fd):
                rel = "" if dirpath == "." else "/" + dirpath[2:]
                out.extend(f"{base}{rel}/{name}" for name in files)
        return out

    async def walk_files(self, root: str) -> list[str]:
        def walk() -> list[str]:
            try:
                return self._walk(root)
            except OSError as exc:
                if exc.errno == errno.ENOTDIR:
                    return []  # a file: no files below it (as os.walk answers)
                raise
        return await anyio.to_thread.run_sync(lambda: self._run(walk, root))
