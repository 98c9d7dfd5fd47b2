"""A directory watched in a sandbox, as every caller sees it: events as a
stream (``async for``) or collected since the last look (:meth:`Watcher.events`).

Written once over the runtime's :class:`~hutch.providers.watching.BackendWatch`:
a pump task takes its batches as they come into a bounded queue, so a
caller that reads seldom (E2B's poll-style watchers) misses nothing until
:data:`MAX_PENDING_EVENTS` wait unread; past that the watch ends with
``output_limit_exceeded``, never an unbounded buffer.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable

import anyio

from ._errors import InvalidArgument, OutputLimitExceeded
from ._types import FileEvent
from .providers.watching import BackendWatch

#: Events a watch holds unread before it gives up (and says so).
MAX_PENDING_EVENTS = 10_000
#: Watches one sandbox may have open at once (each holds kernel watches and
#: up to MAX_PENDING_EVENTS events): past it, resource_exhausted.
MAX_WATCHES = 64


class Watcher:
    """Changes below one directory of a sandbox, from the moment
    ``Sandbox.watch`` returned it: ``async for event in watcher`` (until it
    is closed or ends), or ``await watcher.events(wait=...)`` for those
    since the last call. Close it (or use ``async with``) when done; the
    sandbox's close closes it too.

    ``kind`` says how it learns of changes (``Capabilities.watch``). It ends
    by itself when the directory it watches is removed (its last events are
    still read), or with an error (the sandbox went away, too many events
    unread) raised to its reader once the events before it are read.
    """

    id: str
    #: The directory it watches (absolute, in the sandbox).
    path: str
    recursive: bool
    #: How it learns of changes: ``inotify`` or ``poll``.
    kind: str

    def __init__(
        self, backend: BackendWatch, path: str, recursive: bool, kind: str,
        on_close: Callable[[Watcher], None] | None = None,
    ) -> None:
        self.id = uuid.uuid4().hex[:12]
        self.path = path
        self.recursive = recursive
        self.kind = kind
        self._backend = backend
        self._pending: deque[FileEvent] = deque()
        self._arrived = asyncio.Event()
        self._error: BaseException | None = None
        self._ended = False
        self._closed = False
        self._on_close = on_close
        self._pump_task = asyncio.get_running_loop().create_task(self._pump())

    @property
    def active(self) -> bool:
        """Still watching (not closed, not ended)."""
        return not self._ended

    async def _pump(self) -> None:
        try:
            while (batch := await self._backend.batch()) is not None:
                self._pending.extend(batch)
                self._arrived.set()
                if len(self._pending) > MAX_PENDING_EVENTS:
                    raise OutputLimitExceeded(
                        f"the watch of {self.path} held {MAX_PENDING_EVENTS} events unread "
                        "and stopped: read its events sooner, or watch a smaller tree"
                    )
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # told to the reader, after the events before it
            self._error = exc
        finally:
            self._ended = True
            self._arrived.set()
            with contextlib.suppress(Exception):
                await self._backend.close()

    async def events(self, wait: float | None = 0.0) -> list[FileEvent]:
        """The events since the last call (or since it started), waiting up
        to ``wait`` seconds (None: as long as it takes) for the first one when
        there are none yet; ``[]`` when none came. Once it has ended, its last
        events, then its error if it failed, then ``[]``."""
        if wait is not None and (isinstance(wait, bool) or not wait >= 0):
            raise InvalidArgument(f"wait must be a number of seconds >= 0, got {wait!r}")
        if not self._pending and not self._ended and wait != 0:
            with anyio.move_on_after(math.inf if wait is None else wait):
                while not self._pending and not self._ended:
                    self._arrived.clear()
                    await self._arrived.wait()
        taken = list(self._pending)
        self._pending.clear()
        if not taken and self._error is not None:
            error, self._error = self._error, None
            raise error
        return taken

    async def __aiter__(self) -> AsyncIterator[FileEvent]:
        while True:
            batch = await self.events(wait=None)
            if not batch:
                return  # ended, or closed
            for event in batch:
                yield event

    async def close(self) -> None:
        """Stop watching; what was not read is dropped. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pending.clear()
        self._pump_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._pump_task
        self._ended = True
        self._arrived.set()
        if self._on_close is not None:
            self._on_close(self)

    async def __aenter__(self) -> Watcher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<watch {self.id} of {self.path} ({self.kind})>"
