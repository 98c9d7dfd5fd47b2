"""Running commands on top of a backend: exec with timeout and output cap,
background processes with wait / stream / kill.

Written once for every provider against :class:`BackendProcess`.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, Literal

import anyio

from ._errors import (
    ExecTimeout,
    InvalidArgument,
    KillIncomplete,
    NotFound,
    OutputLimitExceeded,
    StdinClosed,
)
from ._membudget import MemoryHold, Spool
from ._types import KILL_GRACE_SECONDS, ExecResult, ExitStatus, OutputChunk
from ._values import check_text
from .providers.base import BackendProcess

StreamEvent = OutputChunk | ExitStatus


def _limit_error(limit: int) -> OutputLimitExceeded:
    return OutputLimitExceeded(
        f"command output exceeded the cap of {limit} bytes; the command was killed "
        "(raise output_limit, or redirect the output to a file and read it in parts)"
    )


#: Told of a kill that left processes (to record it as an event of the
#: sandbox), before the error goes on to the caller.
KillLeft = Callable[[KillIncomplete], Awaitable[None]]


async def kill_shielded(proc: BackendProcess, left: KillLeft | None = None) -> None:
    # Cleanup must finish even when the caller is being cancelled.
    with anyio.CancelScope(shield=True):
        try:
            await proc.kill(KILL_GRACE_SECONDS)
        except KillIncomplete as exc:
            if left is not None:
                await left(exc)
            raise


async def kill_after(
    proc: BackendProcess, failure: BaseException, left: KillLeft | None = None
) -> KillIncomplete | None:
    """The cleanup kill on a failure's path: the failure stays what is
    raised (a lost connection, a cancel); a kill that could not end the tree
    is said beside it, as a note, and returned for whoever keeps the outcome."""
    try:
        await kill_shielded(proc, left)
    except KillIncomplete as exc:
        failure.add_note(str(exc))
        return exc
    return None


async def collect_output(
    proc: BackendProcess, *, timeout: float | None, output_limit: int,
    kill_left: KillLeft | None = None,
) -> ExecOutput:
    """A process's output (spooled: memory, then disk) and exit code,
    enforcing timeout and cap."""
    spool = OutputSpool()
    try:
        with anyio.fail_after(timeout):
            while (chunk := await proc.read()) is not None:
                if spool.size + len(chunk.data) > output_limit:
                    raise _limit_error(output_limit)
                spool.append(chunk)
            code = await proc.wait()
    except TimeoutError:
        spool.close()
        await kill_shielded(proc, kill_left)
        raise ExecTimeout(
            f"command timed out after {timeout} s; its whole process tree was killed"
        ) from None
    except BaseException as failure:
        spool.close()
        await kill_after(proc, failure, kill_left)
        raise
    return ExecOutput(code, spool, oom_killed=proc.oom_killed)


async def run_to_completion(
    proc: BackendProcess, *, timeout: float | None, output_limit: int
) -> ExecResult:
    """Collect a process's output and exit code, enforcing timeout and cap."""
    with await collect_output(proc, timeout=timeout, output_limit=output_limit) as output:
        return output.result()


#: The most one piece read out of a spool holds: a stream's event, a
#: response's write.
PIECE_BYTES = 64 * 1024

Stream = Literal["stdout", "stderr"]


class OutputSpool:
    """A command's output in the order it came: the first
    :data:`~hutch._membudget.SPOOL_MEMORY_BYTES` in memory (while the
    process's memory budget has room), the rest in a temporary file, so that
    many chatty commands cost the daemon disk, not memory.

    Consecutive pieces of one stream are kept as one run, so the index stays
    as small as the number of switches between stdout and stderr. Whether
    each stream is valid UTF-8 is learnt as it comes (an answer tells it
    before its text). Readers that :meth:`hold` it keep it open past
    :meth:`close` until they let go.
    """

    def __init__(self) -> None:
        self._file = Spool()
        #: [stream, offset, length] of each run.
        self.runs: list[list[Any]] = []
        self.size = 0
        self._sizes = {"stdout": 0, "stderr": 0}
        self._decoders = {name: codecs.getincrementaldecoder("utf-8")() for name in self._sizes}
        self._utf8 = {"stdout": True, "stderr": True}
        self._readers = 0
        self._closing = False

    def append(self, chunk: OutputChunk) -> None:
        self._file.seek(0, 2)
        self._file.write(chunk.data)
        if self.runs and self.runs[-1][0] == chunk.stream:
            self.runs[-1][2] += len(chunk.data)
        else:
            self.runs.append([chunk.stream, self.size, len(chunk.data)])
        self.size += len(chunk.data)
        self._sizes[chunk.stream] += len(chunk.data)
        self._learn_utf8(chunk)

    def _learn_utf8(self, chunk: OutputChunk) -> None:
        if not self._utf8[chunk.stream]:
            return
        decoder = self._decoders[chunk.stream]
        if chunk.data.isascii() and not decoder.getstate()[0]:
            return  # the common case, at a fraction of a decode's cost
        try:
            decoder.decode(chunk.data)
        except UnicodeDecodeError:
            self._utf8[chunk.stream] = False

    def stream_size(self, stream: Stream) -> int:
        return self._sizes[stream]

    def is_utf8(self, stream: Stream) -> bool:
        """Whether what ``stream`` holds so far is whole, valid UTF-8."""
        return self._utf8[stream] and not self._decoders[stream].getstate()[0]

    def read(self, offset: int, length: int) -> bytes:
        self._file.seek(offset)
        return bytes(self._file.read(length))

    def pieces(self, stream: Stream, piece: int = PIECE_BYTES) -> Iterator[bytes]:
        """What ``stream`` holds, in order, at most ``piece`` bytes at a time."""
        for name, offset, length in list(self.runs):
            if name != stream:
                continue
            for start in range(offset, offset + length, piece):
                yield self.read(start, min(piece, offset + length - start))

    def joined(self, stream: Stream) -> bytes:
        return b"".join(self.pieces(stream, max(1, self._sizes[stream])))

    def hold(self) -> None:
        """Keep it open for a reader (until :meth:`let_go`), closed or not."""
        self._readers += 1

    def let_go(self) -> None:
        self._readers -= 1
        if self._closing and self._readers <= 0:
            self._file.close()

    def close(self) -> None:
        self._closing = True
        if self._readers <= 0:
            self._file.close()


