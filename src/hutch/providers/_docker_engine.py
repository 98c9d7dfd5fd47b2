"""The one Docker Engine client: every call hutch makes to Docker (the
``docker`` provider, images, bubblewrap's root file systems exported from
Docker images) goes through :func:`engine`, and Engine failures become
hutch's typed errors here.

The docker SDK is imported lazily, so importing this module costs nothing
where Docker is not used.
"""

from __future__ import annotations

import re
import threading
from typing import Any

import anyio.to_thread

from .._errors import (
    HutchError,
    InvalidArgument,
    ProviderError,
    SandboxFileNotFound,
    SandboxPermissionDenied,
    SandboxUnavailable,
)


class ContainerGone(SandboxUnavailable):
    """The Engine says the sandbox's container is not there (removed outside
    hutch): gone, where an Engine that does not answer (a plain
    :class:`SandboxUnavailable` or :class:`ProviderError`) cannot tell. Its
    wire code stays ``sandbox_unavailable``."""


_api_lock = threading.Lock()
_api_client: Any = None


def engine() -> Any:
    """One low-level docker API client per process (it pools connections)."""
    global _api_client
    with _api_lock:
        if _api_client is None:
            import docker

            try:
                # A pool as wide as the execs a daemon runs at once, so that
                # concurrent calls do not open and drop connections.
                _api_client = docker.APIClient(version="auto", timeout=600, max_pool_size=64)
            except docker.errors.DockerException as exc:
                raise SandboxUnavailable(
                    f"cannot reach the Docker Engine: {exc} (scripts/ensure-docker.sh starts one)"
                ) from None
        return _api_client


def engine_available() -> bool:
    """Whether a Docker Engine answers here."""
    import docker.errors
    import requests

    try:
        return bool(engine().ping())
    except (SandboxUnavailable, docker.errors.DockerException, requests.RequestException):
        return False


def status_of(exc: BaseException) -> int | None:
    """The HTTP status of an Engine failure, where it has one."""
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def explanation(exc: BaseException) -> str:
    """What the Engine said of a failure."""
    return str(getattr(exc, "explanation", None) or exc)


#: The host's path to a container's root file system, as the Engine's messages
#: name it (``/var/lib/docker/overlay2/<id>/merged``): never shown to a caller.
_HOST_ROOT = re.compile(r"/\S*?/(?:overlay2?|aufs|btrfs|zfs|vfs|fuse-overlayfs)/[^/\s]+/merged")


def sandbox_view(text: str) -> str:
    """An Engine message with host paths turned into the sandbox's own paths."""
    return _HOST_ROOT.sub("", text)


def map_engine_error(exc: BaseException, path: str | None = None) -> HutchError:
    """The typed error of an Engine failure; ``path`` is the sandbox file the
    call was about, if any."""
    text = sandbox_view(explanation(exc))
    lowered = text.lower()
    if "no such container" in lowered:
        # The sandbox's container is gone (removed outside hutch): not a
        # missing file, whatever the call was about.
        return ContainerGone(f"docker: its container is gone ({text})")
    if path is not None:
        if status_of(exc) == 404 or "no such file" in lowered or "not a directory" in lowered:
            return SandboxFileNotFound(f"no such file or directory: {path}")
        if "permission denied" in lowered or "operation not permitted" in lowered:
            return SandboxPermissionDenied(f"permission denied: {path}")
        if "read-only" in lowered:
            return SandboxPermissionDenied(f"read-only file system: {path}")
        if "too many links" in lowered:
            return InvalidArgument(f"{path}: too many levels of symbolic links")
    return ProviderError(f"docker: {text}")


def checked(fn: Any, *args: Any, path: str | None = None, **kwargs: Any) -> Any:
    """Make a blocking SDK call, mapping engine errors to ours."""
    import docker.errors

    try:
        return fn(*args, **kwargs)
    except docker.errors.APIError as exc:
        raise map_engine_error(exc, path) from None
    except (docker.errors.DockerException, OSError) as exc:
        if isinstance(exc, HutchError):
            raise
        raise ProviderError(f"docker: {sandbox_view(str(exc))}") from None


async def call(fn: Any, *args: Any, path: str | None = None, **kwargs: Any) -> Any:
    """Run a blocking SDK call in a thread, mapping engine errors to ours."""
    return await anyio.to_thread.run_sync(lambda: checked(fn, *args, path=path, **kwargs))
