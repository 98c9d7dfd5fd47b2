"""A sandbox with the network on tries to reach what its policy keeps out,
on every isolating provider: the host's addresses (one added after the
sandbox started among them), another provider's sandbox, the host's
loopback, the metadata address, private and CGNAT ranges.

Every connection stays on this machine. Where a destination would not exist
here (the metadata address, a private network), the test makes it exist: an
address on an interface of the host that leads nowhere, added after the
sandbox started, with the test's listener behind it; a sandbox whose allow
list names it reaches it, which proves the refusal is the policy's. The
interface goes at the end of each test, with its addresses; the rules hutch
installed on the host go with the sandboxes, and the test checks they did.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anyio
import docker
import pytest

import hutch
from hutch._sandbox import backend_of
from hutch.providers.docker import netguard as _dockernet
from hutch.providers.network import guard_chains, installed_rules
from tests import isolating
from tests.conftest import TEST_IMAGE

pytestmark = [pytest.mark.anyio, pytest.mark.docker]

#: The providers with a network policy (``network: "all" | {"allow": ...}``).
#: gvisor's network is ``none`` only (Debian's runsc cannot bring up its
#: own stack here): nothing of the host is reachable, tried below with the
#: others' ``none``. The kubernetes provider has no network setting: a pod's
#: network is its cluster's (a NetworkPolicy's), not hutch's policy.
PROVIDERS = ["docker", "bubblewrap"]
#: Kinds whose network can be ``none`` (the network is the provider's, not
#: the runtime's: one runtime each).
WITHOUT_NETWORK = isolating.params("docker-native", "bubblewrap-native", "gvisor")

CONNECT = (
    "import socket, sys\n"
    "try:\n"
    "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=4).close()\n"
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

#: Stand-ins for what a sandbox must not reach, one per class, made host
#: addresses on an interface for the test (TEST-NET-2 stands for a
#: public address of the host added after the sandbox started).
LATE_PUBLIC = "198.51.100.77"
CLASS_TARGETS = {
    "metadata": "169.254.169.254",
    "link-local": "169.254.77.1",
    "private 10/8": "10.77.0.1",
    "private 172.16/12": "172.31.77.1",
    "private 192.168/16": "192.168.77.1",
    "CGNAT": "100.64.77.1",
}


async def make(provider: str, network: Any = "all") -> Any:
    if provider == "bubblewrap":
        return await hutch.create_sandbox(
            "bubblewrap", image=TEST_IMAGE, ephemeral=True, read_before_write=False,
            network=network,
        )
    return await hutch.create_sandbox(provider, image=TEST_IMAGE, network=network)


def address_of(sb: Any) -> str:
    """The sandbox's own address, where another sandbox would reach it."""
    if sb.provider == "bubblewrap":
        from hutch.providers.bubblewrap.network import addresses

        return addresses(int(backend_of(sb).describe()["net_index"]))[1]
    info = docker.APIClient().inspect_container(f"hutch-{sb.id}")
    return str(info["NetworkSettings"]["Networks"]["bridge"]["IPAddress"])


def namespace_pid(sb: Any) -> int:
    """A host process in the sandbox's network namespace."""
    if sb.provider == "bubblewrap":
        return int(backend_of(sb).describe()["keeper"]["init_pid"])
    return int(docker.APIClient().inspect_container(f"hutch-{sb.id}")["State"]["Pid"])


async def reaches(sb: Any, ip: str, port: int) -> bool:
    result = await sb.exec(["python3", "-c", CONNECT, ip, str(port)], timeout=30)
    return result.exit_code == 0 and "connected" in result.stdout


def host_primary_address() -> str:
    """The host's address on its route out (present before any sandbox)."""
    route = json.loads(subprocess.run(
        ["ip", "-j", "route", "get", "192.0.2.123"], capture_output=True, text=True, check=True,
    ).stdout)[0]
    return str(route["prefsrc"])


def all_rules() -> str:
    return "".join(
        subprocess.run([tool, "-w", "-S"], capture_output=True, text=True, check=True).stdout
        for tool in ("iptables", "ip6tables")
    )