class ExecOutput:
    """A finished command: its exit status and its output, spooled (memory,
    then disk), for a caller to take whole (:meth:`result`) or in pieces
    (:meth:`pieces`: a large output never whole in memory). Close it (or use
    it as a context manager) to free the spool."""

    def __init__(
        self, exit_code: int, spool: OutputSpool, *, oom_killed: bool = False,
        owns_spool: bool = True,
    ) -> None:
        self.exit_code = exit_code
        self.oom_killed = oom_killed
        self._spool = spool
        #: Whether closing it closes the spool (not a background command's,
        #: which others may read again).
        self._owns_spool = owns_spool
        spool.hold()
        self._open = True

    @property
    def size(self) -> int:
        """Bytes of output, both streams."""
        return self._spool.size

    def stream_size(self, stream: Stream) -> int:
        return self._spool.stream_size(stream)

    def is_utf8(self, stream: Stream) -> bool:
        return self._spool.is_utf8(stream)

    def pieces(self, stream: Stream, piece: int = PIECE_BYTES) -> Iterator[bytes]:
        return self._spool.pieces(stream, piece)

    def result(self) -> ExecResult:
        """The whole output in memory, as :meth:`Sandbox.exec` answers."""
        return ExecResult(self.exit_code, self._spool.joined("stdout"),
                          self._spool.joined("stderr"), oom_killed=self.oom_killed)

    def close(self) -> None:
        if self._open:
            self._open = False
            self._spool.let_go()
            if self._owns_spool:
                self._spool.close()

    def __enter__(self) -> ExecOutput:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


#: How long a stdin write still pending when its command ends is given to
#: answer before it is called refused (a write blocked on a pipe nobody reads).
STDIN_ANSWER_AFTER_END = 1.0


