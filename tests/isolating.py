"""The isolating providers the hostile suite runs on, each with its settings.

A sandbox's root is never the host's on docker and bubblewrap (each on both
runtimes), gvisor and kubernetes (its pods, here, the stand-in API server's
docker containers: tests/kube_standin.py). A test module parametrizes over
the kinds its cases apply to; a kind a case cannot apply to is left out of
that case's list with the reason beside it, in code.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import TEST_IMAGE
from tests.kube_standin import KubeStandin

#: kind -> (provider, its runtime or None where it has one only).
KINDS: dict[str, tuple[str, str | None]] = {
    "docker-agent": ("docker", "agent"),
    "docker-native": ("docker", "native"),
    "bubblewrap-agent": ("bubblewrap", "agent"),
    "bubblewrap-native": ("bubblewrap", "native"),
    "gvisor": ("gvisor", None),
    "kubernetes": ("kubernetes", None),
}


def runsc_missing() -> bool:
    return shutil.which("runsc") is None and not os.environ.get("HUTCH_RUNSC")


def param(kind: str) -> Any:
    """A kind as a pytest parameter, skipped where its runtime is not installed."""
    marks = []
    if kind == "gvisor":
        marks.append(pytest.mark.skipif(runsc_missing(), reason="runsc is not installed"))
    return pytest.param(kind, id=kind, marks=marks)


def params(*kinds: str) -> list[Any]:
    return [param(k) for k in (kinds or tuple(KINDS))]


def settings(kind: str, standin: KubeStandin | None = None, **extra: Any) -> dict[str, Any]:
    """The settings of a sandbox of ``kind`` on the test image (``provider``
    among them), for the daemon's API or ``hutch.create_sandbox(**...)``."""
    provider, runtime = KINDS[kind]
    found: dict[str, Any] = {"provider": provider, "image": TEST_IMAGE}
    if runtime is not None:
        found["runtime"] = runtime
    if provider == "bubblewrap":
        found["ephemeral"] = True
    if provider == "kubernetes":
        assert standin is not None, "a kubernetes sandbox needs the stand-in API server"
        found["kubeconfig"] = standin.kubeconfig
    return {**found, **extra}


#: What a daemon must be told to take the kubernetes settings above from an
#: API client (the kubeconfig is a host file: the operator's to allow).
DAEMON_ALLOWS = ["--allow", "kubeconfig"]


@pytest.fixture(scope="module")
def kube_standin() -> Iterator[KubeStandin]:
    """The stand-in API server, with a kubeconfig for it, for a module."""
    server = KubeStandin().start()
    fd, path = tempfile.mkstemp(prefix="hutch-kubeconfig-")
    os.close(fd)
    os.chmod(path, 0o644)
    server.write_kubeconfig(path)
    try:
        yield server
    finally:
        server.stop()
        os.unlink(path)
