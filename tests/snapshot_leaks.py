"""Snapshot storage a test run made and left behind, found at the session's end.

A run owns what carries its own data directories: the in-process tests' hutch
home (one per session, set by conftest) and every daemon's data directory
(``DaemonProcess`` records them). Docker images are told by their
``hutch.home`` label (snapshot and suspend images both carry it), layer
directories by where they sit. Other runs on the same Docker Engine have other
homes, so nothing of theirs is looked at. Containers, mounts and temporary
directories in general are another check's (tests/conftest.py's hygiene).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterable

HOME_LABEL = "hutch.home"


def leftover_layers(homes: Iterable[str]) -> list[str]:
    """Snapshot layers, branch working directories and gvisor checkpoints
    under ``homes``."""
    found = []
    for home in homes:
        # The gvisor provider's snapshots are checkpoints of their own.
        for base in [os.path.join(home, "layers", kind) for kind in ("snapshots", "mounts")] \
                + [os.path.join(home, "gvisor", "snapshots")]:
            with contextlib.suppress(FileNotFoundError):
                found += [os.path.join(base, name) for name in sorted(os.listdir(base))]
    return found


def leftover_images(homes: Iterable[str]) -> list[tuple[str, str]]:
    """(image id, tags) of images labelled with one of ``homes``."""
    wanted = set(homes)
    if not wanted or shutil.which("docker") is None:
        return []
    try:
        import docker

        api = docker.APIClient(timeout=30)
        images = api.images(all=True, filters={"label": HOME_LABEL})
    except Exception:  # no engine here: no docker tests ran either
        return []
    return [
        (str(image["Id"]), ",".join(t for t in image.get("RepoTags") or [] if t != "<none>:<none>")
         or "<untagged>")
        for image in images
        if (image.get("Labels") or {}).get(HOME_LABEL) in wanted
    ]


def made_at(images: list[tuple[str, str]], layers: list[str]) -> dict[str, float]:
    """When each leftover was made (an image's creation, a directory's
    change time), keyed by image id or path: the run names the test that was
    running then, so a leak is told with the test that made it."""
    when: dict[str, float] = {}
    if images:
        import docker

        api = docker.APIClient(timeout=30)
        for image_id, _ in images:
            with contextlib.suppress(Exception):
                created = api.inspect_image(image_id)["Created"]
                when[image_id] = _rfc3339(created)
    for path in layers:
        with contextlib.suppress(OSError):
            when[path] = os.stat(path).st_ctime
    return when


def _rfc3339(stamp: str) -> float:
    from datetime import datetime

    # Docker gives nanoseconds; fromisoformat takes at most microseconds.
    head, _, frac = stamp.rstrip("Z").partition(".")
    return datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}+00:00").timestamp()


def free(images: list[tuple[str, str]], layers: list[str]) -> None:
    """Remove what :func:`leftover_images` and :func:`leftover_layers` found
    (this run's own), so that a failing run does not leave it for the next."""
    if images:
        import docker

        api = docker.APIClient(timeout=60)
        left = [image_id for image_id, _ in images]
        for _ in range(5):  # children before the images they stand on
            failed = []
            for image_id in left:
                try:
                    api.remove_image(image_id, force=True)
                except docker.errors.NotFound:
                    pass
                except Exception:
                    failed.append(image_id)
            left = failed
            if not left:
                break
    for path in layers:
        merged = os.path.join(path, "merged")
        if os.path.ismount(merged):
            subprocess.run(["umount", "-l", merged], check=False)
        shutil.rmtree(path, ignore_errors=True)
