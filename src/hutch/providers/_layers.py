"""Working directories as stacked layers: how ``local`` and ``docker`` capture
a host directory and start branches from it, copy-on-write.

Measured here (bench/bench_fork.py prints it; 10 000 files of 100 bytes, a
loaded 2-core machine): ``cp -a`` of the tree 4-11 s, hard links (``cp -al``)
0.6-1.6 s, an overlayfs mount 11 ms whatever the tree's size. Hard links are
also wrong for branches: a program that writes a file in place (most
editors, ``>>``) changes the inode every branch shares. So a branch's working
directory is an **overlayfs** mount: the snapshot's layers read-only below,
an empty upper directory of its own above. Where overlayfs cannot be mounted
(no privilege), an attach falls back to a full copy (``cp -a``), correct and
slower.

A plain directory's first capture (``local``) is an **adoption**, picked by
the same figures: the directory is moved, by one rename, into the snapshot's
layer and an overlay of it is mounted in its place, so the sandbox goes on at
the same path (90-350 ms for 10 000 files, most of it counting the
snapshot's size, one stat a file; ``cp -a`` 1-11 s and ``cp -al`` 0.2-1.6 s
in the same runs: 0.03-0.08x of the copy). When the sandbox ends, a
directory the caller gave is given back plain: the layer taken back by a
rename and what changed (the upper directory) moved onto it, whether or
not a snapshot still holds the layer (one that does keeps it as an archive,
unpacked when it is next attached); only a branch running on the layer
makes it a copy (see :func:`end_adopted`). A directory
a process on the host is in (its current or root directory), on another
file system, or without overlayfs is copied instead: moving it would leave
that process writing into the snapshot. ``docker`` never adopts: a plain
directory is bind-mounted into a running container, which would keep the
moved one. Its own working directory is layered from creation instead
(:func:`prepare`), and a capture **freezes** it (:func:`freeze`): the upper
directory moved into the snapshot's layer, a fresh one mounted above.

Layout under ``$HUTCH_HOME/layers``::

    snapshots/<snapshot id>/tree/        that snapshot's own layer
    snapshots/<snapshot id>/tree.tar     or that layer archived (its files
                                         given back to an adopted directory)
    snapshots/<snapshot id>/chain.json   the layers it stacks, top first
                                         (absent: removed, kept for its users)
    mounts/<sandbox id>/{upper,work,merged,chain.json}
                                         a branch's working directory
    mounts/<sandbox id>/adopted.json     an adopted directory: where its
                                         overlay is mounted (no ``merged``)
    mounts/<sandbox id>/giving-back.json its give-back under way (the journal)
    mounts/<sandbox id>/freezing.json    a freeze under way (its journal)
    mounts/<sandbox id>/resting          at rest: its overlay unmounted, no
                                         container on it (a suspended sandbox)
    stores/<sandbox id>{,.img}           a capped one's store, and its image
    stores.lock                          held to mount or unmount stores
    empty/                               the layer under a chain of none

A capture of a branch (or an adopted directory) copies its upper directory
(what changed since it was started, overlayfs whiteouts included) into a new
layer on its chain; a capture of a plain directory that cannot be adopted,
or ``diff=False``, or a chain past :data:`MAX_LAYERS`, copies the merged view
into a single layer (the one flattening rule for directories). A snapshot's
own layer stays on disk, after its removal, while any other snapshot's chain
or any mounted branch still stacks it: :func:`collect_garbage` frees it when
nothing does.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import stat
import subprocess
import threading
from collections.abc import Iterator

from .._errors import ProviderError, SandboxUnavailable
from .._paths import hutch_home
from . import _mounts
from ._diskcap import IMAGE_SUFFIX, image_for, mount_capped, unmount_capped

log = logging.getLogger(__name__)

#: Layers one chain may stack before a capture flattens it: overlayfs takes
#: up to 500 lower directories, but the mount options must fit one page.
MAX_LAYERS = 24

_overlay_ok: bool | None = None
_lock = threading.Lock()


def root() -> str:
    return os.path.join(hutch_home(), "layers")


def snapshot_dir(snapshot_id: str) -> str:
    return os.path.join(root(), "snapshots", snapshot_id)


def mount_dir(sandbox_id: str) -> str:
    return os.path.join(root(), "mounts", sandbox_id)


def _tree(snapshot_id: str) -> str:
    return os.path.join(snapshot_dir(snapshot_id), "tree")


def _write_json(path: str, value: object) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(value, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _read_chain(path: str) -> list[str] | None:
    try:
        with open(path) as fh:
            return [str(x) for x in json.load(fh)]
    except (OSError, ValueError):
        return None


def _copy_tree(source: str, target: str) -> None:
    """Copy ``source``'s contents into ``target`` (new), keeping modes, owners,
    times, links and xattrs (overlayfs's opaque markers among them)."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    result = subprocess.run(
        ["cp", "-a", "--reflink=auto", "--", source, target],
        capture_output=True, check=False,
    )
    if result.returncode != 0:
        raise ProviderError(
            f"copying {source} failed: {result.stderr.decode('utf-8', 'replace').strip()}"
        )


