"""Freezing a layered working directory (``layers.freeze``), the move a
docker snapshot makes instead of a copy: on real overlay mounts (root).

Each step that can be cut short is cut short by a real crash (the process
doing it exits on the spot): the next start of the sandbox's directory
finishes or undoes the freeze, and no file is lost either way.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from hutch.providers import layers
from hutch.providers.layers import captures, flattening, freezing


@pytest.fixture
def sandbox_id() -> Iterator[str]:
    sandbox_id = f"sb-freeze-{uuid.uuid4().hex[:8]}"
    layers.prepare(sandbox_id, None)
    layers.after_start(sandbox_id)
    yield sandbox_id
    layers.end_branch(sandbox_id)


def merged(sandbox_id: str) -> str:
    return os.path.join(layers.mount_dir(sandbox_id), "merged")


def write(sandbox_id: str, name: str, text: str) -> None:
    path = os.path.join(merged(sandbox_id), name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        fh.write(text)


def read(sandbox_id: str, name: str) -> str:
    with open(os.path.join(merged(sandbox_id), name)) as fh:
        return fh.read()


def crash_during_freeze(
    sandbox_id: str, snapshot_id: str, owner: Any, name: str
) -> None:
    """Freeze in a forked child that dies (exit 9, no cleanup) when it
    reaches ``owner.name``."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            die: Callable[..., None] = lambda *args, **kwargs: os._exit(9)  # noqa: E731
            setattr(owner, name, die)
            layers.freeze(snapshot_id, sandbox_id, flatten=False, holder=None)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 9, "the child did not reach the step"


def test_a_freeze_moves_the_files_and_the_directory_goes_on(sandbox_id: str) -> None:
    write(sandbox_id, "src/a.txt", "A")
    write(sandbox_id, "b.txt", "B")
    inode = os.stat(os.path.join(merged(sandbox_id), "src/a.txt")).st_ino
    assert layers.freeze("snap-one", sandbox_id, flatten=False, holder=None)
    assert layers.layer_size("snap-one") >= 2
    assert layers.mounted_chain(sandbox_id) == ["snap-one"]
    assert "snap-one" in layers.held()
    layer = os.path.join(layers.snapshot_dir("snap-one"), "tree")
    assert os.stat(os.path.join(layer, "src/a.txt")).st_ino == inode, "copied, not moved"
    # The directory goes on over the frozen layer; its writes stay out of it.
    write(sandbox_id, "src/a.txt", "A2")
    os.unlink(os.path.join(merged(sandbox_id), "b.txt"))
    assert read(sandbox_id, "src/a.txt") == "A2"
    with open(os.path.join(layer, "src/a.txt")) as fh:
        assert fh.read() == "A"
    assert os.path.exists(os.path.join(layer, "b.txt"))
    # A branch of it sees the frozen state.
    layers.prepare("sb-freeze-branch", "snap-one")
    try:
        layers.after_start("sb-freeze-branch")
        assert read("sb-freeze-branch", "src/a.txt") == "A"
        assert read("sb-freeze-branch", "b.txt") == "B"
    finally:
        layers.end_branch("sb-freeze-branch")
    # Removed while the directory stacks it: kept until that ends.
    layers.remove("snap-one")
    assert os.path.isdir(layer)
    assert read(sandbox_id, "src/a.txt") == "A2"


def test_a_directory_a_process_is_in_is_not_frozen(sandbox_id: str) -> None:
    write(sandbox_id, "a.txt", "A")
    holder = subprocess.Popen(["sleep", "30"], cwd=merged(sandbox_id))
    try:
        assert not layers.freeze("snap-held", sandbox_id, flatten=False, holder=None)
        assert layers.mounted_chain(sandbox_id) == []
        assert "snap-held" not in layers.held()
        assert not os.path.exists(layers.snapshot_dir("snap-held"))
        write(sandbox_id, "a.txt", "still mounted")
        assert os.path.exists(os.path.join(layers.mount_dir(sandbox_id), "upper", "a.txt"))
    finally:
        holder.kill()
        holder.wait()


