"""Size-capped host directories: a file system of its own, loop-mounted.

A working directory on the host is as big as the host's disk. Mounted from
an image of ``size`` bytes (ext4), it is capped at that size (a write past
it fails with "No space left on device") and is ``nosuid,nodev``: a setuid
binary or a device node made in it by a sandbox means nothing on the host.
Mounting needs root.

The image is sparse, but every block its file system may write is
**reserved on the host** (allocated in the image file) before the file
system may use it. A block the loop device writes back into a hole of a
sparse image takes host space only then, and when the host's disk is full
that write-back fails: the kernel logs "potential data loss", leaves the
page clean, and the file reads back as zeros once the page is evicted,
though its write was acknowledged long before. So the file system is made
at the cap's size, but a **balloon** (:data:`BALLOON`, a file at its root,
fallocated: unwritten extents, nothing of it is ever written) holds all
its free space but :data:`FREE_TARGET`; the image's blocks under the
balloon are holes, every other one (metadata, what is written, the free
space left) is allocated on the host. As the free space left runs low
(:data:`FREE_LOW`), :class:`_Grower` (a thread, every :data:`POLL` s)
reserves the host blocks under part of the balloon and then shrinks it by
that part, up to the cap. When the host cannot reserve them, nothing is
released: the sandbox's file system is full, its writes fail with ENOSPC,
and nothing it was told was written is lost. A sandbox writing faster than
the grower keeps up (more than FREE_LOW in a poll) sees ENOSPC early too.
Space freed in a store (files deleted) goes back to the host: past
:data:`FREE_HIGH` free, the grower grows the balloon again (fallocated: it
takes free blocks only, none the file system still writes) and punches the
image's blocks under what it took (:func:`_give_back`).

Host disk a store takes: what it holds, its metadata (the inode tables:
64 MiB for 4 GiB, a 16 MiB journal) and FREE_TARGET to FREE_HIGH free.

The inner file system is kept from punching holes in its image: a loop
device turns the zeroing of a range (the lazy init of inode tables, the
zeroing of a short unwritten extent) into a hole punched in the image,
which would undo the reservation. It is mounted ``noinit_itable`` (a fresh
image reads as zeros anyway), its ``extent_max_zeroout_kb`` is 0, and each
mount and growth reserves again everything outside the balloon.

The balloon is at the file system's root, never in sight of a sandbox. A
store (``layers``) keeps its layers in directories beside it at that root.
A plain capped working directory (:func:`mount_capped_workdir`: what a
sandbox binds as it is) is a bind of the subdirectory :data:`VIEW` of a
file system mounted privately beside it (``<directory>.fs``): its listings,
copies, snapshots and disk figure hold what the sandbox wrote, and nothing
in it is in the sandbox's way (the balloon is immutable).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import re
import struct
import subprocess
import threading
import time

from . import _mounts

#: The image beside the directory it backs.
IMAGE_SUFFIX = ".img"


#: A plain capped working directory's file system is mounted here, beside it.
PRIVATE_SUFFIX = ".fs"
#: The directory in that file system that the working directory shows.
VIEW = "view"


def image_for(directory: str) -> str:
    return directory.rstrip("/") + IMAGE_SUFFIX


def private_root(directory: str) -> str:
    """Where a plain capped working directory's file system is mounted."""
    return directory.rstrip("/") + PRIVATE_SUFFIX


def _fs_root(directory: str) -> str:
    """The root of the capped file system ``directory`` is (a store's) or
    shows (a plain capped working directory's): where its balloon is."""
    private = private_root(directory)
    return private if os.path.ismount(private) else directory


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise OSError(f"{' '.join(argv[:2])} failed: {done.stderr.strip() or done.returncode}")


#: The file at a capped file system's root that holds what the host has not reserved.
BALLOON = ".hutch-unreserved"
#: Free space a store keeps reserved on the host beyond what it holds ...
FREE_TARGET = 128 << 20
#: ... and below which the grower reserves more (up to the cap).
FREE_LOW = 64 << 20
#: Free space past which a store gives back to the host all but FREE_TARGET
#: (files deleted): far enough above it that a sandbox writing and deleting
#: does not have the same space taken and given at every turn.
FREE_HIGH = 4 * FREE_TARGET
#: How often the grower reads a mounted store's free space, in seconds.
POLL = 0.05

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
_FALLOC_FL_KEEP_SIZE = 0x1
_FALLOC_FL_PUNCH_HOLE = 0x2