def _size(path: str) -> int:
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        for name in filenames + dirnames:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def overlay_available() -> bool:
    """Whether this process can mount overlayfs (probed once)."""
    global _overlay_ok
    with _lock:
        if _overlay_ok is None:
            probe = os.path.join(root(), "probe")
            dirs = [os.path.join(probe, d) for d in ("lower", "upper", "work", "merged")]
            try:
                for d in dirs:
                    os.makedirs(d, exist_ok=True)
                _overlay_ok = _mount(dirs[3], [dirs[0]], dirs[1], dirs[2], quiet=True)
                if _overlay_ok:
                    _umount(dirs[3])
            except OSError:
                _overlay_ok = False
            shutil.rmtree(probe, ignore_errors=True)
        return _overlay_ok


def _mount(merged: str, lowers: list[str], upper: str, work: str, *, quiet: bool = False) -> bool:
    options = f"lowerdir={':'.join(lowers)},upperdir={upper},workdir={work}"
    try:
        # nosuid, nodev: a setuid file or a device node a sandbox made means
        # nothing on the host through the mount.
        _mounts.mount("overlay", merged, "overlay", _mounts.MS_NOSUID | _mounts.MS_NODEV,
                      options)
    except OSError as exc:
        if quiet:
            return False
        raise ProviderError(f"mounting the working directory {merged} failed: "
                            f"{exc.strerror}") from None
    return True


def _umount(path: str) -> None:
    """Unmount the top mount at ``path``, if any."""
    try:
        _mounts.umount(path)
    except OSError as exc:
        if exc.errno == errno.EBUSY:  # busy: detach now, freed when its last user goes
            with contextlib.suppress(OSError):
                _mounts.umount(path, detach=True)


# -- captures ------------------------------------------------------------------------


