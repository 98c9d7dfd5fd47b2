"""Tests that try to get out of a sandbox of every isolating provider (docker
and bubblewrap on each runtime, gvisor, kubernetes), one sandbox a kind."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

import hutch
from tests import isolating
from tests.isolating import kube_standin  # noqa: F401  (a fixture)

pytestmark = [pytest.mark.anyio, pytest.mark.docker]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module", params=isolating.params())
async def sb(request: pytest.FixtureRequest, anyio_backend: str) -> AsyncIterator[Any]:
    kind = request.param
    standin = request.getfixturevalue("kube_standin") if kind == "kubernetes" else None
    async with await hutch.create_sandbox(
        **isolating.settings(kind, standin), read_before_write=False) as sandbox:
        yield sandbox


async def test_cannot_mount_or_load_modules(sb: Any) -> None:
    assert (await sb.exec("mount -t tmpfs none /mnt")).exit_code != 0
    assert (await sb.exec("echo 1 > /proc/sys/kernel/sysrq")).exit_code != 0


async def test_sees_only_its_own_processes(sb: Any) -> None:
    first = await sb.exec(["cat", "/proc/1/cmdline"])
    with open("/proc/1/cmdline", "rb") as host_init:
        # PID 1 inside is the sandbox's own init (its keeper), not the host's.
        assert first.stdout_bytes.split(b"\0")[0] != host_init.read().split(b"\0")[0]
    assert first.exit_code == 0 and first.stdout_bytes
    listing = await sb.exec("ls /proc | grep -E '^[0-9]+$'")
    # The keeper, this shell, ls and grep: not the host's hundreds.
    assert len(listing.stdout.split()) < 10, listing.stdout


async def test_no_docker_socket_inside(sb: Any) -> None:
    assert (await sb.exec(["test", "-e", "/var/run/docker.sock"])).exit_code != 0


async def test_setuid_does_not_raise_privileges(sb: Any) -> None:
    # With no-new-privileges a setuid-root binary run by nobody stays nobody.
    await sb.exec("cp /bin/cat /tmp/rootcat && chmod 4755 /tmp/rootcat "
                  "&& echo secret > /root/secret && chmod 600 /root/secret")
    attempt = await sb.exec(["/tmp/rootcat", "/root/secret"], user="nobody")
    assert attempt.exit_code != 0
    assert "secret" not in attempt.stdout


async def test_file_paths_stay_inside_the_container(sb: Any) -> None:
    marker = f"hutch-escape-{uuid.uuid4().hex}"
    await sb.write_text(f"../../../../tmp/{marker}", "inside")
    assert not os.path.exists(f"/tmp/{marker}"), "a sandbox path wrote on the host"
    assert await sb.read_text(f"/tmp/{marker}") == "inside"
    with pytest.raises(FileNotFoundError):
        await sb.read_text(f"/proc/{os.getpid()}/environ/../../../../etc/hutch-{marker}")


async def test_symlink_to_host_path_resolves_inside(sb: Any) -> None:
    await sb.exec("ln -s /etc/hostname /workspace/link")
    inside = (await sb.exec(["cat", "/etc/hostname"])).stdout
    assert await sb.read_text("link") == inside
