"""Network policy for sandboxes with a network namespace of their own.

``network: "none" | "all" | {"allow": [CIDR, ...]}``:

- ``none``: no network but the sandbox's own loopback;
- ``all``: any address, except those hutch always denies (below);
- ``{"allow": [...]}``: only the listed networks.

Whenever the network is on, a sandbox reaches none of these unless its allow
list names them: the host itself (every address it has, those added after the
sandbox started included: the daemon's port, the bridge gateways, each
bubblewrap sandbox's host end), every other sandbox of any provider, loopback,
link-local and the cloud metadata address, the private and CGNAT ranges. The
only exception is DNS (port 53) to the resolvers the sandbox is given.

The rules deny by class, never by a list of what exists when the sandbox
starts, in two places, both installed by hutch from outside the sandbox (which
has no CAP_NET_ADMIN to change them):

- in the sandbox's own namespace (:func:`ruleset`): the denied ranges;
- on the host (:func:`host_ruleset`, one pair of chains per sandbox, jumped to
  from INPUT and FORWARD for the traffic that comes from the sandbox):
  INPUT is the host itself, whatever its addresses are now or later (the
  kernel delivers there what is addressed to any local address); FORWARD
  refuses the interfaces other sandboxes live behind and the denied ranges.
  A provider whose sandbox sends past its namespace's own rules (gVisor's
  netstack) still meets these.

This module says what the rules are and installs them; a provider says how
its sandbox's traffic is recognised on the host (its interface, or its
addresses) and how to enter its namespace.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import ipaddress
import json
import re
import shlex
import subprocess
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Version = Literal[4, 6]

#: Cloud metadata services (AWS, GCP, Azure, OpenStack; AWS's IPv6 one).
METADATA_NETWORKS: tuple[str, ...] = ("169.254.169.254/32", "fd00:ec2::254/128")

#: Destinations denied by class whenever the network is on, unless allowed.
DENIED_NETWORKS: dict[Version, tuple[str, ...]] = {
    4: (
        "0.0.0.0/8",        # "this network": 0.0.0.0 is the local host
        "10.0.0.0/8",       # private (bubblewrap sandboxes live in 10.213.0.0/16)
        "100.64.0.0/10",    # carrier-grade NAT
        "127.0.0.0/8",      # loopback
        "169.254.0.0/16",   # link-local (the metadata address among them)
        "172.16.0.0/12",    # private (Docker's bridges by default)
        "192.0.0.0/24",     # IETF protocol assignments (NAT64 discovery)
        "192.168.0.0/16",   # private
        "198.18.0.0/15",    # benchmarking, used as private
        "224.0.0.0/4",      # multicast: reaches the sandbox's link, the host's side
        "240.0.0.0/4",      # reserved, and the limited broadcast
    ),
    6: (
        "::/128",           # unspecified: the local host
        "::1/128",          # loopback
        "::ffff:0:0/96",    # IPv4-mapped
        "64:ff9b:1::/48",   # local-use NAT64
        "100::/64",         # discard
        "fc00::/7",         # unique local (private)
        "fe80::/10",        # link-local
        "fec0::/10",        # site-local (deprecated, still routed by some)
        "ff00::/8",         # multicast
    ),
}

#: Host interfaces sandboxes live behind, by provider: bubblewrap's veths,
#: Docker's default bridge and its user-defined ones. A sandbox's forwarded
#: traffic never leaves by one of these (a later provider adds its own).
SANDBOX_INTERFACES: tuple[str, ...] = ("hb+", "docker0", "br-+")

#: ICMPv6 neighbour discovery (router solicitation, neighbour solicitation
#: and advertisement): without it a sandbox has no IPv6 at all.
_NEIGHBOUR_DISCOVERY = (133, 135, 136)

#: The IPv6 sources a sandbox uses on its link only (source, destination):
#: its link-local address to link-local and link-scope multicast ones, and
#: none at all (duplicate address detection, multicast listener reports).
_LINK_SCOPE = (("fe80::/10", "fe80::/10"), ("fe80::/10", "ff02::/16"), ("::/128", "ff02::/16"))


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
    """This host's own addresses (every interface but loopback), as /32 and /128,
    as they are now (for a report; the policy never depends on this list)."""
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


def nameservers(resolv_conf: str | bytes) -> list[IPNetwork]:
    """The resolvers a ``resolv.conf`` names (which a sandbox may ask on port 53)."""
    text = resolv_conf.decode(errors="replace") if isinstance(resolv_conf, bytes) else resolv_conf
    found: list[IPNetwork] = []
    for line in text.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] == "nameserver":
            try:
                found.append(ipaddress.ip_network(words[1].split("%")[0]))
            except ValueError:
                continue
    return found


@dataclass(frozen=True)
class Reach:
    """What a sandbox may reach besides the public internet: its policy, and
    DNS to its resolvers."""

    policy: NetworkPolicy
    resolvers: Sequence[IPNetwork] = ()
    #: Further networks to deny, beyond the classes (another provider's
    #: networks at addresses outside them: Docker's pools can be anywhere).
    blocked: Sequence[IPNetwork] = ()

    def allowed(self, version: Version) -> list[IPNetwork]:
        networks = self.policy.networks() if isinstance(self.policy, AllowList) else []
        return [n for n in networks if n.version == version]

    def denied(self, version: Version) -> list[IPNetwork]:
        out: list[IPNetwork] = []
        for text in (*METADATA_NETWORKS, *DENIED_NETWORKS[version]):
            network = ipaddress.ip_network(text)
            if network.version == version and network not in out:
                out.append(network)
        out += [n for n in self.blocked if n.version == version and n not in out]
        return out

    def exceptions(self, chain: str, verdict: str, version: Version) -> list[str]:
        """Rules for what passes in ``chain``: DNS to the resolvers, then the allow list."""
        lines = []
        for resolver in self.resolvers:
            if resolver.version == version:
                for protocol in ("udp", "tcp"):
                    lines.append(f"-A {chain} -d {resolver} -p {protocol} -m {protocol} "
                                 f"--dport 53 -j {verdict}")
        lines += [f"-A {chain} -d {n} -j {verdict}" for n in self.allowed(version)]
        return lines


def _neighbour_discovery(chain: str, verdict: str, version: Version) -> list[str]:
    if version != 6:
        return []
    return [f"-A {chain} -p ipv6-icmp -m icmp6 --icmpv6-type {kind} -j {verdict}"
            for kind in _NEIGHBOUR_DISCOVERY]


def ruleset(
    policy: NetworkPolicy, blocked: Iterable[IPNetwork], version: Version,
    *, resolvers: Sequence[IPNetwork] = (), sources: Sequence[IPNetwork] | None = None,
) -> str:
    """The ``iptables-restore`` (``ip6tables-restore`` for 6) input that
    enforces ``policy`` in the sandbox's own namespace, on what it sends.

    ``blocked``: networks denied beyond the classes. ``sources``: the
    sandbox's own addresses, where the host recognises its traffic by them:
    a packet sent from any other (a socket bound with IP_FREEBIND) is dropped,
    so no sandbox passes for another. Replies to connections made into the
    sandbox (a preview URL) pass.
    """
    reach = Reach(policy, resolvers, list(blocked))
    lines = []
    if sources is not None:
        lines += ["*raw", ":PREROUTING ACCEPT [0:0]", ":OUTPUT ACCEPT [0:0]",
                  "-A OUTPUT -o lo -j RETURN"]
        lines += [f"-A OUTPUT -s {n} -j RETURN" for n in sources if n.version == version]
        if version == 6:
            # Its link-local addresses, and none while it gets one, only
            # to its link: the host's rules know the sandbox by its global
            # address, so a packet from its link-local one (a socket bound
            # to it) to a routed address would pass them unrecognised.
            lines += [f"-A OUTPUT -s {source} -d {destination} -j RETURN"
                      for source, destination in _LINK_SCOPE]
        lines += ["-A OUTPUT -j DROP", "COMMIT"]
    lines += [
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
        lines += _neighbour_discovery("OUTPUT", "ACCEPT", version)
        lines += reach.exceptions("OUTPUT", "ACCEPT", version)
        lines += [f"-A OUTPUT -d {n} -j REJECT" for n in reach.denied(version)]
        if isinstance(policy, AllowList):
            lines.append("-A OUTPUT -j REJECT")
    lines.append("COMMIT")
    return "\n".join(lines) + "\n"


_RESTORE: dict[Version, str] = {4: "iptables-restore", 6: "ip6tables-restore"}
_TABLES: dict[Version, str] = {4: "iptables", 6: "ip6tables"}


def apply_in_namespace(
    pid: int, policy: NetworkPolicy, blocked: Iterable[IPNetwork],
    *, resolvers: Sequence[IPNetwork] = (), sources: Sequence[IPNetwork] | None = None,
) -> None:
    """Install ``policy`` in the network namespace of process ``pid``, from the
    host (``nsenter``), IPv4 and IPv6 alike. Raises OSError or
    subprocess.CalledProcessError when it cannot."""
    blocked = list(blocked)
    for version, tool in _RESTORE.items():
        subprocess.run(
            ["nsenter", "-t", str(pid), "-n", tool],
            input=ruleset(policy, blocked, version, resolvers=resolvers, sources=sources),
            capture_output=True, text=True, timeout=30, check=True,
        )


def installed_rules(pid: int) -> str:
    """The rules in force in ``pid``'s network namespace (``iptables -S``, both families)."""
    out = []
    for tool in _TABLES.values():
        out.append(subprocess.run(
            ["nsenter", "-t", str(pid), "-n", tool, "-S"], capture_output=True, text=True,
            timeout=30, check=True,
        ).stdout)
    return "".join(out)