@contextlib.contextmanager
def _creating(snapshot_id: str) -> Iterator[str]:
    """A new snapshot directory (its path), kept from garbage collection
    (which frees one with no chain file: removed, or a capture cut short)
    while it is made, by any process: an ``flock`` on its ``.creating`` file,
    which the kernel lets go if this process dies. It is made under a hidden
    name, the lock taken, then renamed into place, so no collector ever sees
    it unlocked."""
    target = snapshot_dir(snapshot_id)
    if os.path.exists(target):
        shutil.rmtree(target)
    hidden = os.path.join(os.path.dirname(target), f".new-{snapshot_id}")
    shutil.rmtree(hidden, ignore_errors=True)
    os.makedirs(hidden)
    fd = os.open(os.path.join(hidden, ".creating"), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(hidden, target)
        yield target
    finally:
        os.close(fd)


def _being_created(directory: str) -> bool:
    """Whether a process holds ``directory`` (a snapshot's) while it makes it."""
    try:
        fd = os.open(os.path.join(directory, ".creating"), os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def capture(
    snapshot_id: str, sandbox_id: str, workdir: str, chain: list[str] | None, *, diff: bool
) -> int:
    """Capture ``workdir`` (sandbox ``sandbox_id``'s) as snapshot ``snapshot_id``;
    returns its size in bytes.

    ``chain``: the layers ``workdir`` is mounted on (a branch, or an adopted
    directory), or None (a plain directory). The chain file is written last: a
    capture cut short leaves a directory :func:`held` does not list and
    :func:`remove` frees.
    """
    with _awake(sandbox_id):
        return _capture(snapshot_id, sandbox_id, workdir, chain, diff=diff)


def _capture(
    snapshot_id: str, sandbox_id: str, workdir: str, chain: list[str] | None, *, diff: bool
) -> int:
    with _in_hand([], sandbox_id):  # its store (its upper directory) mounted
        pass
    with _creating(snapshot_id) as target:
        upper = _upper_work(sandbox_id)[0] if chain else None
        if chain and diff and len(chain) < MAX_LAYERS and upper and os.path.isdir(upper):
            _copy_tree(upper, _tree(snapshot_id))
            layers = [snapshot_id, *chain]
        else:
            _copy_tree(workdir, _tree(snapshot_id))
            layers = [snapshot_id]
        size = _size(_tree(snapshot_id))
        _write_json(os.path.join(target, "chain.json"), layers)
    return size


# -- adoption: a plain directory's first capture, by moving it ------------------------


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
    _write_json(os.path.join(base, "chain.json"), [snapshot_id])
    _write_json(os.path.join(base, "adopted.json"), workdir)
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
    _write_json(os.path.join(target, "chain.json"), [snapshot_id])
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
            _write_json(marker, state)
        elif "mode" not in state:
            state = _journal_of_before_modes(state, where, chain)
            _write_json(marker, state)
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
            _write_json(marker, state)
        if mode != "copy" and not placed:
            _put_in_place(_tree(chain[0]), where)
    if mode == "copy" and not placed:
        if "tree" not in state:  # a copy cut short starts again
            shutil.rmtree(staging, ignore_errors=True)
            _merge_copy(chain, staging)
            state["tree"] = os.stat(staging).st_ino
            _write_json(marker, state)
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


def _read_json(path: str) -> dict[str, object] | None:
    try:
        with open(path) as fh:
            value = json.load(fh)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _stacked(*, but: str) -> set[str]:
    """Every layer a held snapshot or a mounted branch (other than ``but``'s) stacks."""
    in_use = _stacked_by_mounts(but=but)
    for name in _listdir(os.path.join(root(), "snapshots")):
        in_use.update(_read_chain(os.path.join(root(), "snapshots", name, "chain.json")) or [])
    return in_use


def _stacked_by_mounts(*, but: str) -> set[str]:
    """Every layer a working directory (other than ``but``'s) stacks: one
    mounted, or recorded to be (its chain is written before its mount)."""
    in_use: set[str] = set()
    for name in _listdir(os.path.join(root(), "mounts")):
        if name != but:
            in_use.update(_read_chain(os.path.join(root(), "mounts", name, "chain.json")) or [])
    return in_use


# -- a layer kept as an archive ------------------------------------------------------
#
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
    fd = os.open(partial, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(partial, archive)
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


_OPAQUE = ("trusted.overlay.opaque", "user.overlay.opaque")


def _opaque(path: str) -> bool:
    for name in _OPAQUE:
        with contextlib.suppress(OSError):
            if os.getxattr(path, name, follow_symlinks=False) == b"y":
                return True
    return False


def _whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _apply_upper(upper: str, target: str) -> None:
    """Move an overlay upper directory's entries onto ``target``, the plain
    directory of the layers below: a whiteout deletes, an opaque directory
    replaces, a directory present in both merges, anything else replaces.
    Renames only: it costs what changed, and empties ``upper`` as it goes."""
    for name in os.listdir(upper):
        source, dest = os.path.join(upper, name), os.path.join(target, name)
        st = os.lstat(source)
        if _whiteout(st):
            _remove(dest)
            os.unlink(source)
            continue
        if stat.S_ISDIR(st.st_mode):
            if os.path.isdir(dest) and not os.path.islink(dest) and not _opaque(source):
                _apply_upper(source, dest)
                shutil.copystat(source, dest, follow_symlinks=False)
                os.lchown(dest, st.st_uid, st.st_gid)
                continue
            _remove(dest)
            _scrub(source)
            os.rename(source, dest)
            continue
        if os.path.isdir(dest) and not os.path.islink(dest):
            shutil.rmtree(dest)
        os.replace(source, dest)


def _scrub(directory: str) -> None:
    """Drop overlay markers from a directory about to become plain."""
    for name in _OPAQUE:
        with contextlib.suppress(OSError):
            os.removexattr(directory, name, follow_symlinks=False)
    for dirpath, dirnames, filenames in os.walk(directory):
        for name in filenames:
            path = os.path.join(dirpath, name)
            if _whiteout(os.lstat(path)):
                os.unlink(path)
        for name in dirnames:
            for marker in _OPAQUE:
                with contextlib.suppress(OSError):
                    os.removexattr(os.path.join(dirpath, name), marker, follow_symlinks=False)


def chain_of(snapshot_id: str) -> list[str]:
    """The layers snapshot ``snapshot_id`` stacks, top first, each ready to
    stack (an archived one unpacked)."""
    with _lock:
        return _chain_of(snapshot_id)


def _chain_of(snapshot_id: str) -> list[str]:
    chain = _read_chain(os.path.join(snapshot_dir(snapshot_id), "chain.json"))
    if chain is None:
        raise SandboxUnavailable(f"snapshot {snapshot_id} is not held under {root()}")
    for layer in chain:
        _materialize(layer)
    return chain


def held() -> list[str]:
    """The snapshots with storage here (a chain file: captured and not removed)."""
    base = os.path.join(root(), "snapshots")
    try:
        names = os.listdir(base)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if os.path.exists(os.path.join(base, n, "chain.json")))


def remove(snapshot_id: str) -> None:
    """Remove a snapshot: its chain file at once, its layer once nothing stacks it."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(snapshot_dir(snapshot_id), "chain.json"))
    collect_garbage()


def collect_garbage() -> None:
    """Free every removed snapshot's layer that no chain still stacks, and
    every store no layer still held is in; unmount the stores no mounted
    working directory stacks (idle: mounted again on demand)."""
    if not os.path.isdir(root()):
        return
    with _lock, _stores_lock():
        in_use: set[str] = set()
        stacked: set[str] = set()
        removed: list[str] = []
        snapshots = os.path.join(root(), "snapshots")
        mounts = os.path.join(root(), "mounts")
        for name in _listdir(snapshots):
            chain = _read_chain(os.path.join(snapshots, name, "chain.json"))
            if chain is not None:
                in_use.update(chain)
            elif not _being_created(os.path.join(snapshots, name)):
                removed.append(name)
        for name in _listdir(mounts):
            chain = _read_chain(os.path.join(mounts, name, "chain.json")) or []
            in_use.update(chain)
            if not os.path.exists(_resting(name)):
                stacked.update(chain)
        kept = {_store_of(layer) for layer in in_use}
        for name in removed:
            if name not in in_use:
                store = _store_of(name)
                if store is not None and (store in kept or _sandbox_of(store) is not None):
                    # Its layer is in a store that stays: deleted there (a
                    # store that goes takes its layers with it).
                    _mount_store(store)
                    shutil.rmtree(os.readlink(_tree(name)), ignore_errors=True)
                shutil.rmtree(os.path.join(snapshots, name), ignore_errors=True)
        _free_stores(kept, stacked)


def _sandbox_of(store: str) -> str | None:
    """The sandbox whose working directory has ``store`` as its own, if it is still here."""
    name = os.path.basename(store)
    return name if os.path.exists(mount_dir(name)) else None


def _overlay_stores() -> set[str]:
    """The stores an overlay mounted here stacks (its upper directory in
    one, or a lower layer): read from the mounts themselves, beside the
    records."""
    stores = os.path.join(root(), "stores") + os.sep
    snapshots = os.path.join(root(), "snapshots") + os.sep
    found: set[str] = set()
    for mount in _mounts.mountinfo():
        if mount.fstype != "overlay":
            continue
        for option in mount.options:
            key, _, value = option.partition("=")
            if key.rstrip("+") not in ("lowerdir", "upperdir", "workdir"):
                continue
            for path in value.split(":"):
                if path.startswith(stores):
                    found.add(stores + path[len(stores):].split(os.sep)[0])
                elif path.startswith(snapshots):
                    store = _store_of(path[len(snapshots):].split(os.sep)[0])
                    if store is not None:
                        found.add(store)
    return found


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


# -- branches ------------------------------------------------------------------------


def start_branch(sandbox_id: str, snapshot_id: str) -> tuple[str, list[str] | None]:
    """A working directory for a new sandbox started from ``snapshot_id``:
    (its path, the chain it is mounted on, or None when it is a plain copy)."""
    base = mount_dir(sandbox_id)
    merged = os.path.join(base, "merged")
    if overlay_available():
        with _lock:  # no give-back takes a layer away between the two
            chain = _chain_of(snapshot_id)
            os.makedirs(merged, exist_ok=True)
            # Recorded before the mount: the layers it stacks are in use from now.
            _write_json(os.path.join(base, "chain.json"), chain)
        try:
            with _in_hand(chain) as lowers:
                # The overlay's root is the upper directory: the snapshot's root's
                # mode and owner.
                _make_upper(sandbox_id, lowers[0])
                _mount(merged, lowers, os.path.join(base, "upper"), os.path.join(base, "work"))
        except BaseException:
            shutil.rmtree(base, ignore_errors=True)
            raise
        return merged, chain
    # No overlayfs here: the merged view, copied (whiteouts applied by
    # copying bottom layer first, each upper one over it).
    chain = chain_of(snapshot_id)
    if len(chain) != 1:
        raise ProviderError(
            f"snapshot {snapshot_id} is layered and overlayfs cannot be mounted here"
        )
    os.makedirs(base, exist_ok=True)
    with _in_hand(chain, read_only=True):
        _copy_tree(_tree(chain[0]), merged)
    return merged, None


def branches() -> list[str]:
    """The sandbox ids that have a branch working directory here."""
    return sorted(_listdir(os.path.join(root(), "mounts")))


def ensure_mounted(sandbox_id: str) -> None:
    """Mount a branch's (or an adopted directory's) working directory again if
    it is not (a host reboot, a crash in the middle of an adoption)."""
    base = mount_dir(sandbox_id)
    found = adopted(sandbox_id)
    if found and giving_back(sandbox_id):
        return  # being given back: the next end_adopted finishes it
    merged = found[0] if found else os.path.join(base, "merged")
    chain = _read_chain(os.path.join(base, "chain.json"))
    if chain is None or os.path.ismount(merged):
        return
    os.makedirs(merged, exist_ok=True)
    with _in_hand(chain) as lowers:
        _mount(merged, lowers, os.path.join(base, "upper"), os.path.join(base, "work"))


def end_branch(sandbox_id: str) -> None:
    """Unmount and free a branch's working directory; idempotent. An adopted
    directory is given back, files kept (:func:`end_adopted`)."""
    if adopted(sandbox_id) is not None:
        end_adopted(sandbox_id, keep=True)
        return
    base = mount_dir(sandbox_id)
    merged = os.path.join(base, "merged")
    for _ in range(8):  # a layered one has its overlay on its anchor
        if not _stack(merged):
            break
        _umount(merged)
    if _stack(merged):
        # Never empty a directory through a mount: that would reach the layers.
        raise ProviderError(f"the working directory {merged} cannot be unmounted")
    shutil.rmtree(base, ignore_errors=True)
    collect_garbage()


# -- layered working directories a container binds before they are mounted ----------
#
# A branch mounted before its container starts is bound into the container
# as it is: the container holds that overlay for good, and the layers under
# it can never be changed. Here the container binds an *anchor* instead (the
# ``merged`` directory bind-mounted on itself and made shared, bound with
# ``rslave``), and the overlay is mounted on the anchor once the container
# runs: the mount reaches the container by propagation, and so does its
# unmount. A snapshot can then **freeze** the working directory: with the
# container stopped, unmount the overlay (the kernel refuses while any
# process holds it: a current directory or an open file in it), move the
# upper directory, whole, into the snapshot's layer (one rename, whatever
# the tree's size), and mount a fresh upper directory on the grown chain.
# An empty chain (nothing captured yet) stacks on :func:`_empty_layer`.
#
# A size-capped one keeps its upper directory in a **store** of its own
# (``stores/<sandbox id>``: a loop-mounted file system of the cap's size,
# nosuid and nodev, see ``_diskcap``), and a freeze moves the upper
# directory within it (``frozen/<snapshot id>``, which the snapshot's
# ``tree`` links to): what the sandbox wrote counts against its cap, frozen
# or not, and the store lives on after the sandbox while a snapshot or a
# branch still stacks a layer in it (:func:`collect_garbage` frees it).
# A mounted store costs about 4 MB of host memory and a kernel thread
# (jbd2), so one that no working directory here stacks (its sandbox ended,
# or suspended: :func:`rest`) is unmounted, its image kept, and mounted
# again on demand by whatever reads it (:func:`_in_hand`): an overlay
# mounted on it, a size, a copy, a removal. Programs sharing a home do
# this concurrently; :func:`_stores_lock` keeps one's unmount out of the
# window between another's mount of a store and the overlay over it.
#
# A freeze is journalled (``freezing.json``) and :func:`_recover` finishes or
# undoes one cut short; the sandbox's chain names the new layer before the
# move, so no garbage collection frees it in between.


_flocks: dict[str, list[int]] = {}  # lock file -> [fd, depth, thread ident]
_flocks_guard = threading.Lock()


@contextlib.contextmanager
def _flock(path: str) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (made if missing, its directory
    not): across threads and processes, let go by the kernel when its holder
    dies, re-entrant in one thread. Nothing to hold when its directory is gone."""
    me = threading.get_ident()
    with _flocks_guard:
        held = _flocks.get(path)
        if held is not None and held[2] == me:
            held[1] += 1
    if held is not None and held[2] == me:
        try:
            yield
        finally:
            with _flocks_guard:
                held[1] -= 1
        return
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except FileNotFoundError:  # none here: nothing to hold
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with _flocks_guard:
            _flocks[path] = [fd, 1, me]
        try:
            yield
        finally:
            with _flocks_guard:
                del _flocks[path]
    finally:
        os.close(fd)


def sandbox_lock(sandbox_id: str) -> contextlib.AbstractContextManager[None]:
    """Hold a layered working directory for a change to its mounts (a
    freeze, a remount, a mend after a crash): exclusive across threads and
    processes, so a process that takes it knows no other is in the middle
    of one; re-entrant in one thread."""
    return _flock(os.path.join(mount_dir(sandbox_id), ".lock"))


def _empty_layer() -> str:
    path = os.path.join(root(), "empty")
    os.makedirs(path, mode=0o755, exist_ok=True)
    return path


def store_dir(sandbox_id: str) -> str:
    return os.path.join(root(), "stores", sandbox_id)


def _cap(sandbox_id: str) -> int | None:
    """The size cap of a layered working directory (its store's), or None."""
    try:
        with open(os.path.join(mount_dir(sandbox_id), "cap.json")) as fh:
            return int(json.load(fh))
    except (OSError, ValueError, TypeError):
        return None


def _mount_store(store: str, size: int | None = None) -> None:
    """Mount a store (again after a reboot: its image keeps the files); a new
    one is made at ``size``."""
    image = image_for(store)
    if size is None and not os.path.exists(image):
        return
    try:
        mount_capped(store, size if size is not None else os.path.getsize(image))
    except OSError as exc:
        raise ProviderError(f"cannot mount the capped working directory store {store} "
                            f"(a loop mount, which needs root): {exc}") from None


def _upper_work(sandbox_id: str) -> tuple[str, str]:
    """Where a layered working directory's upper and work directories are."""
    home = store_dir(sandbox_id) if _cap(sandbox_id) is not None else mount_dir(sandbox_id)
    return os.path.join(home, "upper"), os.path.join(home, "work")


def _frozen_path(sandbox_id: str, snapshot_id: str) -> str:
    """Where a freeze moves the upper directory: the snapshot's layer, or in
    a capped one's store (same file system: a rename)."""
    if _cap(sandbox_id) is not None:
        return os.path.join(store_dir(sandbox_id), "frozen", snapshot_id)
    return _tree(snapshot_id)


def _store_of(layer: str) -> str | None:
    """The store a layer is in (its ``tree`` links there), or None (a plain
    directory). Read from the link: the store need not be mounted."""
    try:
        return os.path.dirname(os.path.dirname(os.readlink(_tree(layer))))
    except OSError:
        return None


def _stores_lock() -> contextlib.AbstractContextManager[None]:
    """Held by whatever mounts a store on demand, from the mount until the
    overlay that stacks it is mounted (or its read of the store is done),
    and by the collector that unmounts idle stores: so no process unmounts a
    store another has just mounted to use. Taken after :func:`sandbox_lock`,
    ``_lock`` and a snapshot's :func:`_creating`, never before them (the
    collector only tries the last, without waiting); nothing that collects
    garbage or waits on another lock runs while it is held."""
    return _flock(os.path.join(root(), "stores.lock"))


@contextlib.contextmanager
def _in_hand(
    chain: list[str], sandbox_id: str | None = None, *, read_only: bool = False
) -> Iterator[list[str]]:
    """``chain``'s lower directories (top first) with every store they are
    in mounted (an idle one is not: mounted on demand here), and
    ``sandbox_id``'s own store too if it is capped; the stores stay mounted
    while the block runs (:func:`_stores_lock`). Mount the overlay that
    stacks them, or read them, inside it: once the overlay is mounted, the
    records of the sandbox that stacks them keep them (:func:`_free_stores`).
    ``read_only``: a read of the layers, no overlay mounted on them; the
    stores it mounted are unmounted again when it is done (none other used
    them: a store is only used mounted, and it was not)."""
    stores = list(dict.fromkeys(s for s in map(_store_of, chain) if s is not None))
    cap = _cap(sandbox_id) if sandbox_id is not None else None
    if not stores and cap is None:  # plain directories only: nothing to mount or hold
        yield [_tree(s) for s in chain] or [_empty_layer()]
        return
    os.makedirs(root(), exist_ok=True)
    with _stores_lock():
        if sandbox_id is not None and cap is not None:
            _mount_store(store_dir(sandbox_id), cap)
        idle = [s for s in stores if not os.path.ismount(s)]
        for store in stores:
            _mount_store(store)
        try:
            yield [_tree(s) for s in chain] or [_empty_layer()]
        finally:
            for store in idle if read_only else []:
                with contextlib.suppress(OSError):
                    _mounts.umount(store)


def _stack(path: str) -> list[str]:
    """The file system types mounted at ``path`` here, bottom first."""
    return [m.fstype for m in _mounts.mountinfo() if m.point == path]


def _overlay_on_top(merged: str) -> bool:
    stack = _stack(merged)
    return bool(stack) and stack[-1] == "overlay"


def _anchor(merged: str) -> None:
    """Make ``merged`` a shared mount of itself (once), for containers to bind."""
    if _stack(merged):
        return
    try:
        _mounts.mount(merged, merged, None, _mounts.MS_BIND)
        _mounts.mount(None, merged, None, _mounts.MS_SHARED)
    except OSError as exc:
        raise ProviderError(f"preparing the working directory {merged} failed: "
                            f"{exc.strerror}") from None


def _make_upper(sandbox_id: str, like: str | None) -> None:
    """A fresh, empty upper directory (and work directory) for a layered
    working directory; its root takes ``like``'s mode and owner (the
    overlay's root is the upper directory's)."""
    upper, work = _upper_work(sandbox_id)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    os.makedirs(upper, exist_ok=True)
    if like is not None:
        st = os.stat(like)
        os.chmod(upper, st.st_mode & 0o7777)
        os.chown(upper, st.st_uid, st.st_gid)


def prepare(
    sandbox_id: str, snapshot_id: str | None, *, cap: int | None = None
) -> tuple[str, list[str]]:
    """A layered working directory for a new sandbox, started from
    ``snapshot_id`` or empty, capped at ``cap`` bytes or not: (the path its
    container binds, its chain). Its overlay is mounted by :func:`after_start`."""
    chain = chain_of(snapshot_id) if snapshot_id is not None else []
    base = mount_dir(sandbox_id)
    merged = os.path.join(base, "merged")
    os.makedirs(merged, exist_ok=True)
    try:
        if cap is not None:
            _write_json(os.path.join(base, "cap.json"), cap)
        with _in_hand(chain[:1], sandbox_id):  # its store made; the top layer read
            _make_upper(sandbox_id, _tree(chain[0]) if chain else None)
            # Recorded before anything is mounted: the layers it stacks are in use from now.
            _write_json(os.path.join(base, "chain.json"), chain)
        _anchor(merged)
    except BaseException:
        end_branch(sandbox_id)
        raise
    return merged, chain


def before_start(sandbox_id: str) -> None:
    """Ready a layered working directory for a container about to start: the
    anchor there, the overlay not (the container must bind the anchor)."""
    with sandbox_lock(sandbox_id):
        _before_start(sandbox_id)


def _before_start(sandbox_id: str) -> None:
    _recover(sandbox_id)
    with _in_hand([], sandbox_id):  # its store, for the overlay after_start mounts
        pass
    merged = os.path.join(mount_dir(sandbox_id), "merged")
    os.makedirs(merged, exist_ok=True)
    while _overlay_on_top(merged):
        _umount(merged)
    _anchor(merged)


def after_start(sandbox_id: str) -> None:
    """Mount a layered working directory's overlay (its container, started on
    the anchor, sees it by propagation); a freeze cut short is finished or
    undone first."""
    with sandbox_lock(sandbox_id):
        _recover(sandbox_id)
        base = mount_dir(sandbox_id)
        if _read_chain(os.path.join(base, "chain.json")) is None:
            raise SandboxUnavailable(f"the working directory of {sandbox_id} is gone from {base}")
        _remount(sandbox_id)


def mounted_chain(sandbox_id: str) -> list[str] | None:
    """The chain a sandbox's working directory stacks now, or None (none here)."""
    _recover(sandbox_id)
    return _read_chain(os.path.join(mount_dir(sandbox_id), "chain.json"))


def freeze(snapshot_id: str, sandbox_id: str, *, flatten: bool, holder: int | None) -> bool:
    """Capture a layered working directory as ``snapshot_id`` by moving what
    changed since its last capture into the snapshot's layer (the overlay's
    upper directory, by one rename), and going on over a fresh one: what
    this costs does not grow with the tree. False when it cannot (a process
    holds the directory: the caller copies instead). Its size:
    :func:`layer_size` (a stat a file: done apart, off the moment the
    caller stops the sandbox for).

    ``flatten`` (asked for, or the chain at :data:`MAX_LAYERS`): the merged
    view is copied into a single layer, and the sandbox goes on over that one
    alone. The caller stops every process that may write in the directory
    first; ``holder`` is a process of the container whose mount namespace
    must follow the unmount.
    """
    base = mount_dir(sandbox_id)
    merged = os.path.join(base, "merged")
    with _awake(sandbox_id), sandbox_lock(sandbox_id), _lock:
        _recover_locked(sandbox_id)
        chain = _read_chain(os.path.join(base, "chain.json"))
        if chain is None or not _overlay_on_top(merged):
            return False
        flatten = flatten or len(chain) >= MAX_LAYERS
        with _creating(snapshot_id) as target:
            return _freeze(snapshot_id, sandbox_id, chain, target, flatten=flatten,
                           holder=holder)


def _freeze(snapshot_id: str, sandbox_id: str, chain: list[str], target: str, *,
            flatten: bool, holder: int | None) -> bool:
    """:func:`freeze` with its locks held and the snapshot's directory made."""
    base = mount_dir(sandbox_id)
    merged = os.path.join(base, "merged")
    upper, work = _upper_work(sandbox_id)
    new_chain = [snapshot_id] if flatten else [snapshot_id, *chain]
    if flatten:  # hutch's own copy: on the host's disk, not counted in a cap
        _copy_tree(merged, _tree(snapshot_id))
    try:
        _mounts.umount(merged)  # refused (EBUSY) while any process holds it
        moved = True
    except OSError:
        moved = False
    if moved and holder is not None and any(
        f"upperdir={upper}" in m.options for m in _mounts.mountinfo(holder)
    ):
        # The container holds the overlay itself (bound before the
        # anchor existed): moving its upper would move it under it.
        with _in_hand(chain, sandbox_id) as lowers:
            _mount(merged, lowers, upper, work)
        moved = False
    if not moved:
        if flatten:  # the copy stands as the snapshot; the sandbox goes on as it was
            _write_json(os.path.join(target, "chain.json"), new_chain)
            return True
        shutil.rmtree(target, ignore_errors=True)
        return False
    try:
        _write_json(os.path.join(base, "freezing.json"),
                    {"snapshot": snapshot_id, "chain": chain, "flatten": flatten})
        _write_json(os.path.join(base, "chain.json"), new_chain)
        if flatten:
            os.rename(upper, os.path.join(os.path.dirname(upper), "discarded"))
        else:
            frozen = _frozen_path(sandbox_id, snapshot_id)
            os.makedirs(os.path.dirname(frozen), exist_ok=True)
            os.rename(upper, frozen)
        _finish_freeze(sandbox_id, snapshot_id)
        _write_json(os.path.join(target, "chain.json"), new_chain)
    except BaseException:
        # Finished or undone as after a crash, and the sandbox's directory
        # mounted again either way: it must never be left on the anchor.
        _recover_locked(sandbox_id)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(target, "chain.json"))
        _remount(sandbox_id)
        raise
    _remount(sandbox_id)
    return True


