"""A fork's branches started together (``Fork.attach_together``, what
``fork(count=...)`` uses where the provider's branches may start side by
side): independent branches, all or none."""

from __future__ import annotations

import pytest

import hutch
from hutch._errors import HutchError

pytestmark = pytest.mark.anyio


async def test_branches_started_together_are_independent() -> None:
    async with await hutch.create_sandbox("virtual") as origin:
        await origin.write_text("before.txt", "from before")
        fork = await origin.fork("together")
        try:
            branches = await fork.attach_together(3)
            assert fork.branches == branches
            assert len({b.id for b in branches} | {origin.id}) == 4
            for index, branch in enumerate(branches):
                assert await branch.read_text("before.txt") == "from before"
                await branch.write_text("mine.txt", f"branch {index}")
            for index, branch in enumerate(branches):
                assert await branch.read_text("mine.txt") == f"branch {index}"
            assert not await origin.exists("mine.txt")
        finally:
            await fork.close()


async def test_branches_that_cannot_all_start_leave_none() -> None:
    async with await hutch.create_sandbox("virtual") as origin:
        fork = await origin.fork("gone")
        await hutch.remove_snapshot(fork.snapshot)  # its state gone: no branch can start
        with pytest.raises(HutchError):
            await fork.attach_together(3)
        assert fork.branches == []
        await fork.close()
