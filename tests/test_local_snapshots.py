"""local: a plain working directory's first snapshot moves the tree into the
snapshot's layer (no file copied) and the sandbox goes on over an overlay; the
directory is given back, files kept, when the sandbox ends."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import hutch
from hutch._sandbox import backend_of
from hutch.providers import layers
from hutch.providers.layers import giveback, overlay
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
    while os.path.ismount(root):  # a test that failed with the directory adopted
        subprocess.run(["umount", "-l", root], check=True)
    shutil.rmtree(root, ignore_errors=True)


async def test_first_snapshot_moves_the_tree_and_the_directory_comes_back(tree: str) -> None:
    inode = os.stat(os.path.join(tree, "src", "f7.txt")).st_ino
    sb = await hutch.create_sandbox("local", workdir=tree, read_before_write=False)
    snap = await sb.snapshot("first")
    try:
        # Moved, not copied: the layer holds the very same file.
        layer_file = os.path.join(layers.snapshot_dir(snap.id), "tree", "src", "f7.txt")
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
    assert not os.path.exists(layers.snapshot_dir(snap.id))
    # (Only this test's: other programs' sandboxes may share the home.)
    assert not {sb.id, branch.id, restored.id, later.id} & set(layers.branches())


async def test_a_directory_of_its_own_goes_with_the_sandbox() -> None:
    sb = await hutch.create_sandbox("local", read_before_write=False)
    await sb.write_text("a.txt", "A")
    snap = await sb.snapshot()
    workdir = sb.workdir
    assert os.path.ismount(workdir)
    await sb.close()
    assert not os.path.exists(workdir)
    assert sb.id not in layers.branches()
    await hutch.remove_snapshot(snap)
    assert not os.path.exists(layers.snapshot_dir(snap.id))


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
            layer_file = os.path.join(layers.snapshot_dir(snap.id), "tree", "src", "f7.txt")
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


def state_of(root: str) -> dict[str, tuple[object, ...]]:
    """Every entry under ``root``: its kind, mode, owner, and content (a
    file's bytes, a link's target, a user attribute)."""
    found: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [".", *dirnames, *filenames] if dirpath == root else [*dirnames, *filenames]:
            path = os.path.normpath(os.path.join(dirpath, name))
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                content: object = os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                with open(path, "rb") as fh:
                    content = fh.read()
            else:
                content = None
            try:
                attribute = os.getxattr(path, "user.hutch-test", follow_symlinks=False)
            except OSError:
                attribute = None
            found[os.path.relpath(path, root)] = (
                stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid,
                content, attribute,
            )
    return found


def fill(root: str) -> None:
    """Files of every kind, for changes of every kind to be made on."""
    for d in ("old/deep", "becomes_file", "renamed_dir", "mixed"):
        os.makedirs(os.path.join(root, d), exist_ok=True)
    for name, text in (("old/deep/x.txt", "x"), ("becomes_file/in.txt", "in"),
                       ("becomes_dir", "plain"), ("to_rename.txt", "r"),
                       ("renamed_dir/a.txt", "a"), ("mode.sh", "#!/bin/sh\n"),
                       ("mixed/keep.txt", "k"), ("attr.txt", "attr")):
        with open(os.path.join(root, name), "w") as fh:
            fh.write(text)
    os.symlink("src/f1.txt", os.path.join(root, "old_link"))
    os.setxattr(os.path.join(root, "attr.txt"), "user.hutch-test", b"v1")
    os.chown(os.path.join(root, "mixed", "keep.txt"), 1234, 5678)


#: Changes of every kind, made inside the sandbox: files changed (in place
#: too), added, deleted, renamed; directories deleted, deleted and made
#: again (opaque), replaced by a file and a file by one; links; modes.
CHANGES = (
    "rm src/f2.txt && rm -r old && mkdir -p old/other && echo o > old/other/o.txt"
    " && echo c > src/f3.txt && echo more >> src/f4.txt && mkdir -p new/a"
    " && echo n > new/a/n.txt && ln -s src/f1.txt link && ln -sfn src/f9.txt old_link"
    " && rm -r becomes_file && echo now-a-file > becomes_file"
    " && rm becomes_dir && mkdir becomes_dir && echo inside > becomes_dir/i.txt"
    " && mv to_rename.txt renamed.txt && mv renamed_dir dir_renamed"
    " && chmod 755 mode.sh && chmod 600 src/f5.txt && rm mixed/keep.txt"
    " && echo v > mixed/new.txt && chmod 700 ."
)


@pytest.mark.parametrize("how", ["snapshot-removed", "snapshot-kept", "branch-running"])
async def test_giving_back_applies_every_kind_of_change(tree: str, how: str) -> None:
    """The directory given back is what the sandbox last saw (whiteouts
    turned into deletions, opaque directories into replacements), and a
    snapshot still held shows what it captured, attached afterwards. Untouched
    files go back as the very same files (moved, not copied) unless a running
    branch stacks the layer (overlayfs reads it: the caller gets a copy)."""
    fill(tree)
    untouched = os.stat(os.path.join(tree, "src", "f1.txt")).st_ino
    captured = state_of(tree)
    sb = await hutch.create_sandbox("local", workdir=tree, read_before_write=False)
    snap = await sb.snapshot()
    branch = None
    if how == "snapshot-removed":
        await hutch.remove_snapshot(snap)
    elif how == "branch-running":
        branch = await hutch.create_sandbox_from_snapshot(snap)
    assert (await sb.exec(CHANGES)).exit_code == 0
    os.setxattr(os.path.join(tree, "attr.txt"), "user.hutch-test", b"v2")
    seen = state_of(tree)  # the merged view, through the overlay
    assert seen != captured
    await sb.close()
    assert not os.path.ismount(tree)
    assert state_of(tree) == seen
    moved_back = os.stat(os.path.join(tree, "src", "f1.txt")).st_ino == untouched
    assert moved_back is (how != "branch-running")
    # The caller's files are theirs: writing one in place changes no snapshot.
    with open(os.path.join(tree, "src", "f1.txt"), "a") as fh:
        fh.write("the caller writes on\n")
    if branch is not None:
        assert state_of(branch.workdir) == captured
        await branch.close()
    if how != "snapshot-removed":
        later = await hutch.create_sandbox_from_snapshot(snap)
        assert state_of(later.workdir) == captured
        await later.close()
        await hutch.remove_snapshot(snap)
    assert not os.path.exists(layers.snapshot_dir(snap.id))
    assert [n for n in os.listdir(os.path.dirname(tree)) if ".hutch-" in n] == []


def give_back_dying_at(sandbox_id: str, owner: Any, name: str, *, after: bool) -> None:
    """Give an adopted directory back in a forked child that dies (exit 9,
    no cleanup) when it reaches ``owner.name`` (``after``: once that returns)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            real = getattr(owner, name)

            def die(*args: Any, **kwargs: Any) -> None:
                if after:
                    real(*args, **kwargs)
                os._exit(9)

            setattr(owner, name, die)
            layers.end_adopted(sandbox_id, keep=True)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 9, "the child did not reach the step"


