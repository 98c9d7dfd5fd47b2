"""Root file systems for bubblewrap sandboxes: a host directory, a hutch image,
or a Docker image exported once and cached, all shared read-only."""

from __future__ import annotations

import os

from ..._errors import InvalidArgument
from ..images import hutch_image_rootfs
from ..images.exported import docker_image_rootfs
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
