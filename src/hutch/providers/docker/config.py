"""A docker sandbox's settings (:class:`DockerConfig`) and what they may hold."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, ConfigDict, Field

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
    keeps_dropped,
    no_key_prefix,
    one_of,
    parse_bytes,
)

#: Capabilities agents have no use for, dropped on top of Docker's defaults.
#: Package managers (apt, pip) and useradd still work as root without them.
DEFAULT_CAP_DROP = ["NET_RAW", "MKNOD", "AUDIT_WRITE", "SYS_CHROOT", "SETFCAP"]


#: Ceilings of the settings, as the kernel takes them (pid_max's own ceiling).
MAX_CPUS = 4096.0
MAX_PIDS = 4 * 1024 * 1024


def _bind_target(path: str) -> str:
    # The Engine reads a bind as "host:container:options".
    if ":" in path or "," in path:
        raise ValueError(f"{path!r}: a mount point has no ':' or ','")
    return path


class DockerConfig(ProviderSettings):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    type: Literal["docker"] = "docker"
    image: ImageName = "hutch-test:bookworm"
    #: Where the sandbox's working directory is mounted inside the container
    #: (a directory of its own: never /proc, /sys, /dev or a system directory).
    mount_point: Annotated[SandboxDirectory, AfterValidator(_bind_target)] = "/workspace"
    #: Host directory bound at the mount point; a fresh one under hutch's data
    #: directory when unset (and then removed with the sandbox).
    host_workdir: Annotated[
        str | None, ReachesHost("binds a host directory of the caller's choosing"), HostPath()
    ] = None
    network_mode: Annotated[
        str, ReachesHost("shares a network namespace not its own (the host's or another "
                         "container's)", one_of("bridge", "none", "default")),
    ] = "bridge"
    #: What the sandbox may reach: ``"none"``, ``"all"`` (but the metadata
    #: address, the host's own addresses and other sandboxes), or
    #: ``{"allow": [CIDR, ...]}``. See hutch.providers.network.
    network: NetworkPolicy = "all"
    #: Extra bind mounts, ``host:container[:ro]``.
    mounts: Annotated[list[str], ReachesHost("binds host paths into the sandbox")] = []
    #: Memory limit, as Docker takes it (``512m``, ``2g``).
    memory: Annotated[MemorySize | None, Limit("memory", parse_bytes, format_bytes)] = None
    #: Size cap on the working directory hutch makes (``10g``): a file system
    #: of its own, nosuid and nodev, loop-mounted (needs root). Not applied
    #: to a ``host_workdir``, nor to what is written outside the mount point.
    disk: Annotated[DiskSize | None, Limit("disk", parse_bytes, format_bytes)] = None
    #: CPU quota in CPUs (``1.5``).
    cpus: Annotated[float | None, Limit("cpus"), NotBool] = Field(default=None, gt=0, le=MAX_CPUS)
    pids_limit: Annotated[int, Limit("pids", int, int), NotBool] = Field(
        default=1024, gt=0, le=MAX_PIDS
    )
    pull_if_missing: bool = True
    env: dict[str, str] = {}
    #: Container labels; hutch's own (``hutch.*``) say what it manages and
    #: keeps, so through the daemon they are the operator's.
    labels: Annotated[dict[str, str], ReachesHost(
        "sets hutch's own labels (hutch.*), which say which containers hutch manages "
        "and keeps", no_key_prefix("hutch."),
    )] = {}
    #: Keep the container after the sandbox closes (and log how to reach it).
    preserve: Annotated[bool, ReachesHost(
        "keeps the container on the host after the sandbox ends, past hutch's cleanup",
        one_of(False),
    )] = False
    cap_drop: Annotated[
        list[str], ReachesHost(
            "gives back capabilities hutch drops (raw sockets, mknod, ...)",
            keeps_dropped(DEFAULT_CAP_DROP),
        ),
    ] = Field(default_factory=lambda: list(DEFAULT_CAP_DROP))
    #: Docker's ``no-new-privileges``: setuid programs (sudo) cannot raise a
    #: user's privileges inside the container. Off for images whose user has
    #: passwordless sudo (E2B's templates' shape): a caller may run as root
    #: in the container anyway, so it gives nothing beyond that.
    no_new_privileges: bool = True
    #: Docker's init (tini) as PID 1, the keeper under it: orphans a kill
    #: leaves behind are reaped, where ``sleep`` as PID 1 would keep them as
    #: zombies (filling the pids limit, and looking busy forever).
    init: bool = True
    #: What executes and moves files: ``agent`` (hutch's agent as the keeper,
    #: on a unix socket: about a millisecond a call), ``native`` (docker exec
    #: and the archive API: ~50 ms a call), or ``auto``: the agent where it
    #: can be built and started, else native.
    runtime: Literal["auto", "agent", "native"] = "auto"
