"""Conformance: snapshots and forks, on every provider that declares them.

A provider that does not declare ``snapshot``/``fork`` must refuse with
``capability_unsupported``; one that does must give branches that are
independent of each other and of their origin.
"""

from __future__ import annotations

from typing import Any

import pytest

import hutch

pytestmark = pytest.mark.anyio


async def _close_all(sandboxes: list[Any]) -> None:
    for sb in sandboxes:
        await sb.close()


async def test_fork_branches_are_independent(files_sandbox: Any) -> None:
    if not files_sandbox.capabilities.fork:
        with pytest.raises(hutch.CapabilityUnsupported):
            await files_sandbox.fork("nope")
        return
    await files_sandbox.write_text("a.txt", "origin A")
    fork = await files_sandbox.fork("three")
    assert fork.snapshot.sandbox_id == files_sandbox.id
    branches = [await fork.attach() for _ in range(3)]
    try:
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
        assert await files_sandbox.read_text("a.txt") == "origin A"
        for j in range(3):
            assert not await files_sandbox.exists(f"b{j}.txt")
        # The origin keeps running and writing; no branch sees it.
        await files_sandbox.write_text("late.txt", "after the fork")
        assert not await branches[0].exists("late.txt")
    finally:
        await _close_all(branches)


async def test_fork_of_a_fork_has_both_parents(files_sandbox: Any) -> None:
    if not files_sandbox.capabilities.fork:
        return
    await files_sandbox.write_text("gen.txt", "0")
    first = await files_sandbox.fork("first")
    child = await first.attach()
    try:
        await child.write_text("gen.txt", "1")
        second = await child.fork("second")
        assert second.snapshot.parent_id == first.snapshot.id
        assert second.snapshot.sandbox_id == child.id
        grandchild = await second.attach()
        try:
            assert await grandchild.read_text("gen.txt") == "1"
            await grandchild.write_text("gen.txt", "2")
            assert await child.read_text("gen.txt") == "1"
            assert await files_sandbox.read_text("gen.txt") == "0"
        finally:
            await grandchild.close()
    finally:
        await child.close()


async def test_snapshot_outlives_its_sandbox_and_removal_frees_it(files_sandbox: Any) -> None:
    if not files_sandbox.capabilities.snapshot:
        with pytest.raises(hutch.CapabilityUnsupported):
            await files_sandbox.snapshot("nope")
        return
    await files_sandbox.write_text("keep.txt", "kept")
    snapshot = await files_sandbox.snapshot("keep")
    assert snapshot.size_bytes >= len("kept")
    assert snapshot.label == "keep"
    await files_sandbox.write_text("keep.txt", "changed later")
    if snapshot.handle is None:
        return  # held by a daemon: its own tests cover attach and removal
    restored = await hutch.create_sandbox_from_snapshot(snapshot)
    try:
        assert await restored.read_text("keep.txt") == "kept"
    finally:
        await restored.close()
    provider = hutch.providers.get_provider(snapshot.provider)
    assert snapshot.id in await provider.held_snapshots()
    await hutch.remove_snapshot(snapshot)
    await hutch.remove_snapshot(snapshot)  # idempotent
    assert snapshot.id not in await provider.held_snapshots()


async def test_fork_a_paused_and_a_suspended_sandbox(files_sandbox: Any) -> None:
    caps = files_sandbox.capabilities
    if not caps.fork:
        return
    await files_sandbox.write_text("state.txt", "before")
    if caps.pause:
        await files_sandbox.pause()
        fork = await files_sandbox.fork("paused")
        assert files_sandbox.state == hutch.SandboxState.PAUSED
        await files_sandbox.resume()
        branch = await fork.attach()
        try:
            assert await branch.read_text("state.txt") == "before"
        finally:
            await branch.close()
    if caps.suspend:
        await files_sandbox.suspend()
        fork = await files_sandbox.fork("suspended")
        assert files_sandbox.state == hutch.SandboxState.SUSPENDED
        branch = await fork.attach()
        try:
            assert await branch.read_text("state.txt") == "before"
            await branch.write_text("state.txt", "branch")
        finally:
            await branch.close()
        assert await files_sandbox.read_text("state.txt") == "before"


async def test_many_suspend_resume_cycles_keep_files(files_sandbox: Any) -> None:
    if not files_sandbox.capabilities.suspend:
        with pytest.raises(hutch.CapabilityUnsupported):
            await files_sandbox.suspend()
        return
    for cycle in range(5):
        await files_sandbox.write_text(f"cycle{cycle}.txt", str(cycle))
        await files_sandbox.suspend()
        await files_sandbox.resume()
        for earlier in range(cycle + 1):
            assert await files_sandbox.read_text(f"cycle{earlier}.txt") == str(earlier)


async def test_pause_holds_files(files_sandbox: Any) -> None:
    if not files_sandbox.capabilities.pause:
        with pytest.raises(hutch.CapabilityUnsupported):
            await files_sandbox.pause()
        return
    await files_sandbox.write_text("p.txt", "held")
    await files_sandbox.pause()
    assert files_sandbox.state == hutch.SandboxState.PAUSED
    await files_sandbox.resume()
    assert await files_sandbox.read_text("p.txt") == "held"
