"""``docker``: one container per sandbox, kept alive by ``sleep infinity`` (or
hutch's agent), its working directory bind-mounted from the host at the mount
point. The docker SDK is imported lazily, so importing this package (for its
config model) costs nothing when docker is not used.

The modules, by responsibility: :mod:`.sandbox` (the backend).
:mod:`.netguard` (the network policy's rules) and :mod:`.outside` (a
container gone outside hutch's hands).
"""

from __future__ import annotations

from .._docker_engine import engine
from .sandbox import (
    DockerConfig,
    DockerSandbox,
    list_managed_containers,
    read_ahead,
    wait_until_started,
)

__all__ = [
    "DockerConfig",
    "DockerSandbox",
    "engine",
    "list_managed_containers",
    "read_ahead",
    "wait_until_started",
]
