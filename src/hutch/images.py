"""hutch images: environments built once and used by name by docker and bubblewrap."""

from __future__ import annotations

import os

from ._paths import hutch_home


def images_home() -> str:
    return os.path.join(hutch_home(), "images")


def hutch_image_rootfs(name: str) -> str | None:
    """The unpacked root file system of hutch image ``name``, if it was built."""
    path = os.path.join(images_home(), name.replace("/", "_"), "rootfs")
    return path if os.path.isdir(path) else None
