"""A command's two output streams read into one sequence of chunks, in the
order they were produced: written once for the providers whose processes
hand back a stdout and a stderr reader (host subprocesses, ssh channels)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Literal, Protocol

from .._types import OutputChunk

#: What one read of a stream asks for.
READ_SIZE = 256 * 1024
#: Pieces read and not yet taken before the readers wait: a consumer slower
#: than the command holds this many, and the command waits on its pipe.
QUEUED_PIECES = 16


class ByteReader(Protocol):
    async def read(self, n: int = -1) -> bytes: ...


class OutputPipes:
    """Reads ``stdout`` and ``stderr`` until both end; :meth:`read` gives the
    chunks and ``None`` once both are closed. A reader that fails with one of
    ``errors`` ends its stream as if closed, and :attr:`error` keeps what it
    raised (a lost connection, for the process to report)."""

    def __init__(
        self,
        stdout: ByteReader,
        stderr: ByteReader,
        errors: tuple[type[BaseException], ...] = (),
    ) -> None:
        self._queue: asyncio.Queue[OutputChunk | None] = asyncio.Queue()
        self._room = asyncio.Semaphore(QUEUED_PIECES)
        self._open_streams = 2
        self._errors = errors
        self.error: BaseException | None = None
        self._readers = (stdout, stderr)
        loop = asyncio.get_running_loop()
        #: The readers' tasks; a process adds its own (feeding stdin) to cancel
        #: them together.
        self.tasks = [
            loop.create_task(self._pipe(stdout, "stdout")),
            loop.create_task(self._pipe(stderr, "stderr")),
        ]

    async def _pipe(self, reader: ByteReader, name: Literal["stdout", "stderr"]) -> None:
        try:
            while data := await reader.read(READ_SIZE):
                await self._room.acquire()
                self._queue.put_nowait(OutputChunk(name, data))
        except self._errors as exc:
            self.error = exc
        finally:
            await self._queue.put(None)

    async def read(self) -> OutputChunk | None:
        while self._open_streams > 0:
            item = await self._queue.get()
            if item is not None:
                self._room.release()
                return item
            self._open_streams -= 1
        return None

    def cancel(self) -> None:
        """Stop reading (a pipe an escaped grandchild holds would never end);
        the cancelled readers still post their end of stream."""
        for task in self.tasks:
            task.cancel()

    async def discard(self, timeout: float) -> None:
        """Stop taking output, and read what is left of both streams to their
        end and drop it, for at most ``timeout`` (then as :meth:`cancel`).
        For a command whose processes are gone: a stream nobody reads stops
        at a full buffer, never sees its end, and keeps its pipe (and the
        process's transport) open until it is collected as garbage."""
        self.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

        async def drop(reader: ByteReader) -> None:
            while await reader.read(READ_SIZE):
                pass

        with contextlib.suppress(TimeoutError, *self._errors):
            await asyncio.wait_for(asyncio.gather(*map(drop, self._readers)), timeout)
