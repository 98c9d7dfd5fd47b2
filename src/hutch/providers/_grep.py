"""Regex matching for grep, in worker processes that are killed when cancelled.

Each call takes an idle worker (or starts one), hands it the work from a
thread, and gives it back when it answers. A call cancelled mid-way (its
timeout, its caller gone) kills that worker: a backtracking pattern stops
using the CPU at once, and nothing of it is left running. The event loop
never matches a caller's regex itself.
"""

from __future__ import annotations

import marshal
import re
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import anyio.to_thread

from .._errors import OutputLimitExceeded, ProviderError
from .._types import DEFAULT_OUTPUT_LIMIT, GrepMatch
from . import _grepworker
from ._grepworker import HEADER, match_cost

#: Idle workers kept for the next grep; more are started as calls overlap.
_MAX_IDLE = 2
#: Bytes of file content handed to a worker per request, so that a large
#: tree is never held in memory whole.
BATCH_BYTES = 4 * 1024 * 1024


class _Worker:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", _grepworker.__file__],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True,
        )

    def call(self, payload: bytes) -> Any:
        """Blocking: send one request, read its answer (None if the worker died)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(HEADER.pack(len(payload)) + payload)
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            return None
        header = self.proc.stdout.read(HEADER.size)
        if len(header) < HEADER.size:
            return None
        size = HEADER.unpack(header)[0]
        body = self.proc.stdout.read(size)
        return marshal.loads(body) if len(body) == size else None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


_idle: list[_Worker] = []
_idle_lock = threading.Lock()


def _take() -> _Worker:
    with _idle_lock:
        while _idle:
            worker = _idle.pop()
            if worker.proc.poll() is None:
                return worker
    return _Worker()


def _give_back(worker: _Worker) -> None:
    with _idle_lock:
        if len(_idle) < _MAX_IDLE:
            _idle.append(worker)
            return
    worker.kill()


#: What one grep may answer with: this many characters of matching lines.
GREP_OUTPUT_LIMIT = DEFAULT_OUTPUT_LIMIT
#: Characters of matching lines the grep under way may still answer with.
_budget: ContextVar[list[int] | None] = ContextVar("hutch_grep_budget", default=None)


@contextmanager
def grep_output_budget(chars: int = GREP_OUTPUT_LIMIT) -> Iterator[None]:
    """One grep: every matching call inside shares a cap of ``chars``."""
    token = _budget.set([chars])
    try:
        yield
    finally:
        _budget.reset(token)


def _too_much(cap: int) -> OutputLimitExceeded:
    return OutputLimitExceeded(
        f"grep matched more than the cap of {cap} characters of lines; "
        "narrow the path, the glob or the pattern"
    )


async def _ask(kind: str, pattern: re.Pattern[str], *args: Any) -> Any:
    budget = _budget.get()
    left = budget[0] if budget is not None else GREP_OUTPUT_LIMIT
    if left < 0:
        raise _too_much(GREP_OUTPUT_LIMIT)
    request = (kind, pattern.pattern, pattern.flags, left, *args)
    payload = marshal.dumps(request)
    worker = _take()
    answered = False
    try:
        # abandon_on_cancel: a cancel returns at once; the kill below ends
        # the worker, and with it the thread's blocking read.
        reply = await anyio.to_thread.run_sync(worker.call, payload, abandon_on_cancel=True)
        answered = reply is not None
    finally:
        if answered:
            _give_back(worker)
        else:
            worker.kill()
    if reply is None:
        raise ProviderError("the grep worker process died")
    if reply[0] == "error":
        if reply[1] == "too_large":
            raise OutputLimitExceeded(reply[2])
        if reply[1] == "too_much":
            raise _too_much(GREP_OUTPUT_LIMIT)
        raise ProviderError(f"grep failed: {reply[1]}: {reply[2]}")
    if budget is not None:
        result = reply[1]
        if kind == "lines":
            budget[0] -= sum(match_cost(args[0][i]) for i in result)
        else:
            budget[0] -= sum(match_cost(row[2]) for row in result)
    return reply[1]


def _matches(rows: Sequence[tuple[str, int, str]]) -> list[GrepMatch]:
    return [GrepMatch(path, number, line) for path, number, line in rows]


async def grep_contents(
    pattern: re.Pattern[str], contents: Sequence[tuple[str, bytes]]
) -> list[GrepMatch]:
    """The matching lines of files whose content is in hand."""
    if not contents:
        return []
    rows = await _ask("data", pattern, list(contents))
    return _matches(rows)


class GrepBatches:
    """File contents gathered as they are read and matched by
    :func:`grep_contents` a batch of about :data:`BATCH_BYTES` at a time, so
    that a large tree is never held in memory whole."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        self._pattern = pattern
        self._matches: list[GrepMatch] = []
        self._batch: list[tuple[str, bytes]] = []
        self._size = 0

    async def add(self, path: str, data: bytes) -> None:
        self._batch.append((path, data))
        self._size += len(data)
        if self._size >= BATCH_BYTES:
            await self._flush()

    async def _flush(self) -> None:
        self._matches.extend(await grep_contents(self._pattern, self._batch))
        self._batch, self._size = [], 0

    async def matches(self) -> list[GrepMatch]:
        """Every match of what was added (the last batch matched now)."""
        await self._flush()
        return self._matches


async def grep_host_files(
    pattern: re.Pattern[str], files: Sequence[tuple[str, str]], limit: int
) -> list[GrepMatch]:
    """The matching lines of host files, ``(path shown, host path)``, read by
    the worker: regular files only, each at most ``limit`` bytes."""
    if not files:
        return []
    rows = await _ask("files", pattern, limit, list(files))
    return _matches(rows)


async def matching_indices(pattern: re.Pattern[str], lines: Sequence[str]) -> list[int]:
    """Which of ``lines`` the pattern matches."""
    if not lines:
        return []
    found: list[int] = await _ask("lines", pattern, list(lines))
    return found
