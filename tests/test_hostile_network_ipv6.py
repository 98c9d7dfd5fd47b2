"""A docker sandbox on an IPv6 network tries every way out over IPv6 that its
policy keeps out: the host's link-local address on the sandbox's link, the
bridge's own (unique local) address, the host's other addresses (one added
after the sandbox started among them), the metadata address's IPv6 form,
another sandbox, and the host through a packet sent from the sandbox's own
link-local address. With ``network: "all"`` each is refused; an allow list
that names it opens it, which proves the refusal is the policy's.

The Engine's default bridge here has no IPv6 (the daemon's ``ipv6`` is off,
and the running daemon is shared), so the test makes a user-defined network
with an IPv6 subnet of its own (the Engine allows that without the daemon's
setting) and gives it to the sandboxes as their ``network_mode``, an
operator's choice. The network, its sandboxes and the addresses the test adds
go at the end; hutch's rules go with the sandboxes, and the test checks they did.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import secrets
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import docker
import pytest

import hutch
from hutch.providers.docker import netguard
from hutch.providers.network import guard_chains, installed_rules
from tests.conftest import TEST_IMAGE
from tests.test_hostile_network import Listener, host_link_local, sandbox_link_local

pytestmark = [pytest.mark.anyio, pytest.mark.docker]

#: Connects to argv[1] port argv[2], from address argv[3] when given (the
#: sandbox's own link-local one: a source the host may not recognise).
CONNECT6 = (
    "import socket, sys\n"
    "target, port = sys.argv[1], int(sys.argv[2])\n"
    "try:\n"
    "    if len(sys.argv) > 3:\n"
    "        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)\n"
    "        sock.settimeout(4)\n"
    "        sock.bind((sys.argv[3], 0, 0, socket.if_nametoindex('eth0')))\n"
    "        sock.connect((target, port, 0, 0))\n"
    "        sock.close()\n"
    "    else:\n"
    "        socket.create_connection((target, port), timeout=4).close()\n"
    "except OSError as exc:\n"
    "    print(type(exc).__name__, exc); sys.exit(1)\n"
    "print('connected')\n"
)

LISTEN6 = (
    "import socket\n"
    "server = socket.create_server(('::', 8000), family=socket.AF_INET6, dualstack_ipv6=True)\n"
    "while True:\n"
    "    server.accept()[0].close()\n"
)

#: Stand-ins made host addresses on an interface that leads nowhere, after
#: the sandboxes started: a public address (documentation range) and the
#: cloud metadata service's IPv6 form (AWS's).
LATE_PUBLIC6 = "2001:db8:77::1"
METADATA6 = "fd00:ec2::254"


@dataclass(frozen=True)
class V6Network:
    name: str
    #: The host's end: the bridge the Engine made for the network.
    bridge: str
    subnet: ipaddress.IPv6Network

    @property
    def gateway(self) -> str:
        """The bridge's own address in the subnet (the host)."""
        return str(self.subnet[1])


@pytest.fixture
def v6_network() -> Iterator[V6Network]:
    """A user-defined Engine network with an IPv6 subnet of its own (a
    random unique local /64), removed at the end."""
    api = docker.APIClient()
    subnet = ipaddress.IPv6Network(
        f"fd{secrets.token_hex(1)}:{secrets.token_hex(2)}:{secrets.token_hex(2)}::/64"
    )
    name = f"hutch-test-v6-{uuid.uuid4().hex[:8]}"
    created = api.create_network(
        name, driver="bridge", enable_ipv6=True,
        ipam=docker.types.IPAMConfig(pool_configs=[docker.types.IPAMPool(subnet=str(subnet))]),
    )
    try:
        yield V6Network(name, f"br-{created['Id'][:12]}", subnet)
    finally:
        api.remove_network(created["Id"])


@pytest.fixture
def listener() -> Iterator[Listener]:
    """On every host address, IPv6 and IPv4, those added later included."""
    server = Listener("::")
    yield server
    server.close()


