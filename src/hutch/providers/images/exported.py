"""Docker images exported once as root file systems (bubblewrap's and
gvisor's lowest layer), cached by image id and shared by every data
directory on this host."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import tempfile

from ..._errors import NotFound
from .in_docker import export_rootfs, image_id


def cache_dir() -> str:
    """Where exported images are kept: a cache shared by every data directory
    on this host (``$HUTCH_CACHE_DIR``, else /var/cache/hutch for root)."""
    configured = os.environ.get("HUTCH_CACHE_DIR")
    if configured:
        return configured
    if os.geteuid() == 0:
        return "/var/cache/hutch"
    return os.path.expanduser("~/.cache/hutch")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def docker_image_rootfs(image: str) -> str:
    """``image``'s file system, exported from Docker once per image id."""
    found = image_id(image)
    if found is None:
        raise NotFound(
            f"no hutch image or Docker image named {image!r} (hutch image build makes one)"
        )
    base = os.path.join(cache_dir(), "rootfs")
    os.makedirs(base, exist_ok=True)
    target = os.path.join(base, f"{_safe(image)}-{found.split(':')[-1][:16]}")
    if os.path.isdir(target):
        _open_root(target)
        return target
    with open(os.path.join(base, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isdir(target):
            return target
        work = tempfile.mkdtemp(prefix=".export-", dir=base)
        try:
            export_rootfs(image, work)
            _open_root(work)
            os.rename(work, target)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    return target



def _open_root(root: str) -> None:
    """The root directory as an image's is (0755): the export's temporary
    directory was made 0700, and a user other than root inside a sandbox
    that enforces permissions itself (gvisor) could then reach nothing."""
    if os.stat(root).st_mode & 0o777 == 0o700:
        os.chmod(root, 0o755)
