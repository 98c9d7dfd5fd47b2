"""A network for a bubblewrap sandbox whose policy is not ``none``.

Each such sandbox gets a /30 of hutch's own range (10.213.0.0/16): a veth
pair, the host end ``hb<index>`` with the first address, the sandbox end
``eth0`` in the keeper's network namespace with the second and a default
route through the host, which masquerades the range out. The policy itself
(:mod:`hutch.providers.network`) is installed from outside, in the sandbox's
namespace and on the host for what arrives on ``hb<index>``: the host itself
(any address it has, now or later), every other sandbox, loopback,
link-local, metadata, private and CGNAT ranges are unreachable unless the
allow list names them. The sandbox has no capability over its network
namespace (the host's root owns it, not the sandbox's user namespace), so it
cannot change the rules or its addresses.

An index is held by a file under ``/run/hutch/bubblewrap-net`` (host-wide:
every hutch on the host shares the range) made with O_EXCL, so concurrent
creates never share one; it is freed on close.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import subprocess

from ..._errors import ProviderError
from ..network import (
    HostMatch,
    NetworkPolicy,
    Reach,
    apply_in_namespace,
    guard_host,
    nameservers,
    unguard_host,
)

RANGE = ipaddress.ip_network("10.213.0.0/16")
_SLOTS = RANGE.num_addresses // 4


def _index_dir() -> str:
    # Host-wide, not per data directory: the addresses and the interface
    # names are the host's, shared by every hutch on it.
    return os.environ.get("HUTCH_NET_DIR") or "/run/hutch/bubblewrap-net"


def allocate(sandbox_id: str) -> int:
    """A free /30 of the range, held for ``sandbox_id`` until :func:`release`."""
    directory = _index_dir()
    os.makedirs(directory, exist_ok=True)
    for index in range(1, _SLOTS):
        try:
            fd = os.open(os.path.join(directory, str(index)), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            continue
        with os.fdopen(fd, "w") as fh:
            fh.write(sandbox_id)
        return index
    raise ProviderError("every address of hutch's sandbox network range is in use")


def release(index: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(_index_dir(), str(index)))


def release_of(sandbox_id: str) -> None:
    """Disconnect and free whatever slot ``sandbox_id`` holds (reconciliation)."""
    try:
        names = os.listdir(_index_dir())
    except FileNotFoundError:
        return
    for name in names:
        try:
            with open(os.path.join(_index_dir(), name)) as fh:
                owner = fh.read().strip()
        except OSError:
            continue
        if owner == sandbox_id and name.isdigit():
            with contextlib.suppress(ProviderError):  # its slot is freed all the same
                disconnect(int(name))
            release(int(name))


def addresses(index: int) -> tuple[str, str]:
    """The host end's and the sandbox end's addresses of slot ``index``."""
    base = int(RANGE.network_address) + 4 * index
    return str(ipaddress.ip_address(base + 1)), str(ipaddress.ip_address(base + 2))


def host_resolver() -> bytes:
    try:
        with open("/etc/resolv.conf", "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=False)


def _must(*argv: str) -> None:
    done = _run(*argv)
    if done.returncode != 0:
        raise ProviderError(f"{' '.join(argv)}: {done.stderr.strip() or done.stdout.strip()}")


def _host_rules() -> None:
    """Forwarding and masquerading for the range (once per host; idempotent)."""
    rules = [
        ("nat", "POSTROUTING", ["-s", str(RANGE), "!", "-d", str(RANGE), "-j", "MASQUERADE"]),
        ("filter", "FORWARD", ["-s", str(RANGE), "-j", "ACCEPT"]),
        ("filter", "FORWARD", ["-d", str(RANGE), "-m", "conntrack", "--ctstate",
                               "ESTABLISHED,RELATED", "-j", "ACCEPT"]),
    ]
    for table, chain, spec in rules:
        if _run("iptables", "-t", table, "-C", chain, *spec).returncode != 0:
            _must("iptables", "-t", table, "-I", chain, "1", *spec)
    with open("/proc/sys/net/ipv4/ip_forward") as fh:
        if fh.read().strip() != "1":
            with open("/proc/sys/net/ipv4/ip_forward", "w") as out:
                out.write("1")


def guard_key(index: int) -> str:
    """The host rules' key: the slot's, as they match its interface."""
    return f"bubblewrap:hb{index}"


def connect(init_pid: int, index: int, policy: NetworkPolicy) -> None:
    """Give the keeper's namespace its end of the veth, a route out, the policy."""
    host_if = f"hb{index}"
    host_ip, sandbox_ip = addresses(index)
    _run("ip", "link", "del", host_if)  # a leftover of a sandbox that died
    _host_rules()
    _must("ip", "link", "add", host_if, "type", "veth", "peer", "name", "eth0",
          "netns", str(init_pid))
    _must("ip", "addr", "add", f"{host_ip}/30", "dev", host_if)
    _must("ip", "link", "set", host_if, "up")
    inside = ["nsenter", "-t", str(init_pid), "-n"]
    _must(*inside, "ip", "addr", "add", f"{sandbox_ip}/30", "dev", "eth0")
    _must(*inside, "ip", "link", "set", "eth0", "up")
    _must(*inside, "ip", "link", "set", "lo", "up")
    _must(*inside, "ip", "route", "add", "default", "via", host_ip)
    # DNS to the resolvers it is given (the host's, written into it) passes.
    reach = Reach(policy, nameservers(host_resolver()), [RANGE])
    try:
        apply_in_namespace(init_pid, policy, reach.blocked, resolvers=reach.resolvers)
        guard_host(guard_key(index), reach, HostMatch(interfaces=[host_if]))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        raise ProviderError(f"cannot install the network policy: {detail}") from None


def disconnect(index: int) -> None:
    """Remove the host end (the sandbox end goes with its namespace) and the
    host's rules for it."""
    _run("ip", "link", "del", f"hb{index}")
    try:
        unguard_host(guard_key(index))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        raise ProviderError(f"cannot remove the network policy's host rules: {detail}") from None
