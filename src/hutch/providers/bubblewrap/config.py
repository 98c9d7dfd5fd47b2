"""A bubblewrap sandbox's settings (:class:`BubblewrapConfig`) and what they may hold."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from ..._errors import InvalidArgument
from ..base import ProviderSettings
from ..network import NetworkPolicy
from ..policy import (
    DiskSize,
    HostPath,
    ImageName,
    Limit,
    MemorySize,
    NotBool,
    ReachesHost,
    SandboxDirectory,
    format_bytes,
    parse_bytes,
)

_MAX_BYTES = 1 << 50


def parse_size(value: str | int | None, what: str) -> int | None:
    """Bytes from ``512m``, ``2g``, ``1.5G`` or a plain number."""
    if value is None:
        return None
    try:
        number = int(parse_bytes(value))
    except ValueError as exc:
        raise InvalidArgument(f"{what}: {exc}") from None
    if not 0 < number <= _MAX_BYTES:
        raise InvalidArgument(f"{what} {value!r} is out of range (1 byte to 1 PiB)")
    return number


class BubblewrapConfig(ProviderSettings):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    type: Literal["bubblewrap"] = "bubblewrap"
    #: A host directory to use as the (read-only, shared) root file system.
    rootfs: Annotated[
        str | None, ReachesHost("uses a host directory as the sandbox's root file system"),
        HostPath(),
    ] = None
    #: A hutch image, or a Docker image exported once and cached; the test
    #: image when neither this nor ``rootfs`` is set.
    image: ImageName | None = None
    #: The working directory inside (made if missing; a directory of its own:
    #: never /proc, /sys, /dev or a system directory).
    workdir: SandboxDirectory = "/workspace"
    #: Memory limit (``512m``, ``2g``, or bytes).
    memory: Annotated[MemorySize | None, Limit("memory", parse_bytes, format_bytes)] = None
    pids_limit: Annotated[int, Limit("pids", int, int), NotBool] = Field(
        default=1024, gt=0, le=4_194_304
    )
    #: CPU quota in CPUs (``1.5``).
    cpus: Annotated[float | None, Limit("cpus"), NotBool] = Field(default=None, gt=0, le=1024)
    #: What executes and moves files: ``agent`` (hutch's agent as the keeper,
    #: on a unix socket: about a millisecond a call), ``native`` (each exec
    #: joins the namespaces with nsenter + bwrap), or ``auto``: the agent
    #: where it can be had here.
    runtime: Literal["auto", "agent", "native"] = "auto"
    #: ``none`` (a loopback of its own), ``all``, or ``{"allow": [CIDR, ...]}``:
    #: a veth of its own, masqueraded out; the metadata address, the host's
    #: addresses and other sandboxes unreachable unless allowed.
    network: NetworkPolicy = "none"
    #: Cap on what the sandbox may write while it runs (its tmpfs upper layer).
    disk: Annotated[DiskSize, Limit("disk", parse_bytes, format_bytes)] = "4g"
    env: dict[str, str] = {}
    hostname: str = Field(default="hutch", pattern=r"^[A-Za-z0-9][A-Za-z0-9.-]{0,62}$")
    #: End with the process that made it (``--die-with-parent``): for
    #: in-process use that must leave nothing behind. A daemon's sandboxes are
    #: not ephemeral, so that a restarted daemon adopts them.
    ephemeral: bool = False