_FS_IOC_FIEMAP = 0xC020660B
_FS_IOC_GETFLAGS = 0x80086601
_FS_IOC_SETFLAGS = 0x40086602
_FS_IMMUTABLE_FL = 0x10
_FIEMAP_FLAG_SYNC = 0x1
_FIEMAP_EXTENT_LAST = 0x1
_FIEMAP_HEADER = struct.Struct("=QQLLLL")
_FIEMAP_EXTENT = struct.Struct("=QQQQQLLLL")
_FIEMAP_BATCH = 256


def mount_capped(directory: str, size: int) -> None:
    """Make ``directory`` a mount of at most ``size`` bytes, the balloon at
    its root (idempotent: an existing image is mounted again as it is, after
    a reboot say). OSError (ENOSPC) if the host cannot reserve what the new
    file system needs to start."""
    _mount_image(directory, image_for(directory), size)


def mount_capped_workdir(directory: str, size: int) -> None:
    """Make ``directory`` a working directory of at most ``size`` bytes
    that shows only what is written in it: a bind of the :data:`VIEW` of a
    capped file system mounted at :func:`private_root` (idempotent, as
    :func:`mount_capped`). One capped before there was a view (the file
    system's root itself) has its files moved into one as it is mounted
    again; one still mounted so is left as it is."""
    if os.path.ismount(directory):
        _grower.watch(_fs_root(directory))
        return
    private = private_root(directory)
    _mount_image(private, image_for(directory), size)
    try:
        view = _view(private)
        os.makedirs(directory, exist_ok=True)
        _mounts.mount(view, directory, None, _mounts.MS_BIND)
    except OSError:
        with contextlib.suppress(OSError):
            _mounts.umount(private)
        raise


def _view(root: str) -> str:
    """The view of the capped file system at ``root``: made on its first
    mount, the root's mode and owner its own, with whatever the root holds
    but the balloon moved into it (an older working directory's files).
    Moved into a directory of another name, renamed last: a move cut short
    is taken up again on the next mount."""
    view = os.path.join(root, VIEW)
    if os.path.isdir(view) and not os.path.islink(view):
        return view
    moving = os.path.join(root, VIEW + ".moving")
    if not os.path.isdir(moving):
        st = os.stat(root)
        os.mkdir(moving, 0o700)
        os.chown(moving, st.st_uid, st.st_gid)
        os.chmod(moving, st.st_mode & 0o7777)
    for name in os.listdir(root):
        if name not in (BALLOON, VIEW + ".moving"):
            os.rename(os.path.join(root, name), os.path.join(moving, name))
    os.rename(moving, view)
    return view


def _mount_image(directory: str, image: str, size: int) -> None:
    if os.path.ismount(directory):
        _grower.watch(directory)
        return
    os.makedirs(directory, exist_ok=True)
    fresh = not os.path.exists(image)
    if fresh:
        fd = os.open(image, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        # No resize inode (it never grows: the balloon makes room), a 16 MiB
        # journal where the default would be bigger (all of it is reserved).
        journal = ["-J", "size=16"] if size >= 1 << 30 else []
        try:
            _run(["mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^resize_inode", *journal, "-E",
                  "lazy_itable_init=1,lazy_journal_init=1,nodiscard", image])
        except OSError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(image)
            raise
    _run(["mount", "-o", "loop,nosuid,nodev,noinit_itable", image, directory])
    try:
        _no_zeroout(directory)
        if fresh:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(directory, "lost+found"))  # the sandbox's dir starts empty
        _reserve(directory, image)
    except OSError:
        with contextlib.suppress(OSError):
            _mounts.umount(directory)
        if fresh:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(image)
        raise
    _grower.watch(directory)