def layer_size(snapshot_id: str) -> int:
    """The bytes in a snapshot's own layer."""
    with _in_hand([snapshot_id], read_only=True):
        return _size(_tree(snapshot_id))


def _remount(sandbox_id: str) -> None:
    base = mount_dir(sandbox_id)
    merged = os.path.join(base, "merged")
    chain = _read_chain(os.path.join(base, "chain.json"))
    if chain is not None and not _overlay_on_top(merged):
        with _in_hand(chain, sandbox_id) as lowers:
            _mount(merged, lowers, *_upper_work(sandbox_id))
            # Its stores are stacked again, by the records from now on.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_resting(sandbox_id))


def _resting(sandbox_id: str) -> str:
    """The marker of a layered working directory at rest (:func:`rest`)."""
    return os.path.join(mount_dir(sandbox_id), "resting")


def rest(sandbox_id: str) -> None:
    """Put a layered working directory whose container is gone (a suspended
    sandbox's) at rest: its overlay unmounted and the directory marked, so
    that the stores it stacks, its own among them, are unmounted unless
    something else stacks them (:func:`collect_garbage`): a suspended
    sandbox holds no mounted store. Its files stay in its layers and upper
    directory; :func:`after_start` (the resume) mounts it all again, and a
    capture of it in the meantime wakes it for the capture. A plain
    unmount: a host process in the directory keeps it mounted as it is."""
    with sandbox_lock(sandbox_id):
        if mounted_chain(sandbox_id) is None or not _rest_locked(sandbox_id):
            return
    try:
        collect_garbage()
    except OSError as exc:  # a saving, not the suspend's: the next collection frees them
        log.warning("sandbox %s at rest, its stores not yet unmounted: %s", sandbox_id, exc)