@pytest.fixture
def dummy() -> Iterator[Callable[[str], None]]:
    """An interface of the host's that leads nowhere (a veth pair, both ends
    on the host); the fixture gives a function that adds an IPv6 address to
    it (usable at once: no duplicate address detection). The pair goes at
    the end, its addresses with it."""
    name = f"hx{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "link", "add", name, "type", "veth", "peer", "name", f"{name}p"],
                   check=True)
    try:
        for end in (name, f"{name}p"):
            subprocess.run(["ip", "link", "set", end, "up"], check=True)

        def add(address: str) -> None:
            subprocess.run(["ip", "-6", "addr", "add", f"{address}/128", "dev", name, "nodad"],
                           check=True)

        yield add
    finally:
        subprocess.run(["ip", "link", "del", name], check=False)


def all_rules() -> str:
    return "".join(
        subprocess.run([tool, "-w", "-S"], capture_output=True, text=True, check=True).stdout
        for tool in ("iptables", "ip6tables")
    )


@contextlib.asynccontextmanager
async def sandbox(network: V6Network, policy: Any = "all") -> AsyncIterator[Any]:
    sb = await hutch.create_sandbox(
        "docker", image=TEST_IMAGE, network=policy, network_mode=network.name
    )
    key = netguard.guard_key(sb.id)
    try:
        rules = all_rules()
        assert all(chain in rules for chain in guard_chains(key))
        yield sb
    finally:
        await sb.close()
    rules = all_rules()
    for chain in guard_chains(key):
        assert chain not in rules, f"{chain} ({key}) left behind"


def container_info(sb: Any, network: V6Network) -> dict[str, Any]:
    info = docker.APIClient().inspect_container(f"hutch-{sb.id}")
    return dict(info["NetworkSettings"]["Networks"][network.name])


def global_address(sb: Any, network: V6Network) -> str:
    """The sandbox's own address in the network's IPv6 subnet."""
    address = str(container_info(sb, network)["GlobalIPv6Address"])
    assert ipaddress.IPv6Address(address) in network.subnet, address
    return address


async def link_local(sb: Any) -> str:
    """The sandbox's own link-local address on eth0 once it is usable."""
    address = await sandbox_link_local(sb)
    assert address, "the sandbox has no IPv6 link-local address"
    return address


def wait_usable(interface: str, address: str) -> None:
    """Until the host's ``address`` on ``interface`` is out of duplicate
    address detection (a bridge's address stays tentative until a port is up)."""
    for _ in range(100):
        listing = json.loads(subprocess.run(
            ["ip", "-j", "-6", "addr", "show", "dev", interface],
            capture_output=True, text=True, check=True,
        ).stdout)
        for entry in listing:
            for info in entry.get("addr_info") or []:
                if info.get("local") == address and not info.get("tentative"):
                    return
        time.sleep(0.1)
    raise AssertionError(f"{address} on {interface} stayed tentative")


def host_other_address6() -> str | None:
    """An IPv6 address of the host's, not loopback nor link-local, on an
    interface no sandbox lives behind (its uplink), if it has one."""
    listing = json.loads(subprocess.run(
        ["ip", "-j", "-6", "addr"], capture_output=True, text=True, check=True,
    ).stdout)
    for entry in listing:
        name = str(entry.get("ifname", ""))
        if name == "lo" or name.startswith(("docker", "br-", "hb", "veth", "hx")):
            continue
        for info in entry.get("addr_info") or []:
            address = ipaddress.IPv6Address(str(info.get("local", "::1")))
            if not (address.is_loopback or address.is_link_local):
                return str(address)
    return None


async def reaches(sb: Any, target: str, port: int, source: str | None = None) -> bool:
    argv = ["python3", "-c", CONNECT6, target, str(port), *([source] if source else [])]
    result = await sb.exec(argv, timeout=30)
    return result.exit_code == 0 and "connected" in result.stdout


