"""hutch.testing.ready_for_another_case: when a sandbox a case used may take
the next one (the conformance suite keeps one per provider by it)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest

import hutch
from hutch.testing import ready_for_another_case

pytestmark = pytest.mark.anyio


@pytest.fixture
async def sandbox(tmp_path: object) -> AsyncIterator[hutch.Sandbox]:
    async with await hutch.create_sandbox(
        "local", workdir=str(tmp_path), read_before_write=False
    ) as sb:
        yield sb


async def test_what_a_case_left_in_the_working_directory_is_emptied(
    sandbox: hutch.Sandbox,
) -> None:
    await sandbox.write_text("a/b/c.txt", "c")
    await sandbox.write_text("-leading-dash.txt", "d")
    await sandbox.write_text(".hidden", "h")
    assert await ready_for_another_case(sandbox)
    assert await sandbox.list_dir(".") == []


async def test_a_sandbox_with_a_process_listed_is_not_ready(sandbox: hutch.Sandbox) -> None:
    process = await sandbox.start("sleep 30")
    assert not await ready_for_another_case(sandbox)
    await process.kill()
    # Ended, it is still listed (a fresh sandbox lists nothing).
    assert not await ready_for_another_case(sandbox)


async def test_a_paused_or_closed_sandbox_is_not_ready(sandbox: hutch.Sandbox) -> None:
    if sandbox.capabilities.pause:
        await sandbox.pause()
        assert not await ready_for_another_case(sandbox)
        await sandbox.resume()
    assert await ready_for_another_case(sandbox)
    await sandbox.close()
    assert not await ready_for_another_case(sandbox)


async def test_a_command_still_running_is_not_ready(sandbox: hutch.Sandbox) -> None:
    # A foreground exec is no listed process, but an open operation.
    async with anyio.create_task_group() as tg:
        tg.start_soon(sandbox.exec, ["sleep", "30"])
        for _ in range(1000):  # until it has started (10 s at most)
            if sandbox.open_operations:
                break
            await anyio.sleep(0.01)
        assert sandbox.processes() == []
        assert not await ready_for_another_case(sandbox)
        tg.cancel_scope.cancel()
    assert await ready_for_another_case(sandbox)
