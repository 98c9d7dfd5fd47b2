"""A fork's branches started together (``fork(count=...)`` where the
provider says its branches may start side by side: virtual here, gvisor in
tests/test_gvisor.py): independent branches, each its own."""

from __future__ import annotations

import pytest

import hutch

pytestmark = pytest.mark.anyio


async def test_branches_started_together_are_independent() -> None:
    async with await hutch.create_sandbox("virtual") as origin:
        await origin.write_text("before.txt", "from before")
        fork = await origin.fork("together", count=3)
        try:
            assert len({b.id for b in fork.branches} | {origin.id}) == 4
            for index, branch in enumerate(fork.branches):
                assert await branch.read_text("before.txt") == "from before"
                await branch.write_text("mine.txt", f"branch {index}")
            for index, branch in enumerate(fork.branches):
                assert await branch.read_text("mine.txt") == f"branch {index}"
            assert not await origin.exists("mine.txt")
        finally:
            await fork.close()
        assert fork.branches == []
