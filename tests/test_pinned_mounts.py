"""A host mount that goes away while sandboxes live is gone for good: no
sandbox's namespaces keep a copy of it.

Every new mount namespace starts as a copy of its parent's mount table. A
namespace a sandbox keeps alive must therefore hold only what the sandbox
needs, or a mount the host unmounts later (a docker sandbox's capped
working-directory store: an ext4 image on a loop device) lives on in it,
with its memory, journal thread and loop device, until that sandbox ends.
On real Docker Engine, bubblewrap and loop devices (root).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

import hutch
from tests.conftest import TEST_IMAGE
from tests.hazards import loop_devices_left

pytestmark = [pytest.mark.anyio, pytest.mark.docker]


@pytest.mark.parametrize("runtime", ["agent", "native"])
async def test_a_capped_store_is_released_on_suspend_while_later_sandboxes_live(
    runtime: str,
) -> None:
    from hutch.providers import _diskcap, layers

    origin = await hutch.create_sandbox(
        "docker", image=TEST_IMAGE, disk="64m", read_before_write=False
    )
    later: list[Any] = []
    try:
        store = layers.store_dir(origin.id)
        image = _diskcap.image_for(store)
        await origin.write_text("a.txt", "a")
        assert loop_devices_left(image) != [], "the store is mounted while it runs"
        # Made while the store is mounted on the host, and running when it
        # is unmounted: a bubblewrap sandbox (its keeper and an exec), and
        # another docker sandbox.
        later.append(await hutch.create_sandbox(
            "bubblewrap", image=TEST_IMAGE, runtime=runtime, read_before_write=False
        ))
        later.append(await hutch.create_sandbox(
            "docker", image=TEST_IMAGE, runtime=runtime, read_before_write=False
        ))
        for sandbox in later:
            assert (await sandbox.exec("true")).exit_code == 0
        await origin.suspend()
        assert not os.path.ismount(store)
        assert loop_devices_left(image) == [], "a later sandbox holds the store's mount"
        # The later sandboxes go on working, the origin comes back whole.
        for sandbox in later:
            done = await sandbox.exec("echo still")
            assert done.stdout == "still\n"
        await origin.resume()
        assert await origin.read_text("a.txt") == "a"
    finally:
        for sandbox in later:
            await sandbox.close()
        await origin.close()


def test_a_keepers_namespace_keeps_only_the_mounts_on_the_way_to_what_it_uses() -> None:
    from hutch.providers.bubblewrap.mountns import unneeded

    points = [
        "/", "/proc", "/proc/sys/fs/binfmt_misc", "/tmp", "/tmp/h/layers/stores/sb-a",
        "/tmp/h/bubblewrap/sandboxes/sb-s/hot", "/tmp/h/bubblewrap/sandboxes/sb-t/hot",
        "/run", "/run/user/0", "/run/hutch/bubblewrap/root", "/home", "/home/u/disk",
        "/a", "/a/c", "/a b", "/a b", "/ab/c",
    ]
    keep = ["/proc", "/run/hutch/bubblewrap", "/tmp/h/bubblewrap/sandboxes/sb-s"]
    # Each unneeded subtree once, at its top; what leads to a kept path, or
    # lies below one, stays.
    assert unneeded(points, keep) == [
        "/a", "/a b", "/ab/c", "/home", "/run/user/0",
        "/tmp/h/bubblewrap/sandboxes/sb-t/hot", "/tmp/h/layers/stores/sb-a",
    ]