# -- on the host ----------------------------------------------------------------------------


@dataclass(frozen=True)
class HostMatch:
    """How the host recognises a sandbox's traffic: the host interface it
    arrives on (a veth of its own), or its addresses (on a shared bridge, with
    the namespace's rules dropping any other source)."""

    interfaces: Sequence[str] = ()
    sources: Sequence[IPNetwork] = ()

    def matches(self, version: Version) -> list[str]:
        out = [f"-i {name}" for name in self.interfaces]
        out += [f"-s {n}" for n in self.sources if n.version == version]
        return out


def guard_chains(key: str) -> tuple[str, str]:
    """The host chains holding ``key``'s rules: what it may send to the host
    itself (INPUT) and through it (FORWARD). A name of at most 28 characters
    whatever the key."""
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return f"HUTCH-I-{digest}", f"HUTCH-F-{digest}"


_GUARD_CHAIN = re.compile(r"^HUTCH-[IF]-[0-9a-f]{12}$")
_JUMP_FROM = ("INPUT", "FORWARD", "DOCKER-USER")


def host_ruleset(
    key: str, reach: Reach, match: HostMatch, version: Version, listing: str
) -> str:
    """The ``iptables-restore --noflush`` input that (re)installs ``key``'s
    chains and the jumps to them, given the host's rules now (``iptables -S``):
    it removes the jumps a previous install left, and those of another key
    that match the same traffic (a sandbox gone without its close, whose
    address or interface this one has now)."""
    into_host, through_host = guard_chains(key)
    matches = match.matches(version)
    lines = ["*filter"]
    lines += _removals(key, listing, matches)
    if matches:
        lines += [f":{into_host} - [0:0]", f":{through_host} - [0:0]"]
        for chain in (into_host, through_host):
            lines.append(f"-A {chain} -m conntrack --ctstate ESTABLISHED,RELATED -j RETURN")
        if reach.policy == "none":
            lines += [f"-A {into_host} -j REJECT", f"-A {through_host} -j REJECT"]
        else:
            lines += _neighbour_discovery(into_host, "RETURN", version)
            lines += reach.exceptions(into_host, "RETURN", version)
            lines.append(f"-A {into_host} -j REJECT")  # the host itself, any address
            # Neighbour discovery between containers on one bridge passes
            # FORWARD (bridged, with br_netfilter): without it an allowed
            # neighbour is unreachable over IPv6; it is never routed on.
            lines += _neighbour_discovery(through_host, "RETURN", version)
            lines += reach.exceptions(through_host, "RETURN", version)
            lines += [f"-A {through_host} -o {name} -j REJECT" for name in SANDBOX_INTERFACES]
            lines += [f"-A {through_host} -d {n} -j REJECT" for n in reach.denied(version)]
            if isinstance(reach.policy, AllowList):
                lines.append(f"-A {through_host} -j REJECT")
        forward = ["FORWARD"]
        if "-N DOCKER-USER" in listing.splitlines():
            # Docker puts its jump to DOCKER-USER first again when it restarts,
            # and accepts its bridges' traffic right after: be there too.
            forward.append("DOCKER-USER")
        comment = f"-m comment --comment hutch:{_safe_comment(key)}"
        for rule in matches:
            lines.append(f"-I INPUT 1 {rule} {comment} -j {into_host}")
            lines += [f"-I {chain} 1 {rule} {comment} -j {through_host}" for chain in forward]
    lines.append("COMMIT")
    return "\n".join(lines) + "\n"


