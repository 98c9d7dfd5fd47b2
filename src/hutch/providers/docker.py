"""``docker``: one container per sandbox, kept alive by ``sleep infinity``,
its working directory bind-mounted from the host at the mount point.

The docker SDK is imported lazily, so importing this module (for its config
model) costs nothing when docker is not used.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

#: Capabilities agents have no use for, dropped on top of Docker's defaults.
#: Package managers (apt, pip) and useradd still work as root without them.
DEFAULT_CAP_DROP = ["NET_RAW", "MKNOD", "AUDIT_WRITE", "SYS_CHROOT", "SETFCAP"]


class DockerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["docker"] = "docker"
    image: str = "hutch-test:bookworm"
    #: Where the sandbox's working directory is mounted inside the container.
    mount_point: str = "/workspace"
    #: Host directory bound at the mount point; a fresh one under hutch's data
    #: directory when unset.
    host_workdir: str | None = None
    network_mode: str = "bridge"
    #: Extra bind mounts, ``host:container[:ro]``.
    mounts: list[str] = []
    #: Memory limit, as Docker takes it (``512m``, ``2g``).
    memory: str | None = None
    #: CPU quota in CPUs (``1.5``).
    cpus: float | None = Field(default=None, gt=0)
    pids_limit: int = Field(default=1024, gt=0)
    pull_if_missing: bool = True
    env: dict[str, str] = {}
    labels: dict[str, str] = {}
    #: Keep the container after the sandbox closes (and log how to reach it).
    preserve: bool = False
    cap_drop: list[str] = Field(default_factory=lambda: list(DEFAULT_CAP_DROP))
