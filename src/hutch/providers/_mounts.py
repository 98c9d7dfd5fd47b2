"""Mounts on this host by system call: a ``mount(8)`` process costs a few
milliseconds a call, the system call microseconds. Used where hutch mounts
for its sandboxes (bubblewrap's layers, the working directory layers of
``layers``); errors are ``OSError`` with the kernel's errno."""

from __future__ import annotations

import ctypes
import os
import re
from typing import NamedTuple

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = (
    ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p
)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)

MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MS_SHARED = 1 << 20
MNT_DETACH = 2
UMOUNT_NOFOLLOW = 8


def _bytes(value: str | None) -> bytes | None:
    return None if value is None else os.fsencode(value)


def mount(source: str | None, target: str, fstype: str | None, flags: int,
          data: str | None = None) -> None:
    if _libc.mount(_bytes(source), _bytes(target), _bytes(fstype), flags, _bytes(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mounting {fstype or source} on {target}: {os.strerror(err)}")


def umount(target: str, *, detach: bool = False, nofollow: bool = False) -> None:
    flags = (MNT_DETACH if detach else 0) | (UMOUNT_NOFOLLOW if nofollow else 0)
    if _libc.umount2(os.fsencode(target), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unmounting {target}: {os.strerror(err)}")


class Mount(NamedTuple):
    point: str
    fstype: str
    #: The file system's own options (``upperdir=...`` of an overlay, say).
    options: list[str]


def _unescape(field: str) -> str:
    """A mountinfo field as it is (the kernel writes a space as ``\\040``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mountinfo(pid: int | str = "self") -> list[Mount]:
    """Every mount in ``pid``'s mount namespace, in the kernel's order (a
    mount stacked on another comes after it); none if it cannot be read."""
    try:
        with open(f"/proc/{pid}/mountinfo") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        rest = fields[fields.index("-", 6) + 1:]
        options = rest[2].split(",") if len(rest) > 2 else []
        found.append(Mount(_unescape(fields[4]), rest[0], options))
    return found
