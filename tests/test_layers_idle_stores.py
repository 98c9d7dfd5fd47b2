"""A capped working directory's store (a loop-mounted ext4 image) costs host
memory and a kernel thread while it is mounted: one that no working
directory stacks any more (its sandbox closed, a workspace suspended into a
snapshot) is unmounted, its image kept, and mounted again on demand by
whatever reads it. On real loop and overlay mounts (root).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator

import pytest

from hutch.providers import _diskcap, layers
from tests.hazards import loop_devices_left

CAP = 64 * 1024 * 1024


def new_id(kind: str) -> str:
    return f"sb-idle-{kind}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def made() -> Iterator[tuple[list[str], list[str]]]:
    """(sandboxes, snapshots) a test made: ended and removed after it."""
    sandboxes: list[str] = []
    snapshots: list[str] = []
    yield sandboxes, snapshots
    for sandbox_id in sandboxes:
        layers.end_branch(sandbox_id)
    for snapshot_id in snapshots:
        layers.remove(snapshot_id)
    for sandbox_id in sandboxes:
        store = layers.store_dir(sandbox_id)
        assert not os.path.exists(store)
        assert loop_devices_left(_diskcap.image_for(store)) == []


def start(made: tuple[list[str], list[str]], snapshot_id: str | None) -> str:
    sandbox_id = new_id("sb")
    made[0].append(sandbox_id)
    layers.prepare(sandbox_id, snapshot_id, cap=CAP)
    layers.after_start(sandbox_id)
    return sandbox_id


def path(sandbox_id: str, name: str) -> str:
    return os.path.join(layers.mount_dir(sandbox_id), "merged", name)


def write(sandbox_id: str, name: str, text: str) -> None:
    with open(path(sandbox_id, name), "w") as fh:
        fh.write(text)


def read(sandbox_id: str, name: str) -> str:
    with open(path(sandbox_id, name)) as fh:
        return fh.read()


def freeze(made: tuple[list[str], list[str]], sandbox_id: str, *, flatten: bool = False) -> str:
    snapshot_id = f"snap-idle-{uuid.uuid4().hex[:8]}"
    assert layers.freeze(snapshot_id, sandbox_id, flatten=flatten, holder=None)
    made[1].append(snapshot_id)
    return snapshot_id


def idle(sandbox_id: str) -> bool:
    """Whether ``sandbox_id``'s store is kept (its image there) but not
    mounted, and no loop device is left backing it."""
    store = layers.store_dir(sandbox_id)
    image = _diskcap.image_for(store)
    return (os.path.exists(image) and not os.path.ismount(store)
            and loop_devices_left(image) == [])


def test_a_closed_sandboxs_store_is_unmounted_and_mounted_again_when_read(
    made: tuple[list[str], list[str]],
) -> None:
    origin = start(made, None)
    write(origin, "a.txt", "A")
    snapshot = freeze(made, origin)
    layers.end_branch(origin)
    # The snapshot still holds its layer: the image stays, the mount goes.
    assert idle(origin)
    assert os.path.isdir(layers.snapshot_dir(snapshot))
    # Its size is read from the store, mounted for the read only.
    assert layers.layer_size(snapshot) >= 1
    assert idle(origin)
    branch = start(made, snapshot)
    assert read(branch, "a.txt") == "A"
    # Stacked by a live branch: never unmounted, however often collected.
    for _ in range(3):
        layers.collect_garbage()
        assert os.path.ismount(layers.store_dir(origin))
    assert read(branch, "a.txt") == "A"
    write(branch, "b.txt", "B")
    child = freeze(made, branch)
    layers.end_branch(branch)
    assert idle(origin) and idle(branch)
    # A branch of a branch, on two unmounted stores.
    grandchild = start(made, child)
    assert (read(grandchild, "a.txt"), read(grandchild, "b.txt")) == ("A", "B")


def test_a_flatten_reads_every_unmounted_store(made: tuple[list[str], list[str]]) -> None:
    snapshot = None
    for step in range(3):
        sandbox_id = start(made, snapshot)
        write(sandbox_id, f"f{step}.txt", str(step))
        if step:
            os.unlink(path(sandbox_id, f"f{step - 1}.txt"))  # a whiteout over the layer below
        snapshot = freeze(made, sandbox_id)
        layers.end_branch(sandbox_id)
    assert all(idle(s) for s in made[0])
    assert snapshot is not None and len(layers.chain_of(snapshot)) == 3
    last = start(made, snapshot)
    flat = freeze(made, last, flatten=True)
    assert layers.chain_of(flat) == [flat]
    layers.end_branch(last)
    for snapshot_id in made[1][:-1]:
        layers.remove(snapshot_id)
    # Only the flattened layer is left; it reads alone.
    assert [s for s in made[0] if os.path.exists(layers.store_dir(s))] == []
    again = start(made, flat)
    assert sorted(os.listdir(os.path.dirname(path(again, "x")))) == ["f2.txt"]
    assert read(again, "f2.txt") == "2"


def test_a_store_a_process_is_in_stays_mounted(made: tuple[list[str], list[str]]) -> None:
    origin = start(made, None)
    write(origin, "a.txt", "A")
    snapshot = freeze(made, origin)
    store = layers.store_dir(origin)
    inside = os.open(os.path.join(store, "frozen", snapshot, "a.txt"), os.O_RDONLY)
    try:
        layers.end_branch(origin)  # a plain unmount, refused: left mounted
        assert os.path.ismount(store)
        assert os.pread(inside, 1, 0) == b"A"
    finally:
        os.close(inside)
    layers.collect_garbage()
    assert idle(origin)


def test_a_collector_in_another_process_never_empties_a_branch(
    made: tuple[list[str], list[str]],
) -> None:
    """Another program collecting in a loop while branches are attached,
    suspended and resumed: a store it finds idle is unmounted only between
    the branches' mounts, never under one, and is never mounted twice."""
    origin = start(made, None)
    for i in range(20):
        write(origin, f"f{i}.txt", str(i))
    snapshot = freeze(made, origin)
    layers.end_branch(origin)
    image = _diskcap.image_for(layers.store_dir(origin))
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the collecting program
        try:
            while True:
                layers.collect_garbage()
        finally:
            os._exit(0)
    try:
        deadline = time.monotonic() + 20
        attached = 0
        while attached < 8 or time.monotonic() < deadline - 15:
            branch = start(made, snapshot)
            assert len(_diskcap.loop_devices_backed_by(image)) == 1
            assert sorted(os.listdir(os.path.dirname(path(branch, "x")))) == sorted(
                f"f{i}.txt" for i in range(20)
            )
            assert read(branch, "f7.txt") == "7"
            # Suspended and resumed (its stores unmounted, mounted again) as well.
            layers.rest(branch)
            layers.before_start(branch)
            layers.after_start(branch)
            assert read(branch, "f13.txt") == "13"
            layers.end_branch(branch)
            made[0].remove(branch)
            attached += 1
            assert time.monotonic() < deadline
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    layers.collect_garbage()
    assert idle(origin)


