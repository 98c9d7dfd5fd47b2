"""A docker sandbox's own working directory is layered from the start, so a
snapshot moves what changed into the snapshot's layer instead of copying it
(the cost of the first fork no longer grows with the tree's file count).

What is checked here, on real containers: a branch reads the origin's very
files (same inodes: moved, not copied); the origin goes on, its writes never
reaching the snapshot, none lost while the snapshot is taken; a process that
holds the working directory open is never cut off (the snapshot is then a
copy); suspend and resume, and branches, keep working the same way.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

import anyio
import docker
import pytest

import hutch
from tests.conftest import TEST_IMAGE
from tests.hazards import loop_devices_left

pytestmark = [pytest.mark.anyio, pytest.mark.docker]


@pytest.fixture(params=["agent", "native"])
async def origin(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    async with await hutch.create_sandbox(
        "docker", image=TEST_IMAGE, runtime=request.param, read_before_write=False
    ) as sandbox:
        yield sandbox


async def inode(sb: Any, path: str) -> str:
    result = await sb.exec(["stat", "-c", "%i", path])
    assert result.exit_code == 0, result.stderr
    return str(result.stdout).strip()


async def fill(sb: Any, count: int) -> None:
    result = await sb.exec(
        f"mkdir -p src && for i in $(seq {count}); do echo $i > src/f$i.txt; done"
    )
    assert result.exit_code == 0, result.stderr


async def test_a_branch_reads_the_origins_files_moved_not_copied(origin: Any) -> None:
    await fill(origin, 50)
    before = await inode(origin, "src/f7.txt")
    fork = await origin.fork("moved")
    branch = await fork.attach()
    try:
        assert await inode(branch, "src/f7.txt") == before, "the snapshot copied the files"
        assert await branch.read_text("src/f7.txt") == "7\n"
        # The origin goes on writing; the snapshot (and so every branch) keeps its own.
        await origin.exec("echo more >> src/f7.txt && echo new > src/g.txt && rm src/f8.txt")
        assert await origin.read_text("src/f7.txt") == "7\nmore\n"
        assert await branch.read_text("src/f7.txt") == "7\n"
        assert not await branch.exists("src/g.txt")
        assert await branch.read_text("src/f8.txt") == "8\n"
        late = await fork.attach()
        try:
            assert await late.read_text("src/f7.txt") == "7\n"
            assert not await late.exists("src/g.txt")
        finally:
            await late.close()
    finally:
        await branch.close()
        await hutch.remove_snapshot(fork.snapshot)


async def test_no_write_is_lost_or_leaks_while_a_snapshot_is_taken(origin: Any) -> None:
    # A writer that opens the file anew for every line (its own directory is
    # "/"): it is stopped while the snapshot is taken, and goes on after it.
    writer = await origin.start(
        "i=0; while :; do echo $i >> /workspace/log; i=$((i+1)); sleep 0.002; done", cwd="/"
    )
    try:
        await asyncio.sleep(0.3)
        fork = await origin.fork("while-writing")
        branch = await fork.attach()
        await asyncio.sleep(0.3)
        taken = (await branch.read_text("log")).split()
        await asyncio.sleep(0.2)
        assert (await branch.read_text("log")).split() == taken, "writes reached the snapshot"
        await writer.kill()
        lines = (await origin.read_text("log")).split()
        assert lines == [str(i) for i in range(len(lines))], "a line was lost or doubled"
        assert len(lines) > len(taken) > 0
        assert lines[: len(taken)] == taken
        await branch.close()
        await hutch.remove_snapshot(fork.snapshot)
    finally:
        await writer.kill()


async def test_a_process_holding_the_directory_keeps_it_and_the_snapshot_is_whole(
    origin: Any,
) -> None:
    await fill(origin, 20)
    # Its current directory and an open file are in the working directory: it
    # must go on in the same directory, so this snapshot is a copy.
    holder = await origin.start(
        "exec 3>>held.log; while :; do echo x >&3; sleep 0.01; done", cwd="/workspace"
    )
    try:
        await asyncio.sleep(0.2)
        fork = await origin.fork("held")
        branch = await fork.attach()
        assert await branch.read_text("src/f3.txt") == "3\n"
        taken = await branch.read_text("held.log")
        await asyncio.sleep(0.2)
        assert await branch.read_text("held.log") == taken
        grown = await origin.read_text("held.log")
        assert len(grown) > len(taken), "the holder was cut off from the working directory"
        await branch.close()
        await hutch.remove_snapshot(fork.snapshot)
    finally:
        await holder.kill()
    # Once it is gone, snapshots move again.
    before = await inode(origin, "src/f3.txt")
    second = await origin.fork("free")
    branch = await second.attach()
    try:
        assert await inode(branch, "src/f3.txt") == before
    finally:
        await branch.close()
        await hutch.remove_snapshot(second.snapshot)


async def test_suspend_resume_and_branches_of_branches_keep_moving(origin: Any) -> None:
    await fill(origin, 10)
    await origin.suspend()
    await origin.resume()
    assert await origin.read_text("src/f2.txt") == "2\n"
    await origin.write_text("after.txt", "resumed")
    before = await inode(origin, "after.txt")
    fork = await origin.fork("after-resume")
    branch = await fork.attach()
    try:
        assert await inode(branch, "after.txt") == before
        await branch.exec("echo b > b.txt && echo changed > src/f2.txt")
        b_inode = await inode(branch, "b.txt")
        child = await branch.fork("child")
        grandchild = await child.attach()
        try:
            assert await inode(grandchild, "b.txt") == b_inode
            assert await grandchild.read_text("src/f2.txt") == "changed\n"
            assert await grandchild.read_text("after.txt") == "resumed"
            await branch.exec("echo later > b.txt")
            assert await grandchild.read_text("b.txt") == "b\n"
            # A suspended branch snapshots as well (nothing runs to stop).
            await branch.suspend()
            third = await branch.snapshot("of-suspended")
            restored = await hutch.create_sandbox_from_snapshot(third)
            try:
                assert await restored.read_text("b.txt") == "later\n"
            finally:
                await restored.close()
                await hutch.remove_snapshot(third)
        finally:
            await grandchild.close()
            await hutch.remove_snapshot(child.snapshot)
    finally:
        await branch.close()
        await hutch.remove_snapshot(fork.snapshot)


async def test_a_capped_directory_moves_within_its_cap_and_outlives_its_sandbox() -> None:
    from hutch.providers import _diskcap, layers

    origin = await hutch.create_sandbox(
        "docker", image=TEST_IMAGE, disk="64m", read_before_write=False
    )
    store = layers.store_dir(origin.id)
    try:
        await fill(origin, 20)
        full = await origin.exec("head -c 80m /dev/zero > big; echo $?; rm -f big")
        assert full.stdout.strip() != "0" and "No space left" in full.stderr
        before = await inode(origin, "src/f5.txt")
        fork = await origin.fork("capped")
        branch = await fork.attach()
        # The branch is capped too, in a store of its own.
        assert os.path.ismount(layers.store_dir(branch.id))
        over = await branch.exec("head -c 80m /dev/zero > big; echo $?; rm -f big")
        assert "No space left" in over.stderr
        assert await inode(branch, "src/f5.txt") == before, "the snapshot copied the files"
        # What the origin wrote stays in its store after it ends, for the
        # snapshot and the branch that stack it.
        await origin.close()
        assert os.path.ismount(store)
        assert await branch.read_text("src/f5.txt") == "5\n"
        await branch.close()
        again = await fork.attach()
        assert await again.read_text("src/f5.txt") == "5\n"
        await again.close()
        await hutch.remove_snapshot(fork.snapshot)
        # Nothing stacks it any more: the store, its image and loop device go.
        assert not os.path.exists(store)
        assert loop_devices_left(_diskcap.image_for(store)) == []
    finally:
        await origin.close()


@pytest.mark.parametrize("dies_at", ["before the move", "after the move"])
async def test_a_program_dying_in_a_capture_leaves_nothing_stopped_or_unmounted(
    dies_at: str,
) -> None:
    """A program killed while it held the container paused (and, after the
    move, the directory unmounted): the next one to reconnect mends both."""
    from hutch._sandbox import backend_of
    from hutch.providers import _docker_engine as docker_engine
    from hutch.providers import layers
    from hutch.providers.docker import DockerSandbox

    origin = await hutch.create_sandbox(
        "docker", image=TEST_IMAGE, runtime="native", read_before_write=False
    )
    try:
        await origin.write_text("a.txt", "A")
        backend = backend_of(origin)
        assert isinstance(backend, DockerSandbox)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the program that dies
            try:
                docker_engine._api_client = None  # a connection of its own
                if dies_at == "before the move":
                    layers.freeze = lambda *args, **kwargs: os._exit(9)  # type: ignore[assignment]
                else:
                    os.rename = lambda *args, **kwargs: os._exit(9)  # type: ignore[assignment]
                backend._freeze_and_commit("snap-dies", True, "hutch-never", {})
            finally:
                os._exit(0)
        _, status = await anyio.to_thread.run_sync(os.waitpid, pid, 0)
        assert os.waitstatus_to_exitcode(status) == 9
        api = docker.APIClient()
        assert api.inspect_container(backend.container_id)["State"]["Paused"]
        again = await DockerSandbox.reconnect(origin.id, backend.describe())
        assert not api.inspect_container(backend.container_id)["State"]["Paused"]
        result = await again.run_quiet(["cat", "/workspace/a.txt"])
        assert result == (0, b"A", b"")
        # And it snapshots again.
        fork = await origin.fork("after")
        branch = await fork.attach()
        assert await branch.read_text("a.txt") == "A"
        await branch.close()
        await hutch.remove_snapshot(fork.snapshot)
    finally:
        await origin.close()


async def test_a_capped_directory_nothing_runs_on_holds_no_mounted_store() -> None:
    """A store costs host memory and a kernel thread while mounted: a
    suspended sandbox's, and a closed one's its snapshot still holds, are
    unmounted (no loop device left), and everything reads back from them."""
    from hutch.providers import _diskcap, layers

    origin = await hutch.create_sandbox(
        "docker", image=TEST_IMAGE, disk="64m", read_before_write=False
    )
    store = layers.store_dir(origin.id)
    image = _diskcap.image_for(store)

    def idle() -> bool:
        return (os.path.exists(image) and not os.path.ismount(store)
                and loop_devices_left(image) == [])

    try:
        await fill(origin, 20)
        first = await origin.fork("before-suspend")
        await origin.write_text("after.txt", "after")
        await origin.suspend()
        assert idle()
        # Captured while suspended: read from the store, left unmounted after.
        second = await origin.fork("while-suspended")
        assert idle()
        await origin.resume()
        assert await origin.read_text("src/f5.txt") == "5\n"
        assert await origin.read_text("after.txt") == "after"
        await origin.write_text("resumed.txt", "resumed")
        await origin.close()
        assert idle()
        for fork, names in ((first, ["src"]), (second, ["after.txt", "src"])):
            branch = await fork.attach()
            try:
                assert os.path.ismount(store), "a live branch stacks it"
                listed = await branch.exec("ls")
                assert sorted(listed.stdout.split()) == names
                assert await branch.read_text("src/f5.txt") == "5\n"
            finally:
                await branch.close()
            assert idle()
        await hutch.remove_snapshot(first.snapshot)
        await hutch.remove_snapshot(second.snapshot)
        assert not os.path.exists(store)
        assert loop_devices_left(image) == []
    finally:
        await origin.close()
