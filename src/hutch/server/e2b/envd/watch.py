"""Watching a directory, as envd offers it: ``WatchDir`` (a server stream of
events) and ``CreateWatcher`` / ``GetWatcherEvents`` / ``RemoveWatcher`` (the
same events, polled by the sync Python SDK).

Where the sandbox's runtime has inotify (``capabilities.watch``), a watch
follows hutch's own (:meth:`hutch.Sandbox.watch`): every change as the kernel
tells it. Elsewhere events come two ways:

- what a caller changes through envd itself (a write, a removal, a rename, a
  new directory) is told to the sandbox's watches as it is done
  (:class:`WatchHub`), with the events inotify would give: a new file is
  created then written, a rename is the old name renamed and the new one
  created;
- what the sandbox's own processes change is found by comparing what the
  directory holds from one look to the next (every :data:`POLL_SECONDS`,
  through the sandbox's own listing): a path new since the last look was
  created (and, a file with bytes in it, written), a file whose size or time
  changed was written, one whose mode changed chmodded, one gone removed. A
  process's rename shows as a removal and a creation, and a file made and
  removed between two looks shows nothing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import posixpath
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio

from ...._errors import HutchError
from ...._sandbox import Sandbox
from ...._types import FileEvent, FileInfo, FileType
from ...._watch import Watcher
from ....states import FINAL, HELD
from .calls import Call
from .connect import ConnectError, connect_error, flag, text
from .entries import entry_info

#: How often a watch looks at its directory.
POLL_SECONDS = 0.3
#: The most entries one watch follows (a larger tree is an error, not a stall).
MAX_WATCHED_ENTRIES = 20_000
#: Events a watch keeps until they are read; the oldest go past it.
MAX_PENDING_EVENTS = 10_000
#: envd's event for each of hutch's own.
_KERNEL_EVENTS = {"created": "CREATE", "written": "WRITE", "removed": "REMOVE",
                  "renamed": "RENAME"}
#: A polled watcher nobody has read for this long is removed (its caller forgot it).
FORGOTTEN_AFTER_SECONDS = 600.0


async def _look(sandbox: Sandbox, root: str, recursive: bool) -> dict[str, FileInfo]:
    """What the directory holds, by path relative to it."""
    seen: dict[str, FileInfo] = {}
    level = [root]
    while level:
        below: list[str] = []
        for directory in level:
            try:
                found = await sandbox.list_dir(directory)
            except FileNotFoundError:
                if directory == root:
                    raise
                continue
            for info in found:
                seen[_relative(root, info.path)] = info
                if recursive and info.type == FileType.DIRECTORY:
                    below.append(info.path)
            if len(seen) > MAX_WATCHED_ENTRIES:
                raise ConnectError(
                    "resource_exhausted",
                    f"{root} holds more than {MAX_WATCHED_ENTRIES} entries to watch",
                )
        level = below
    return seen


def _relative(root: str, path: str) -> str:
    return path[len(root):].lstrip("/")


def _event(name: str, kind: str, info: FileInfo | None, with_entry: bool) -> dict[str, Any]:
    event: dict[str, Any] = {"name": name, "type": f"EVENT_TYPE_{kind}"}
    if with_entry and info is not None:
        event["entry"] = entry_info(info)
    return event


def changes(
    before: dict[str, FileInfo], now: dict[str, FileInfo], *, with_entry: bool,
) -> list[dict[str, Any]]:
    """The FilesystemEvents between two looks, in the order of their names."""
    events: list[dict[str, Any]] = []
    for name in sorted(now.keys() | before.keys()):
        old, new = before.get(name), now.get(name)
        if new is None:
            events.append(_event(name, "REMOVE", old, False))
        elif old is None or old.type != new.type:
            if old is not None:
                events.append(_event(name, "REMOVE", old, False))
            events.append(_event(name, "CREATE", new, with_entry))
            if new.type == FileType.FILE and new.size:
                events.append(_event(name, "WRITE", new, with_entry))
        elif new.type != FileType.DIRECTORY and (old.size, old.mtime) != (new.size, new.mtime):
            events.append(_event(name, "WRITE", new, with_entry))
        elif old.mode != new.mode:
            events.append(_event(name, "CHMOD", new, with_entry))
    return events


class Watch:
    """One watched directory: what it held at the last look, and the events
    not yet handed over."""

    def __init__(
        self, sandbox: Sandbox, root: str, *, recursive: bool, with_entry: bool,
        first: dict[str, FileInfo], kernel: Watcher | None = None,
    ) -> None:
        self.sandbox = sandbox
        #: hutch's own watch, where the sandbox's runtime has inotify: its
        #: events are the kernel's, every one (envd tells it nothing).
        self.kernel = kernel
        self.root = root
        self.recursive = recursive
        self.with_entry = with_entry
        self.known = first
        self.pending: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=MAX_PENDING_EVENTS)
        self.failure: ConnectError | None = None
        self.woken = asyncio.Event()
        #: Counts the changes told by envd: a look that ran while one was
        #: told is not compared (it may predate it), the next one is.
        self.told = 0
        self.read_at = time.monotonic()
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.task = loop.create_task(
            self._poll() if self.kernel is None else self._follow(self.kernel))

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()  # the kernel's watch, if any, is closed as it ends

    def emit(self, events: list[dict[str, Any]]) -> None:
        if events:
            self.pending.extend(events)
            self.woken.set()

    def take(self) -> list[dict[str, Any]]:
        events = list(self.pending)
        self.pending.clear()
        self.woken.clear()
        return events

    async def _poll(self) -> None:
        try:
            while True:
                await asyncio.sleep(POLL_SECONDS)
                state = self.sandbox.state
                if state in FINAL:
                    raise ConnectError(
                        "unavailable", f"the sandbox {self.sandbox.id} was not found ({state})")
                if state in HELD:
                    continue  # a look would resume it: a watch is no reason to
                told = self.told
                try:
                    now = await _look(self.sandbox, self.root, self.recursive)
                except FileNotFoundError:
                    raise ConnectError(
                        "not_found", f"the watched directory {self.root} was removed") from None
                if told == self.told:
                    self.emit(changes(self.known, now, with_entry=self.with_entry))
                    self.known = now
        except (ConnectError, HutchError) as exc:
            self.failure = connect_error(exc)
            self.woken.set()

    async def _follow(self, kernel: Watcher) -> None:
        try:
            while True:
                batch = await kernel.events(wait=None)
                if not batch:  # it ended: its directory is gone
                    raise ConnectError(
                        "not_found", f"the watched directory {self.root} was removed")
                events: list[dict[str, Any]] = []
                for event in batch:
                    events += await self._told_by_kernel(event)
                self.emit(events)
        except (ConnectError, HutchError) as exc:
            self.failure = connect_error(exc)
            self.woken.set()
        finally:
            with anyio.CancelScope(shield=True):
                await kernel.close()

    async def _told_by_kernel(self, event: FileEvent) -> list[dict[str, Any]]:
        """envd's events for one of hutch's: a rename is the old name
        renamed and the new one created (when the watch sees it)."""
        kinds = [(event.path, _KERNEL_EVENTS[event.type])]
        if event.type == "renamed" and event.new_path is not None:
            kinds.append((event.new_path, "CREATE"))
        events = []
        for path, kind in kinds:
            name = self.name_of(path)
            if name is None:
                continue
            info = None
            if self.with_entry and kind != "REMOVE" and kind != "RENAME":
                with contextlib.suppress(FileNotFoundError):
                    info = await self.sandbox.stat(path)
            events.append(_event(name, kind, info, self.with_entry))
        return events

    # what envd's own operations tell ---------------------------------------------------------
    def name_of(self, path: str) -> str | None:
        """``path``'s name in this watch, or None when the watch does not see it."""
        if not path.startswith(self.root.rstrip("/") + "/"):
            return None
        name = _relative(self.root, path)
        if not name or (not self.recursive and "/" in name):
            return None
        return name

    def _drop(self, name: str) -> None:
        for known in [k for k in self.known if k == name or k.startswith(name + "/")]:
            del self.known[known]

    def created(self, infos: list[FileInfo], written: bool) -> None:
        """``infos``: new directories on the way down, then the path itself."""
        events = []
        for position, info in enumerate(infos):
            name = self.name_of(info.path)
            if name is None:
                continue
            old = self.known.get(name)
            if old is None:
                events.append(_event(name, "CREATE", info, self.with_entry))
            last = position == len(infos) - 1
            # A look may have found it first (and said so): not twice.
            seen = old is not None and (old.size, old.mtime) == (info.size, info.mtime)
            if last and written and info.type == FileType.FILE and info.size and not seen:
                events.append(_event(name, "WRITE", info, self.with_entry))
            self.known[name] = info
        self.emit(events)

    def removed(self, path: str) -> None:
        name = self.name_of(path)
        if name is not None and name in self.known:
            self._drop(name)
            self.emit([_event(name, "REMOVE", None, False)])

    def renamed(self, source: str, moved: list[FileInfo]) -> None:
        name = self.name_of(source)
        if name is not None and name in self.known:
            self._drop(name)
            self.emit([_event(name, "RENAME", None, False)])
        self.created(moved, written=False)


