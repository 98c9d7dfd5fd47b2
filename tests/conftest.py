"""Shared test configuration: the anyio backend and docker availability."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest

from tests import snapshot_leaks
from tests.daemon_fixture import DaemonProcess

TEST_IMAGE = os.environ.get("HUTCH_TEST_IMAGE", "hutch-test:bookworm")

#: This run's own hutch home: what in-process tests make (snapshot layers,
#: images labelled with it) is told apart from other runs' on the same host
#: and Docker Engine, and checked at the session's end.
SESSION_HOME = tempfile.mkdtemp(prefix="hutch-test-home-")
os.environ["HUTCH_HOME"] = SESSION_HOME


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


def docker_available() -> bool:
    if shutil.which("docker") is None:
        return False
    probe = subprocess.run(
        ["docker", "image", "inspect", TEST_IMAGE], capture_output=True, check=False
    )
    return probe.returncode == 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Docker tests must run, not skip, in CI: .ci/run starts the engine first.
    # Outside CI a developer without docker gets a clear failure reason up front.
    if any(item.get_closest_marker("docker") for item in items) and not docker_available():
        if os.environ.get("HUTCH_SKIP_DOCKER") == "1":
            items[:] = [i for i in items if not i.get_closest_marker("docker")]
            return
        raise pytest.UsageError(
            f"docker tests need a Docker Engine with image {TEST_IMAGE}: run "
            "scripts/ensure-docker.sh (or set HUTCH_SKIP_DOCKER=1 to deselect them)"
        )


@pytest.fixture(params=["agent", "native"])
def docker_runtime(request: pytest.FixtureRequest) -> str:
    """Each docker test that takes this runs on both runtimes: hutch's agent
    inside the container, and docker's own exec and archive API."""
    return str(request.param)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if its own snapshot storage is left: images labelled with
    its homes, snapshot layers or branch directories under them. Whatever is
    found is reported, then freed."""
    homes = [SESSION_HOME, *DaemonProcess.data_dirs]
    images = snapshot_leaks.leftover_images(homes)
    layers = snapshot_leaks.leftover_layers(homes)
    if images or layers:
        lines = [f"  image {tags} ({image_id[7:19]})" for image_id, tags in images]
        lines += [f"  layer directory {path}" for path in layers]
        session.config.get_terminal_writer().line(
            "\nsnapshot storage left behind by this run (now freed):\n" + "\n".join(lines),
            red=True,
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    snapshot_leaks.free(images, layers)
    shutil.rmtree(SESSION_HOME, ignore_errors=True)