def guard_key(sb: Any) -> str:
    """The key of the host rules hutch installs for ``sb``."""
    if sb.provider == "bubblewrap":
        from hutch.providers.bubblewrap import network

        return network.guard_key(int(backend_of(sb).describe()["net_index"]))
    return _dockernet.guard_key(sb.id)


def assert_unguarded(key: str) -> None:
    """Nothing hutch installed on the host under ``key`` is left."""
    rules = all_rules()
    for chain in guard_chains(key):
        assert chain not in rules, f"{chain} ({key}) left behind"


class Listener:
    """A TCP listener of the test's on the host, accepting and closing
    (``"::"``: every address, IPv6 and IPv4)."""

    def __init__(self, host: str) -> None:
        self.server = (socket.create_server(("::", 0), family=socket.AF_INET6,
                                            dualstack_ipv6=True) if host == "::"
                       else socket.create_server((host, 0)))
        self.server.settimeout(0.5)
        self.port = int(self.server.getsockname()[1])
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while not self.done.is_set():
            with contextlib.suppress(OSError):
                conn, _ = self.server.accept()
                conn.close()

    def close(self) -> None:
        self.done.set()
        self.thread.join(5)
        self.server.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    """On every host address, those added later included."""
    server = Listener("0.0.0.0")
    yield server
    server.close()


@pytest.fixture
def loopback_listener() -> Iterator[Listener]:
    server = Listener("127.0.0.1")
    yield server
    server.close()


@pytest.fixture
def dummy() -> Iterator[Callable[[str], None]]:
    """An interface of the host's that leads nowhere (a veth pair, both ends
    on the host: this kernel has no dummy driver); the fixture gives a
    function that adds an address to it. The pair goes at the end, its
    addresses with it."""
    name = f"hx{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "link", "add", name, "type", "veth", "peer", "name", f"{name}p"],
                   check=True)
    try:
        for end in (name, f"{name}p"):
            subprocess.run(["ip", "link", "set", end, "up"], check=True)

        def add(address: str) -> None:
            network = ipaddress.ip_network(address)
            subprocess.run(
                ["ip", "addr", "add", f"{address}/{network.max_prefixlen}", "dev", name],
                check=True,
            )

        yield add
    finally:
        subprocess.run(["ip", "link", "del", name], check=False)


@pytest.fixture(params=PROVIDERS)
def provider(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@contextlib.asynccontextmanager
async def sandbox(provider: str, network: Any = "all") -> AsyncIterator[Any]:
    sb = await make(provider, network)
    try:
        key = guard_key(sb)
        assert any(chain in all_rules() for chain in guard_chains(key))
        yield sb
    finally:
        await sb.close()
    assert_unguarded(key)


@pytest.mark.parametrize("kind", WITHOUT_NETWORK)
async def test_a_sandbox_without_a_network_reaches_nothing_of_the_host(
    kind: str, listener: Listener, loopback_listener: Listener
) -> None:
    async with await hutch.create_sandbox(
        **isolating.settings(kind, network="none"), read_before_write=False
    ) as sb:
        assert not await reaches(sb, host_primary_address(), listener.port)
        assert not await reaches(sb, "127.0.0.1", loopback_listener.port)
        links = await sb.exec(["cat", "/proc/net/dev"])
        names = {line.split(":")[0].strip() for line in links.stdout.splitlines()[2:]}
        assert names <= {"lo"}, names  # no interface but its own loopback


async def test_the_hosts_addresses_are_out_of_reach_present_and_added_later(
    provider: str, listener: Listener, dummy: Callable[[str], None]
) -> None:
    present = host_primary_address()
    async with sandbox(provider) as sb:
        assert sb.capabilities.network_policy
        assert not await reaches(sb, present, listener.port)
        dummy(LATE_PUBLIC)  # after the sandbox started: no list made at start has it
        assert not await reaches(sb, LATE_PUBLIC, listener.port)


async def test_an_allowed_host_address_is_reachable(
    provider: str, listener: Listener, dummy: Callable[[str], None]
) -> None:
    present = host_primary_address()
    async with sandbox(provider, {"allow": [f"{present}/32", f"{LATE_PUBLIC}/32"]}) as sb:
        assert await reaches(sb, present, listener.port)
        dummy(LATE_PUBLIC)
        assert await reaches(sb, LATE_PUBLIC, listener.port)


async def test_loopback_metadata_private_and_cgnat_are_out_of_reach(
    provider: str, listener: Listener, loopback_listener: Listener,
    dummy: Callable[[str], None],
) -> None:
    allowed = {"allow": [f"{target}/32" for target in CLASS_TARGETS.values()]}
    async with sandbox(provider) as sb, sandbox(provider, allowed) as allowed_sb:
        # The host's loopback: the sandbox's own is another one.
        assert not await reaches(sb, "127.0.0.1", loopback_listener.port)
        for target in CLASS_TARGETS.values():
            dummy(target)
        for name, target in CLASS_TARGETS.items():
            assert await reaches(allowed_sb, target, listener.port), name
            assert not await reaches(sb, target, listener.port), name
        # The refusal is by class, in the sandbox's own namespace too: the
        # rules name the ranges, not a list of what exists here.
        rules = installed_rules(namespace_pid(sb))
        for network in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10",
                        "169.254.0.0/16", "127.0.0.0/8", "169.254.169.254/32",
                        "fe80::/10", "fc00::/7", "::1/128", "fd00:ec2::254/128"):
            assert f"-A OUTPUT -d {network} -j REJECT" in rules, network