def _safe_comment(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.:-]", "_", key)[:200]


def _removals(key: str, listing: str, matches: Sequence[str]) -> list[str]:
    """Delete the jumps to ``key``'s chains, and the other keys' jumps that
    match one of ``matches``; then ``key``'s chains themselves if no match
    is left to install them again."""
    own = guard_chains(key)
    wanted = {tuple(shlex.split(m)) for m in matches}
    out = []
    for line in listing.splitlines():
        words = shlex.split(line)
        if len(words) < 4 or words[0] != "-A" or words[1] not in _JUMP_FROM:
            continue
        target = words[words.index("-j") + 1] if "-j" in words else ""
        if not _GUARD_CHAIN.match(target):
            continue
        pairs = {tuple(words[i:i + 2]) for i in range(2, len(words) - 1)}
        if target in own or pairs & wanted:
            out.append(shlex.join(["-D", *words[1:]]))
    if not matches:
        existing = set(listing.splitlines())
        for chain in own:
            if f"-N {chain}" in existing:
                out += [f"-F {chain}", f"-X {chain}"]
    return out


def _listing(version: Version) -> str:
    return subprocess.run(
        [_TABLES[version], "-w", "-S"], capture_output=True, text=True, timeout=30, check=True,
    ).stdout


def _restore(version: Version, text: str) -> None:
    subprocess.run(
        [_RESTORE[version], "-w", "--noflush"], input=text, capture_output=True, text=True,
        timeout=30, check=True,
    )


