"""Calls in flight on a sandbox, as every program on this host holding it sees them.

A program marks each call it makes on a shared sandbox with a shared
``flock`` on one file per sandbox (taken by the first of its calls, given
back by the last: two system calls, no disk write); a program about to take
the sandbox down (suspend it) takes the same lock exclusively. So a suspend
never starts while another program's call runs (it waits, or an idle timer
counts the sandbox busy), and a call that begins while one is under way is
refused its mark and goes the slow way: it waits for the suspend to be
recorded, then resumes the sandbox from it. The kernel drops a killed
program's locks with it.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

log = logging.getLogger("hutch.lifecycle")


class CallMark(enum.Enum):
    """What :meth:`InFlightCalls.begin` made of a call."""

    #: The first of this program's calls in flight: it took the shared lock.
    FIRST = "first"
    #: Another of this program's calls holds it already: this one rides on it.
    JOINED = "joined"
    #: A program (this one or another) is taking the sandbox down: not marked.
    REFUSED = "refused"


@dataclass
class _Lock:
    fd: int
    #: This program's calls in flight on the sandbox.
    calls: int = 0
    #: This program holds it exclusively (taking the sandbox down).
    exclusive: bool = False


class InFlightCalls:
    """The in-flight calls of this program, one lock file per sandbox in ``directory``."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._locks: dict[str, _Lock] = {}
        # Engines on several event loops (threads) may share one program's host.
        self._mutex = threading.Lock()

    def _lock(self, sandbox_id: str) -> _Lock:
        lock = self._locks.get(sandbox_id)
        if lock is None:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            fd = os.open(os.path.join(self.directory, sandbox_id),
                         os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            lock = self._locks[sandbox_id] = _Lock(fd)
        return lock

    def begin(self, sandbox_id: str) -> CallMark:
        """Mark a call starting on ``sandbox_id`` (never blocks)."""
        with self._mutex:
            lock = self._lock(sandbox_id)
            if lock.exclusive:
                return CallMark.REFUSED
            if lock.calls:
                lock.calls += 1
                return CallMark.JOINED
            try:
                fcntl.flock(lock.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return CallMark.REFUSED
            lock.calls = 1
            return CallMark.FIRST

    def end(self, sandbox_id: str) -> None:
        """A call :meth:`begin` marked (FIRST or JOINED) has ended."""
        with self._mutex:
            lock = self._locks.get(sandbox_id)
            if lock is None or not lock.calls:
                return
            lock.calls -= 1
            if not lock.calls and not lock.exclusive:
                fcntl.flock(lock.fd, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def held_off(self, sandbox_id: str) -> Iterator[bool]:
        """Hold off every other program's calls on ``sandbox_id`` while the
        block runs, if none is in flight now (never blocks). Yields whether
        it did; this program's own calls are its caller's to judge."""
        with self._mutex:
            lock = self._lock(sandbox_id)
            if lock.exclusive:  # held off already, by an enclosing block
                held, owner = True, False
            else:
                try:
                    # Converts this program's own shared hold, if it has one.
                    fcntl.flock(lock.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held = owner = lock.exclusive = True
                except BlockingIOError:
                    held = owner = False
                    if lock.calls:
                        self._share_again(sandbox_id, lock)
        try:
            yield held
        finally:
            if owner:
                with self._mutex:
                    lock.exclusive = False
                    if lock.calls:
                        self._share_again(sandbox_id, lock)
                    else:
                        fcntl.flock(lock.fd, fcntl.LOCK_UN)

    @staticmethod
    def _share_again(sandbox_id: str, lock: _Lock) -> None:
        """Take back this program's shared hold for its calls in flight (a
        conversion gives the lock up first; no other program holds it
        exclusively: only a holder of the sandbox's claim, this one, does)."""
        try:
            fcntl.flock(lock.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("sandbox %s: this program's calls in flight lost their mark", sandbox_id)

    def drop(self, sandbox_id: str, *, ended: bool) -> None:
        """This program holds ``sandbox_id`` no more: its lock file is closed,
        and removed once the sandbox has ended (no program calls it again)."""
        with self._mutex:
            lock = self._locks.pop(sandbox_id, None)
            if lock is not None:
                os.close(lock.fd)
            if ended:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.directory, sandbox_id))