async def test_the_host_over_ipv6_is_out_of_reach_unless_allowed(
    v6_network: V6Network, listener: Listener, dummy: Callable[[str], None]
) -> None:
    other = host_other_address6()
    named = [v6_network.gateway, LATE_PUBLIC6, METADATA6, *([other] if other else [])]
    allowed = {"allow": ["fe80::/10", *(f"{address}/128" for address in named)]}
    async with sandbox(v6_network) as sb, sandbox(v6_network, allowed) as open_sb:
        own_link_local = await link_local(sb)
        await link_local(open_sb)
        wait_usable(v6_network.bridge, v6_network.gateway)
        dummy(LATE_PUBLIC6)  # after the sandboxes started: no list made at start has it
        dummy(METADATA6)
        bridge_link_local = f"{host_link_local(v6_network.bridge)}%eth0"
        targets = {
            "the host's link-local address on the sandbox's link": bridge_link_local,
            "the bridge's own address": v6_network.gateway,
            "a public address of the host's added later": LATE_PUBLIC6,
            "the metadata address": METADATA6,
        }
        if other:
            targets["the host's uplink address"] = other
        for what, target in targets.items():
            assert await reaches(open_sb, target, listener.port), what
            assert not await reaches(sb, target, listener.port), what
        # From its own link-local address (a source the host sees on the
        # bridge, not the sandbox's global one), the host is the host still.
        for what, target in targets.items():
            assert not await reaches(sb, target, listener.port, own_link_local), what
        rules = installed_rules(int(docker.APIClient().inspect_container(
            f"hutch-{sb.id}")["State"]["Pid"]))
        for network in ("fe80::/10", "fc00::/7", "fd00:ec2::254/128"):
            assert f"-A OUTPUT -d {network} -j REJECT" in rules, network


async def test_another_sandbox_over_ipv6_is_out_of_reach_unless_allowed(
    v6_network: V6Network,
) -> None:
    async with sandbox(v6_network) as target_sb:
        await target_sb.start(["python3", "-c", LISTEN6])
        target = global_address(target_sb, v6_network)
        target_link_local = f"{await link_local(target_sb)}%eth0"
        for _ in range(100):
            if await reaches(target_sb, "::1", 8000):
                break
            await anyio.sleep(0.1)
        else:
            raise AssertionError("the other sandbox's listener did not come up")
        allowed = {"allow": [f"{target}/128", "fe80::/10"]}
        async with sandbox(v6_network) as sb, sandbox(v6_network, allowed) as open_sb:
            own_link_local = await link_local(sb)
            await link_local(open_sb)
            for what, address in (("its address", target), ("its link-local", target_link_local)):
                assert await reaches(open_sb, address, 8000), what
                assert not await reaches(sb, address, 8000), what
                assert not await reaches(sb, address, 8000, own_link_local), what


async def test_the_hosts_rules_refuse_the_sandbox_over_ipv6_without_its_namespaces(
    v6_network: V6Network, listener: Listener
) -> None:
    """The host's rules are the second place: with the sandbox's own
    namespace rules gone (a runtime that sends past them), what it sends
    the host from its link-local address or its global one is refused still."""
    async with sandbox(v6_network) as sb:
        own_link_local = await link_local(sb)
        wait_usable(v6_network.bridge, v6_network.gateway)
        pid = int(docker.APIClient().inspect_container(f"hutch-{sb.id}")["State"]["Pid"])
        for table in ("raw", "filter"):
            subprocess.run(["nsenter", "-t", str(pid), "-n", "ip6tables", "-t", table, "-F"],
                           check=True)
        targets = {
            "the host's link-local address on the sandbox's link":
                f"{host_link_local(v6_network.bridge)}%eth0",
            "the bridge's own address": v6_network.gateway,
        }
        for what, target in targets.items():
            assert not await reaches(sb, target, listener.port), what
            assert not await reaches(sb, target, listener.port, own_link_local), what
