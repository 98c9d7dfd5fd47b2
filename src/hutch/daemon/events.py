"""The daemon's event log, followed live: a follower is woken when the
daemon writes an event (every write goes through the async store, which
tells of it), then reads what is new. Nothing polls the store in a loop; a
follower looks again on its own only every :data:`RECHECK_SECONDS`, for events
another program sharing the store wrote."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

#: The store calls that write an event (``put_sandbox`` with one, ``log_event``).
EVENT_WRITES = frozenset({"put_sandbox", "log_event"})
#: How often a follower looks without being woken (other programs' events).
RECHECK_SECONDS = 5.0
#: The most events one look reads.
READ_LIMIT = 1000

Reader = Callable[[str | None, int], Awaitable[list[dict[str, Any]]]]


class EventFeed:
    """Wakes the followers of the event log when the daemon writes to it."""

    def __init__(self, read: Reader) -> None:
        self._read = read
        self._waiting: set[asyncio.Event] = set()

    def store_call(self, call: str) -> None:
        """The async store finished ``call`` (on the event loop)."""
        if call in EVENT_WRITES:
            for woken in self._waiting:
                woken.set()

    async def follow(self, subject: str | None, backlog: int) -> AsyncIterator[dict[str, Any]]:
        """The newest ``backlog`` events (of ``subject``, or all), then each
        new one as it is written, oldest first, until the caller stops."""
        woken = asyncio.Event()
        self._waiting.add(woken)  # before the first read: a write after it wakes the first wait
        try:
            found = await self._read(subject, max(backlog, 1))
            seen = max((int(e["seq"]) for e in found), default=-1)
            for event in found[-backlog:] if backlog else ():
                yield event
            while True:
                try:
                    await asyncio.wait_for(woken.wait(), RECHECK_SECONDS)
                except TimeoutError:
                    pass
                woken.clear()  # before the read: a write during it wakes the next wait
                for event in await self._read(subject, READ_LIMIT):
                    if int(event["seq"]) > seen:
                        seen = int(event["seq"])
                        yield event
        finally:
            self._waiting.discard(woken)