def let_go(sandbox_id: str) -> None:
    """A layered working directory no container will run on again (its
    preserved container was removed): at rest (:func:`rest`) and its anchor
    unmounted too, so that no mount nor store of it is left; its files stay
    in its upper directory and layers, for :func:`end_branch` to free."""
    rest(sandbox_id)
    merged = os.path.join(mount_dir(sandbox_id), "merged")
    with sandbox_lock(sandbox_id):
        for _ in range(8):
            if not _stack(merged) or _overlay_on_top(merged):
                break  # nothing left; or mounted again meanwhile, in use
            _umount(merged)


def _rest_locked(sandbox_id: str) -> bool:
    """Whether the directory is at rest now. Resting saves memory; it is
    never worth failing a suspend over: where the marker cannot be written
    (a full disk) or the overlay cannot be unmounted (a process in it), the
    directory stays mounted as it was, unmarked."""
    merged = os.path.join(mount_dir(sandbox_id), "merged")
    try:
        # Marked before the unmount: never an overlay unmounted that no
        # marker says is at rest (its stores would be kept mounted for good).
        _write_json(_resting(sandbox_id), True)
    except OSError as exc:
        log.warning("sandbox %s stays mounted while suspended: %s", sandbox_id, exc)
        return False
    while _overlay_on_top(merged):
        try:
            _mounts.umount(merged)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(_resting(sandbox_id))
            return False
    return True


