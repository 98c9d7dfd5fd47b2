"""The records of layered working directories: where things are under
``$HUTCH_HOME/layers`` (see :mod:`hutch.providers.layers` for the layout),
the chain files that say what stacks what, and the locks that keep programs
sharing a home out of each other's way."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator

from ..._errors import ProviderError
from ..._paths import hutch_home

_lock = threading.Lock()


def root() -> str:
    return os.path.join(hutch_home(), "layers")


def snapshot_dir(snapshot_id: str) -> str:
    return os.path.join(root(), "snapshots", snapshot_id)


def mount_dir(sandbox_id: str) -> str:
    return os.path.join(root(), "mounts", sandbox_id)


def _tree(snapshot_id: str) -> str:
    return os.path.join(snapshot_dir(snapshot_id), "tree")


def _read_chain(path: str) -> list[str] | None:
    try:
        with open(path) as fh:
            return [str(x) for x in json.load(fh)]
    except (OSError, ValueError):
        return None


def _copy_tree(source: str, target: str, *, into: bool = False) -> None:
    """Copy ``source``'s contents into ``target`` (new; or, ``into``, an
    empty directory there already, a mount say), keeping modes, owners,
    times, links and xattrs (overlayfs's opaque markers among them); the
    root's too."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    result = subprocess.run(
        ["cp", "-a", "--reflink=auto", "--", os.path.join(source, ".") if into else source,
         target],
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


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []



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


def _resting(sandbox_id: str) -> str:
    """The marker of a layered working directory at rest (:func:`rest`)."""
    return os.path.join(mount_dir(sandbox_id), "resting")
