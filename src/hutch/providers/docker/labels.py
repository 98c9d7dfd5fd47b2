"""The names hutch gives what it makes on the Docker Engine: the labels of its
containers and images, and the repositories of its suspend and snapshot images."""

from __future__ import annotations

import hashlib
from typing import Any

from ..._paths import hutch_home
from .._docker_engine import engine

MANAGED_LABEL = "hutch.managed"
#: The hutch home (data directory) of the process that made a container or a
#: snapshot image: reconciliation only ever touches its own.
HOME_LABEL = "hutch.home"
PRESERVE_LABEL = "hutch.preserve"
SNAPSHOT_LABEL = "hutch.snapshot"
SANDBOX_LABEL = "hutch.sandbox_id"
SUSPENDED_REPOSITORY = "hutch-suspended"


def snapshot_repository() -> str:
    """Where this hutch home's snapshot images are tagged (one repository
    per home, so that two daemons never take each other's for orphans)."""
    return "hutch-snapshot-" + hashlib.sha256(hutch_home().encode()).hexdigest()[:12]


def list_managed_containers(*, with_labels: bool = False) -> list[tuple[str, str, Any]]:
    """(sandbox_id, container_id, status) of every container hutch made;
    with ``with_labels`` the third item is the container's labels instead."""
    containers = engine().containers(all=True, filters={"label": f"{MANAGED_LABEL}=1"})
    return [
        (c["Labels"].get(SANDBOX_LABEL, ""), c["Id"], c["Labels"] if with_labels else c["State"])
        for c in containers
    ]