def _apply(version: Version, build: Callable[[str], str]) -> None:
    """Read the host's rules and apply what ``build`` makes of them; again on a
    failure (three tries in all, at once), as another hutch may have changed
    them in between; the last failure is raised as it is."""
    from tenacity import Retrying, retry_if_exception_type, stop_after_attempt

    for attempt in Retrying(stop=stop_after_attempt(3), reraise=True,
                            retry=retry_if_exception_type(subprocess.CalledProcessError)):
        with attempt:
            _restore(version, build(_listing(version)))


def guard_host(key: str, reach: Reach, match: HostMatch) -> None:
    """Install (or replace) the host's rules for the sandbox ``key``, both
    families. Raises OSError or subprocess.CalledProcessError when it cannot."""
    _each_family(lambda version: _apply(
        version, functools.partial(_ruleset_for, key, reach, match, version)))


def _each_family(work: Callable[[Version], None]) -> None:
    """``work`` for IPv4 and IPv6 at once (each waits on its own tools; a
    sandbox's create waits on both)."""
    with concurrent.futures.ThreadPoolExecutor(len(_TABLES)) as pool:
        for done in [pool.submit(work, version) for version in _TABLES]:
            done.result()


def guarded_keys() -> set[str]:
    """The keys whose host rules are installed (read from their jumps' comments)."""
    keys = set()
    for version in _TABLES:
        for line in _listing(version).splitlines():
            if "hutch:" not in line:
                continue  # the host's and the Engine's own: shlex costs ~70 us a line
            words = shlex.split(line)
            if "--comment" in words and "-j" in words:
                comment = words[words.index("--comment") + 1]
                target = words[words.index("-j") + 1]
                if comment.startswith("hutch:") and _GUARD_CHAIN.match(target):
                    keys.add(comment.removeprefix("hutch:"))
    return keys


def unguard_host(key: str) -> None:
    """Remove the host's rules for the sandbox ``key`` (none there: nothing to do)."""
    _each_family(lambda version: _apply(
        version, functools.partial(_ruleset_for, key, Reach("none"), HostMatch(), version)))


def _ruleset_for(key: str, reach: Reach, match: HostMatch, version: Version, listing: str) -> str:
    return host_ruleset(key, reach, match, version, listing)
