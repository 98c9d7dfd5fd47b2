"""Pause, suspend/resume cycles, snapshots and forks: capability-gated."""

from __future__ import annotations

from typing import Any

import hutch

from ._support import Case, refused


async def check_fork_branches_are_independent(sandbox: Any) -> None:
    if not sandbox.capabilities.fork:
        await refused(sandbox.fork("nope"))
        return
    await sandbox.write_text("a.txt", "origin A")
    fork = await sandbox.fork("three")
    try:
        assert fork.snapshot.sandbox_id == sandbox.id
        branches = [await fork.attach() for _ in range(3)]
        assert [b.id for b in fork.branches] == [b.id for b in branches], (
            "attach() must add each branch to fork.branches"
        )
        assert len({b.id for b in branches}) == 3
        for i, branch in enumerate(branches):
            assert await branch.read_text("a.txt") == "origin A"
            await branch.write_text(f"b{i}.txt", f"branch {i}")
            await branch.write_text("a.txt", f"changed by {i}")
        for i, branch in enumerate(branches):
            assert await branch.read_text("a.txt") == f"changed by {i}"
            assert await branch.read_text(f"b{i}.txt") == f"branch {i}"
            for j in range(3):
                if j != i:
                    assert not await branch.exists(f"b{j}.txt")
        assert await sandbox.read_text("a.txt") == "origin A"
        for j in range(3):
            assert not await sandbox.exists(f"b{j}.txt")
        # The origin keeps running and writing; no branch sees it.
        await sandbox.write_text("late.txt", "after the fork")
        assert not await branches[0].exists("late.txt")
    finally:
        await fork.close()
    assert fork.branches == []
    assert all(b.closed for b in branches)


async def check_fork_of_a_fork_has_both_parents(sandbox: Any) -> None:
    if not sandbox.capabilities.fork:
        return
    await sandbox.write_text("gen.txt", "0")
    first = await sandbox.fork("first")
    try:
        child = await first.attach()
        await child.write_text("gen.txt", "1")
        second = await child.fork("second")
        try:
            assert second.snapshot.parent_id == first.snapshot.id
            assert second.snapshot.sandbox_id == child.id
            grandchild = await second.attach()
            assert await grandchild.read_text("gen.txt") == "1"
            await grandchild.write_text("gen.txt", "2")
            assert await child.read_text("gen.txt") == "1"
            assert await sandbox.read_text("gen.txt") == "0"
        finally:
            await second.close()  # the child snapshot first: it names its parent
    finally:
        await first.close()


async def check_snapshot_outlives_its_sandbox_and_removal_frees_it(sandbox: Any) -> None:
    if not sandbox.capabilities.snapshot:
        await refused(sandbox.snapshot("nope"))
        return
    await sandbox.write_text("keep.txt", "kept")
    if not isinstance(sandbox, hutch.Sandbox):
        # Held by a daemon: its snapshot goes with the fork handle over it
        # (the daemon's own tests cover attach and removal by id).
        fork = await sandbox.fork("keep")
        try:
            assert fork.snapshot.size_bytes >= len("kept")
            assert fork.snapshot.label == "keep"
        finally:
            await fork.close()
        await fork.close()  # idempotent
        return
    snapshot = await sandbox.snapshot("keep")
    provider = hutch.providers.get_provider(snapshot.provider)
    try:
        assert snapshot.size_bytes >= len("kept")
        assert snapshot.label == "keep"
        await sandbox.write_text("keep.txt", "changed later")
        restored = await hutch.create_sandbox_from_snapshot(snapshot)
        try:
            assert await restored.read_text("keep.txt") == "kept"
        finally:
            await restored.close()
        assert snapshot.id in await provider.held_snapshots()
    finally:
        await hutch.remove_snapshot(snapshot)
    await hutch.remove_snapshot(snapshot)  # idempotent
    assert snapshot.id not in await provider.held_snapshots()


async def check_fork_a_paused_and_a_suspended_sandbox(sandbox: Any) -> None:
    caps = sandbox.capabilities
    if not caps.fork:
        return
    await sandbox.write_text("state.txt", "before")
    if caps.pause:
        await sandbox.pause()
        fork = await sandbox.fork("paused")
        try:
            assert sandbox.state == hutch.SandboxState.PAUSED
            await sandbox.resume()
            branch = await fork.attach()
            assert await branch.read_text("state.txt") == "before"
        finally:
            await fork.close()
    if caps.suspend:
        await sandbox.suspend()
        fork = await sandbox.fork("suspended")
        try:
            assert sandbox.state == hutch.SandboxState.SUSPENDED
            branch = await fork.attach()
            assert await branch.read_text("state.txt") == "before"
            await branch.write_text("state.txt", "branch")
        finally:
            await fork.close()
        assert await sandbox.read_text("state.txt") == "before"


async def check_many_suspend_resume_cycles_keep_files(sandbox: Any) -> None:
    if not sandbox.capabilities.suspend:
        await refused(sandbox.suspend())
        return
    for cycle in range(5):
        await sandbox.write_text(f"cycle{cycle}.txt", str(cycle))
        await sandbox.suspend()
        await sandbox.resume()
        for earlier in range(cycle + 1):
            assert await sandbox.read_text(f"cycle{earlier}.txt") == str(earlier)


async def check_pause_holds_files(sandbox: Any) -> None:
    if not sandbox.capabilities.pause:
        await refused(sandbox.pause())
        return
    await sandbox.write_text("p.txt", "held")
    await sandbox.pause()
    assert sandbox.state == hutch.SandboxState.PAUSED
    await sandbox.resume()
    assert await sandbox.read_text("p.txt") == "held"


#: In the order they are best run.
LIFECYCLE_CASES: list[Case] = [
    check_pause_holds_files,
    check_many_suspend_resume_cycles_keep_files,
    check_snapshot_outlives_its_sandbox_and_removal_frees_it,
    check_fork_branches_are_independent,
    check_fork_of_a_fork_has_both_parents,
    check_fork_a_paused_and_a_suspended_sandbox,
]