def test_a_chain_at_its_cap_is_flattened_into_one_layer(
    sandbox_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(flattening, "MAX_LAYERS", 2)
    write(sandbox_id, "a.txt", "A")
    write(sandbox_id, "gone.txt", "G")
    layers.freeze("snap-f1", sandbox_id, flatten=False, holder=None)
    os.unlink(os.path.join(merged(sandbox_id), "gone.txt"))  # a whiteout over snap-f1
    write(sandbox_id, "b.txt", "B")
    layers.freeze("snap-f2", sandbox_id, flatten=False, holder=None)
    assert layers.mounted_chain(sandbox_id) == ["snap-f2", "snap-f1"]
    write(sandbox_id, "c.txt", "C")
    layers.freeze("snap-f3", sandbox_id, flatten=False, holder=None)
    assert layers.mounted_chain(sandbox_id) == ["snap-f3"]
    layer = os.path.join(layers.snapshot_dir("snap-f3"), "tree")
    assert sorted(os.listdir(layer)) == ["a.txt", "b.txt", "c.txt"]
    assert sorted(os.listdir(merged(sandbox_id))) == ["a.txt", "b.txt", "c.txt"]
    for snapshot in ("snap-f1", "snap-f2", "snap-f3"):
        layers.remove(snapshot)
    # Nothing stacks the first two any more: freed now, not at the end.
    assert not os.path.exists(layers.snapshot_dir("snap-f1"))
    assert not os.path.exists(layers.snapshot_dir("snap-f2"))


def test_a_crash_before_the_move_is_undone(sandbox_id: str) -> None:
    write(sandbox_id, "a.txt", "A")
    crash_during_freeze(sandbox_id, "snap-c1", os, "rename")
    # Left unmounted, with its journal: the next start undoes it.
    layers.before_start(sandbox_id)
    layers.after_start(sandbox_id)
    assert read(sandbox_id, "a.txt") == "A"
    assert layers.mounted_chain(sandbox_id) == []
    assert not os.path.exists(layers.snapshot_dir("snap-c1"))
    assert "snap-c1" not in layers.held()
    # And the next freeze works.
    assert layers.freeze("snap-c2", sandbox_id, flatten=False, holder=None)
    assert layers.mounted_chain(sandbox_id) == ["snap-c2"]
    layers.remove("snap-c2")


def test_a_crash_after_the_move_is_finished_and_its_layer_kept_while_used(
    sandbox_id: str,
) -> None:
    write(sandbox_id, "a.txt", "A")
    crash_during_freeze(sandbox_id, "snap-c3", freezing, "_finish_freeze")
    layers.before_start(sandbox_id)
    layers.after_start(sandbox_id)
    assert read(sandbox_id, "a.txt") == "A"
    write(sandbox_id, "a.txt", "A2")
    # Finished: the directory stacks the moved layer. Not listed as a
    # snapshot (no record names it), and freed when the directory ends.
    assert layers.mounted_chain(sandbox_id) == ["snap-c3"]
    assert "snap-c3" not in layers.held()
    assert os.path.isdir(layers.snapshot_dir("snap-c3"))
    layers.end_branch(sandbox_id)
    assert not os.path.exists(layers.snapshot_dir("snap-c3"))


def test_a_collector_running_while_a_snapshot_is_made_leaves_it_be(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another program's garbage collection (here: run in the middle of the
    copy) frees removed snapshots' directories, never one being made."""
    workdir = tmp_path / "plain"
    workdir.mkdir()
    (workdir / "a.txt").write_text("A")
    copy = captures._copy_tree

    def copy_while_collecting(source: str, target: str) -> None:
        layers.collect_garbage()
        copy(source, target)
        layers.collect_garbage()

    monkeypatch.setattr(captures, "_copy_tree", copy_while_collecting)
    size = layers.capture("snap-gc", "sb-plain", str(workdir), None, diff=True)
    assert size >= 1 and "snap-gc" in layers.held()
    with open(os.path.join(layers.snapshot_dir("snap-gc"), "tree", "a.txt")) as fh:
        assert fh.read() == "A"
    layers.remove("snap-gc")
    assert not os.path.exists(layers.snapshot_dir("snap-gc"))
