"""A snapshot's layer kept as an archive."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess

from ..._errors import ProviderError
from .records import _tree, snapshot_dir

# A snapshot's layer whose files went back to the caller (``end_adopted``,
# ``archive``) is kept as ``tree.tar`` beside where its ``tree`` was, and
# unpacked into ``tree`` again the first time something stacks it. Made and
# unpacked with GNU tar: owners (numerically), modes, times, hard links,
# sparse files, extended attributes and ACLs kept.

_TAR_KEEP = ["--numeric-owner", "--xattrs", "--xattrs-include=*", "--acls"]


def _archive_path(snapshot_id: str) -> str:
    return os.path.join(snapshot_dir(snapshot_id), "tree.tar")


def _archive(snapshot_id: str) -> bool:
    """Write snapshot ``snapshot_id``'s layer to its archive (whole, or not
    at all: made under another name, flushed, then renamed); False if tar
    could not."""
    archive = _archive_path(snapshot_id)
    partial = archive + ".partial"
    result = subprocess.run(
        ["tar", "--create", f"--file={partial}", f"--directory={_tree(snapshot_id)}",
         "--sparse", *_TAR_KEEP, "."],
        capture_output=True, check=False,
    )
    if result.returncode != 0:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
        return False
    try:
        fd = os.open(partial, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(partial, archive)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
        raise
    return True


def _materialize(snapshot_id: str) -> None:
    """Unpack an archived layer into its ``tree`` (into a directory beside,
    renamed into place once whole); nothing when its tree is there. Called
    with the lock held, before anything stacks the layer."""
    tree, archive = _tree(snapshot_id), _archive_path(snapshot_id)
    if os.path.lexists(tree) or not os.path.exists(archive):
        return
    unpacking = tree + ".unpacking"
    shutil.rmtree(unpacking, ignore_errors=True)
    os.makedirs(unpacking)
    result = subprocess.run(
        ["tar", "--extract", f"--file={archive}", f"--directory={unpacking}",
         "--same-owner", "--same-permissions", *_TAR_KEEP],
        capture_output=True, check=False,
    )
    if result.returncode != 0:
        shutil.rmtree(unpacking, ignore_errors=True)
        raise ProviderError(f"unpacking the layer of snapshot {snapshot_id} failed: "
                            f"{result.stderr.decode('utf-8', 'replace').strip()}")
    os.rename(unpacking, tree)
    os.unlink(archive)
