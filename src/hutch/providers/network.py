"""Network policy for sandboxes with a network namespace of their own.

``network: "none" | "all" | {"allow": [CIDR, ...]}``:

- ``none``: no network but the sandbox's own loopback;
- ``all``: any address, except those hutch always blocks (below);
- ``{"allow": [...]}``: only the listed networks.

Whenever the network is on, the cloud metadata address, the host's own
addresses (the daemon's port among them, the bridge gateway) and the
networks other sandboxes live on are unreachable unless an allow list names
them. The rules go into the sandbox's own namespace, installed from outside by
hutch (a sandbox without CAP_NET_ADMIN cannot change them): this module says
what they are; each provider says how it enters its namespace.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
from collections.abc import Iterable, Sequence
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

#: Cloud metadata services (AWS, GCP, Azure, OpenStack; AWS's IPv6 one).
METADATA_NETWORKS: tuple[str, ...] = ("169.254.169.254/32", "fd00:ec2::254/128")


class AllowList(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: Networks the sandbox may reach (``10.1.2.0/24``, ``203.0.113.7``,
    #: ``2001:db8::/32``), kept as their normal text (the store takes JSON).
    allow: Annotated[list[str], Field(max_length=256)]

    @field_validator("allow")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        out = []
        for item in value:
            try:
                out.append(str(ipaddress.ip_network(item.strip(), strict=True)))
            except ValueError as exc:
                raise ValueError(f"{item!r} is not a network (CIDR): {exc}") from None
        return out

    def networks(self) -> list[IPNetwork]:
        return [ipaddress.ip_network(item) for item in self.allow]


NetworkPolicy = Literal["none", "all"] | AllowList


def host_addresses() -> list[IPNetwork]:
    """This host's own addresses (every interface but loopback), as /32 and /128."""
    try:
        listing = subprocess.run(
            ["ip", "-j", "addr"], capture_output=True, text=True, timeout=10, check=True
        ).stdout
        interfaces = json.loads(listing)
    except (OSError, subprocess.SubprocessError, ValueError):
        return []
    found: list[IPNetwork] = []
    for interface in interfaces:
        for info in interface.get("addr_info") or []:
            address = ipaddress.ip_address(str(info.get("local", "")).split("%")[0])
            if not address.is_loopback:
                found.append(ipaddress.ip_network(address))
    return found


def _family(network: IPNetwork) -> int:
    return network.version


def ruleset(
    policy: NetworkPolicy, blocked: Iterable[IPNetwork], version: Literal[4, 6]
) -> str:
    """The ``iptables-restore`` (``ip6tables-restore`` for 6) input that
    enforces ``policy`` on what the sandbox sends, given the networks hutch
    blocks unless allowed (metadata, the host's addresses, other sandboxes).

    Replies to connections made into the sandbox (a preview URL) pass.
    """
    allowed: Sequence[IPNetwork] = policy.networks() if isinstance(policy, AllowList) else []
    lines = [
        "*filter",
        ":INPUT ACCEPT [0:0]",
        ":FORWARD DROP [0:0]",
        ":OUTPUT ACCEPT [0:0]",
        "-A OUTPUT -o lo -j ACCEPT",
        "-A OUTPUT -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
    ]
    if policy == "none":
        lines.append("-A OUTPUT -j REJECT")
    else:
        lines += [f"-A OUTPUT -d {n} -j ACCEPT" for n in allowed if _family(n) == version]
        metadata = [ipaddress.ip_network(n) for n in METADATA_NETWORKS]
        for network in [*metadata, *blocked]:
            if _family(network) == version:
                lines.append(f"-A OUTPUT -d {network} -j REJECT")
        if isinstance(policy, AllowList):
            lines.append("-A OUTPUT -j REJECT")
    lines.append("COMMIT")
    return "\n".join(lines) + "\n"


def apply_in_namespace(pid: int, policy: NetworkPolicy, blocked: Iterable[IPNetwork]) -> None:
    """Install ``policy`` in the network namespace of process ``pid``, from the
    host (``nsenter``), IPv4 and IPv6 alike. Raises OSError or
    subprocess.CalledProcessError when it cannot."""
    blocked = list(blocked)
    versions: tuple[tuple[Literal[4, 6], str], ...] = (
        (4, "iptables-restore"), (6, "ip6tables-restore"),
    )
    for version, tool in versions:
        subprocess.run(
            ["nsenter", "-t", str(pid), "-n", tool],
            input=ruleset(policy, blocked, version), capture_output=True, text=True,
            timeout=30, check=True,
        )


def installed_rules(pid: int) -> str:
    """The rules in force in ``pid``'s network namespace (``iptables -S``, both families)."""
    out = []
    for tool in ("iptables", "ip6tables"):
        out.append(subprocess.run(
            ["nsenter", "-t", str(pid), "-n", tool, "-S"], capture_output=True, text=True,
            timeout=30, check=True,
        ).stdout)
    return "".join(out)