class WatchHub:
    """The live watches of every sandbox, told of what envd changes."""

    def __init__(self) -> None:
        self._watches: dict[str, set[Watch]] = {}

    def add(self, watch: Watch) -> None:
        self._watches.setdefault(watch.sandbox.id, set()).add(watch)
        watch.start()

    def discard(self, watch: Watch) -> None:
        watch.stop()
        watches = self._watches.get(watch.sandbox.id)
        if watches is not None:
            watches.discard(watch)
            if not watches:
                del self._watches[watch.sandbox.id]

    def _seeing(self, sandbox: Sandbox, *paths: str) -> list[Watch]:
        """The watches that look (the kernel tells the others) and see any
        of ``paths``; each is told at once that a change is coming (its
        look under way is not compared)."""
        watches = [w for w in self._watches.get(sandbox.id, ())
                   if w.kernel is None and any(w.name_of(p) is not None for p in paths)]
        for watch in watches:
            watch.told += 1
        return watches

    async def _new_infos(self, sandbox: Sandbox, watches: list[Watch], path: str,
                         ) -> list[FileInfo]:
        """The path's FileInfo, after those of its directories no watch
        knew of yet (made on the way: a write makes its parents)."""
        chain = []
        parent = posixpath.dirname(path)
        while parent not in ("/", "") and any(
            (name := w.name_of(parent)) is not None and name not in w.known for w in watches
        ):
            chain.append(parent)
            parent = posixpath.dirname(parent)
        infos = []
        for directory in reversed(chain):
            try:
                infos.append(await sandbox.stat(directory))
            except FileNotFoundError:
                continue
        try:
            infos.append(await sandbox.stat(path))
        except FileNotFoundError:
            pass
        return infos

    async def wrote(self, sandbox: Sandbox, path: str) -> None:
        watches = self._seeing(sandbox, path)
        if watches:
            infos = await self._new_infos(sandbox, watches, path)
            for watch in watches:
                watch.created(infos, written=True)

    async def made_dir(self, sandbox: Sandbox, path: str) -> None:
        watches = self._seeing(sandbox, path)
        if watches:
            infos = await self._new_infos(sandbox, watches, path)
            for watch in watches:
                watch.created(infos, written=False)

    def removed(self, sandbox: Sandbox, path: str) -> None:
        for watch in self._seeing(sandbox, path):
            watch.removed(path)

    async def moved(self, sandbox: Sandbox, source: str, destination: str) -> None:
        watches = self._seeing(sandbox, source, destination)
        if watches:
            infos = await self._new_infos(sandbox, watches, destination)
            for watch in watches:
                watch.renamed(source, infos)