@contextlib.contextmanager
def _awake(sandbox_id: str) -> Iterator[None]:
    """A working directory at rest mounted for the block (a capture of a
    suspended sandbox reads it), and at rest again after it."""
    with sandbox_lock(sandbox_id):
        resting = os.path.exists(_resting(sandbox_id))
        if resting:
            _recover(sandbox_id)
            _remount(sandbox_id)
        try:
            yield
        finally:
            if resting:
                _rest_locked(sandbox_id)
    if resting:
        collect_garbage()


def _finish_freeze(sandbox_id: str, snapshot_id: str) -> None:
    """The rest of a freeze whose move is done (the sandbox's chain already
    names the new layer: it is written before the move): the snapshot's
    layer linked to a store's, a fresh upper directory, the journal gone,
    what a flatten discarded freed."""
    base = mount_dir(sandbox_id)
    frozen = _frozen_path(sandbox_id, snapshot_id)
    if frozen != _tree(snapshot_id) and not os.path.lexists(_tree(snapshot_id)):
        os.makedirs(snapshot_dir(snapshot_id), exist_ok=True)
        os.symlink(frozen, _tree(snapshot_id))
    _make_upper(sandbox_id, _tree(snapshot_id))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(base, "freezing.json"))
    upper, _ = _upper_work(sandbox_id)
    shutil.rmtree(os.path.join(os.path.dirname(upper), "discarded"), ignore_errors=True)


