"""One scheduler for every timer: a heap of deadlines and one task.

Each key (a sandbox id) has at most one live entry; rescheduling bumps the
key's generation and pushes a new entry, and stale entries are dropped when
they surface (lazy deletion), so a reschedule is O(log n) and nothing scans
all sandboxes. The task sleeps until the earliest deadline, is woken early
when an earlier one is pushed, and never keeps the process alive: it is a
plain task on the running loop, cancelled by ``close``.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import Callable, Coroutine
from typing import Any

from .clock import Clock

Callback = Callable[[str], Coroutine[Any, Any, None]]

#: Below this many entries the heap is never compacted (it costs nothing).
_COMPACT_MIN = 1024


class Scheduler:
    def __init__(self, clock: Clock, callback: Callback, *, drive: bool = True) -> None:
        self._clock = clock
        self._callback = callback
        self._heap: list[tuple[float, int, str, int]] = []
        self._generation: dict[str, int] = {}
        self._seq = itertools.count()
        self._drive = drive
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._running: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._generation)

    def schedule(self, key: str, due: float) -> None:
        generation = self._generation.get(key, 0) + 1
        self._generation[key] = generation
        earliest = self._heap[0][0] if self._heap else None
        heapq.heappush(self._heap, (due, next(self._seq), key, generation))
        if len(self._heap) > _COMPACT_MIN and len(self._heap) > 2 * len(self._generation):
            self._compact()
        if self._drive:
            self._ensure_task()
            if self._wake is not None and (earliest is None or due < earliest):
                self._wake.set()

    def cancel(self, key: str) -> None:
        self._generation.pop(key, None)

    def _compact(self) -> None:
        """Drop every stale entry at once. Stale entries normally go when they
        surface, but one superseded by an earlier due time (a shorter
        set_timeout) sits below the top until its own time; without this a
        sandbox whose deadline keeps moving earlier would grow the heap
        without bound. Amortized O(1) a push: it runs only once the stale
        entries outnumber the live ones."""
        generation = self._generation
        self._heap = [entry for entry in self._heap if generation.get(entry[2]) == entry[3]]
        heapq.heapify(self._heap)

    def next_due(self) -> float | None:
        self._drop_stale()
        return self._heap[0][0] if self._heap else None

    def _drop_stale(self) -> None:
        heap = self._heap
        while heap and self._generation.get(heap[0][2]) != heap[0][3]:
            heapq.heappop(heap)

    def run_due(self) -> list[asyncio.Task[None]]:
        """Start the callback of every entry that is due; return their tasks."""
        now = self._clock.monotonic()
        started = []
        while True:
            self._drop_stale()
            if not self._heap or self._heap[0][0] > now:
                break
            _, _, key, _ = heapq.heappop(self._heap)
            self._generation.pop(key, None)
            task = asyncio.get_running_loop().create_task(self._callback(key))
            self._running.add(task)
            task.add_done_callback(self._running.discard)
            started.append(task)
        return started

    def _ensure_task(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        assert self._wake is not None
        while True:
            due = self.next_due()
            self._wake.clear()
            if due is None:
                await self._wake.wait()
                continue
            delay = due - self._clock.monotonic()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)
                continue
            self.run_due()

    async def close(self) -> None:
        self._generation.clear()
        self._heap.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for task in list(self._running):
            task.cancel()