async def _directory(call: Call, request: dict[str, Any]) -> str:
    path = text(request, "path", required=True)
    try:
        info = await call.sandbox.stat(path)
    except FileNotFoundError:
        raise ConnectError("not_found", f"path {path} does not exist") from None
    if info.type != FileType.DIRECTORY:
        raise ConnectError("invalid_argument", f"path {path} is not a directory")
    return info.path


class WatchService:
    def __init__(self, hub: WatchHub) -> None:
        self.hub = hub
        self._watchers: dict[str, Watch] = {}

    async def _watch(self, call: Call, request: dict[str, Any]) -> Watch:
        root = await _directory(call, request)
        recursive = flag(request, "recursive")
        with_entry = flag(request, "includeEntry")
        if call.sandbox.capabilities.watch == "inotify":
            kernel = await call.sandbox.watch(root, recursive=recursive)
            watch = Watch(call.sandbox, root, recursive=recursive, with_entry=with_entry,
                          first={}, kernel=kernel)
        else:
            watch = Watch(call.sandbox, root, recursive=recursive, with_entry=with_entry,
                          first=await _look(call.sandbox, root, recursive))
        self.hub.add(watch)
        return watch

    # the stream ------------------------------------------------------------------------------
    async def watch_dir(self, call: Call, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        return self._stream(call, await self._watch(call, request))

    async def _stream(self, call: Call, watch: Watch) -> AsyncIterator[dict[str, Any]]:
        try:
            yield {"start": {}}
            while True:
                for event in watch.take():
                    yield {"filesystem": event}
                if watch.failure is not None:
                    raise watch.failure
                waits = [w for w in (call.keepalive, call.timeout) if w is not None]
                try:
                    await asyncio.wait_for(watch.woken.wait(), min(waits, default=None))
                except TimeoutError:
                    if call.deadline is not None and time.monotonic() >= call.deadline:
                        raise ConnectError(
                            "deadline_exceeded", "the watch reached its deadline") from None
                    yield {"keepalive": {}}
        finally:
            self.hub.discard(watch)

    # the polled watchers ---------------------------------------------------------------------
    async def create_watcher(self, call: Call, request: dict[str, Any]) -> dict[str, Any]:
        self._forget_stale()
        watcher_id = uuid.uuid4().hex
        self._watchers[watcher_id] = await self._watch(call, request)
        return {"watcherId": watcher_id}

    def _watcher(self, call: Call, request: dict[str, Any]) -> tuple[str, Watch]:
        watcher_id = text(request, "watcherId", required=True)
        watch = self._watchers.get(watcher_id)
        if watch is None or watch.sandbox.id != call.sandbox.id:
            raise ConnectError("not_found", f"watcher {watcher_id} not found")
        return watcher_id, watch

    async def get_watcher_events(self, call: Call, request: dict[str, Any]) -> dict[str, Any]:
        _, watch = self._watcher(call, request)
        watch.read_at = time.monotonic()
        events = watch.take()
        if not events and watch.failure is not None:
            raise watch.failure
        return {"events": events}

    async def remove_watcher(self, call: Call, request: dict[str, Any]) -> dict[str, Any]:
        watcher_id, _ = self._watcher(call, request)
        self._remove(watcher_id)
        return {}

    def _remove(self, watcher_id: str) -> None:
        watch = self._watchers.pop(watcher_id, None)
        if watch is not None:
            self.hub.discard(watch)

    def _forget_stale(self) -> None:
        cutoff = time.monotonic() - FORGOTTEN_AFTER_SECONDS
        for watcher_id, watch in list(self._watchers.items()):
            if watch.read_at < cutoff:
                self._remove(watcher_id)

    def unary(self) -> dict[str, Callable[[Call, dict[str, Any]], Any]]:
        return {"CreateWatcher": self.create_watcher, "GetWatcherEvents": self.get_watcher_events,
                "RemoveWatcher": self.remove_watcher}

    def streams(self) -> dict[str, Callable[[Call, dict[str, Any]], Any]]:
        return {"WatchDir": self.watch_dir}
