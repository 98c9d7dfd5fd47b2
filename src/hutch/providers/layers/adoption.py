"""Adoption: a plain directory's first capture, by moving it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil

from ..._atomic import write_json
from .overlay import _mount, _umount, overlay_available
from .records import _creating, _listdir, _read_chain, _size, _tree, mount_dir


def _used_by_a_process(path: str) -> bool:
    """Whether a process on this host has its current or root directory at or
    under ``path``: it holds the directory's inode, and would go on reading and
    writing the moved layer instead of the overlay that replaces it."""
    prefix = path.rstrip("/") + "/"
    for pid in _listdir("/proc"):
        if not pid.isdigit():
            continue
        for link in ("cwd", "root"):
            try:
                where = os.readlink(f"/proc/{pid}/{link}")
            except OSError:
                continue
            if where == path or where.startswith(prefix):
                return True
    return False


def adopt(snapshot_id: str, sandbox_id: str, workdir: str) -> int | None:
    """Capture the plain directory ``workdir`` as snapshot ``snapshot_id`` by
    moving it, whole, into the snapshot's layer (one rename, whatever the
    tree's size) and mounting an overlay of that layer and an empty upper
    directory at ``workdir``, where the sandbox goes on. Returns the size, or
    None where it cannot (no overlayfs, another file system, the directory
    in a process's hands, already a mount point): the caller copies then.

    The sandbox's mount directory records the layer and where the overlay is
    mounted before the move, so a crash at any point leaves the files in a
    layer nothing frees, found and mounted again by :func:`ensure_mounted`.
    """
    if not overlay_available() or os.path.ismount(workdir):
        return None
    with _creating(snapshot_id) as target:
        return _adopt(snapshot_id, sandbox_id, workdir, target)


def _adopt(snapshot_id: str, sandbox_id: str, workdir: str, target: str) -> int | None:
    if os.stat(workdir).st_dev != os.stat(target).st_dev or _used_by_a_process(workdir):
        shutil.rmtree(target, ignore_errors=True)
        return None
    base = mount_dir(sandbox_id)
    upper, work = os.path.join(base, "upper"), os.path.join(base, "work")
    os.makedirs(upper)
    os.makedirs(work)
    st = os.stat(workdir)
    # The overlay's root takes the upper directory's mode and owner.
    os.chmod(upper, st.st_mode & 0o7777)
    os.chown(upper, st.st_uid, st.st_gid)
    write_json(os.path.join(base, "chain.json"), [snapshot_id])
    write_json(os.path.join(base, "adopted.json"), workdir)
    os.rename(workdir, _tree(snapshot_id))
    try:
        os.mkdir(workdir, st.st_mode & 0o7777)
        _mount(workdir, [_tree(snapshot_id)], upper, work)
    except BaseException:
        # Put the directory back as it was.
        _umount(workdir)
        with contextlib.suppress(OSError):
            os.rmdir(workdir)
        os.rename(_tree(snapshot_id), workdir)
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(target, ignore_errors=True)
        raise
    size = _size(_tree(snapshot_id))
    write_json(os.path.join(target, "chain.json"), [snapshot_id])
    return size


def adopted(sandbox_id: str) -> tuple[str, list[str]] | None:
    """(the directory, the chain) of an adopted directory, or None."""
    base = mount_dir(sandbox_id)
    try:
        with open(os.path.join(base, "adopted.json")) as fh:
            where = str(json.load(fh))
    except (OSError, ValueError):
        return None
    chain = _read_chain(os.path.join(base, "chain.json"))
    return (where, chain) if chain else None
