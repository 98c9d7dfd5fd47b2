"""Mounts on this host by system call: a ``mount(8)`` process costs a few
milliseconds a call, the system call microseconds. Used where hutch mounts
for its sandboxes (bubblewrap's layers, the working directory layers of
``_layers``); errors are ``OSError`` with the kernel's errno."""

from __future__ import annotations

import ctypes
import os

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


def _bytes(value: str | None) -> bytes | None:
    return None if value is None else os.fsencode(value)


def mount(source: str | None, target: str, fstype: str | None, flags: int,
          data: str | None = None) -> None:
    if _libc.mount(_bytes(source), _bytes(target), _bytes(fstype), flags, _bytes(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mounting {fstype or source} on {target}: {os.strerror(err)}")


def umount(target: str, *, detach: bool = False) -> None:
    if _libc.umount2(os.fsencode(target), MNT_DETACH if detach else 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unmounting {target}: {os.strerror(err)}")