def _recover(sandbox_id: str) -> None:
    with sandbox_lock(sandbox_id), _lock:
        _recover_locked(sandbox_id)


def _recover_locked(sandbox_id: str) -> None:
    """Finish or undo a freeze cut short (a crash): finished once its move
    was made (the upper directory in the new layer, or a flatten's set
    aside), undone before. A snapshot finished here is not listed (its chain
    file is not written: no record names it); its layer stays while the
    sandbox stacks it."""
    base = mount_dir(sandbox_id)
    journal = os.path.join(base, "freezing.json")
    upper, _ = _upper_work(sandbox_id)
    discarded = os.path.join(os.path.dirname(upper), "discarded")
    try:
        with open(journal) as fh:
            state = json.load(fh)
    except (OSError, ValueError):
        shutil.rmtree(discarded, ignore_errors=True)
        return
    with _in_hand([], sandbox_id):  # its store: where the move is seen or not
        pass
    snapshot_id, chain = str(state["snapshot"]), [str(s) for s in state["chain"]]
    if state.get("flatten"):
        moved = os.path.exists(discarded) or not os.path.isdir(upper)
    else:
        moved = os.path.isdir(_frozen_path(sandbox_id, snapshot_id))
    if moved:
        _finish_freeze(sandbox_id, snapshot_id)
        return
    _write_json(os.path.join(base, "chain.json"), chain)
    shutil.rmtree(snapshot_dir(snapshot_id), ignore_errors=True)
    os.unlink(journal)