#: Where a give-back is cut short (the step, and whether it was done): in
#: the middle of making the archive and after, before the tree is renamed into place,
#: before and in the middle of moving the changes onto it (after a first
#: deletion; before a directory is moved), and, with a branch running, in
#: the middle of the copy and after it, before it is renamed into place.
CRASH_POINTS = [
    ("snapshot-kept", giveback, "_archive", False),
    ("snapshot-kept", subprocess, "run", True),
    ("snapshot-kept", giveback, "_archive", True),
    ("snapshot-kept", giveback, "_put_in_place", False),
    ("snapshot-kept", giveback, "_put_in_place", True),
    ("snapshot-kept", overlay, "_remove", True),
    ("snapshot-kept", overlay, "_scrub", False),
    ("snapshot-removed", giveback, "_put_in_place", False),
    ("snapshot-removed", overlay, "_remove", True),
    ("branch-running", giveback, "_copy_tree", False),
    ("branch-running", giveback, "_merge_copy", True),
    ("branch-running", overlay, "_remove", True),
]


@pytest.mark.parametrize(
    ("how", "owner", "step", "after"), CRASH_POINTS,
    ids=[f"{h}-{s}{'-done' if a else ''}" for h, _, s, a in CRASH_POINTS],
)
async def test_a_give_back_cut_short_is_finished_by_the_next_start(
    tree: str, how: str, owner: Any, step: str, after: bool
) -> None:
    """Whatever step the process dies at, the next start (the orphan reaper,
    or the sandbox's close after a reconnect) finishes the give-back: the
    caller's directory as the sandbox last saw it, the snapshot as captured."""
    fill(tree)
    captured = state_of(tree)
    sandbox_id, snapshot_id = f"sb-give-{uuid.uuid4().hex[:8]}", f"snap-{uuid.uuid4().hex[:8]}"
    assert layers.adopt(snapshot_id, sandbox_id, tree) is not None
    subprocess.run(["bash", "-c", CHANGES], cwd=tree, check=True)
    seen = state_of(tree)
    branch = f"sb-branch-{uuid.uuid4().hex[:8]}"
    if how == "branch-running":
        layers.start_branch(branch, snapshot_id)
    elif how == "snapshot-removed":
        layers.remove(snapshot_id)
    give_back_dying_at(sandbox_id, owner, step, after=after)
    # A restart (the reaper, or the close after a reconnect) finishes it.
    layers.ensure_mounted(sandbox_id)
    await LocalSandbox.discard(sandbox_id)
    assert not os.path.ismount(tree)
    assert state_of(tree) == seen
    assert sandbox_id not in layers.branches()
    if how == "branch-running":
        assert state_of(os.path.join(layers.mount_dir(branch), "merged")) == captured
        layers.end_branch(branch)
    if how != "snapshot-removed":
        again = f"sb-again-{uuid.uuid4().hex[:8]}"
        workdir, _ = layers.start_branch(again, snapshot_id)
        assert state_of(workdir) == captured
        layers.end_branch(again)
        layers.remove(snapshot_id)
    assert not os.path.exists(layers.snapshot_dir(snapshot_id))


