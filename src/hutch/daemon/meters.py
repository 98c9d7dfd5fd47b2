"""Memory and disk over time: the daemon samples each running sandbox's
figures at a modest interval and keeps the last hour of them, so that a
dashboard opened now draws the past, not only what it sees from here on.

Cheap by construction: one read of each figure per running sandbox per
interval (a cgroup file, a ``statvfs`` or a walk of what the sandbox wrote,
as its provider measures it), nothing written to the store, and nothing
asked of a paused or suspended sandbox (a read must never wake one; its
plot has a gap where it slept). The samples live in a fixed ring of three
packed arrays per sandbox (24 bytes a sample: an hour at 10 s is ~9 KB),
dropped when the sandbox ends. With no running sandbox, a round costs one
timer wake-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from array import array
from collections.abc import Callable, Iterable
from typing import Any

import anyio

from .._errors import InvalidArgument
from .._sandbox import Sandbox, backend_of
from ..states import SandboxState
from .common import log

#: Seconds between two samples of a sandbox (``[server] meter_interval``).
DEFAULT_METER_INTERVAL = 10.0
#: Seconds of samples kept per sandbox.
DEFAULT_METER_KEEP_SECONDS = 3600.0
#: How a figure the provider could not tell is packed (the arrays hold integers).
_UNKNOWN = -1


class _Ring:
    """The last ``size`` samples of one sandbox, oldest overwritten first."""

    __slots__ = ("at", "disk", "memory", "next", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.at = array("d")
        self.memory = array("q")
        self.disk = array("q")
        #: Where the next sample goes once the ring is full.
        self.next = 0

    def add(self, at: float, memory: int | None, disk: int | None) -> None:
        packed = (_UNKNOWN if memory is None else memory, _UNKNOWN if disk is None else disk)
        if len(self.at) < self.size:
            self.at.append(at)
            self.memory.append(packed[0])
            self.disk.append(packed[1])
            return
        i = self.next
        self.at[i], self.memory[i], self.disk[i] = at, packed[0], packed[1]
        self.next = (i + 1) % self.size

    def samples(self) -> list[dict[str, Any]]:
        """Oldest first."""
        order = [*range(self.next, len(self.at)), *range(self.next)]
        return [{
            "at_unix": self.at[i],
            "memory_bytes": None if self.memory[i] == _UNKNOWN else self.memory[i],
            "disk_bytes": None if self.disk[i] == _UNKNOWN else self.disk[i],
        } for i in order]


class MeterHistory:
    """The daemon's samples of its running sandboxes' memory and disk."""

    def __init__(
        self, interval: float = DEFAULT_METER_INTERVAL,
        keep_seconds: float = DEFAULT_METER_KEEP_SECONDS,
    ) -> None:
        if not (0 < interval < math.inf and 0 < keep_seconds < math.inf):
            raise InvalidArgument(
                f"meter_interval must be a positive number of seconds, got {interval!r}")
        self.interval = float(interval)
        self.keep = max(1, math.ceil(keep_seconds / interval))
        self._rings: dict[str, _Ring] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self, sandboxes: Callable[[], Iterable[Sandbox]]) -> None:
        """Sample ``sandboxes()`` (the live ones) every interval until :meth:`stop`."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(sandboxes))

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._rings.clear()

    def forget(self, sandbox_id: str) -> None:
        self._rings.pop(sandbox_id, None)

    def history_json(self, sandbox_id: str) -> dict[str, Any]:
        """What the meters route answers for a sandbox (``wire.MeterHistory``)."""
        ring = self._rings.get(sandbox_id)
        return {"id": sandbox_id, "interval_seconds": self.interval,
                "samples": [] if ring is None else ring.samples()}

    async def _run(self, sandboxes: Callable[[], Iterable[Sandbox]]) -> None:
        while True:
            await anyio.sleep(self.interval)
            try:
                await self.sample(list(sandboxes()))
            except Exception:  # a figure for a dashboard: the next round tries again
                log.exception("sampling the sandboxes' memory and disk failed")

    async def sample(self, sandboxes: list[Sandbox]) -> None:
        """One round: a sample of each running sandbox; the rings of those
        that are gone dropped."""
        live = {s.id for s in sandboxes}
        for gone in [i for i in self._rings if i not in live]:
            del self._rings[gone]
        for sandbox in sandboxes:
            # Only a running one: a paused or suspended sandbox is not asked
            # anything (no figure of it is worth waking it).
            if sandbox.state is not SandboxState.RUNNING:
                continue
            backend = backend_of(sandbox)  # the figures, not the sandbox: no activity
            at, memory, disk = time.time(), None, None
            # A provider that is slow to answer costs its own sample, not the round.
            with anyio.move_on_after(self.interval):
                with contextlib.suppress(Exception):
                    memory = await backend.memory_bytes()
                with contextlib.suppress(Exception):
                    disk = await backend.disk_bytes()
            # Nothing told, or it ended (or slept) meanwhile: no sample.
            if (memory is None and disk is None) or sandbox.state is not SandboxState.RUNNING:
                continue
            ring = self._rings.get(sandbox.id)
            if ring is None:
                ring = self._rings[sandbox.id] = _Ring(self.keep)
            ring.add(at, memory, disk)