def _free_stores(kept: set[str | None], stacked: set[str]) -> None:
    """Each store of an ended sandbox that holds no layer still stacked or
    held (not in ``kept``) is unmounted and deleted, its image with it. Each
    other one that no working directory here stacks (``stacked``: the
    layers of their chains, recorded before they are mounted), and no
    overlay mounted here either, is unmounted, its image kept (a sandbox's
    own store too, while its directory is at rest): a store costs
    host memory and a kernel thread while it is mounted, and one a snapshot
    alone holds is mounted again when something reads it (:func:`_in_hand`).
    Called with the lock and :func:`_stores_lock` held.

    A plain unmount only, never a lazy one: the kernel refuses it while a
    process is in the store (left mounted, for a later collection).
    The records decide, not the kernel's refusal: an overlay holds a clone
    of its layers' mount, and does not make the store's own busy."""
    stores = os.path.join(root(), "stores")
    busy: set[str | None] = {_store_of(layer) for layer in stacked}
    busy.update(_overlay_stores())
    for name in _listdir(stores):
        store = os.path.join(stores, name)
        if name.endswith(IMAGE_SUFFIX):
            continue  # an image, beside its store
        owner = _sandbox_of(store)
        if owner is not None and not os.path.exists(_resting(owner)):
            continue  # a sandbox's working directory, mounted or about to be
        if owner is not None or store in kept:
            if store not in busy and os.path.ismount(store):
                with contextlib.suppress(OSError):
                    _mounts.umount(store)  # idle
            continue
        with contextlib.suppress(OSError):
            unmount_capped(store)
        if not os.path.ismount(store):
            shutil.rmtree(store, ignore_errors=True)
