"""The user namespace bubblewrap sandboxes run in: root inside is an
unprivileged id on the host.

As rootless containers do, ids 0..65535 inside map to a range of host ids
that no host account uses: hutch's entry in ``/etc/subuid`` and
``/etc/subgid`` (``hutch:<first>:<count>``, count 65536 or more), else
:data:`DEFAULT_FIRST_ID` (1879048192, 0x70000000: above the 0x80000 to
0x6FFFFFFF range systemd hands to containers, below the ids that are
negative as 32-bit signed numbers). Root inside is that first host id: a
kernel setting, a host file, a device, another process of the host's treats
it as any unprivileged user, whatever capabilities it holds in its own
namespace (only over namespaces and files that namespace owns).

Files keep their owners in the host's ids: what a sandbox writes (its upper
layer, snapshots of it) is owned by mapped ids on the host. The shared root
file systems are not rewritten: hutch mounts each, for a sandbox, through an
idmapped mount (``mount_setattr(MOUNT_ATTR_IDMAP)``) that shows host uid 0
as the range's first id, and so as root inside (see :func:`idmapped_mount`).

One namespace serves every sandbox this process starts (made once, held by a
descriptor): sandboxes share nothing else through it (each has its own PID,
mount, IPC, UTS, cgroup and network namespaces, and no capability over any
other's), and making one costs a process.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import threading
from dataclasses import dataclass
from functools import cache

from ..._errors import ProviderError

#: The first host id of the range when /etc/subuid names none for hutch.
DEFAULT_FIRST_ID = 0x70000000
#: How many ids the range holds (0..65535 inside: nobody, 65534, among them).
ID_COUNT = 65536
#: The account hutch's range is listed under in /etc/subuid and /etc/subgid.
SUBID_NAME = "hutch"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_SYS_OPEN_TREE = 428
_SYS_MOVE_MOUNT = 429
_SYS_MOUNT_SETATTR = 442
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_OPEN_TREE_CLONE = 1
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_MOUNT_ATTR_IDMAP = 0x00100000


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


@dataclass(frozen=True)
class IdRange:
    """Host ids ``uid``.. and ``gid``.. (``count`` of each) are 0.. inside."""

    uid: int
    gid: int
    count: int = ID_COUNT

    @property
    def root(self) -> tuple[int, int]:
        """Root inside, as the host's (uid, gid)."""
        return self.uid, self.gid

    def holds(self, host_uid: int) -> bool:
        return self.uid <= host_uid < self.uid + self.count


def _subid(path: str) -> int | None:
    """The first id of hutch's range in ``path`` (``name:first:count``)."""
    try:
        with open(path) as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.strip().split(":")
        if len(fields) != 3 or fields[0] != SUBID_NAME:
            continue
        try:
            first, count = int(fields[1]), int(fields[2])
        except ValueError:
            continue
        if count < ID_COUNT or first <= 0 or first + ID_COUNT > 0xFFFFFFFF:
            raise ProviderError(
                f"{path}: hutch's range {line.strip()!r} must hold {ID_COUNT} ids above 0"
            )
        return first
    return None


@cache
def id_range() -> IdRange:
    """The host ids root and every other user inside a sandbox are."""
    uid = _subid("/etc/subuid")
    gid = _subid("/etc/subgid")
    return IdRange(DEFAULT_FIRST_ID if uid is None else uid,
                   DEFAULT_FIRST_ID if gid is None else gid)


class _Namespace:
    """The user namespace, made on first use and held by a descriptor."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fd: int | None = None

    def fd(self) -> int:
        with self._lock:
            # A forked child inherits the descriptor: the same namespace serves.
            if self._fd is None:
                self._fd = _make_namespace(id_range())
            return self._fd


def _make_namespace(ids: IdRange) -> int:
    """A new user namespace with ``ids`` mapped, as a descriptor: a helper
    process unshares it (a threaded process cannot), hutch writes its maps
    (it has CAP_SETUID and CAP_SETGID where the helper came from), keeps it
    by a descriptor and lets the helper end."""
    helper = subprocess.Popen(
        ["unshare", "--user", "--", "sh", "-c", "echo; read _"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    assert helper.stdin is not None and helper.stdout is not None
    try:
        if not helper.stdout.readline():
            said = helper.stderr.read().decode(errors="replace").strip() if helper.stderr else ""
            raise ProviderError(f"cannot make a user namespace for bubblewrap: {said}")
        try:
            with open(f"/proc/{helper.pid}/uid_map", "w") as fh:
                fh.write(f"0 {ids.uid} {ids.count}\n")
            with open(f"/proc/{helper.pid}/gid_map", "w") as fh:
                fh.write(f"0 {ids.gid} {ids.count}\n")
            return os.open(f"/proc/{helper.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise ProviderError(f"mapping bubblewrap's user namespace: {exc}") from None
    finally:
        helper.stdin.close()
        helper.wait()
        helper.stdout.close()
        if helper.stderr is not None:
            helper.stderr.close()


_NAMESPACE = _Namespace()


def namespace_fd() -> int:
    """The user namespace's descriptor (this process's, not to be closed)."""
    return _NAMESPACE.fd()


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise ProviderError(f"{what}: {os.strerror(err)}")
    return result


def idmapped_mount(source: str, target: str) -> None:
    """Mount directory ``source`` at ``target`` (in the calling thread's mount
    namespace) with host ids shown shifted into the range: host uid 0 as
    the range's first id, and so as root inside. Nothing on disk changes."""
    tree = _check(
        _libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, os.fsencode(source),
                      _OPEN_TREE_CLONE | os.O_CLOEXEC),
        f"open_tree({source})",
    )
    try:
        attr = _MountAttr(_MOUNT_ATTR_IDMAP, 0, 0, namespace_fd())
        _check(_libc.syscall(_SYS_MOUNT_SETATTR, tree, b"", _AT_EMPTY_PATH,
                             ctypes.byref(attr), ctypes.sizeof(attr)),
               f"an idmapped mount of {source}")
        _check(_libc.syscall(_SYS_MOVE_MOUNT, tree, b"", _AT_FDCWD, os.fsencode(target),
                             _MOVE_MOUNT_F_EMPTY_PATH),
               f"mounting {source} at {target}")
    finally:
        os.close(tree)


def shifted(layer: str) -> bool:
    """Whether ``layer`` is stored in the range's ids (a sandbox's upper layer,
    a snapshot of one), rather than the host's (a root file system)."""
    try:
        return id_range().holds(os.stat(layer).st_uid)
    except OSError as exc:
        raise ProviderError(f"layer {layer}: {exc.strerror}") from None
