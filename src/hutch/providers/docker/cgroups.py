"""A container's cgroups as the host sees them: where they are, and what the
kernel counted in them (OOM kills, forks refused at the pids limit)."""

from __future__ import annotations

import os

from ..agent import workload as _workload


def cgroup_dir(container_id: str, controller: str) -> str | None:
    """The host directory of a container's cgroup for ``controller``
    (cgroup v1 with the cgroupfs driver, or v2 with either driver)."""
    for path in (
        f"/sys/fs/cgroup/{controller}/docker/{container_id}",
        f"/sys/fs/cgroup/system.slice/docker-{container_id}.scope",
        f"/sys/fs/cgroup/docker/{container_id}",
    ):
        if os.path.isdir(path):
            return path
    return None


def frozen(container_id: str) -> bool:
    """Whether the kernel holds the container frozen (a pause): the truth
    the Engine's flag lags."""
    return frozen_state(container_id) is True


def frozen_state(container_id: str) -> bool | None:
    """Whether the kernel holds the container frozen; None where its
    freezer cannot be read here (no cgroup of it in this host's view)."""
    where = cgroup_dir(container_id, "freezer")
    if where is None:
        return None
    for name, is_frozen in (("freezer.state", lambda s: s.strip() == "FROZEN"),  # v1
                            ("cgroup.events", lambda s: "frozen 1" in s.splitlines())):  # v2
        try:
            with open(os.path.join(where, name)) as fh:
                return bool(is_frozen(fh.read()))
        except OSError:
            continue
    return None


def oom_kills(container_id: str) -> int | None:
    """How many processes the OOM killer has killed in the container so far."""
    where = cgroup_dir(container_id, "memory")
    if where is None:
        return None
    for name in ("memory.events", "memory.oom_control"):  # v2, v1
        try:
            with open(os.path.join(where, name)) as fh:
                count = _workload.oom_kill_count(fh.read())
        except (OSError, ValueError):
            continue
        if count is not None:
            return count
    return None


def pids_refusals(container_id: str) -> int | None:
    """How many forks the container's pids limit has refused so far (the
    kernel's count, ``pids.events``), or None where it cannot be read."""
    where = cgroup_dir(container_id, "pids")
    if where is None:
        return None
    try:
        with open(os.path.join(where, "pids.events")) as fh:
            return _workload.event_count(fh.read(), "max")
    except (OSError, ValueError):
        return None
