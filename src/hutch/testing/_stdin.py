"""A background command's stdin, kept open at its start: written to while
it runs, then closed (the same on every provider that runs processes)."""

from __future__ import annotations

from typing import Any

import hutch

from ._support import Case, raises, runs_processes


async def check_stdin_written_to_a_running_command(sandbox: Any) -> None:
    if not await runs_processes(sandbox):
        return
    process = await sandbox.start(["head", "-n", "1"], keep_stdin=True)
    assert process.stdin_open
    await process.write_stdin("hello ")
    await process.write_stdin(b"world\nnot read\n")
    result = await process.wait(timeout=30)
    assert (result.exit_code, result.stdout) == (0, "hello world\n")


async def check_close_stdin_ends_cat(sandbox: Any) -> None:
    if not await runs_processes(sandbox):
        return
    # The bytes given at the start come first, then each write in order.
    process = await sandbox.start(["cat"], stdin="first\n", keep_stdin=True)
    await process.write_stdin("second\n")
    await process.write_stdin(bytes([0, 255, 10]))
    assert process.running
    await process.close_stdin()
    assert not process.stdin_open
    result = await process.wait(timeout=30)
    assert result.exit_code == 0
    assert result.stdout_bytes == b"first\nsecond\n\x00\xff\n"
    # Closing it again (or once it ended) does nothing; a write is refused.
    await process.close_stdin()
    with raises(hutch.StdinClosed, code="stdin_closed"):
        await process.write_stdin("late\n")


async def check_stdin_in_many_writes_arrives_whole(sandbox: Any) -> None:
    """More than a pipe holds, in writes that wait for the command to read."""
    if not await runs_processes(sandbox):
        return
    process = await sandbox.start("wc -c", keep_stdin=True)
    piece = b"0123456789abcdef" * 4096  # 64 KiB
    for _ in range(16):
        await process.write_stdin(piece)
    await process.close_stdin()
    result = await process.wait(timeout=60)
    assert result.stdout.strip() == str(16 * len(piece))


async def check_stdin_not_kept_is_refused(sandbox: Any) -> None:
    if not await runs_processes(sandbox):
        return
    process = await sandbox.start("sleep 30")
    try:
        assert not process.stdin_open
        with raises(hutch.StdinClosed, match="keep_stdin"):
            await process.write_stdin("x")
        with raises(hutch.StdinClosed, match="keep_stdin"):
            await process.close_stdin()
    finally:
        await process.kill()


async def check_stdin_of_an_ended_command_is_refused(sandbox: Any) -> None:
    if not await runs_processes(sandbox):
        return
    process = await sandbox.start(["head", "-c", "3"], keep_stdin=True)
    await process.write_stdin("abc")
    assert (await process.wait(timeout=30)).stdout == "abc"
    assert not process.stdin_open
    with raises(hutch.StdinClosed, match="ended"):
        await process.write_stdin("more")
    await process.close_stdin()  # nothing left to close: no error


STDIN_CASES: list[Case] = [
    check_stdin_written_to_a_running_command,
    check_close_stdin_ends_cat,
    check_stdin_in_many_writes_arrives_whole,
    check_stdin_not_kept_is_refused,
    check_stdin_of_an_ended_command_is_refused,
]
