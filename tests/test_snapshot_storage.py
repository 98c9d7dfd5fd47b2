"""Removing a snapshot frees its provider storage, whichever goes first: the
snapshot or a branch started from it (local layers, docker images and layers)."""

from __future__ import annotations

import os
from typing import Any

import pytest

import hutch
from hutch.providers import layers
from tests.conftest import TEST_IMAGE

pytestmark = pytest.mark.anyio

SETTINGS = [
    pytest.param({"provider": "local"}, id="local"),
    pytest.param({"provider": "docker", "image": TEST_IMAGE}, id="docker",
                 marks=pytest.mark.docker),
]


def images_of(snapshot_id: str) -> list[str]:
    """Every image (tagged or not) that carries ``snapshot_id``'s label."""
    import docker

    api = docker.APIClient()
    labelled = api.images(all=True, filters={"label": f"hutch.snapshot={snapshot_id}"})
    return [image["Id"] for image in labelled]


async def assert_freed(snapshot: hutch.Snapshot, *sandboxes: hutch.Sandbox) -> None:
    """The snapshot's storage is gone, and the working directories of
    ``sandboxes`` (this test's: other programs' may share the home)."""
    assert snapshot.id not in await hutch.providers.get_provider(snapshot.provider).held_snapshots()
    assert not os.path.exists(layers.snapshot_dir(snapshot.id))
    assert not {sb.id for sb in sandboxes} & set(layers.branches())
    if snapshot.provider == "docker":
        assert images_of(snapshot.id) == []


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("first", ["branch", "snapshot"])
async def test_branch_and_snapshot_removed_in_either_order_leave_nothing(
    settings: dict[str, Any], first: str
) -> None:
    async with await hutch.create_sandbox(**settings, read_before_write=False) as origin:
        await origin.write_text("a.txt", "A")
        fork = await origin.fork("gone")
        branch = await fork.attach()
        await branch.write_text("a.txt", "B")
        if first == "branch":
            await branch.close()
            await hutch.remove_snapshot(fork.snapshot)
        else:
            # Removed while the branch still runs on it: the branch keeps working.
            await hutch.remove_snapshot(fork.snapshot)
            assert await branch.read_text("a.txt") == "B"
            await branch.close()
    # (A local origin goes on over the first snapshot's layer until it ends.)
    await assert_freed(fork.snapshot, origin, branch)


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("first", ["branch", "snapshot"])
async def test_a_child_snapshot_keeps_what_it_stands_on_until_it_goes(
    settings: dict[str, Any], first: str
) -> None:
    async with await hutch.create_sandbox(**settings, read_before_write=False) as origin:
        await origin.write_text("a.txt", "A")
        fork = await origin.fork("gone")
        branch = await fork.attach()
        await branch.write_text("a.txt", "B")
        # A child snapshot of the branch stacks the fork's layer too.
        child = await branch.snapshot("child")
        if first == "branch":
            await branch.close()
            await hutch.remove_snapshot(fork.snapshot)
        else:
            # Removed while the branch still runs on it: the branch keeps working.
            await hutch.remove_snapshot(fork.snapshot)
            assert await branch.read_text("a.txt") == "B"
            await branch.close()
        # The child still starts, from layers its parent's removal kept.
        restored = await hutch.create_sandbox_from_snapshot(child)
        assert await restored.read_text("a.txt") == "B"
        await restored.close()
        await hutch.remove_snapshot(child)
    await assert_freed(fork.snapshot, origin, branch, restored)
    await assert_freed(child, origin, branch, restored)
