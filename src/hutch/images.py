"""hutch images (the public name): built once, used by name by the docker and
bubblewrap providers. The code lives in :mod:`hutch.providers.images`."""

from __future__ import annotations

from .providers.images import (
    MINBASE_TAR,
    ImageInfo,
    Progress,
    _apt_sandbox,
    build,
    docker_reference,
    docker_tag,
    hutch_image_rootfs,
    images_home,
    inspect,
    list_images,
    remove,
)

__all__ = [
    "MINBASE_TAR",
    "ImageInfo",
    "Progress",
    "_apt_sandbox",
    "build",
    "docker_reference",
    "docker_tag",
    "hutch_image_rootfs",
    "images_home",
    "inspect",
    "list_images",
    "remove",
]
