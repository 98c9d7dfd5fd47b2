"""``docker``: one container per sandbox, kept alive by ``sleep infinity`` (or
hutch's agent), its working directory bind-mounted from the host at the mount
point. The docker SDK is imported lazily, so importing this package (for its
config model) costs nothing when docker is not used.

Its modules, by responsibility: :mod:`.config` (the settings), :mod:`.labels`
(the names of what hutch makes on the Engine), :mod:`.cgroups`, :mod:`.freeze`
(pauses kept apart from exec starts), :mod:`.provisioning` (the container and
its agent), :mod:`.process` (execs), :mod:`.files` (the archive API, grep),
:mod:`.snapshots` (suspend and snapshot images, orphans), :mod:`.watch` (the
Engine's events), :mod:`.netguard` (the network policy's rules),
:mod:`.outside` (a container gone outside hutch's hands), and
:mod:`.sandbox`, the backend that ties them together. Every Engine call goes
through :mod:`hutch.providers._docker_engine`.
"""

from __future__ import annotations

from .._docker_engine import engine
from .config import DockerConfig
from .labels import list_managed_containers
from .process import read_ahead, wait_until_started
from .sandbox import DockerSandbox

__all__ = [
    "DockerConfig",
    "DockerSandbox",
    "engine",
    "list_managed_containers",
    "read_ahead",
    "wait_until_started",
]
