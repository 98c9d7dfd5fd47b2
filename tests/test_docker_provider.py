"""Docker-specific behaviour, against a real Docker Engine."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import docker
import pytest

import hutch
from hutch.providers.docker import DockerSandbox, list_managed_containers
from tests.conftest import TEST_IMAGE

pytestmark = [pytest.mark.anyio, pytest.mark.docker]


@pytest.fixture
def api() -> docker.APIClient:
    return docker.APIClient(version="auto")


@pytest.fixture
async def sb() -> AsyncIterator[Any]:
    async with await hutch.create_sandbox(
        "docker", image=TEST_IMAGE, labels={"team": "tests"}, pids_limit=300,
        memory="256m", read_before_write=False,
    ) as sandbox:
        yield sandbox


async def test_container_is_labelled_named_and_hardened(sb: Any, api: docker.APIClient) -> None:
    details = api.inspect_container(sb.backend.container_id)
    assert details["Name"] == f"/hutch-{sb.id}"
    labels = details["Config"]["Labels"]
    assert labels["hutch.managed"] == "1"
    assert labels["hutch.sandbox_id"] == sb.id
    assert labels["team"] == "tests"
    host = details["HostConfig"]
    assert "no-new-privileges" in host["SecurityOpt"]
    assert host["PidsLimit"] == 300
    assert host["Memory"] == 256 * 1024 * 1024
    assert "NET_RAW" in host["CapDrop"]
    assert (sb.id, sb.backend.container_id, "running") in list_managed_containers()


async def test_capabilities_are_really_dropped(sb: Any) -> None:
    status = await sb.exec(["grep", "CapEff", "/proc/self/status"])
    cap_eff = int(status.stdout.split()[1], 16)
    net_raw, mknod = 1 << 13, 1 << 27
    assert cap_eff & net_raw == 0
    assert cap_eff & mknod == 0
    assert (await sb.exec(["mknod", "/tmp/dev", "c", "1", "3"])).exit_code != 0
    # Package managers still work as root: chown, setuid and file ownership.
    assert (await sb.exec("useradd -m agent && su agent -c 'id -un'")).stdout == "agent\n"


async def test_pids_limit_holds_a_fork_bomb(sb: Any) -> None:
    result = await sb.exec(
        "for i in $(seq 1 400); do sleep 5 & done 2>/dev/null; jobs -p | wc -l", timeout=30
    )
    assert int(result.stdout.strip() or 0) < 300


async def test_working_directory_is_the_host_bind_mount(sb: Any) -> None:
    await sb.write_text("from-sandbox.txt", "inside")
    host = sb.backend.host_workdir
    with open(os.path.join(host, "from-sandbox.txt")) as fh:
        assert fh.read() == "inside"
    with open(os.path.join(host, "from-host.txt"), "w") as fh:
        fh.write("outside")
    assert (await sb.exec(["cat", "/workspace/from-host.txt"])).stdout == "outside"


async def test_pause_keeps_files_and_processes(sb: Any) -> None:
    await sb.exec("nohup sleep 300 >/dev/null 2>&1 &")
    await sb.write_text("/root/kept.txt", "kept")
    await sb.backend.pause()
    await sb.backend.unpause()
    assert await sb.read_text("/root/kept.txt") == "kept"
    assert "sleep 300" in (await sb.exec("ps -eo args")).stdout
    assert await sb.backend.count_busy_processes() >= 1


async def test_suspend_frees_the_container_and_resume_restores_files(
    sb: Any, api: docker.APIClient
) -> None:
    await sb.write_text("/root/rootfs.txt", "in the container layer")
    await sb.write_text("work.txt", "in the bind mount")
    old = sb.backend.container_id
    await sb.backend.suspend()
    assert not any(c["Id"] == old for c in api.containers(all=True))
    assert not await sb.backend.is_alive()
    await sb.backend.resume()
    assert await sb.backend.is_alive()
    assert await sb.read_text("/root/rootfs.txt") == "in the container layer"
    assert await sb.read_text("work.txt") == "in the bind mount"


async def test_close_removes_container_image_and_own_workdir(api: docker.APIClient) -> None:
    sandbox = await hutch.create_sandbox("docker", image=TEST_IMAGE)
    await sandbox.exec("echo x > /root/x")
    await sandbox.backend.suspend()
    image = sandbox.backend.suspended_image
    await sandbox.backend.resume()
    container, workdir = sandbox.backend.container_id, sandbox.backend.host_workdir
    await sandbox.close()
    assert not any(c["Id"] == container for c in api.containers(all=True))
    assert not any(i["Id"] == image for i in api.images(all=True))
    assert not os.path.exists(workdir)


async def test_preserve_keeps_the_container(api: docker.APIClient) -> None:
    workdir = tempfile.mkdtemp()
    sandbox = await hutch.create_sandbox(
        "docker", image=TEST_IMAGE, preserve=True, host_workdir=workdir
    )
    container = sandbox.backend.container_id
    await sandbox.close()
    try:
        assert api.inspect_container(container)["State"]["Running"]
        assert os.path.isdir(workdir)
    finally:
        api.remove_container(container, force=True)
        shutil.rmtree(workdir, ignore_errors=True)


async def test_reconnect_from_description(sb: Any) -> None:
    await sb.write_text("/root/r.txt", "again")
    again = await DockerSandbox.reconnect(sb.id, sb.backend.describe())
    assert await again.is_alive()
    assert await again.read_file("/root/r.txt", 100) == b"again"


async def test_missing_image_without_pull_is_not_found() -> None:
    with pytest.raises(hutch.NotFound, match="no-such-image"):
        await hutch.create_sandbox(
            "docker", image="hutch-no-such-image:never", pull_if_missing=False
        )


async def test_bad_mount_is_invalid_argument() -> None:
    with pytest.raises(hutch.InvalidArgument, match="host:container"):
        await hutch.create_sandbox("docker", image=TEST_IMAGE, mounts=["nocolon"])
