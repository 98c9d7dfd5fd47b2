"""Root file systems for bubblewrap sandboxes: a host directory, a hutch image,
or a Docker image exported once and cached, all shared read-only."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import tempfile
from typing import Any

from ..._errors import InvalidArgument, NotFound, ProviderError
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
    from ...images import hutch_image_rootfs

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
    from ..docker import engine

    api: Any = engine()
    import docker.errors

    try:
        info = api.inspect_image(image)
    except docker.errors.ImageNotFound:
        raise NotFound(
            f"no hutch image or Docker image named {image!r} (hutch image build makes one)"
        ) from None
    except docker.errors.APIError as exc:  # a name the Engine refuses (upper case, ...)
        raise InvalidArgument(
            f"image {image!r}: {getattr(exc, 'explanation', None) or exc}"
        ) from None
    except docker.errors.DockerException as exc:
        raise ProviderError(f"image {image!r}: the Docker Engine: {exc}") from None
    image_id = str(info["Id"]).split(":")[-1][:16]
    base = os.path.join(cache_dir(), "rootfs")
    os.makedirs(base, exist_ok=True)
    target = os.path.join(base, f"{_safe(image)}-{image_id}")
    if os.path.isdir(target):
        return target
    with open(os.path.join(base, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isdir(target):
            return target
        work = tempfile.mkdtemp(prefix=".export-", dir=base)
        try:
            _export(api, image, work)
            os.rename(work, target)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    return target


def _export(api: Any, image: str, into: str) -> None:
    container = api.create_container(image, command=["/bin/true"], labels={"hutch.export": "1"})
    cid = container["Id"]
    try:
        tar = subprocess.Popen(
            ["tar", "-x", "--numeric-owner", "-C", into],
            stdin=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        assert tar.stdin is not None
        try:
            for chunk in api.export(cid):
                tar.stdin.write(chunk)
        finally:
            tar.stdin.close()
        tar.wait()
        assert tar.stderr is not None
        err = tar.stderr.read()
        if tar.returncode != 0:
            raise ProviderError(f"unpacking {image}: {err.decode(errors='replace').strip()}")
    finally:
        api.remove_container(cid, force=True)
