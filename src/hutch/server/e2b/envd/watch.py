"""Watching a directory, as envd offers it: ``WatchDir`` (a server stream of
events) and ``CreateWatcher`` / ``GetWatcherEvents`` / ``RemoveWatcher`` (the
same events, polled by the sync Python SDK).

The events come from comparing what the directory holds from one look to the
next (every :data:`POLL_SECONDS`), on every provider, through the sandbox's
own listing: a path new since the last look was created (and, a file with
bytes in it, written), a file whose size or time changed was written, one
whose mode changed chmodded, one gone removed. A rename shows as a removal
and a creation; a file written and put back between two looks shows nothing.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from ...._errors import HutchError
from ...._sandbox import Sandbox
from ...._types import FileInfo, FileType
from .calls import Call
from .connect import ConnectError, connect_error, flag, text
from .filesystem import entry_info

#: How often a watch looks at its directory.
POLL_SECONDS = 0.3
#: The most entries one watch follows (a larger tree is an error, not a stall).
MAX_WATCHED_ENTRIES = 20_000
#: Events a polled watcher keeps until they are read; the oldest go past it.
MAX_PENDING_EVENTS = 10_000
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
                seen[info.path[len(root):].lstrip("/")] = info
                if recursive and info.type == FileType.DIRECTORY:
                    below.append(info.path)
            if len(seen) > MAX_WATCHED_ENTRIES:
                raise ConnectError(
                    "resource_exhausted",
                    f"{root} holds more than {MAX_WATCHED_ENTRIES} entries to watch",
                )
        level = below
    return seen


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


async def _directory(call: Call, request: dict[str, Any]) -> str:
    path = text(request, "path", required=True)
    try:
        info = await call.sandbox.stat(path)
    except FileNotFoundError:
        raise ConnectError("not_found", f"path {path} does not exist") from None
    if info.type != FileType.DIRECTORY:
        raise ConnectError("invalid_argument", f"path {path} is not a directory")
    return info.path


async def watch_events(
    sandbox: Sandbox, root: str, *, recursive: bool, with_entry: bool,
    first: dict[str, FileInfo],
) -> AsyncIterator[dict[str, Any]]:
    """The directory's events, as they are seen, for ever (until the
    directory or the sandbox is gone, which ends it with an error)."""
    before = first
    while True:
        await asyncio.sleep(POLL_SECONDS)
        try:
            now = await _look(sandbox, root, recursive)
        except FileNotFoundError:
            raise ConnectError("not_found", f"the watched directory {root} was removed") from None
        for event in changes(before, now, with_entry=with_entry):
            yield event
        before = now


@dataclass
class Watcher:
    """A watch whose events wait to be polled."""

    sandbox_id: str
    events: list[dict[str, Any]] = field(default_factory=list)
    failure: ConnectError | None = None
    read_at: float = field(default_factory=time.monotonic)
    task: asyncio.Task[None] | None = None


class WatchService:
    def __init__(self) -> None:
        self._watchers: dict[str, Watcher] = {}

    async def _start(
        self, call: Call, request: dict[str, Any],
    ) -> AsyncIterator[dict[str, Any]]:
        root = await _directory(call, request)
        recursive = flag(request, "recursive")
        first = await _look(call.sandbox, root, recursive)
        return watch_events(call.sandbox, root, recursive=recursive,
                            with_entry=flag(request, "includeEntry"), first=first)

    # the stream ------------------------------------------------------------------------------
    async def watch_dir(self, call: Call, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        events = await self._start(call, request)
        return self._stream(call, events)

    @staticmethod
    async def _stream(
        call: Call, events: AsyncIterator[dict[str, Any]],
    ) -> AsyncIterator[dict[str, Any]]:
        yield {"start": {}}
        queue: asyncio.Queue[dict[str, Any] | BaseException] = asyncio.Queue(1024)

        async def pump() -> None:
            try:
                async for event in events:
                    await queue.put(event)
            except Exception as exc:
                await queue.put(exc)

        task = asyncio.get_running_loop().create_task(pump())
        try:
            while True:
                waits = [w for w in (call.keepalive, call.timeout) if w is not None]
                try:
                    item = await asyncio.wait_for(queue.get(), min(waits, default=None))
                except TimeoutError:
                    if call.deadline is not None and time.monotonic() >= call.deadline:
                        raise ConnectError(
                            "deadline_exceeded", "the watch reached its deadline") from None
                    yield {"keepalive": {}}
                    continue
                if isinstance(item, BaseException):
                    raise connect_error(item)
                yield {"filesystem": item}
        finally:
            task.cancel()

    # the polled watchers ---------------------------------------------------------------------
    async def create_watcher(self, call: Call, request: dict[str, Any]) -> dict[str, Any]:
        self._forget_stale()
        events = await self._start(call, request)
        watcher = Watcher(call.sandbox.id)
        watcher_id = uuid.uuid4().hex

        async def gather() -> None:
            try:
                async for event in events:
                    watcher.events.append(event)
                    del watcher.events[:-MAX_PENDING_EVENTS]
            except (ConnectError, HutchError) as exc:
                watcher.failure = connect_error(exc)

        watcher.task = asyncio.get_running_loop().create_task(gather())
        self._watchers[watcher_id] = watcher
        return {"watcherId": watcher_id}

    def _watcher(self, call: Call, request: dict[str, Any]) -> tuple[str, Watcher]:
        watcher_id = text(request, "watcherId", required=True)
        watcher = self._watchers.get(watcher_id)
        if watcher is None or watcher.sandbox_id != call.sandbox.id:
            raise ConnectError("not_found", f"watcher {watcher_id} not found")
        return watcher_id, watcher

    async def get_watcher_events(self, call: Call, request: dict[str, Any]) -> dict[str, Any]:
        _, watcher = self._watcher(call, request)
        watcher.read_at = time.monotonic()
        events, watcher.events = watcher.events, []
        if not events and watcher.failure is not None:
            raise watcher.failure
        return {"events": events}

    async def remove_watcher(self, call: Call, request: dict[str, Any]) -> dict[str, Any]:
        watcher_id, _ = self._watcher(call, request)
        self._remove(watcher_id)
        return {}

    def _remove(self, watcher_id: str) -> None:
        watcher = self._watchers.pop(watcher_id, None)
        if watcher is not None and watcher.task is not None:
            watcher.task.cancel()

    def _forget_stale(self) -> None:
        cutoff = time.monotonic() - FORGOTTEN_AFTER_SECONDS
        for watcher_id, watcher in list(self._watchers.items()):
            if watcher.read_at < cutoff or (watcher.task is not None and watcher.task.done()
                                            and watcher.failure is None):
                self._remove(watcher_id)

    def unary(self) -> dict[str, Callable[[Call, dict[str, Any]], Any]]:
        return {"CreateWatcher": self.create_watcher, "GetWatcherEvents": self.get_watcher_events,
                "RemoveWatcher": self.remove_watcher}

    def streams(self) -> dict[str, Callable[[Call, dict[str, Any]], Any]]:
        return {"WatchDir": self.watch_dir}
