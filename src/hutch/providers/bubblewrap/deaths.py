"""Watching bubblewrap keepers for deaths outside hutch's hands.

A sandbox runs as long as its keeper does: bwrap's init (PID 1 inside,
whose namespaces an exec joins) and the outer bwrap (through which the host
reaches the sandbox's files). Either one killed leaves a sandbox no call can
use. The watcher holds a pidfd of each (``pidfd_open``), readable once the
process ends, and sleeps on them: the kernel wakes it, nothing is polled.
A keeper started in any thread wakes it too (:func:`keepers_changed`), to be
watched from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Mapping
from typing import Protocol

from ..base import RuntimeNotice, RuntimeReport
from .provisioning import Keeper

log = logging.getLogger("hutch.bubblewrap")

#: How long the watcher waits on its descriptors before it looks at every
#: live sandbox anyway (a backstop; a death or a new keeper wakes it at once).
WATCH_BACKSTOP = 30.0

#: The running watchers' loops and wake-up events.
_watchers: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []


class Watched(Protocol):
    """A live sandbox, as the watcher sees it."""

    @property
    def watched_keeper(self) -> Keeper | None:
        """Its keeper while it is meant to run (None: suspended or closed)."""

    def death_reason(self) -> str:
        """Why its keeper is gone, in words for a person."""


def keepers_changed() -> None:
    """A keeper started or came under this process (from any thread): the
    watchers look again."""
    for loop, wake in list(_watchers):
        with contextlib.suppress(RuntimeError):  # that loop has ended
            loop.call_soon_threadsafe(wake.set)


async def watch_keepers(live: Callable[[], Mapping[str, Watched]],
                        report: RuntimeReport) -> None:
    """Until cancelled, report each sandbox of ``live()`` whose keeper ends
    while it is meant to run, once per keeper."""
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()
    watched: dict[str, tuple[Keeper, list[int]]] = {}
    reported: dict[str, Keeper] = {}
    tasks: set[asyncio.Task[None]] = set()

    def unwatch(sandbox_id: str) -> None:
        _, fds = watched.pop(sandbox_id, (None, []))
        for fd in fds:
            loop.remove_reader(fd)
            os.close(fd)

    async def tell(sandbox_id: str, reason: str) -> None:
        try:
            await report(RuntimeNotice(sandbox_id, reason))
        except Exception:
            log.exception("sandbox %s: reporting its death failed", sandbox_id)

    _watchers.append((loop, wake))
    try:
        while True:
            wake.clear()
            sandboxes = dict(live())
            for sandbox_id in [s for s in (*watched, *reported) if s not in sandboxes]:
                unwatch(sandbox_id)
                reported.pop(sandbox_id, None)
            for sandbox_id, sandbox in sandboxes.items():
                keeper = sandbox.watched_keeper
                if keeper is None or reported.get(sandbox_id) is keeper:
                    unwatch(sandbox_id)
                    continue
                if watched.get(sandbox_id, (None, []))[0] is not keeper:
                    unwatch(sandbox_id)
                    fds = keeper.pidfds()
                    for fd in fds:
                        loop.add_reader(fd, wake.set)
                    watched[sandbox_id] = (keeper, fds)
                if not keeper.alive():
                    unwatch(sandbox_id)
                    reported[sandbox_id] = keeper
                    task = loop.create_task(tell(sandbox_id, sandbox.death_reason()))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), WATCH_BACKSTOP)
    finally:
        _watchers.remove((loop, wake))
        for sandbox_id in list(watched):
            unwatch(sandbox_id)
        for task in tasks:
            task.cancel()