@pytest.fixture(params=PROVIDERS)
async def other(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """A sandbox of a provider with a listener on port 8000 inside."""
    async with sandbox(str(request.param)) as sb:
        await sb.start(["python3", "-c", LISTEN])
        for _ in range(100):
            if await reaches(sb, "127.0.0.1", 8000):
                break
        else:
            raise AssertionError("the other sandbox's listener did not come up")
        yield sb


async def test_another_sandbox_of_any_provider_is_out_of_reach(provider: str, other: Any) -> None:
    target = address_of(other)
    async with sandbox(provider) as sb:
        assert not await reaches(sb, target, 8000)
    # Allowed by its address, the same listener answers: the refusal was the policy's.
    async with sandbox(provider, {"allow": [f"{target}/32"]}) as sb:
        assert await reaches(sb, target, 8000)


async def test_dns_to_the_sandboxs_own_resolver_still_passes(provider: str) -> None:
    """Its resolver may sit in a private range (this host's does): the one
    exception, on port 53 only."""
    async with sandbox(provider) as sb:
        conf = (await sb.exec("cat /etc/resolv.conf")).stdout
        resolver = next(line.split()[1] for line in conf.splitlines()
                        if line.startswith("nameserver"))
        assert await reaches(sb, resolver, 53), resolver


def test_a_sandbox_gone_without_its_close_leaves_no_rule_over_its_successor() -> None:
    """Host rules match a docker sandbox by its address, which the Engine gives
    the next container: installing the newcomer's removes the old jumps."""
    from hutch.providers.network import AllowList, HostMatch, Reach, guard_host, unguard_host

    address = [ipaddress.ip_network("172.17.250.250/32")]
    gone, successor = f"sb-gone-{uuid.uuid4().hex[:6]}", f"sb-new-{uuid.uuid4().hex[:6]}"
    try:
        guard_host(gone, Reach("all"), HostMatch(sources=address))
        guard_host(successor, Reach(AllowList(allow=["0.0.0.0/0"])), HostMatch(sources=address))
        jumps = [line for line in all_rules().splitlines()
                 if "172.17.250.250/32" in line and "-j HUTCH-" in line]
        assert jumps and all(
            line.endswith(tuple(guard_chains(successor))) for line in jumps
        ), jumps
    finally:
        unguard_host(gone)
        unguard_host(successor)
    rules = all_rules()
    for chain in (*guard_chains(gone), *guard_chains(successor)):
        assert chain not in rules


async def sandbox_link_local(sb: Any) -> str | None:
    """The sandbox's own IPv6 link-local address on eth0 once it is usable
    (duplicate address detection over), or None where it has no IPv6."""
    for _ in range(100):
        lines = (await sb.exec("cat /proc/net/if_inet6 2>/dev/null || true")).stdout
        entries = [line.split() for line in lines.splitlines()]
        found = [e for e in entries if len(e) == 6 and e[5] == "eth0" and e[0].startswith("fe80")]
        if not found:
            return None
        if not int(found[0][4], 16) & 0x40:  # IFA_F_TENTATIVE
            return str(ipaddress.ip_address(int(found[0][0], 16)))
        await anyio.sleep(0.1)
    raise AssertionError("the sandbox's link-local address stayed tentative")


def _host_end(sb: Any) -> str:
    """The host interface at the other end of the sandbox's eth0."""
    if sb.provider == "bubblewrap":
        return f"hb{backend_of(sb).describe()['net_index']}"
    return "docker0"


def host_link_local(interface: str) -> str:
    for _ in range(100):
        listing = json.loads(subprocess.run(
            ["ip", "-j", "-6", "addr", "show", "dev", interface],
            capture_output=True, text=True, check=True,
        ).stdout)
        infos = [i for entry in listing for i in entry.get("addr_info") or []
                 if str(i.get("local", "")).startswith("fe80")]
        if infos and not infos[0].get("tentative"):
            return str(infos[0]["local"])
        time.sleep(0.1)
    raise AssertionError(f"{interface} has no usable link-local address")


async def test_the_host_over_ipv6_link_local_is_out_of_reach(provider: str) -> None:
    """Where the sandbox has IPv6 (bubblewrap's veth does; Docker turns it off
    in a container on a network without IPv6), the host's link-local address
    on the sandbox's link is the host too."""
    server = Listener("::")
    port = server.port
    try:
        async with sandbox(provider) as sb, sandbox(provider, {"allow": ["fe80::/10"]}) as open_sb:
            if await sandbox_link_local(sb) is None:
                # No IPv6 in the sandbox (docker's default bridge here): the
                # host's address on its link is out of reach all the more.
                # test_hostile_network_ipv6 tries docker on an IPv6 network.
                assert not await reaches(sb, f"{host_link_local(_host_end(sb))}%eth0", port)
                return
            assert await sandbox_link_local(open_sb)
            target = f"{host_link_local(_host_end(sb))}%eth0"
            open_target = f"{host_link_local(_host_end(open_sb))}%eth0"
            assert await reaches(open_sb, open_target, port)
            assert not await reaches(sb, target, port)
            rules = installed_rules(namespace_pid(sb))
            assert "-A OUTPUT -d fe80::/10 -j REJECT" in rules
    finally:
        server.close()


def test_the_rules_of_a_container_removed_behind_hutchs_back_are_swept() -> None:
    """The daemon's orphan reaping removes host rules whose container is gone
    (a daemon that died before its close left them) and keeps a live one's."""
    from hutch.providers.network import HostMatch, Reach, guard_host

    api = docker.APIClient()
    gone = f"sb-gone-{uuid.uuid4().hex[:6]}"
    live = api.create_container(TEST_IMAGE, command=["true"],
                                name=f"hutch-sb-live-{uuid.uuid4().hex[:6]}")
    live_id = str(api.inspect_container(live["Id"])["Name"]).lstrip("/").removeprefix("hutch-")
    try:
        for sandbox_id, address in ((gone, "172.17.250.251/32"), (live_id, "172.17.250.252/32")):
            guard_host(_dockernet.guard_key(sandbox_id), Reach("all"),
                       HostMatch(sources=[ipaddress.ip_network(address)]))
        swept = _dockernet.sweep(api, "hutch-")
        assert gone in swept and live_id not in swept
        rules = all_rules()
        assert not any(c in rules for c in guard_chains(_dockernet.guard_key(gone)))
        assert all(c in rules for c in guard_chains(_dockernet.guard_key(live_id)))
    finally:
        _dockernet.release(gone)
        _dockernet.release(live_id)
        api.remove_container(live["Id"], force=True)
