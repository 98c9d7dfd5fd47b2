"""Watching a directory in a sandbox: the seam (:class:`BackendWatch`), and
the two ways a runtime can tell what changed below it.

- :class:`InotifyEvents`: the kernel's word, as inotify gives it, turned into
  hutch's events (a rename's two halves paired by their cookie, a move out
  of the tree a removal, into it a creation; under a recursive watch, a new
  directory watched and what was already made in it told as created, a file
  already holding bytes as written too). Host
  runtimes use it through :class:`HostInotifyWatch`; the agent does the same
  in the sandbox (``go/watch.go``).
- :class:`PollWatch`: the honest fallback where nothing can run inotify (ssh,
  docker's native runtime, virtual): the tree is listed again and again and
  compared; what changed and changed back between two looks is missed, a
  file that came with bytes in it is told created and written (as inotify
  would), and a rename is guessed from a removal and a creation of the same
  kind, size and time.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import errno
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, NamedTuple

from .._errors import (
    HutchError,
    InvalidArgument,
    OutputLimitExceeded,
    ProviderError,
    ResourceExhausted,
    SandboxFileNotFound,
    SandboxNotADirectory,
    SandboxUnavailable,
)
from .._types import FileEvent, FileInfo, FileType

if TYPE_CHECKING:
    from .base import SandboxFiles

#: Seconds between two looks of a polling watch.
POLL_INTERVAL = 0.5
#: Seconds a batch holding a rename's first half waits for its second
#: (:meth:`InotifyEvents.translate`): the kernel queues both in one rename,
#: so they are apart only while the renaming thread is off its CPU. Past
#: it, the first half was a move out of the tree. (The agent's is
#: ``renameHalfWait`` in ``go/watch.go``.)
RENAME_HALF_WAIT = 0.05


class BackendWatch(abc.ABC):
    """A directory watched by a runtime, from the moment it was returned."""

    @abc.abstractmethod
    async def batch(self) -> list[FileEvent] | None:
        """The next events, once there are some (waits); None once the watch
        has ended (its directory is gone). Typed errors when it fails."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop watching. Idempotent."""


# -- polling ------------------------------------------------------------------------


def _same_thing(a: FileInfo, b: FileInfo) -> bool:
    return a.type == b.type and a.size == b.size and a.mtime == b.mtime


def compare(before: dict[str, FileInfo], after: dict[str, FileInfo]) -> list[FileEvent]:
    """The events that turn one look of a tree into the next, by path."""
    gone = sorted(set(before) - set(after))
    new = sorted(set(after) - set(before))
    events: list[FileEvent] = []
    renamed_dirs: list[tuple[str, str]] = []
    unmatched_new = list(new)
    for path in gone:
        if any(path.startswith(old + "/") for old, _ in renamed_dirs):
            continue  # inside a directory already told as renamed
        twin = next((n for n in unmatched_new if _same_thing(before[path], after[n])), None)
        if twin is None:
            events.append(FileEvent("removed", path))
            continue
        unmatched_new.remove(twin)
        events.append(FileEvent("renamed", path, twin))
        if before[path].type == FileType.DIRECTORY:
            renamed_dirs.append((path, twin))
    for path in unmatched_new:
        if any(path.startswith(moved + "/") for _, moved in renamed_dirs):
            continue
        events.append(FileEvent("created", path))
        if after[path].type == FileType.FILE and after[path].size:
            # Its bytes were written too, as inotify would tell.
            events.append(FileEvent("written", path))
    for path in sorted(set(before) & set(after)):
        old, now = before[path], after[path]
        if old.type != now.type:
            events += [FileEvent("removed", path), FileEvent("created", path)]
        elif now.type != FileType.DIRECTORY and (old.size, old.mtime) != (now.size, now.mtime):
            events.append(FileEvent("written", path))
    return events


