"""The end of a working directory: a branch unmounted and freed, an adopted
directory given back to its caller."""

from __future__ import annotations

import contextlib
import os
import shutil

from ..._atomic import write_json
from ..._errors import ProviderError
from .._diskcap import image_for, private_root, unmount_capped
from .adoption import adopted
from .archive import _archive, _archive_path
from .garbage import collect_garbage
from .overlay import _apply_upper, _stack, _umount
from .records import (
    _copy_tree,
    _lock,
    _read_json,
    _stacked,
    _stacked_by_mounts,
    _tree,
    mount_dir,
)
from .stores import _in_hand


def end_adopted(sandbox_id: str, *, keep: bool) -> None:
    """Give an adopted directory back: with ``keep``, its files as a plain
    directory again at the same path; without, nothing (hutch's own
    directory, going with its sandbox). Idempotent, and resumable: a give-back
    cut short (the process killed) is finished by the next call, which a
    restart makes (``LocalSandbox.reconnect`` and close, or the orphan reaper).

    The caller's directory comes back as a tree of its own that no snapshot
    needs, with the upper directory's changes moved onto it (renames: what
    changed, whiteouts and opaque directories turned into deletions). Which
    tree (:func:`_give_back_mode`):

    - ``move``: no snapshot stacks the layer any more: the layer itself, by
      one rename.
    - ``archive``: a held snapshot stacks it, but no mounted working
      directory does: the layer's files go back to the caller by one rename
      all the same, and the snapshot keeps its state as an archive of them
      (``tree.tar``: one file written, no inode a file; 0.3 s against 3-20 s
      for ``cp -a`` of 10 000 files here), unpacked into a layer again the
      first time anything stacks it (:func:`_materialize`). The caller's
      files can never be the snapshot's: sharing them (hard links) would let
      a later write in place change the snapshot.
    - ``copy``: a mounted branch stacks the layer: overlayfs reads it by
      path, so it stays, and the caller gets a copy of it (the whole tree:
      this filesystem has no cheaper copy that is safe to write to).

    Each step is journalled (``giving-back.json``) or shows on disk, and a
    tree reaches the caller's path only whole, by one rename.
    """
    found = adopted(sandbox_id)
    if found is None:
        end_branch(sandbox_id)
        return
    where, chain = found
    base = mount_dir(sandbox_id)
    _umount(where)
    if keep:
        _give_back(sandbox_id, where, chain)
    shutil.rmtree(base, ignore_errors=True)
    collect_garbage()


def giving_back(sandbox_id: str) -> bool:
    """Whether an adopted directory's give-back began (and was cut short, if
    no one is finishing it): its sandbox's close had begun, whatever any
    record says, and :func:`end_adopted` finishes it."""
    return os.path.exists(os.path.join(mount_dir(sandbox_id), "giving-back.json"))


def _give_back(sandbox_id: str, where: str, chain: list[str]) -> None:
    base = mount_dir(sandbox_id)
    marker = os.path.join(base, "giving-back.json")
    staging = os.path.join(base, "returning")
    with _lock:
        state = _read_json(marker)
        if state is None:
            mode = _give_back_mode(sandbox_id, chain)
            state = {"mode": mode}
            if mode != "copy":  # the tree that goes back, known by its inode
                state["tree"] = os.stat(_tree(chain[0])).st_ino
            write_json(marker, state)
        elif "mode" not in state:
            state = _journal_of_before_modes(state, where, chain)
            write_json(marker, state)
        mode = str(state.get("mode"))
        placed = _placed(where, state)
    # The archive is made without the lock (it reads the whole tree): a
    # branch that starts on the layer meanwhile is seen below.
    archived = mode == "archive" and not placed and (
        os.path.exists(_archive_path(chain[0])) or _archive(chain[0]))
    with _lock:
        if mode == "archive" and not placed and (
            # A branch started on the layer meanwhile (or after a crash), or no archive.
            chain[0] in _stacked_by_mounts(but=sandbox_id) or not archived
        ):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_archive_path(chain[0]))
            mode, state = "copy", {"mode": "copy"}
            write_json(marker, state)
        if mode != "copy" and not placed:
            _put_in_place(_tree(chain[0]), where)
    if mode == "copy" and not placed:
        if "tree" not in state:  # a copy cut short starts again
            shutil.rmtree(staging, ignore_errors=True)
            _merge_copy(chain, staging)
            state["tree"] = os.stat(staging).st_ino
            write_json(marker, state)
        _put_in_place(staging, where)
    upper = os.path.join(base, "upper")
    if os.path.isdir(upper):
        _apply_upper(upper, where)
        root = os.lstat(upper)
        os.chmod(where, root.st_mode & 0o7777)
        os.chown(where, root.st_uid, root.st_gid)


