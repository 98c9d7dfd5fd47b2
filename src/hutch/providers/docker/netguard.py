"""A docker sandbox's network policy (:mod:`hutch.providers.network`), installed
from the host when its container starts and removed when the container goes.

In the container's own namespace: the denied ranges, the Engine's networks
(where other containers live, whatever their addresses), and no packet from an
address not the container's own (its IPv6 link-local one to its link only).
On the host, for what comes from the container's addresses: nothing to the
host itself, to another sandbox's interface or to a denied range. The
container has no CAP_NET_ADMIN, so it changes neither.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
from typing import Any

from ..._errors import ProviderError
from ..network import (
    HostMatch,
    IPNetwork,
    NetworkPolicy,
    Reach,
    apply_in_namespace,
    guard_host,
    guarded_keys,
    nameservers,
    unguard_host,
)


def guard_key(sandbox_id: str) -> str:
    """The key of the host rules of ``sandbox_id``'s container."""
    return f"{_KEY_PREFIX}{sandbox_id}"


_KEY_PREFIX = "docker:"


def _resolvers(info: dict[str, Any]) -> list[IPNetwork]:
    """The resolvers the Engine wrote into the container's ``resolv.conf``."""
    path = str(info.get("ResolvConfPath") or "")
    try:
        with open(path, "rb") as fh:
            return nameservers(fh.read())
    except OSError:
        return []


def _addresses(info: dict[str, Any]) -> list[IPNetwork]:
    found: list[IPNetwork] = []
    for attached in (info["NetworkSettings"].get("Networks") or {}).values():
        for key in ("IPAddress", "GlobalIPv6Address"):
            if attached.get(key):
                found.append(ipaddress.ip_network(attached[key]))
    return found


def _link_locals(pid: int) -> list[IPNetwork]:
    """The IPv6 link-local addresses of the namespace of process ``pid``
    (from the host's /proc: the kernel lists that namespace's), loopback's
    aside: the host sees a packet from one on the sandbox's bridge."""
    try:
        with open(f"/proc/{pid}/net/if_inet6") as listing:
            lines = listing.read().splitlines()
    except OSError:
        return []  # no IPv6 in it
    found: list[IPNetwork] = []
    for words in (line.split() for line in lines):
        if len(words) == 6 and words[5] != "lo" and words[3] == "20":  # scope: link
            found.append(ipaddress.ip_network(int(words[0], 16).to_bytes(16, "big")))
    return found


def _engine_networks(api: Any) -> list[IPNetwork]:
    blocked: set[IPNetwork] = set()
    for network in api.networks():
        for pool in (network.get("IPAM") or {}).get("Config") or []:
            if pool.get("Subnet"):
                blocked.add(ipaddress.ip_network(pool["Subnet"], strict=False))
    return sorted(blocked, key=str)


def enforce(api: Any, container: str, sandbox_id: str, policy: NetworkPolicy) -> None:
    """Install ``policy`` for the started ``container`` of ``sandbox_id``."""
    info = api.inspect_container(container)
    pid = int(info["State"]["Pid"])
    if os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat("/proc/self/ns/net").st_ino:
        raise ProviderError(f"container {container[:12]} shares hutch's network namespace")
    own = _addresses(info)
    reach = Reach(policy, _resolvers(info), _engine_networks(api))
    try:
        apply_in_namespace(pid, policy, reach.blocked, resolvers=reach.resolvers, sources=own)
        # The host knows its link-local addresses too (the namespace's rules
        # keep them to its link): a second place for what it sends the host.
        guard_host(guard_key(sandbox_id), reach, HostMatch(sources=own + _link_locals(pid)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        raise ProviderError(
            f"cannot enforce the network policy of sandbox {sandbox_id} (nsenter, "
            f"iptables-restore and ip6tables-restore, run as root, install it): {detail}"
        ) from None


def release(sandbox_id: str) -> None:
    """Remove the host's rules for ``sandbox_id``'s container (gone or going)."""
    try:
        unguard_host(guard_key(sandbox_id))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        raise ProviderError(
            f"cannot remove the network policy's host rules of sandbox {sandbox_id}: {detail}"
        ) from None


def sweep(api: Any, container_prefix: str) -> list[str]:
    """Remove the host rules of docker sandboxes whose container is gone
    (removed behind hutch's back, or by a hutch that died before its close):
    their addresses go to the Engine's next containers. Any hutch's on this
    host, as the rules are the host's. The rules are read before the
    containers: one read was installed for a container that existed by then.
    Returns the sandboxes whose rules went."""
    try:
        keys = [key for key in guarded_keys() if key.startswith(_KEY_PREFIX)]
    except (OSError, subprocess.SubprocessError):
        return []  # no iptables here: no rules either
    if not keys:
        return []
    names = {
        name.lstrip("/") for container in api.containers(all=True)
        for name in container.get("Names") or []
    }
    gone = []
    for key in keys:
        sandbox_id = key.removeprefix(_KEY_PREFIX)
        if f"{container_prefix}{sandbox_id}" not in names:
            release(sandbox_id)
            gone.append(sandbox_id)
    return gone
