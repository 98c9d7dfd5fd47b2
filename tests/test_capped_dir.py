"""The plain capped working directory (providers/_diskcap.py's
``mount_capped_workdir``: a docker sandbox's own directory where overlayfs
cannot be mounted) shows the sandbox what it wrote and nothing else.

Its file system holds a placeholder (``_diskcap.BALLOON``, as big as the
free space the host has not reserved: most of the cap) that the sandbox
must not see: not in a listing, a glob, a snapshot, a fork, nor in the
disk figure; and it must not be in the sandbox's way (it is immutable:
EPERM on a delete).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

import hutch
from hutch._sandbox import backend_of
from hutch.providers import _diskcap, _mounts, layers
from tests.conftest import TEST_IMAGE
from tests.hazards import loop_devices_left

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="loop mounts need root")

BALLOON = _diskcap.BALLOON


@pytest.fixture
def no_overlay(monkeypatch: pytest.MonkeyPatch) -> None:
    """This host as one where overlayfs cannot be mounted: docker's working
    directories are plain (capped) ones, branches copies."""
    monkeypatch.setattr(layers.overlay, "_overlay_ok", False)


@pytest.fixture
async def plain(no_overlay: None) -> AsyncIterator[Any]:
    async with await hutch.create_sandbox(
        "docker", image=TEST_IMAGE, disk="1g", read_before_write=False,
    ) as sandbox:
        backend = backend_of(sandbox)
        assert not backend.layered and os.path.ismount(backend.host_workdir)
        yield sandbox


@pytest.mark.anyio
@pytest.mark.docker
async def test_the_sandbox_sees_no_placeholder_in_its_capped_directory(plain: Any) -> None:
    assert await plain.list_dir("/workspace") == []
    assert (await plain.exec("ls -A /workspace")).stdout == ""
    assert not await plain.exists(f"/workspace/{BALLOON}")
    assert await plain.glob(".*", "/workspace") == []
    # Nothing in its way: its directory is its own to empty.
    done = await plain.exec("touch a && rm -rf /workspace/* /workspace/.[!.]* && ls -A")
    assert (done.exit_code, done.stdout) == (0, "")


@pytest.mark.anyio
@pytest.mark.docker
async def test_the_disk_figure_of_a_capped_directory_is_what_was_written(plain: Any) -> None:
    await plain.exec("head -c 2097152 /dev/urandom > /workspace/two-mib")
    disk = (await plain.info())["disk_bytes"]
    # Two MiB written (and a container layer of a few KB), not the 1 GiB cap.
    assert 2 << 20 <= disk < 16 << 20, disk


@pytest.mark.anyio
@pytest.mark.docker
async def test_a_snapshot_and_a_fork_of_a_capped_directory_hold_no_placeholder(
    plain: Any,
) -> None:
    await plain.write_text("/workspace/kept.txt", "kept")
    fork = await plain.fork("capped")
    try:
        assert fork.snapshot.size_bytes < 16 << 20, fork.snapshot.size_bytes
        branch = await fork.attach()
        async with branch:
            names = [f.name for f in await branch.list_dir("/workspace")]
            assert names == ["kept.txt"]
    finally:
        await hutch.remove_snapshot(fork.snapshot)


@pytest.mark.anyio
@pytest.mark.docker
async def test_a_branch_of_a_capped_sandbox_is_capped_too(plain: Any) -> None:
    """Where overlayfs cannot be mounted a branch is a copy of the snapshot:
    in a capped directory of its own, the placeholder out of its sight."""
    await plain.write_text("/workspace/kept.txt", "kept")
    fork = await plain.fork("capped")
    try:
        branch = await fork.attach()
        async with branch:
            assert [f.name for f in await branch.list_dir("/workspace")] == ["kept.txt"]
            assert await branch.read_text("/workspace/kept.txt") == "kept"
            past_cap = await branch.exec("fallocate -l 2G /workspace/big")
            assert past_cap.exit_code != 0, "a branch wrote past its sandbox's 1 GiB cap"
            workdir = backend_of(branch).host_workdir
            assert os.path.ismount(workdir)
        assert not os.path.ismount(workdir)
        assert not os.path.exists(_diskcap.private_root(workdir))
        assert loop_devices_left(_diskcap.image_for(workdir)) == []
    finally:
        await hutch.remove_snapshot(fork.snapshot)


# -- the mount itself -----------------------------------------------------------------


@contextlib.contextmanager
def _capped(directory: str, size: int) -> Iterator[str]:
    try:
        _diskcap.mount_capped_workdir(directory, size)
        yield directory
    finally:
        _diskcap.unmount_capped(directory)
    assert not os.path.ismount(directory)
    assert not os.path.exists(_diskcap.private_root(directory))
    assert loop_devices_left(_diskcap.image_for(directory)) == []


def test_a_capped_workdir_shows_only_what_is_written_and_grows_to_its_cap(
    tmp_path: Any,
) -> None:
    workdir = str(tmp_path / "workdir")
    cap = 512 << 20
    with _capped(workdir, cap):
        assert os.listdir(workdir) == []
        # More than the store starts with free (FREE_TARGET): the grower
        # makes room as it fills, in the file system behind the directory.
        written = 0
        chunk = b"\1" * (8 << 20)
        with open(os.path.join(workdir, "big"), "wb", buffering=0) as fh:
            while written < 320 << 20:
                try:
                    written += fh.write(chunk)
                except OSError:
                    assert _diskcap.wait_for_room(workdir, timeout=10), written
        assert os.listdir(workdir) == ["big"]
        used = sum(os.lstat(os.path.join(workdir, n)).st_blocks * 512
                   for n in os.listdir(workdir))
        assert 320 << 20 <= used < 321 << 20, used  # and an extent block
        # Mounted again (a daemon that finds it mounted): the same view.
        _diskcap.mount_capped_workdir(workdir, cap)
        assert os.listdir(workdir) == ["big"]


def test_a_capped_workdir_mounted_again_from_its_image_keeps_its_files(
    tmp_path: Any,
) -> None:
    workdir = str(tmp_path / "workdir")
    with _capped(workdir, 64 << 20):
        with open(os.path.join(workdir, "f"), "w") as fh:
            fh.write("kept")
        _mounts.umount(workdir)  # a reboot: the image is kept
        _mounts.umount(_diskcap.private_root(workdir))
        assert not os.path.ismount(workdir)
        assert os.path.exists(_diskcap.image_for(workdir))
        _diskcap.mount_capped_workdir(workdir, 64 << 20)
        assert os.listdir(workdir) == ["f"]


def test_an_older_capped_workdir_keeps_its_files_and_loses_sight_of_its_placeholder(
    tmp_path: Any,
) -> None:
    """A directory capped before (the file system's root itself, the
    placeholder in it), mounted again from its image: its files stay, the
    placeholder goes out of sight."""
    workdir = str(tmp_path / "workdir")
    cap = 512 << 20
    _diskcap.mount_capped(workdir, cap)  # the older layout
    try:
        os.makedirs(os.path.join(workdir, "sub"))
        with open(os.path.join(workdir, "sub", "f"), "w") as fh:
            fh.write("kept")
        assert BALLOON in os.listdir(workdir)
        _mounts.umount(workdir)
    except BaseException:
        _diskcap.unmount_capped(workdir)
        raise
    with _capped(workdir, cap):
        assert os.listdir(workdir) == ["sub"]
        with open(os.path.join(workdir, "sub", "f")) as fh:
            assert fh.read() == "kept"


def test_a_file_a_sandbox_names_as_the_placeholder_is_never_taken_for_it(
    tmp_path: Any,
) -> None:
    """A sandbox that sees the root of a capped file system (one capped before
    there were views, still mounted so) can make a file of the placeholder's
    name, but not an immutable one: the grower does not grow it and punch
    the host blocks under it (the sandbox would write into the holes)."""
    store = str(tmp_path / "store")
    _diskcap.mount_capped(store, 1 << 30)
    try:
        balloon = os.path.join(store, BALLOON)
        subprocess.run(["chattr", "-i", balloon], check=True)
        os.unlink(balloon)  # the store grew to its cap, then its files went
        with open(balloon, "wb") as fh:  # the sandbox's
            fh.write(b"mine" * 1024)
        image = _diskcap.image_for(store)
        held = os.stat(image).st_blocks
        assert not _diskcap._give_back(store, image)
        assert os.path.getsize(balloon) == 4096
        assert os.stat(image).st_blocks >= held
    finally:
        _diskcap.unmount_capped(store)
