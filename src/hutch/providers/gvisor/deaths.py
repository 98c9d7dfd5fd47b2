"""Why a gvisor sandbox ended outside hutch's hands, and the watcher that
tells (:func:`watch_runtimes`).

A sandbox's kernel (runsc's sentry) that dies writes why to its panic log
(:data:`runsc.PANIC_LOG`) and nowhere else. One end is known by cause: the
process limit. On this runsc (Debian's 2022 build, ptrace platform) each
process in the sandbox is a process of the host's too (its address space's
stub), in the sandbox's host cgroup, whose pids limit is ``pids_limit``.
Past it the host refuses the stub, and the sentry cannot go on without it:
it panics, and the whole sandbox ends. Nothing bounds the sandbox's own
processes below that limit on this build (it neither enforces
RLIMIT_NPROC nor has the pids controller in its own cgroups), so a fork
bomb ends the sandbox where on docker and bubblewrap it only fails forks.
The panic does not always say so (the sentry may trip on the address space
it could not make before it says why), so the host's count of refused forks
(:func:`.cgroups.refused_forks`) is asked first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from ..base import RuntimeNotice, RuntimeReport
from . import bundle, cgroups, runsc

log = logging.getLogger("hutch.gvisor")

#: What the sentry's panic says when the host refused it a process (a stub)
#: or a thread (Go's runtime): EAGAIN, the cgroup's pids limit.
_REFUSED = ("resource temporarily unavailable", "errno=11", "failed to create new os thread")
_PANIC_HEAD = 4096


def _panic(sandbox_dir: str) -> str:
    """The first line of the sandbox kernel's panic, or "" (none)."""
    try:
        with open(os.path.join(sandbox_dir, runsc.PANIC_LOG), "rb") as found:
            head = found.read(_PANIC_HEAD).decode(errors="replace")
    except OSError:
        return ""
    for line in head.splitlines():
        if line.strip():
            return line.strip()[:300]
    return ""


def death_reason(sandbox_dir: str, container: str) -> str | None:
    """Why the sandbox kept in ``sandbox_dir`` ended, running as
    ``container``, where its kernel said (a panic); None where it said
    nothing."""
    panic = _panic(sandbox_dir)
    if not panic:
        return None
    if (cgroups.refused_forks(container) or 0) > 0 \
            or any(sign in panic.lower() for sign in _REFUSED):
        limit = bundle.pids_limit(os.path.join(sandbox_dir, "bundle"))
        named = f"pids_limit {limit}" if limit is not None else "its pids_limit"
        return (f"its processes reached the process limit ({named}): gVisor's kernel "
                f"needs a host process for each one, and ended when the host refused "
                f"one (this runsc cannot refuse the sandbox's forks before that); "
                f"its kernel said: {panic}")
    return f"gVisor's kernel panicked: {panic}"


def sandbox_of(container: str) -> str:
    """The sandbox a runsc container id is of (``ID``, or ``N+ID`` after a restore)."""
    return container.partition("+")[2] or container


async def watch_runtimes(report: RuntimeReport) -> None:
    """Until cancelled, report each sandbox whose runsc (started by this
    process) ends with its kernel's panic: a death, with its reason. An end
    hutch made (a checkpoint, a close) writes no panic and is not told."""
    loop = asyncio.get_running_loop()
    ended: asyncio.Queue[tuple[str, str]] = asyncio.Queue()

    def tell(container: str, panic_log: str) -> None:
        with contextlib.suppress(RuntimeError):  # that loop has ended
            loop.call_soon_threadsafe(ended.put_nowait, (container, panic_log))

    stop = runsc.on_end(tell)
    try:
        while True:
            container, panic_log = await ended.get()
            reason = await asyncio.to_thread(
                death_reason, os.path.dirname(panic_log), container)
            if reason is None:
                continue
            sandbox_id = sandbox_of(container)
            try:
                await report(RuntimeNotice(sandbox_id, f"gvisor sandbox ended: {reason}"))
            except Exception:
                log.exception("sandbox %s: reporting its death failed", sandbox_id)
    finally:
        stop()
