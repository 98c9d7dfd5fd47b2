"""Size-capped host directories: a file system of its own, loop-mounted.

A working directory on the host is as big as the host's disk. Mounted from
a sparse image of ``size`` bytes (ext4), it is capped at that size (a write
past it fails with "No space left on device"), costs only what is written,
and is ``nosuid,nodev``: a setuid binary or a device node made in it by a
sandbox means nothing on the host. Mounting needs root.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess

from . import _mounts

#: The image beside the directory it backs.
IMAGE_SUFFIX = ".img"


def image_for(directory: str) -> str:
    return directory.rstrip("/") + IMAGE_SUFFIX


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise OSError(f"{' '.join(argv[:2])} failed: {done.stderr.strip() or done.returncode}")


def mount_capped(directory: str, size: int) -> None:
    """Make ``directory`` a mount of at most ``size`` bytes (idempotent: an
    existing image is mounted again as it is, after a reboot say)."""
    if os.path.ismount(directory):
        return
    os.makedirs(directory, exist_ok=True)
    image = image_for(directory)
    fresh = not os.path.exists(image)
    if fresh:
        fd = os.open(image, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        _run(["mkfs.ext4", "-q", "-F", "-m", "0", "-E",
              "lazy_itable_init=1,lazy_journal_init=1,nodiscard", image])
    _run(["mount", "-o", "loop,nosuid,nodev", image, directory])
    if fresh:
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(directory, "lost+found"))  # the sandbox's dir starts empty


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
    """Unmount ``directory`` if it is a capped mount, and drop its image and
    any loop device still backed by it."""
    image = image_for(directory)
    clean = False
    if os.path.ismount(directory):
        try:
            _mounts.umount(directory)
            # mount(8) set its loop device up to clear itself on this unmount.
            clean = True
        except OSError:
            _mounts.umount(directory, detach=True)  # busy: detached now, freed when let go
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
