"""local: a plain working directory's first snapshot moves the tree into the
snapshot's layer (no file copied) and the sandbox goes on over an overlay; the
directory is given back, files kept, when the sandbox ends."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator

import pytest

import hutch
from hutch._sandbox import backend_of
from hutch.providers import _layers
from hutch.providers.local import LocalSandbox

pytestmark = pytest.mark.anyio


@pytest.fixture
def tree() -> Iterator[str]:
    root = tempfile.mkdtemp(prefix="hutch-adopt-")
    os.makedirs(os.path.join(root, "src"))
    for i in range(50):
        with open(os.path.join(root, "src", f"f{i}.txt"), "w") as fh:
            fh.write(f"file {i}\n")
    os.chmod(root, 0o750)
    yield root
    shutil.rmtree(root, ignore_errors=True)


async def test_first_snapshot_moves_the_tree_and_the_directory_comes_back(tree: str) -> None:
    inode = os.stat(os.path.join(tree, "src", "f7.txt")).st_ino
    sb = await hutch.create_sandbox("local", workdir=tree, read_before_write=False)
    snap = await sb.snapshot("first")
    try:
        # Moved, not copied: the layer holds the very same file.
        layer_file = os.path.join(_layers.snapshot_dir(snap.id), "tree", "src", "f7.txt")
        assert os.stat(layer_file).st_ino == inode
        assert os.path.ismount(tree)
        assert os.stat(tree).st_mode & 0o777 == 0o750
        assert snap.size_bytes >= 50 * len("file 0\n")
        # The sandbox and the host both go on at the same path.
        assert await sb.read_text("src/f7.txt") == "file 7\n"
        await sb.write_text("src/f7.txt", "changed\n")
        await sb.exec("rm src/f8.txt && echo new > new.txt")
        with open(os.path.join(tree, "new.txt")) as fh:
            assert fh.read() == "new\n"
        # The snapshot keeps what was there when it was taken.
        with open(layer_file) as fh:
            assert fh.read() == "file 7\n"
        branch = await hutch.create_sandbox_from_snapshot(snap)
        assert await branch.read_text("src/f7.txt") == "file 7\n"
        assert await branch.exists("src/f8.txt")
        assert not await branch.exists("new.txt")
        await branch.close()
        # A second snapshot copies only what changed (the upper directory).
        second = await sb.snapshot("second")
        assert second.size_bytes < snap.size_bytes
        restored = await hutch.create_sandbox_from_snapshot(second)
        assert await restored.read_text("src/f7.txt") == "changed\n"
        assert not await restored.exists("src/f8.txt")
        await restored.close()
        await hutch.remove_snapshot(second)
    finally:
        await sb.close()
    # Given back: a plain directory again, with every change made in it.
    assert not os.path.ismount(tree)
    assert os.stat(tree).st_mode & 0o777 == 0o750
    with open(os.path.join(tree, "src", "f7.txt")) as fh:
        assert fh.read() == "changed\n"
    assert not os.path.exists(os.path.join(tree, "src", "f8.txt"))
    assert os.path.exists(os.path.join(tree, "new.txt"))
    assert sorted(os.listdir(os.path.dirname(tree))) == sorted(
        n for n in os.listdir(os.path.dirname(tree)) if ".hutch-" not in n
    )
    # The snapshot outlives the sandbox, then goes with nothing left.
    later = await hutch.create_sandbox_from_snapshot(snap)
    assert await later.read_text("src/f7.txt") == "file 7\n"
    await later.close()
    await hutch.remove_snapshot(snap)
    assert not os.path.exists(_layers.snapshot_dir(snap.id))
    # (Only this test's: other programs' sandboxes may share the home.)
    assert not {sb.id, branch.id, restored.id, later.id} & set(_layers.branches())


async def test_a_directory_of_its_own_goes_with_the_sandbox() -> None:
    sb = await hutch.create_sandbox("local", read_before_write=False)
    await sb.write_text("a.txt", "A")
    snap = await sb.snapshot()
    workdir = sb.workdir
    assert os.path.ismount(workdir)
    await sb.close()
    assert not os.path.exists(workdir)
    assert sb.id not in _layers.branches()
    await hutch.remove_snapshot(snap)
    assert not os.path.exists(_layers.snapshot_dir(snap.id))


async def test_a_directory_a_process_is_in_is_copied_not_moved(tree: str) -> None:
    inode = os.stat(os.path.join(tree, "src", "f7.txt")).st_ino
    # A shell outside hutch sits in the directory: moving it would leave that
    # shell writing into the snapshot.
    outsider = subprocess.Popen(  # noqa: ASYNC220 - started once, before the sandbox
        ["sleep", "60"], cwd=os.path.join(tree, "src"))
    try:
        async with await hutch.create_sandbox("local", workdir=tree,
                                              read_before_write=False) as sb:
            snap = await sb.snapshot()
            assert not os.path.ismount(tree)
            layer_file = os.path.join(_layers.snapshot_dir(snap.id), "tree", "src", "f7.txt")
            assert os.stat(layer_file).st_ino != inode
            await sb.write_text("src/f7.txt", "changed\n")
            with open(layer_file) as fh:
                assert fh.read() == "file 7\n"
            await hutch.remove_snapshot(snap)
    finally:
        outsider.kill()
        outsider.wait()


async def test_an_adopted_directory_is_mounted_again_after_a_reboot(tree: str) -> None:
    sb = await hutch.create_sandbox("local", workdir=tree, read_before_write=False)
    # What a daemon stored when it made the sandbox, before any snapshot.
    description = backend_of(sb).describe()
    snap = await sb.snapshot()
    await sb.write_text("after.txt", "kept")
    try:
        subprocess.run(["umount", tree], check=True)  # as a reboot would
        assert not os.path.exists(os.path.join(tree, "after.txt"))
        again = await LocalSandbox.reconnect(sb.id, description)
        assert os.path.ismount(tree)
        assert (await again.read_file(f"{tree}/after.txt", 100)) == b"kept"
        assert (await again.read_file(f"{tree}/src/f1.txt", 100)) == b"file 1\n"
        await again.close()
        assert not os.path.ismount(tree)
        with open(os.path.join(tree, "after.txt")) as fh:
            assert fh.read() == "kept"
    finally:
        await sb.close()
        await hutch.remove_snapshot(snap)


@pytest.mark.parametrize("snapshot_kept", [True, False], ids=["snapshot-kept", "snapshot-removed"])
async def test_giving_back_applies_every_kind_of_change(tree: str, snapshot_kept: bool) -> None:
    """Deleted files and directories (whiteouts), a directory deleted and made
    again (opaque), changed and new files: the directory given back is what
    the sandbox last saw. With the snapshot gone, untouched files are the
    very same files (the layer taken back, nothing copied)."""
    os.makedirs(os.path.join(tree, "old", "deep"))
    with open(os.path.join(tree, "old", "deep", "x.txt"), "w") as fh:
        fh.write("x")
    untouched = os.stat(os.path.join(tree, "src", "f1.txt")).st_ino
    sb = await hutch.create_sandbox("local", workdir=tree, read_before_write=False)
    snap = await sb.snapshot()
    if not snapshot_kept:
        await hutch.remove_snapshot(snap)
    script = (
        "rm src/f2.txt && rm -r old && mkdir -p old/other && echo o > old/other/o.txt"
        " && echo c > src/f3.txt && mkdir -p new/a && echo n > new/a/n.txt"
        " && ln -s src/f1.txt link && chmod 700 ."
    )
    assert (await sb.exec(script)).exit_code == 0
    seen = sorted((await sb.exec("find . | sort")).stdout.split())
    await sb.close()
    assert not os.path.ismount(tree)
    given = sorted(subprocess.run(["find", "."], cwd=tree, capture_output=True, text=True,
                                  check=True).stdout.split())
    assert given == seen
    assert not os.path.exists(os.path.join(tree, "old", "deep"))
    with open(os.path.join(tree, "src", "f3.txt")) as fh:
        assert fh.read() == "c\n"
    assert os.readlink(os.path.join(tree, "link")) == "src/f1.txt"
    assert os.stat(tree).st_mode & 0o777 == 0o700
    moved_back = os.stat(os.path.join(tree, "src", "f1.txt")).st_ino == untouched
    assert moved_back is not snapshot_kept
    if snapshot_kept:
        branch = await hutch.create_sandbox_from_snapshot(snap)
        assert await branch.read_text("old/deep/x.txt") == "x"
        await branch.close()
        await hutch.remove_snapshot(snap)
    assert not os.path.exists(_layers.snapshot_dir(snap.id))
    assert [n for n in os.listdir(os.path.dirname(tree)) if ".hutch-" in n] == []
