"""A sandbox's pids cgroup, held by hutch so that its count outlives runsc.

runsc makes the cgroups of a container it runs and removes them as it ends.
The count of forks the host refused at ``pids_limit`` (``pids.events``) went
with them, and a sandbox whose kernel died of its process limit was told
only by its panic's first line, which is not always the refused fork: the
sentry sometimes trips on the half-made address space first ("trying to
use inactive address space?"). A cgroup that already exists is joined, left
as it is and kept by runsc (its own is only what it made), so hutch makes
the pids one itself, with the limit, before each start or restore. The
count is read (:func:`refused_forks`) where the sandbox's end is told, and
the cgroup removed with the container (:func:`release`).

Only where the host mounts cgroup v1's pids hierarchy (this build of runsc
runs its sandboxes under v1 here); elsewhere runsc makes it as before.
"""

from __future__ import annotations

import contextlib
import os

from ..agent import workload as _workload
from . import bundle

PIDS_ROOT = "/sys/fs/cgroup/pids"


def _pids_dir(container: str) -> str:
    return PIDS_ROOT + bundle.cgroup_path(container)


def hold(container: str, bundle_dir: str) -> None:
    """The pids cgroup ``container`` will run in, made with its bundle's
    limit (blocking). Nothing where the bundle sets no limit (no fork is
    refused to count) or the host has no v1 pids hierarchy to make it in."""
    limit = bundle.pids_limit(bundle_dir)
    if limit is None or not os.path.isdir(PIDS_ROOT):
        return
    where = _pids_dir(container)
    try:
        os.makedirs(where, exist_ok=True)
        with open(os.path.join(where, "pids.max"), "w") as fh:
            fh.write(str(limit))
    except OSError:
        # Not ours to make (a read-only or delegated hierarchy): runsc makes
        # it, and the end is told from the panic alone.
        with contextlib.suppress(OSError):
            os.rmdir(where)


def refused_forks(container: str) -> int | None:
    """How many forks the host refused ``container`` at its pids limit (the
    kernel's count), or None where hutch holds no cgroup of it."""
    try:
        with open(os.path.join(_pids_dir(container), "pids.events")) as fh:
            return _workload.event_count(fh.read(), "max")
    except (OSError, ValueError):
        return None


def release(sandbox_id: str) -> None:
    """The pids cgroups of each container of the sandbox (``ID`` and each
    restore's ``N+ID``) removed, those no process is left in (blocking,
    idempotent)."""
    parent = os.path.dirname(_pids_dir(sandbox_id))
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        if name == sandbox_id or name.endswith("+" + sandbox_id):
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(parent, name))
