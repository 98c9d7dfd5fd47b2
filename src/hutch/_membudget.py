"""What callers' bytes may hold of this process's memory, all calls together.

One budget for the whole process (memory is the process's, not a call's):
what calls keep in memory on a caller's behalf (a request body being parsed,
the first piece of a command's output) is taken from it and given back when
the call ends. Output never waits on it: a :class:`Spool` whose share is
refused goes to disk at once. What cannot go to disk (a JSON body being
parsed) is refused with :class:`~hutch._errors.DaemonBusy` when the budget is
spent, so the daemon answers every caller instead of running out of memory.

The daemon sizes it and names the directory spools spill to (its data
directory) at start: :func:`configure`.
"""

from __future__ import annotations

import os
import tempfile
import threading
from typing import Any

from ._errors import DaemonBusy

#: The budget of a process that sets none, bytes.
DEFAULT_MEMORY_BUDGET = 512 * 1024 * 1024
#: What one spool keeps in memory before it moves to disk, bytes.
SPOOL_MEMORY_BYTES = 256 * 1024


class MemoryBudget:
    """Bytes a process lets callers hold at once; thread-safe."""

    def __init__(self, total: int) -> None:
        if total <= 0:
            raise ValueError(f"a memory budget must be positive, got {total}")
        self.total = total
        self.held = 0
        self._lock = threading.Lock()

    def try_take(self, size: int) -> bool:
        """Take ``size`` bytes if the budget has them; whether it did."""
        with self._lock:
            if self.held + size > self.total:
                return False
            self.held += size
            return True

    def take(self, size: int, what: str) -> None:
        """Take ``size`` bytes for ``what``, or raise ``DaemonBusy``."""
        if not self.try_take(size):
            raise DaemonBusy(
                f"{what} needs {size} bytes of memory and the daemon already holds "
                f"{self.held} of its memory budget of {self.total} for its callers; "
                "retry shortly (large input goes best as a file upload)"
            )

    def give(self, size: int) -> None:
        with self._lock:
            self.held = max(0, self.held - size)


class MemoryHold:
    """``size`` bytes taken from the process's budget for ``what`` (or
    ``DaemonBusy``), until :meth:`release` (idempotent)."""

    def __init__(self, size: int, what: str) -> None:
        self._budget = _budget
        self._size = size
        if size:
            self._budget.take(size, what)

    def release(self) -> None:
        size, self._size = self._size, 0
        if size:
            self._budget.give(size)


_budget = MemoryBudget(DEFAULT_MEMORY_BUDGET)
_spill_dir: str | None = None


def budget() -> MemoryBudget:
    """This process's budget."""
    return _budget


def configure(total: int | None = None, spill_dir: str | None = None) -> None:
    """Size this process's budget (a new one: what is held under the old one
    is given back to it) and name where spools spill (None: the system's
    temporary directory, as before)."""
    global _budget, _spill_dir
    if total is not None:
        _budget = MemoryBudget(total)
    if spill_dir is not None:
        os.makedirs(spill_dir, mode=0o700, exist_ok=True)
        _spill_dir = spill_dir


class Spool(tempfile.SpooledTemporaryFile):  # type: ignore[type-arg]
    """Bytes in memory while they are few and the budget has room, on disk
    (an unlinked temporary file: gone with the process, whatever happens)
    past ``memory_max`` or as soon as the budget refuses more."""

    def __init__(self, memory_max: int = SPOOL_MEMORY_BYTES) -> None:
        # max_size=0: never moves on its own; write() decides, with the budget.
        super().__init__(max_size=0, mode="w+b", dir=_spill_dir)
        self._memory_max = memory_max
        self._budget = _budget
        #: Bytes of the budget this spool holds (its in-memory size).
        self._held = 0
        self._on_disk = False

    @property
    def on_disk(self) -> bool:
        return self._on_disk

    def write(self, data: Any) -> int:
        if not self._on_disk:
            end = max(self.tell() + len(data), self._held)
            more = end - self._held
            if end > self._memory_max or not self._budget.try_take(more):
                self.rollover()
            else:
                self._held = end
        return int(super().write(data))

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def rollover(self) -> None:
        if not self._on_disk:
            self._on_disk = True
            super().rollover()
            self._release()

    def _release(self) -> None:
        held, self._held = self._held, 0
        if held:
            self._budget.give(held)

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._release()

    def __del__(self) -> None:
        # A spool is dropped unread as a matter of course (the output of a
        # background command whose handle nobody reads, the commands a
        # sandbox's end forgets): collected, it is closed and its share given
        # back, with no ResourceWarning (SpooledTemporaryFile's own warns).
        if not self.closed:
            self.close()
