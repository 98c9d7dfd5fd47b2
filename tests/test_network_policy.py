"""Docker network policy, enforced by hutch in the sandbox's own namespace.

Every connection stays on this machine: a listener this test runs on the
host, or in another sandbox. The metadata rule is checked by reading the
rules installed, never by sending traffic to it.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import docker
import httpx
import pytest

import hutch
from hutch.providers.network import host_addresses, installed_rules
from tests.conftest import TEST_IMAGE
from tests.daemon_fixture import DaemonProcess

pytestmark = [pytest.mark.anyio, pytest.mark.docker]

CONNECT = (
    "import socket, sys\n"
    "try:\n"
    "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).close()\n"
    "except OSError as exc:\n"
    "    print(type(exc).__name__); sys.exit(1)\n"
    "print('connected')\n"
)


LISTEN = (
    "import socket\n"
    "server = socket.create_server(('0.0.0.0', 8000))\n"
    "while True:\n"
    "    server.accept()[0].close()\n"
)


@pytest.fixture(scope="module")
def host_listener() -> Iterator[int]:
    """A TCP listener on every host address; its port."""
    server = socket.create_server(("0.0.0.0", 0))
    server.settimeout(0.5)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            with contextlib.suppress(OSError):
                conn, _ = server.accept()
                conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield int(server.getsockname()[1])
    done.set()
    thread.join(5)
    server.close()


def container_info(sb: Any) -> dict[str, Any]:
    info: dict[str, Any] = docker.APIClient().inspect_container(f"hutch-{sb.id}")
    return info


def gateway(sb: Any) -> str:
    return str(container_info(sb)["NetworkSettings"]["Networks"]["bridge"]["Gateway"])


def address(sb: Any) -> str:
    return str(container_info(sb)["NetworkSettings"]["Networks"]["bridge"]["IPAddress"])


def host_ip() -> str:
    return next(str(n.network_address) for n in host_addresses() if n.version == 4
                and not str(n.network_address).startswith("172.17."))


async def reaches(sb: Any, ip: str, port: int) -> bool:
    result = await sb.exec(["python3", "-c", CONNECT, ip, str(port)])
    return result.exit_code == 0 and "connected" in result.stdout


@pytest.fixture
async def other() -> AsyncIterator[Any]:
    """Another sandbox with a listener on port 8000."""
    async with await hutch.create_sandbox("docker", image=TEST_IMAGE) as sb:
        await sb.start(["python3", "-c", LISTEN])
        for _ in range(50):
            if await reaches(sb, "127.0.0.1", 8000):
                break
        else:
            raise AssertionError("the other sandbox's listener did not come up")
        yield sb


async def test_all_blocks_the_host_and_other_sandboxes(host_listener: int, other: Any) -> None:
    async with await hutch.create_sandbox("docker", image=TEST_IMAGE) as sb:
        assert sb.capabilities.network_policy
        assert not await reaches(sb, gateway(sb), host_listener)
        assert not await reaches(sb, host_ip(), host_listener)
        assert not await reaches(sb, address(other), 8000)
        assert await reaches(sb, "127.0.0.1", 1) is False  # its own loopback: nothing there
        pid = int(container_info(sb)["State"]["Pid"])
        rules = installed_rules(pid)
        assert "-A OUTPUT -d 169.254.169.254/32 -j REJECT" in rules
        # The sandbox cannot change them: no CAP_NET_ADMIN (bit 12) among its capabilities.
        status = (await sb.exec("grep CapEff /proc/self/status")).stdout
        assert not int(status.split()[1], 16) & (1 << 12)
        assert (await sb.exec("ip link set eth0 down || exit 1")).exit_code != 0
    # Without a policy in the way, the same listener answers (the test can fail).
    async with await hutch.create_sandbox(
        "docker", image=TEST_IMAGE, network={"allow": ["0.0.0.0/0"]}
    ) as open_sb:
        assert await reaches(open_sb, gateway(open_sb), host_listener)
        assert await reaches(open_sb, address(other), 8000)


async def test_an_allow_list_reaches_only_what_it_names(host_listener: int, other: Any) -> None:
    target = address(other)
    async with await hutch.create_sandbox(
        "docker", image=TEST_IMAGE, network={"allow": [f"{target}/32"]}
    ) as sb:
        assert await reaches(sb, target, 8000)
        assert not await reaches(sb, gateway(sb), host_listener)
        assert not await reaches(sb, host_ip(), host_listener)
        rules = installed_rules(int(container_info(sb)["State"]["Pid"]))
        assert f"-A OUTPUT -d {target}/32 -j ACCEPT" in rules
        assert "-A OUTPUT -d 169.254.169.254/32 -j REJECT" in rules
        assert rules.rstrip().splitlines()[-1].startswith("-A OUTPUT -j REJECT")


async def test_none_has_only_loopback(host_listener: int) -> None:
    async with await hutch.create_sandbox("docker", image=TEST_IMAGE, network="none") as sb:
        interfaces = (await sb.exec("ls /sys/class/net")).stdout.split()
        assert interfaces == ["lo"]
        assert not await reaches(sb, "172.17.0.1", host_listener)


async def test_a_bad_allow_list_is_invalid() -> None:
    with pytest.raises(ValueError, match="allow"):
        await hutch.create_sandbox("docker", image=TEST_IMAGE, network={"allow": ["10.0.0.0/33"]})


def test_the_policy_through_the_daemon(host_listener: int) -> None:
    d = DaemonProcess(token=f"tok-{uuid.uuid4().hex}").start()
    try:
        headers = {"Authorization": f"Bearer {d.token}"}
        made = httpx.post(f"{d.url}/v1/sandboxes", headers=headers, timeout=120, json={
            "provider": "docker", "image": TEST_IMAGE, "network": {"allow": ["192.0.2.0/24"]},
        })
        assert made.status_code == 201, made.text
        sid = made.json()["id"]
        assert made.json()["capabilities"]["network_policy"] is True
        rules = installed_rules(int(docker.APIClient().inspect_container(
            f"hutch-{sid}")["State"]["Pid"]))
        assert "-A OUTPUT -d 192.0.2.0/24 -j ACCEPT" in rules
        httpx.delete(f"{d.url}/v1/sandboxes/{sid}", headers=headers, timeout=60)
    finally:
        d.stop()
