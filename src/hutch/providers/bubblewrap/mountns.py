"""What a keeper's private mount namespace holds: what its processes use,
nothing else of the host's.

A new mount namespace starts as a copy of the host's whole mount table, and
the keeper's lives as long as its sandbox. Every host mount in that copy is
held there: one the host unmounts meanwhile (a docker sandbox's capped
working-directory store, a loop-mounted ext4 image, when it suspends; a
user's tmpfs at logout) lives on, with its memory, journal thread and loop
device, until the sandbox ends. Private as the namespace is, no unmount
reaches it. So, once the sandbox's own mounts are made in it, the starter
detaches every copied mount that nothing there uses (:func:`keep_only`).

What its processes use: the outer bwrap and each exec's (their binaries and
libraries, ``/proc``, ``/dev``, the cgroup file system), the overlay and the
agent's binary under the shared mount points, the sandbox's own directory
(its tmpfs, which the host reaches through ``/proc/<keeper>/root``). Every
mount on the way to one of these stays, and every mount below one; the
rest (``/tmp``, ``/home``, ``/var``, ``/mnt``, ``/run/user``, and whatever
is mounted under them) is detached from the namespace, its copy alone: the
host's own mounts are untouched. The sandbox's own namespaces (bwrap's,
inside) are made from this one and drop its root after ``pivot_root``.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Iterable
from functools import cache

from ..._errors import ProviderError
from .. import _mounts

log = logging.getLogger("hutch.bubblewrap")

#: Where the host's programs and their libraries live, and the kernel's
#: file systems bwrap and the cgroup launcher use: kept whole.
SYSTEM_TREES = (
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc",
    "/nix", "/gnu", "/proc", "/dev", "/sys",
)
#: The host programs run in the namespace: the keeper's and execs' bwrap,
#: nsenter and the launcher's shell (a directory elsewhere is kept too).
HOST_PROGRAMS = ("bwrap", "nsenter", "sh")
_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


def mount(source: str | None, target: str, fstype: str | None, flags: int,
          data: str | None) -> None:
    """mount(2), its failure a :class:`ProviderError` saying why."""
    try:
        _mounts.mount(source, target, fstype, flags, data)
    except OSError as exc:
        raise ProviderError(exc.strerror or str(exc)) from None


@cache
def _program_dirs() -> tuple[str, ...]:
    found = []
    for program in HOST_PROGRAMS:
        where = shutil.which(program, path=_PATH)
        if where is not None:
            found.append(os.path.dirname(os.path.realpath(where)))
    return tuple(found)


def _on_the_line(point: str, kept: str) -> bool:
    """Whether mount ``point`` is ``kept``, on the way to it, or below it."""
    if point == kept or point == "/" or kept == "/":
        return True
    return kept.startswith(point + "/") or point.startswith(kept + "/")


def unneeded(points: Iterable[str], keep: Iterable[str]) -> list[str]:
    """The mount points of ``points`` (a namespace's, in mountinfo's order)
    to detach so that only what ``keep`` names is left: the topmost of each
    unneeded subtree, each once (detaching it takes what is below)."""
    kept = [os.path.normpath(k) for k in keep]
    chosen: list[str] = []
    # Component by component, so that what is below a point follows it at once.
    for point in sorted(set(points), key=lambda p: p.split("/")):
        if any(_on_the_line(point, k) for k in kept):
            continue
        if chosen and (point == chosen[-1] or point.startswith(chosen[-1].rstrip("/") + "/")):
            continue  # goes with the one above it
        chosen.append(point)
    return chosen


def keep_only(paths: Iterable[str]) -> None:
    """Detach, from the calling thread's mount namespace (a keeper's, never
    the host's), every mount neither :data:`SYSTEM_TREES`, the host
    programs' directories nor ``paths`` need. A mount that cannot be
    detached is left, and said (the sandbox works all the same)."""
    mounts = _mounts.mountinfo("thread-self")
    points = [m.point for m in mounts]
    for point in unneeded(points, (*SYSTEM_TREES, *_program_dirs(), *paths)):
        # As many mounts as are stacked there (each detach takes the top one).
        for _ in range(points.count(point)):
            try:
                _mounts.umount(point, detach=True, nofollow=True)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.ENOENT):
                    log.warning("a sandbox's mount namespace keeps %s: %s", point, exc)
                break