class PollWatch(BackendWatch):
    """Looks at the tree every :data:`POLL_INTERVAL` seconds and tells what
    differs (see :func:`compare`)."""

    def __init__(self, files: SandboxFiles, root: str, recursive: bool) -> None:
        self._files = files
        self._root = root
        self._recursive = recursive
        self._seen: dict[str, FileInfo] = {}
        self._ended = False

    async def start(self) -> PollWatch:
        info = await self._files.stat(self._root)
        if info.type != FileType.DIRECTORY:
            raise SandboxNotADirectory(f"{self._root} is not a directory to watch")
        self._seen = await self._look()
        return self

    async def _look(self) -> dict[str, FileInfo]:
        found: dict[str, FileInfo] = {}
        pending = [self._root]
        while pending:
            directory = pending.pop()
            try:
                entries = await self._files.list_dir(directory)
            except (FileNotFoundError, NotADirectoryError, InvalidArgument):
                if directory == self._root:
                    raise
                continue  # gone (or replaced) since it was listed: the next look says
            for entry in entries:
                found[entry.path] = entry
                if self._recursive and entry.type == FileType.DIRECTORY:
                    pending.append(entry.path)
        return found

    async def batch(self) -> list[FileEvent] | None:
        while not self._ended:
            await asyncio.sleep(POLL_INTERVAL)
            try:
                now = await self._look()
            except (FileNotFoundError, InvalidArgument):
                self._ended = True
                return [FileEvent("removed", path) for path in sorted(self._seen)]
            except SandboxUnavailable:
                # Paused or suspended: nothing changes meanwhile; the next look
                # after its resume compares (the sandbox's end ends the watch).
                continue
            events = compare(self._seen, now)
            self._seen = now
            if events:
                return events
        return None

    async def close(self) -> None:
        self._ended = True


# -- inotify --------------------------------------------------------------------------

IN_MODIFY = 0x2
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x1000000
IN_EXCL_UNLINK = 0x4000000
IN_ISDIR = 0x40000000
#: What a watched directory is asked to tell.
WATCH_MASK = (IN_CREATE | IN_MODIFY | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_DELETE_SELF
              | IN_MOVE_SELF | IN_ONLYDIR | IN_EXCL_UNLINK)


class WatchedEntry(NamedTuple):
    """What is just below a directory a watch starts on."""

    name: str
    is_dir: bool
    #: A regular file with bytes in it: they were written before the watch
    #: could see them (a file made and written in a directory just made).
    written: bool


