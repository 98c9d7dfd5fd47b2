"""Running commands on top of a backend: exec with timeout and output cap,
background processes with wait / stream / kill.

Written once for every provider against :class:`BackendProcess`.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio

from ._errors import ExecTimeout, NotFound, OutputLimitExceeded
from ._types import KILL_GRACE_SECONDS, ExecResult, OutputChunk
from ._types import ExitStatus as ExitStatus  # its home was here
from .providers.base import BackendProcess

StreamEvent = OutputChunk | ExitStatus


def _limit_error(limit: int) -> OutputLimitExceeded:
    return OutputLimitExceeded(
        f"command output exceeded the cap of {limit} bytes; the command was killed "
        "(raise output_limit, or redirect the output to a file and read it in parts)"
    )


async def kill_shielded(proc: BackendProcess) -> None:
    # Cleanup must finish even when the caller is being cancelled.
    with anyio.CancelScope(shield=True):
        await proc.kill(KILL_GRACE_SECONDS)


async def run_to_completion(
    proc: BackendProcess, *, timeout: float | None, output_limit: int
) -> ExecResult:
    """Collect a process's output and exit code, enforcing timeout and cap."""
    out: list[bytes] = []
    err: list[bytes] = []
    total = 0
    try:
        with anyio.fail_after(timeout):
            while (chunk := await proc.read()) is not None:
                total += len(chunk.data)
                if total > output_limit:
                    raise _limit_error(output_limit)
                (out if chunk.stream == "stdout" else err).append(chunk.data)
            code = await proc.wait()
    except TimeoutError:
        await kill_shielded(proc)
        raise ExecTimeout(
            f"command timed out after {timeout} s; its whole process tree was killed"
        ) from None
    except BaseException:
        await kill_shielded(proc)
        raise
    return ExecResult(code, b"".join(out), b"".join(err), oom_killed=proc.oom_killed)


#: Output a background command keeps in memory; past it, its output is on disk.
SPOOL_MEMORY_BYTES = 256 * 1024


class OutputSpool:
    """A background command's output in the order it came: the first
    :data:`SPOOL_MEMORY_BYTES` in memory, the rest in a temporary file, so
    that many chatty commands cost the daemon disk, not memory.

    Consecutive pieces of one stream are kept as one run, so the index stays
    as small as the number of switches between stdout and stderr.
    """

    def __init__(self) -> None:
        self._file = tempfile.SpooledTemporaryFile(max_size=SPOOL_MEMORY_BYTES)  # noqa: SIM115
        #: [stream, offset, length] of each run.
        self.runs: list[list[Any]] = []
        self.size = 0

    def append(self, chunk: OutputChunk) -> None:
        self._file.seek(0, 2)
        self._file.write(chunk.data)
        if self.runs and self.runs[-1][0] == chunk.stream:
            self.runs[-1][2] += len(chunk.data)
        else:
            self.runs.append([chunk.stream, self.size, len(chunk.data)])
        self.size += len(chunk.data)

    def read(self, offset: int, length: int) -> bytes:
        self._file.seek(offset)
        return self._file.read(length)

    def joined(self, stream: str) -> bytes:
        return b"".join(
            self.read(offset, length) for name, offset, length in self.runs if name == stream
        )

    def close(self) -> None:
        self._file.close()


class Process:
    """A command started in the background: wait on it, stream it, kill it.

    A pump task reads its output as it comes (so a chatty job never blocks on
    a full pipe) into an :class:`OutputSpool` capped at ``output_limit``; past
    the cap the command is killed and ``wait`` raises ``OutputLimitExceeded``.
    Once its owner forgets it (:meth:`release`), its output is gone.
    """

    def __init__(
        self,
        backend_proc: BackendProcess,
        *,
        command: str,
        output_limit: int,
        on_exit: Callable[[Process], None] | None = None,
    ) -> None:
        self.id = uuid.uuid4().hex[:12]
        self.command = command
        self._proc = backend_proc
        self._limit = output_limit
        self._spool = OutputSpool()
        self._released = False
        #: time.monotonic() when it ended; None while it runs.
        self.ended_at: float | None = None
        self._exit_code: int | None = None
        self._error: BaseException | None = None
        self._changed = asyncio.Condition()
        self._done = asyncio.Event()
        self._on_exit = on_exit
        self._pump_task = asyncio.get_running_loop().create_task(self._pump())

    @property
    def running(self) -> bool:
        return not self._done.is_set()

    @property
    def exit_code(self) -> int | None:
        return self._exit_code

    async def _pump(self) -> None:
        try:
            while (chunk := await self._proc.read()) is not None:
                if self._spool.size + len(chunk.data) > self._limit:
                    raise _limit_error(self._limit)
                async with self._changed:
                    self._spool.append(chunk)
                    self._changed.notify_all()
            self._exit_code = await self._proc.wait()
        except asyncio.CancelledError:
            await kill_shielded(self._proc)
            self._error = ExecTimeout("background command was cancelled and killed")
            raise
        except BaseException as exc:
            await kill_shielded(self._proc)
            self._error = exc
            self._exit_code = self._proc.returncode
        finally:
            self.ended_at = time.monotonic()
            self._done.set()
            async with self._changed:
                self._changed.notify_all()
            if self._on_exit is not None:
                self._on_exit(self)

    async def wait(self, timeout: float | None = None) -> ExecResult:
        """Wait for the command to end; ``ExecTimeout`` if it outlives ``timeout``
        (the command keeps running: kill it if that is what you want)."""
        try:
            with anyio.fail_after(timeout):
                await self._done.wait()
        except TimeoutError:
            raise ExecTimeout(
                f"background command {self.id} still running after {timeout} s"
            ) from None
        if self._error is not None:
            raise self._error
        self._check_kept()
        out, err = self._spool.joined("stdout"), self._spool.joined("stderr")
        return ExecResult(self._exit_code if self._exit_code is not None else -1, out, err,
                          oom_killed=self._proc.oom_killed)

    def _check_kept(self) -> None:
        if self._released:
            raise NotFound(
                f"background command {self.id} ended and its output was dropped "
                "(finished commands are kept for a while; read them sooner)"
            )

    async def stream(self) -> AsyncIterator[StreamEvent]:
        """Every output chunk from the start, live, then the exit status."""
        position = 0  # bytes of the spool already handed out
        while True:
            async with self._changed:
                while position >= self._spool.size and not self._done.is_set():
                    await self._changed.wait()
                done = self._done.is_set()
            self._check_kept()
            end = self._spool.size
            for name, offset, length in list(self._spool.runs):
                start, stop = max(offset, position), min(offset + length, end)
                if start < stop:
                    yield OutputChunk(name, self._spool.read(start, stop - start))
                    self._check_kept()
            position = end
            if done and position >= self._spool.size:
                if self._error is not None:
                    raise self._error
                yield ExitStatus(self._exit_code if self._exit_code is not None else -1,
                                 oom_killed=self._proc.oom_killed)
                return

    def _release(self) -> None:
        self._released = True
        self._spool.close()

    async def kill(self) -> None:
        """End the command's whole process tree (SIGTERM, a grace, SIGKILL)."""
        if self._done.is_set():
            return
        await kill_shielded(self._proc)
        with anyio.move_on_after(KILL_GRACE_SECONDS + 5):
            await self._done.wait()


def release_output(process: Process) -> None:
    """Drop the output of an ended command: its sandbox has forgotten it.

    The sandbox's housekeeping, not a method: a caller holding a handle
    (in-process or remote) never needs it.
    """
    process._release()
