"""One sandbox for many cases: whether a sandbox a case has used can take the
next one, as a fresh sandbox would, once its working directory is emptied.

Making a sandbox costs far more than most cases (a container, a pod, a
daemon's round trips), so a runner may keep one per provider and ask this
after each case. What a case cannot undo through the working directory
(the sandbox closed, left paused or suspended, a process or an operation
still open) makes the answer no, and the runner makes a new sandbox.
"""

from __future__ import annotations

from typing import Any

from hutch.states import SandboxState

from ._support import settle


async def ready_for_another_case(sandbox: Any) -> bool:
    """Whether ``sandbox`` can take another case: running, with no process
    listed and no operation open; its working directory is emptied first.
    Any error on the way is a no (the runner drops the sandbox), never raised."""
    try:
        if sandbox.closed:
            return False
        status = await settle(sandbox.status())
        if status.state is not SandboxState.RUNNING:
            return False
        if sandbox.capabilities.processes and await settle(sandbox.processes()):
            return False
        for entry in await sandbox.list_dir("."):
            await sandbox.remove(entry.name, recursive=True)
        if await sandbox.list_dir("."):
            return False
        info = await sandbox.info()
        return bool(info["open_operations"] == 0)
    except Exception:
        return False