class InotifyEvents:
    """inotify's events, as hutch's, for one watched tree.

    ``add(path)`` watches a directory (a sandbox path) and returns its watch
    descriptor; ``remove(wd)`` stops one; ``subdirs(path)`` lists the
    directories (and ``entries`` everything) just below a directory, for a
    recursive watch to follow a new one.
    """

    def __init__(
        self, root: str, recursive: bool, add: Callable[[str], int],
        remove: Callable[[int], None], entries: Callable[[str], list[WatchedEntry]],
    ) -> None:
        self.root = root.rstrip("/") or "/"
        self.recursive = recursive
        self._add = add
        self._remove = remove
        self._entries = entries
        self.dirs: dict[int, str] = {}
        self.ended = False
        #: A batch held for a rename's second half (see :meth:`translate`).
        self._held: list[FileEvent] = []
        #: cookie -> (path, is a directory, where its placeholder is in the
        #: held batch): renames whose IN_MOVED_TO has not been read yet.
        self._moved_from: dict[int, tuple[str, bool, int]] = {}

    def _join(self, directory: str, name: str) -> str:
        return f"{directory.rstrip('/')}/{name}"

    def watch_tree(self, path: str, told: list[FileEvent] | None = None) -> None:
        """Watch ``path`` (and, recursive, every directory below it); with
        ``told``, what is already in it is told as created (it was made
        before its watch was), and a file with bytes in it as written too
        (they were written before the watch could see it)."""
        pending = [path]
        while pending:
            directory = pending.pop()
            try:
                self.dirs[self._add(directory)] = directory
                listed = self._entries(directory) if (self.recursive or told is not None) else []
            except (FileNotFoundError, NotADirectoryError, SandboxFileNotFound,
                    SandboxNotADirectory):
                if directory == self.root:
                    raise
                continue  # gone again already
            for name, is_dir, written in listed:
                child = self._join(directory, name)
                if told is not None:
                    told.append(FileEvent("created", child))
                    if written:
                        told.append(FileEvent("written", child))
                if is_dir and self.recursive:
                    pending.append(child)

    def _forget_below(self, path: str, *, stop: bool) -> None:
        for wd, directory in list(self.dirs.items()):
            if directory == path or directory.startswith(path.rstrip("/") + "/"):
                del self.dirs[wd]
                if stop:
                    with contextlib.suppress(OSError):
                        self._remove(wd)

    def _moved_below(self, old: str, new: str) -> None:
        prefix = old.rstrip("/") + "/"
        for wd, directory in list(self.dirs.items()):
            if directory == old:
                self.dirs[wd] = new
            elif directory.startswith(prefix):
                self.dirs[wd] = new.rstrip("/") + "/" + directory[len(prefix):]

    @property
    def awaiting_rename_half(self) -> bool:
        """A batch is held: it has a rename's IN_MOVED_FROM and not yet its
        IN_MOVED_TO (read it again within :data:`RENAME_HALF_WAIT`, or
        :meth:`flush`)."""
        return bool(self._moved_from)

    def translate(self, raw: list[tuple[int, int, int, str]]) -> list[FileEvent]:
        """One read's events (wd, mask, cookie, name) as hutch's: what is
        told now.

        The kernel queues a rename's two halves one after the other, and a
        read can come between them: a batch with an IN_MOVED_FROM whose
        IN_MOVED_TO has not come is held (``[]`` is returned), and the next
        read's events join it, until its other half pairs it (told, in their
        order, with a "renamed") or :meth:`flush` tells it moved out.
        """
        out = self._held
        moved_from = self._moved_from
        for wd, mask, cookie, name in raw:
            if mask & IN_Q_OVERFLOW:
                raise OutputLimitExceeded(
                    "the watch fell behind and the kernel dropped events: watch a smaller "
                    "tree, or read its events sooner"
                )
            directory = self.dirs.get(wd)
            if directory is None:
                continue
            if mask & IN_IGNORED:
                self.dirs.pop(wd, None)
                if directory == self.root:
                    self.ended = True
                continue
            if mask & (IN_DELETE_SELF | IN_MOVE_SELF):
                if directory == self.root:
                    self.ended = True  # the watched directory itself is gone
                continue
            path = self._join(directory, name)
            is_dir = bool(mask & IN_ISDIR)
            if mask & IN_CREATE:
                out.append(FileEvent("created", path))
                if is_dir and self.recursive:
                    self.watch_tree(path, told=out)
            elif mask & IN_MODIFY:
                if not out or out[-1] != FileEvent("written", path):
                    out.append(FileEvent("written", path))
            elif mask & IN_DELETE:
                out.append(FileEvent("removed", path))
            elif mask & IN_MOVED_FROM:
                moved_from[cookie] = (path, is_dir, len(out))
                out.append(FileEvent("removed", path))  # until its other half comes
            elif mask & IN_MOVED_TO:
                source = moved_from.pop(cookie, None)
                if source is None:
                    out.append(FileEvent("created", path))
                    if is_dir and self.recursive:
                        self.watch_tree(path, told=out)
                    continue
                out[source[2]] = FileEvent("renamed", source[0], path)
                if source[1] and self.recursive:
                    self._moved_below(source[0], path)
        if moved_from:
            self._held = out
            return []
        self._held = []
        return out

    def flush(self) -> list[FileEvent]:
        """The held batch, as it is: a rename half whose other half never
        came was a move out of the tree, told as a removal."""
        for path, is_dir, _ in self._moved_from.values():
            if is_dir:
                self._forget_below(path, stop=True)  # moved out of the tree
        self._moved_from.clear()
        out, self._held = self._held, []
        return out