class Process:
    """A command started in the background: wait on it, stream it, kill it.

    A pump task reads its output as it comes (so a chatty job never blocks on
    a full pipe) into an :class:`OutputSpool` capped at ``output_limit``; past
    the cap the command is killed and ``wait`` raises ``OutputLimitExceeded``.
    Once its owner forgets it (:meth:`release`), its output is gone.
    """

    id: str

    def __init__(
        self,
        backend_proc: BackendProcess,
        *,
        command: str,
        output_limit: int,
        on_exit: Callable[[Process], None] | None = None,
        hold: MemoryHold | None = None,
        keep_stdin: bool = False,
        kill_left: KillLeft | None = None,
    ) -> None:
        self.id = uuid.uuid4().hex[:12]
        #: Its stdin: "open" (kept open at its start, not closed since),
        #: "closed" (by close_stdin) or "none" (not kept open).
        self._stdin = "open" if keep_stdin else "none"
        #: One write (or close) at a time, in the order they were asked for.
        self._stdin_turn = asyncio.Lock()
        #: Memory it holds of the budget while it runs (its stdin), given back at its end.
        self._hold = hold
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
        self._kill_left = kill_left
        self._pump_task = asyncio.get_running_loop().create_task(self._pump())

    @property
    def running(self) -> bool:
        return not self._done.is_set()

    @property
    def exit_code(self) -> int | None:
        return self._exit_code

    @property
    def stdin_open(self) -> bool:
        """Whether :meth:`write_stdin` can write: started with ``keep_stdin``,
        not closed since, still running."""
        return self._stdin == "open" and self.running

    def _stdin_refusal(self, what: str) -> StdinClosed:
        if self._stdin == "none":
            why = "it was started without keep_stdin (start it with keep_stdin=True to write to it)"
        elif not self.running:
            why = "it has ended"
        else:
            why = "its stdin was closed"
        return StdinClosed(f"cannot {what} the stdin of background command {self.id}: {why}")

    async def write_stdin(self, data: bytes | str) -> None:
        """Write ``data`` (text as UTF-8) to the command's stdin. Returns once
        its pipe took them: a command that does not read makes this wait (as
        a full pipe does), until it reads, ends or is killed. ``StdinClosed``
        unless it was started with ``keep_stdin`` and its stdin is still
        open; the bytes of writes made one after another arrive in order."""
        if isinstance(data, str):
            check_text(data, "stdin", nul=False)
            data = data.encode()
        elif isinstance(data, bytearray | memoryview):
            data = bytes(data)
        elif not isinstance(data, bytes):
            raise InvalidArgument(f"stdin must be bytes or text, not {type(data).__name__}")
        async with self._stdin_turn:
            if not self.stdin_open:
                raise self._stdin_refusal("write to")
            await self._until_done(self._proc.write_stdin(data), "write to")

    async def close_stdin(self) -> None:
        """Close the command's stdin: it reads its end of file (``cat`` ends).
        Closing it again, or once the command ended, does nothing;
        ``StdinClosed`` for a command started without ``keep_stdin``."""
        async with self._stdin_turn:
            if self._stdin == "none":
                raise self._stdin_refusal("close")
            if not self.stdin_open:
                return
            self._stdin = "closed"
            with contextlib.suppress(StdinClosed):  # it ended meanwhile: closed anyway
                await self._until_done(self._proc.close_stdin(), "close")

    async def _until_done(self, step: Awaitable[None], what: str) -> None:
        """``step`` on the command's stdin, given up (StdinClosed) if the
        command ends first and ``step`` has not answered
        :data:`STDIN_ANSWER_AFTER_END` later: a write waiting on a pipe nobody
        reads any more."""
        task = asyncio.ensure_future(step)
        ended = asyncio.ensure_future(self._done.wait())
        try:
            await asyncio.wait({task, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
        if not task.done():
            # The end may be heard before the step's own answer (over a wire):
            # a step whose bytes were taken answers soon after, and is no refusal.
            await asyncio.wait({task}, timeout=STDIN_ANSWER_AFTER_END)
        if task.done():
            task.result()
            return
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise StdinClosed(
            f"cannot {what} the stdin of background command {self.id}: it has ended"
        )

    async def _pump(self) -> None:
        try:
            while (chunk := await self._proc.read()) is not None:
                if self._spool.size + len(chunk.data) > self._limit:
                    raise _limit_error(self._limit)
                async with self._changed:
                    self._spool.append(chunk)
                    self._changed.notify_all()
            self._exit_code = await self._proc.wait()
        except asyncio.CancelledError as cancel:
            left = await kill_after(self._proc, cancel, self._kill_left)
            self._error = left or ExecTimeout("background command was cancelled and killed")
            raise
        except BaseException as exc:
            await kill_after(self._proc, exc, self._kill_left)
            self._error = exc
            self._exit_code = self._proc.returncode
        finally:
            if self._hold is not None:
                self._hold.release()
            self.ended_at = time.monotonic()
            self._done.set()
            async with self._changed:
                self._changed.notify_all()
            if self._on_exit is not None:
                self._on_exit(self)

    async def wait(self, timeout: float | None = None) -> ExecResult:
        """Wait for the command to end; ``ExecTimeout`` if it outlives ``timeout``
        (the command keeps running: kill it if that is what you want)."""
        with await self._wait_output(timeout) as output:
            return output.result()

    async def _wait_output(self, timeout: float | None = None) -> ExecOutput:
        """As :meth:`wait`, the output left in its spool (see :func:`wait_output`)."""
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
        return ExecOutput(self._exit_code if self._exit_code is not None else -1, self._spool,
                          oom_killed=self._proc.oom_killed, owns_spool=False)

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
                # In pieces: a reader that fell behind never gets its backlog at once.
                for piece in range(start, stop, PIECE_BYTES):
                    yield OutputChunk(name, self._spool.read(piece, min(PIECE_BYTES, stop - piece)))
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
        await kill_shielded(self._proc, self._kill_left)
        with anyio.move_on_after(KILL_GRACE_SECONDS + 5):
            await self._done.wait()


async def wait_output(process: Process, timeout: float | None = None) -> ExecOutput:
    """As ``process.wait``, the output left in its spool to read in pieces
    (close the answer when done). For the daemon, which answers a large
    output as it reads it: a caller holding a handle takes ``wait``'s bytes."""
    return await process._wait_output(timeout)


def release_output(process: Process) -> None:
    """Drop the output of an ended command: its sandbox has forgotten it.

    The sandbox's housekeeping, not a method: a caller holding a handle
    (in-process or remote) never needs it.
    """
    process._release()