def _no_zeroout(directory: str) -> None:
    """Keep ext4 from zeroing short unwritten extents (a hole punched in the image)."""
    dev = os.stat(directory).st_dev
    name = os.path.basename(os.path.realpath(
        f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"))
    with contextlib.suppress(OSError), open(f"/sys/fs/ext4/{name}/extent_max_zeroout_kb",
                                            "w") as fh:
        fh.write("0")


def _extents(fd: int, start: int, length: int) -> list[tuple[int, int]]:
    """The (image offset, length) of the blocks holding ``fd``'s bytes from
    ``start`` on, ``length`` of them (FIEMAP)."""
    found: list[tuple[int, int]] = []
    end = start + length
    while start < end:
        request = bytearray(_FIEMAP_HEADER.size + _FIEMAP_BATCH * _FIEMAP_EXTENT.size)
        _FIEMAP_HEADER.pack_into(request, 0, start, end - start, _FIEMAP_FLAG_SYNC, 0,
                                 _FIEMAP_BATCH, 0)
        fcntl.ioctl(fd, _FS_IOC_FIEMAP, request)
        mapped = _FIEMAP_HEADER.unpack_from(request, 0)[3]
        if mapped == 0:
            break
        last = False
        for i in range(mapped):
            logical, physical, size, _, _, flags, *_ = _FIEMAP_EXTENT.unpack_from(
                request, _FIEMAP_HEADER.size + i * _FIEMAP_EXTENT.size)
            lo, hi = max(logical, start), min(logical + size, end)
            if hi > lo:
                found.append((physical + lo - logical, hi - lo))
            start = logical + size
            last = bool(flags & _FIEMAP_EXTENT_LAST)
        if last:
            break
    return found


def _flags(fd: int) -> int:
    return int(struct.unpack("=l", fcntl.ioctl(fd, _FS_IOC_GETFLAGS, struct.pack("=l", 0)))[0])


def _immutable(fd: int) -> bool:
    return bool(_flags(fd) & _FS_IMMUTABLE_FL)


def _set_immutable(fd: int, on: bool) -> None:
    """The balloon is immutable: a sandbox (no CAP_LINUX_IMMUTABLE) that
    sees it (a working directory capped before there were views, still
    mounted so) cannot free it."""
    flags = _flags(fd)
    flags = flags | _FS_IMMUTABLE_FL if on else flags & ~_FS_IMMUTABLE_FL
    fcntl.ioctl(fd, _FS_IOC_SETFLAGS, struct.pack("=l", flags))


def _free(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _reserve(directory: str, image: str) -> None:
    """Make the balloon if there is none (a new store, or one made before
    there were balloons), then allocate on the host every block of the image
    the balloon does not hold. OSError (ENOSPC) if the host has not the room."""
    path = os.path.join(directory, BALLOON)
    try:  # read only: it is immutable
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        spare = _free(directory) - FREE_TARGET
        spare -= spare % 4096
        if spare <= 0:  # a small cap: reserved in full, no balloon
            fd = -1
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o400)
            try:
                os.posix_fallocate(fd, 0, spare)
                _set_immutable(fd, True)
            except OSError:
                os.close(fd)
                os.unlink(path)
                raise
    if fd == -1:
        ballooned = []
    else:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # one grower at a time (programs sharing a home)
            held = os.fstat(fd).st_size
            ballooned = sorted(_extents(fd, 0, held)) if held else []
        finally:
            os.close(fd)
    image_fd = os.open(image, os.O_WRONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(image_fd).st_size
        at = 0
        for offset, length in [*ballooned, (size, 0)]:
            if offset > at:
                os.posix_fallocate(image_fd, at, offset - at)
            at = max(at, offset + length)
    finally:
        os.close(image_fd)


def _release(directory: str, image: str, wanted: int) -> bool:
    """Reserve on the host the blocks under the balloon's last ``wanted``
    bytes, then shrink the balloon by them: that much more room in the
    store. False if there is no balloon left or the host has not the room."""
    path = os.path.join(directory, BALLOON)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)  # it is immutable
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # one grower at a time (programs sharing a home)
        held = os.fstat(fd).st_size
        keep = max(0, held - wanted)
        keep -= keep % 4096
        if keep >= held:
            return False
        image_fd = os.open(image, os.O_WRONLY | os.O_CLOEXEC)
        try:
            for offset, length in _extents(fd, keep, held - keep):
                os.posix_fallocate(image_fd, offset, length)
        except OSError:
            return False  # the host is full: the store stays as full as it is
        finally:
            os.close(image_fd)
        _set_immutable(fd, False)
        try:
            os.truncate(path, keep)
        finally:
            if keep:
                _set_immutable(fd, True)
        if not keep:
            os.unlink(path)
        return True
    finally:
        os.close(fd)


def _give_back(directory: str, image: str) -> bool:
    """Give the host back what a store holds free past FREE_TARGET (files
    deleted): the balloon (made again if the store had grown to its cap)
    takes that room, then the image's blocks under what it took are punched.
    Safe: blocks the balloon holds are never written (unwritten extents,
    nothing reads or writes the balloon), and ext4 reuses a freed block
    only once the transaction that freed it is committed, so no write of
    the file system lands in them after the punch. Done through the store's
    root held open, checked to be ``image``'s: a store unmounted meanwhile
    is not mistaken for the host directory under it. False if nothing was
    given (a write took the room meanwhile)."""
    root = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _backing_file(os.fstat(root).st_dev) != image:
            return False
        try:
            fd = os.open(BALLOON, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=root)
        except FileNotFoundError:  # the store had grown to its cap
            fd = os.open(BALLOON, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o400,
                         dir_fd=root)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # one grower at a time (programs sharing a home)
            held = os.fstat(fd).st_size
            if held and not _immutable(fd):
                # Not one hutch made (a sandbox that sees the root of an
                # older capped directory could make a file of that name):
                # its blocks are the sandbox's to write, never punched.
                return False
            st = os.fstatvfs(root)
            surplus = st.f_bavail * st.f_frsize - FREE_TARGET
            surplus -= surplus % 4096
            if surplus > FREE_HIGH - FREE_TARGET:
                _set_immutable(fd, False)
                try:
                    writable = os.open(BALLOON, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW,
                                       dir_fd=root)
                    try:
                        # ENOSPC: the sandbox wrote meanwhile; what was taken is given.
                        with contextlib.suppress(OSError):
                            os.posix_fallocate(writable, held, surplus)
                    finally:
                        os.close(writable)
                finally:
                    if os.fstat(fd).st_size:
                        _set_immutable(fd, True)
            grown = os.fstat(fd).st_size
            if grown <= held:
                if not held:  # none was there: none made
                    os.unlink(BALLOON, dir_fd=root)
                return False
            image_fd = os.open(image, os.O_WRONLY | os.O_CLOEXEC)
            try:
                for offset, length in _extents(fd, held, grown - held):
                    if _libc.fallocate(image_fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE,
                                       offset, length) != 0:
                        break  # a host file system that cannot punch: kept reserved
            finally:
                os.close(image_fd)
            return True
        finally:
            os.close(fd)
    finally:
        os.close(root)


def _backing_file(dev: int) -> str | None:
    """The image the loop device ``dev`` is backed by."""
    try:
        with open(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/loop/backing_file") as fh:
            return fh.read().rstrip("\n")
    except OSError:
        return None


def _image_of(directory: str) -> str | None:
    """The image a mounted capped directory is loop-mounted from."""
    return _backing_file(os.stat(directory).st_dev)


class _Grower:
    """The thread that makes room in mounted stores as they fill: every
    store this process mounted, and every other one mounted here (a daemon
    started again finds its running sandboxes' stores)."""

    RESCAN = 40  # polls between looks for stores this process did not mount

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: dict[str, str] = {}  # directory -> its image
        self._thread: threading.Thread | None = None
        self._room = threading.Condition(self._lock)

    def watch(self, directory: str | None = None) -> None:
        """Keep ``directory`` growing (and start the thread if it is not running)."""
        image = _image_of(directory) if directory is not None else None
        with self._lock:
            if directory is not None and image is not None:
                self._watched[directory] = image
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hutch-store-grower",
                                                daemon=True)
                self._thread.start()

    def wait_for_room(self, directory: str, timeout: float) -> bool:
        """Wait until ``directory`` has room (FREE_LOW / 2): whether it has
        (not if it is at its cap, or the host stays full)."""
        deadline = time.monotonic() + timeout
        root = _fs_root(directory)
        with self._room:
            while _free(root) <= FREE_LOW // 2:
                if not os.path.exists(os.path.join(root, BALLOON)):
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._room.wait(min(left, POLL))
        return True

    def _rescan(self) -> None:
        """Watch the stores mounted here that this process did not mount;
        forget the ones no longer mounted."""
        for directory in list(self._watched):
            if not os.path.ismount(directory):
                self._forget(directory)
        for mount in _mounts.mountinfo():
            if mount.fstype == "ext4" and mount.point not in self._watched and \
                    os.path.exists(os.path.join(mount.point, BALLOON)):
                self.watch(mount.point)

    def _forget(self, directory: str) -> None:
        with self._lock:
            self._watched.pop(directory, None)

    def _run(self) -> None:
        polls = -1
        while True:
            polls += 1
            if polls % self.RESCAN == 0:
                with contextlib.suppress(OSError):
                    self._rescan()
            with self._lock:
                watched = list(self._watched.items())
            for directory, image in watched:
                # One statvfs a store a poll; the rest only when it runs low.
                try:
                    free = _free(directory)
                    if free < FREE_LOW and _image_of(directory) == image and \
                            _release(directory, image, FREE_TARGET - free):
                        with self._room:
                            self._room.notify_all()
                    elif free > FREE_HIGH and _image_of(directory) == image:
                        _give_back(directory, image)
                except OSError:
                    self._forget(directory)
            time.sleep(POLL)


_grower = _Grower()


def keep_growing() -> None:
    """Make room in every capped directory mounted here as it fills (a
    daemon started again, whose running sandboxes' stores an earlier one
    mounted); mounting one here does it too."""
    _grower.watch()


def wait_for_room(directory: str, timeout: float) -> bool:
    """Wait (at most ``timeout`` s) for a full capped ``directory`` to be
    given more room: whether it was (False: at its cap, or the host is full)."""
    return _grower.wait_for_room(directory, timeout)


def loop_devices_backed_by(image: str) -> list[str]:
    """The loop devices whose backing file is ``image`` (also once it is deleted)."""
    done = subprocess.run(["losetup", "--list", "--noheadings", "--raw",
                           "--output", "NAME,BACK-FILE"],
                          capture_output=True, text=True, timeout=60, check=False)
    found = []
    for line in done.stdout.splitlines():
        device, _, back = line.partition(" ")
        if unescape_raw(back).removesuffix(" (deleted)") == image:
            found.append(device)
    return found


def unescape_raw(field: str) -> str:
    """A field of util-linux's ``--raw`` output as it is (a space there is ``\\x20``)."""
    return re.sub(r"\\x([0-9a-fA-F]{2})", lambda m: chr(int(m.group(1), 16)), field)


def unmount_capped(directory: str) -> None:
    """Unmount ``directory`` if it is a capped mount (a working directory's
    view, and the file system behind it), and drop its image and any loop
    device still backed by it."""
    image = image_for(directory)
    private = private_root(directory)
    loop_mount = private if os.path.ismount(private) else directory
    points = [directory, private] if loop_mount == private else [directory]
    clean = False
    for point in points:
        if not os.path.ismount(point):
            continue
        try:
            _mounts.umount(point)
            # mount(8) set its loop device up to clear itself on this unmount.
            clean = point == loop_mount
        except OSError:
            _mounts.umount(point, detach=True)  # busy: detached now, freed when let go
    with contextlib.suppress(OSError):
        os.rmdir(private)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(image)
    if clean:
        return
    # A loop device the mount no longer holds (a mount cut short, an image
    # deleted under it, a lazy unmount) is let go too; a busy one goes when
    # its last user does.
    for device in loop_devices_backed_by(image):
        subprocess.run(["losetup", "--detach", device], capture_output=True,
                       timeout=60, check=False)