class HostInotifyWatch(BackendWatch):
    """inotify on this host, for a runtime whose files the host reaches
    (``local``; ``bubblewrap``'s root, reached through its keeper):
    ``host_dir(path)`` gives, for the time of a call, the host path of the
    sandbox directory ``path`` to watch (its links resolved inside the
    sandbox), ``entries(path)`` what is in it (:class:`WatchedEntry`)."""

    def __init__(
        self, root: str, recursive: bool,
        host_dir: Callable[[str], AbstractContextManager[str]],
        entries: Callable[[str], list[WatchedEntry]],
    ) -> None:
        from inotify_simple import INotify

        try:
            self._inotify = INotify(nonblocking=True)
        except OSError as exc:
            raise _inotify_limit(exc) from None
        self._host_dir = host_dir
        self._events = InotifyEvents(root, recursive, self._add, self._inotify.rm_watch, entries)
        self._ready = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._closed = False

    def _add(self, path: str) -> int:
        with self._host_dir(path) as host:
            try:
                return int(self._inotify.add_watch(host, WATCH_MASK))
            except OSError as exc:
                if exc.errno == errno.ENOTDIR:
                    raise SandboxNotADirectory(f"{path} is not a directory to watch") from None
                if exc.errno == errno.ENOENT:
                    raise SandboxFileNotFound(f"no such directory: {path}") from None
                raise _inotify_limit(exc) from None

    def start(self) -> HostInotifyWatch:
        try:
            self._events.watch_tree(self._events.root)
        except BaseException:
            self._inotify.close()
            raise
        self._loop.add_reader(self._inotify.fileno(), self._ready.set)
        return self

    async def batch(self) -> list[FileEvent] | None:
        #: When a batch held for a rename's second half is told without it.
        held_until: float | None = None
        while not self._closed and not self._events.ended:
            if self._events.awaiting_rename_half:
                if held_until is None:
                    held_until = self._loop.time() + RENAME_HALF_WAIT
                left = held_until - self._loop.time()
                if left > 0 and not self._ready.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._ready.wait(), left)
                if left <= 0 or not self._ready.is_set():
                    # Bounded even while other events keep coming.
                    return self._events.flush()
            else:
                await self._ready.wait()
            self._ready.clear()
            try:
                raw = [(e.wd, e.mask, e.cookie, e.name) for e in self._inotify.read(timeout=0)]
            except BlockingIOError:
                continue
            except OSError as exc:
                if self._closed:
                    return None
                raise HutchError(f"reading the watch's events failed: {exc}") from None
            events = self._events.translate(raw)
            if events:
                return events
        if not self._closed and (held := self._events.flush()):
            return held  # told before the end
        return None

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._ready.set()
        with contextlib.suppress(ValueError, OSError):
            self._loop.remove_reader(self._inotify.fileno())
        self._inotify.close()


def _inotify_limit(exc: OSError) -> HutchError:
    """The kernel's inotify limits (instances, watches per user) reached: the
    host is full of watches, not the caller's mistake."""
    if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOSPC, errno.ENOMEM):
        return ResourceExhausted(
            f"this host watches all it may ({exc.strerror}: fs.inotify.max_user_instances "
            "or max_user_watches); close other watches, or watch a smaller tree"
        )
    return ProviderError(f"watching failed: {exc.strerror or exc}")


@contextlib.contextmanager
def same_path(path: str) -> Iterator[str]:
    """A sandbox path that is its host path (``local``)."""
    yield path


def host_entries(path: str) -> list[WatchedEntry]:
    """What is just below the host directory ``path``."""
    with os.scandir(path) as it:
        return [WatchedEntry(e.name, e.is_dir(follow_symlinks=False),
                             e.is_file(follow_symlinks=False)
                             and e.stat(follow_symlinks=False).st_size > 0)
                for e in it]