def test_a_branch_started_while_the_archive_is_made_keeps_the_layer(
    tree: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The archive is made without the layers' lock: a branch that starts on
    the layer meanwhile (overlayfs then reads it by path) makes the give-back
    a copy, and the branch goes on over the layer as captured."""
    fill(tree)
    captured = state_of(tree)
    untouched = os.stat(os.path.join(tree, "src", "f1.txt")).st_ino
    sandbox_id, snapshot_id = f"sb-give-{uuid.uuid4().hex[:8]}", f"snap-{uuid.uuid4().hex[:8]}"
    branch = f"sb-branch-{uuid.uuid4().hex[:8]}"
    assert layers.adopt(snapshot_id, sandbox_id, tree) is not None
    subprocess.run(["bash", "-c", CHANGES], cwd=tree, check=True)
    seen = state_of(tree)
    real = giveback._archive

    def archive_while_a_branch_starts(layer: str) -> bool:
        layers.start_branch(branch, snapshot_id)
        return real(layer)

    monkeypatch.setattr(giveback, "_archive", archive_while_a_branch_starts)
    layers.end_adopted(sandbox_id, keep=True)
    assert state_of(tree) == seen
    assert os.stat(os.path.join(tree, "src", "f1.txt")).st_ino != untouched  # a copy
    with open(os.path.join(tree, "src", "f1.txt"), "a") as fh:
        fh.write("the caller writes on\n")
    assert state_of(os.path.join(layers.mount_dir(branch), "merged")) == captured
    layers.end_branch(branch)
    layers.remove(snapshot_id)
    assert not os.path.exists(layers.snapshot_dir(snapshot_id))


async def test_a_close_cut_short_is_finished_when_its_sandbox_is_reconnected(tree: str) -> None:
    """A daemon that restarts reconnects the sandboxes its records call live:
    one whose give-back had begun was being closed; it is finished, and the
    reconnect says the sandbox ended."""
    fill(tree)
    captured = state_of(tree)
    sb = await hutch.create_sandbox("local", workdir=tree, read_before_write=False)
    snap = await sb.snapshot()
    assert (await sb.exec(CHANGES)).exit_code == 0
    seen = state_of(tree)
    description = backend_of(sb).describe()
    give_back_dying_at(sb.id, giveback, "_apply_upper", after=False)
    with pytest.raises(hutch.SandboxUnavailable, match="was being closed"):
        await LocalSandbox.reconnect(sb.id, description)
    assert state_of(tree) == seen
    assert sb.id not in layers.branches()
    await sb.close()
    later = await hutch.create_sandbox_from_snapshot(snap)
    assert state_of(later.workdir) == captured
    await later.close()
    await hutch.remove_snapshot(snap)


async def test_a_close_cut_short_whose_record_ended_is_finished_by_the_reaper(
    tree: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon records a sandbox ended before it closes it: after a crash in
    between, the record names it (no orphan) but the reaper, which runs at
    every start, finishes its give-back all the same. (A home of its own:
    the reaper ends whatever else a home holds.)"""
    monkeypatch.setenv("HUTCH_HOME", str(tmp_path / "home"))
    fill(tree)
    sandbox_id, snapshot_id = f"sb-give-{uuid.uuid4().hex[:8]}", f"snap-{uuid.uuid4().hex[:8]}"
    assert layers.adopt(snapshot_id, sandbox_id, tree) is not None
    subprocess.run(["bash", "-c", CHANGES], cwd=tree, check=True)
    seen = state_of(tree)
    running = f"sb-running-{uuid.uuid4().hex[:8]}"
    layers.start_branch(running, snapshot_id)  # a live sandbox, left alone
    give_back_dying_at(sandbox_id, giveback, "_put_in_place", after=False)
    assert await LocalSandbox.reap_orphans({sandbox_id, running}) == [sandbox_id]
    assert state_of(tree) == seen
    assert layers.branches() == [running]
    layers.end_branch(running)
    layers.remove(snapshot_id)
    assert layers.held() == []


@pytest.mark.parametrize("moved", [True, False], ids=["moved", "copied"])
def test_a_give_back_journal_from_before_the_modes_is_finished(tree: str, moved: bool) -> None:
    """A give-back cut short by an earlier hutch (its journal said only
    whether the layer was moved) is finished without taking the layer from
    a snapshot that holds it."""
    fill(tree)
    captured = state_of(tree)
    sandbox_id, snapshot_id = f"sb-give-{uuid.uuid4().hex[:8]}", f"snap-{uuid.uuid4().hex[:8]}"
    assert layers.adopt(snapshot_id, sandbox_id, tree) is not None
    subprocess.run(["bash", "-c", CHANGES], cwd=tree, check=True)
    seen = state_of(tree)
    if moved:  # that hutch moved the layer when no snapshot held it
        layers.remove(snapshot_id)
    # Where it stopped: the journal written, the mount point gone, nothing moved.
    subprocess.run(["umount", tree], check=True)
    with open(os.path.join(layers.mount_dir(sandbox_id), "giving-back.json"), "w") as fh:
        json.dump({"moved": moved}, fh)
    os.rmdir(tree)
    layers.end_adopted(sandbox_id, keep=True)
    assert state_of(tree) == seen
    if not moved:
        again = f"sb-again-{uuid.uuid4().hex[:8]}"
        workdir, _ = layers.start_branch(again, snapshot_id)
        assert state_of(workdir) == captured
        layers.end_branch(again)
        layers.remove(snapshot_id)
    assert not os.path.exists(layers.snapshot_dir(snapshot_id))