def test_a_directory_at_rest_holds_no_store_and_comes_back_whole(
    made: tuple[list[str], list[str]],
) -> None:
    """A suspended sandbox's working directory (its container gone) is put at
    rest: no store it stacks stays mounted. A capture of it wakes it for the
    capture only; the resume mounts it all again."""
    origin = start(made, None)
    write(origin, "a.txt", "A")
    branch = start(made, freeze(made, origin))
    write(branch, "b.txt", "B")
    freeze(made, branch)
    write(branch, "c.txt", "C")  # in its upper directory, in its own store
    layers.end_branch(origin)
    assert os.path.ismount(layers.store_dir(origin)), "a live branch stacks it"
    layers.rest(branch)
    assert idle(origin) and idle(branch)
    # Captured at rest: moved (a freeze), and copied whole (no diff).
    moved = freeze(made, branch)
    assert idle(origin) and idle(branch)
    copied = f"snap-idle-{uuid.uuid4().hex[:8]}"
    chain = layers.mounted_chain(branch)
    layers.capture(copied, branch, os.path.dirname(path(branch, "x")), chain, diff=False)
    made[1].append(copied)
    assert idle(origin) and idle(branch)
    assert sorted(os.listdir(os.path.join(layers.snapshot_dir(copied), "tree"))) == [
        "a.txt", "b.txt", "c.txt"]
    for snapshot in (moved, copied):
        again = start(made, snapshot)
        assert [read(again, n) for n in ("a.txt", "b.txt", "c.txt")] == ["A", "B", "C"]
        layers.end_branch(again)
    # Resumed: everything mounted again, its writes going on in its own store.
    layers.before_start(branch)
    layers.after_start(branch)
    assert [read(branch, n) for n in ("a.txt", "b.txt", "c.txt")] == ["A", "B", "C"]
    write(branch, "d.txt", "D")
    layers.collect_garbage()
    assert os.path.ismount(layers.store_dir(branch))
    assert os.path.ismount(layers.store_dir(origin))
    assert os.path.exists(os.path.join(layers.store_dir(branch), "upper", "d.txt"))


def test_a_store_whose_mount_lingers_elsewhere_is_mounted_on_its_own_loop_device(
    made: tuple[list[str], list[str]],
) -> None:
    """Another mount namespace (here a process's made with ``unshare -m``)
    keeps a copy of a store's mount after hutch unmounts it, and with it the
    loop device: mounted again on demand, the store goes through that same
    device, never a second one on the same image (two would corrupt it)."""
    origin = start(made, None)
    write(origin, "a.txt", "A")
    snapshot = freeze(made, origin)
    image = _diskcap.image_for(layers.store_dir(origin))
    holder = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sleep", "120"])
    try:
        mine = os.readlink("/proc/self/ns/mnt")
        deadline = time.monotonic() + 30
        while os.readlink(f"/proc/{holder.pid}/ns/mnt") == mine:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        sleep = os.path.realpath(shutil.which("sleep") or "sleep")
        while os.readlink(f"/proc/{holder.pid}/exe") != sleep:
            assert time.monotonic() < deadline  # unshare has made its namespace
            time.sleep(0.01)
        layers.end_branch(origin)
        assert not os.path.ismount(layers.store_dir(origin))
        devices = _diskcap.loop_devices_backed_by(image)
        assert len(devices) == 1, "the other namespace's copy holds it"
        branch = start(made, snapshot)
        assert _diskcap.loop_devices_backed_by(image) == devices
        assert read(branch, "a.txt") == "A"
        write(branch, "b.txt", "B")
        assert read(branch, "a.txt") == "A"
    finally:
        holder.kill()
        holder.wait()
