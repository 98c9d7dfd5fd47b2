"""hutch's own freezes of a bubblewrap sandbox (a suspend, a capture), told
apart from the user's pause, and what a restart finds of one cut short.

While hutch holds a sandbox's cgroup frozen for a step of its own, a marker
file in the sandbox's directory says so, locked (``flock``) by the program
holding it. A program that dies inside the step (SIGKILL) leaves the
sandbox frozen and the marker unlocked: the next one to find the sandbox
(:func:`thaw_left`) thaws it, for the pause was never the user's. A
marker still locked is a living program's step, left alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator

from .cgroups import SandboxCgroup

MARKER = "frozen-by-hutch"


def marker_path(sandbox_dir: str) -> str:
    return os.path.join(sandbox_dir, MARKER)


@contextlib.contextmanager
def held(cgroup: SandboxCgroup, sandbox_dir: str) -> Iterator[None]:
    """The sandbox frozen for the block, by hutch, and thawed after it; one
    frozen already (the user's pause) stays as it is and is not marked."""
    if cgroup.frozen():
        yield
        return
    path = marker_path(sandbox_dir)
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        cgroup.freeze()
        try:
            yield
        finally:
            cgroup.thaw()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    finally:
        os.close(fd)


def thaw_left(cgroup: SandboxCgroup, sandbox_dir: str) -> bool:
    """Thaw a sandbox a program died holding frozen (its marker left,
    unlocked); whether it did."""
    path = marker_path(sandbox_dir)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a living program's freeze: its own to undo
        cgroup.thaw()
        os.unlink(path)
        return True
    finally:
        os.close(fd)
