"""A write to a command's stdin whose bytes were taken is not told refused
because the command's end was heard before the write's answer."""

from __future__ import annotations

import asyncio

import pytest

from hutch._process import Process
from hutch._types import OutputChunk
from hutch.providers.base import BackendProcess

pytestmark = pytest.mark.anyio


class _EndsBeforeTheWriteIsAnswered(BackendProcess):
    """``head -c 3`` behind a wire (E2B's): the write's bytes end the command,
    and its end comes back before the write's own answer does."""

    def __init__(self) -> None:
        self.ended = asyncio.Event()
        self.written = b""

    async def read(self) -> OutputChunk | None:
        await self.ended.wait()
        return None

    async def wait(self) -> int:
        await self.ended.wait()
        return 0

    async def kill(self, grace: float) -> None:
        self.ended.set()

    @property
    def returncode(self) -> int | None:
        return 0 if self.ended.is_set() else None

    async def write_stdin(self, data: bytes) -> None:
        self.written += data
        self.ended.set()
        await asyncio.sleep(0.05)  # the write's answer, later than the end

    async def close_stdin(self) -> None:
        return None


async def test_a_write_taken_before_the_command_ended_is_not_refused() -> None:
    backend = _EndsBeforeTheWriteIsAnswered()
    process = Process(backend, command="head -c 3", output_limit=1 << 20, keep_stdin=True)
    await process.write_stdin("abc")  # StdinClosed here before the fix
    assert backend.written == b"abc"
    await process.wait(timeout=5)
    assert not process.stdin_open