def _journal_of_before_modes(
    state: dict[str, object], where: str, chain: list[str]
) -> dict[str, object]:
    """A give-back journal written before the modes (``{"moved": bool}``),
    cut short, as one of now: moved (the layer renamed to ``where``, or not
    yet), or copied (straight into ``where`` then: made again)."""
    if state.get("moved"):
        tree = _tree(chain[0])
        return {"mode": "move", "tree": os.stat(tree if os.path.isdir(tree) else where).st_ino}
    shutil.rmtree(where, ignore_errors=True)
    return {"mode": "copy"}


def _give_back_mode(sandbox_id: str, chain: list[str]) -> str:
    """How an adopted directory goes back (see :func:`end_adopted`); called
    with the lock held, so that no branch starts on the layer in between."""
    if len(chain) != 1:
        return "copy"
    if chain[0] not in _stacked(but=sandbox_id):
        return "move"
    if chain[0] not in _stacked_by_mounts(but=sandbox_id):
        return "archive"
    return "copy"


def _placed(where: str, state: dict[str, object]) -> bool:
    """Whether the tree a give-back's journal names is at ``where`` already
    (before, ``where`` is the empty mount point, or absent)."""
    try:
        return os.lstat(where).st_ino == state.get("tree")
    except FileNotFoundError:
        return False


def _put_in_place(tree: str, where: str) -> None:
    """Rename ``tree`` to ``where``, which is absent or the empty mount point
    (``rmdir`` never removes a file of the caller's)."""
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(where)
    os.rename(tree, where)


def _merge_copy(chain: list[str], target: str) -> None:
    """``chain``'s merged view as a plain directory at ``target``: the bottom
    layer copied, each one above applied over it."""
    with _in_hand(chain, read_only=True):
        _copy_tree(_tree(chain[-1]), target)
        for layer in reversed(chain[:-1]):
            scratch = f"{target}.layer-{layer}"
            shutil.rmtree(scratch, ignore_errors=True)
            _copy_tree(_tree(layer), scratch)
            _apply_upper(scratch, target)
            shutil.rmtree(scratch, ignore_errors=True)


def end_branch(sandbox_id: str) -> None:
    """Unmount and free a branch's working directory; idempotent. An adopted
    directory is given back, files kept (:func:`end_adopted`)."""
    if adopted(sandbox_id) is not None:
        end_adopted(sandbox_id, keep=True)
        return
    base = mount_dir(sandbox_id)
    merged = os.path.join(base, "merged")
    if os.path.exists(image_for(merged)) or os.path.ismount(private_root(merged)):
        unmount_capped(merged)  # a capped copy (no overlayfs here): its file system too
    for _ in range(8):  # a layered one has its overlay on its anchor
        if not _stack(merged):
            break
        _umount(merged)
    if _stack(merged):
        # Never empty a directory through a mount: that would reach the layers.
        raise ProviderError(f"the working directory {merged} cannot be unmounted")
    shutil.rmtree(base, ignore_errors=True)
    collect_garbage()
