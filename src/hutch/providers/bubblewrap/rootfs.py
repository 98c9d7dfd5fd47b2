"""Root file systems for bubblewrap sandboxes: a host directory, a hutch image,
or a Docker image exported once and cached, all shared read-only."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import tempfile

from ..._errors import InvalidArgument, NotFound
from ..images import hutch_image_rootfs
from ..images.in_docker import export_rootfs, image_id
from .provisioning import check_layer_path


def _check_root(path: str, named: str | None = None) -> str:
    """``path`` if it is a root file system a sandbox can start on; an error
    that names it ``named`` (an image's name: where hutch keeps the image is
    its own business, never shown to a caller), else by its path."""
    what = f"root file system {path}" if named is None else f"image {named!r}"
    try:
        check_layer_path(path)
    except InvalidArgument:
        if named is None:
            raise
        raise InvalidArgument(f"{what} is kept where an overlay cannot reach it") from None
    if not os.path.isdir(path):
        raise InvalidArgument(f"{what} is not a directory")
    if not os.path.lexists(os.path.join(path, "bin/sh")):
        raise InvalidArgument(f"{what} has no /bin/sh")
    return path


def resolve_rootfs(rootfs: str | None, image: str | None) -> str:
    """The host directory that is the sandbox's lowest (read-only) layer."""
    if rootfs is not None:
        return _check_root(os.path.realpath(rootfs))
    assert image is not None
    built = hutch_image_rootfs(image)
    if built is not None:
        return _check_root(built, image)
    return _check_root(docker_image_rootfs(image), image)


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
        return target
    with open(os.path.join(base, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isdir(target):
            return target
        work = tempfile.mkdtemp(prefix=".export-", dir=base)
        try:
            export_rootfs(image, work)
            os.rename(work, target)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    return target

