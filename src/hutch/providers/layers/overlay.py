"""Mounting overlayfs, and reading an overlay's upper directory as changes
(whiteouts, opaque directories) applied onto a plain directory."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat

from ..._errors import ProviderError
from .. import _mounts
from .records import _lock, root

_overlay_ok: bool | None = None


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
