"""The workload's cgroup: room of the agent's own beside what it runs.

The agent is a Go program in the sandbox's cgroups; its threads count as
tasks and its memory as the sandbox's. Were what it runs held to the same
limits, a fork bomb would leave it no thread to answer with. So, on cgroup v1
(one hierarchy a controller, as this host has), the sandbox's cgroups get the
caller's limits plus a small reserve, and a child of each, the workload's
cgroup, gets the caller's limits: every command the agent starts runs in it
(see ``go/workload.go``), the agent itself in the reserve above.

The workload has a ``cpu`` cgroup of its own too, with no limit of its own:
the sandbox's CPU limit stays on the parent and bounds both. Its point is
the weight: a child cgroup competes with its parent's threads as one
entity, so 50 busy loops (or ``make -j64``, a fork bomb's thousand
processes) share one agent thread's weight between them, where beside the
agent in one cgroup they would have left it 1/51 of the sandbox's CPU and
every request, a kill included, waiting behind them.

The host makes the child (the sandbox cannot: its cgroup file system is
read-only, or absent) and hands the agent descriptors of its ``tasks``
files, which the agent uses once and closes. Elsewhere (the unified v2
hierarchy) nothing is split: the sandbox keeps one cgroup, as before.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping

from ..._errors import ProviderError

CGROUP_ROOT = "/sys/fs/cgroup"
#: The workload's cgroup, below the sandbox's in each controller's hierarchy.
WORKLOAD_NAME = "hutch-workload"
#: The controllers it is split in (the freezer stays the sandbox's: a pause
#: holds everything; the CPU limit stays on the sandbox's cpu cgroup).
CONTROLLERS = ("pids", "memory", "cpu")
#: Tasks above the caller's pids limit, for the agent's threads (Go starts
#: one per blocking call; ~10 is usual) and hutch's own probes.
PIDS_RESERVE = 64
#: Bytes above the caller's memory limit, for the agent (~10 MiB resident).
MEMORY_RESERVE = 64 << 20
_UNLIMITED = 1 << 60


def splittable() -> bool:
    """Whether this host's cgroups let the workload have a cgroup of its own
    (cgroup v1: threads can be placed one by one)."""
    return not os.path.exists(os.path.join(CGROUP_ROOT, "cgroup.controllers")) and all(
        os.path.isdir(os.path.join(CGROUP_ROOT, c)) for c in CONTROLLERS
    )


def _write(path: str, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as fh:
            return int(fh.read())
    except (OSError, ValueError):
        return None


def workload_dirs(sandbox_dirs: Mapping[str, str]) -> dict[str, str]:
    """The workload's cgroup directories, from the sandbox's (by controller)."""
    return {c: os.path.join(sandbox_dirs[c], WORKLOAD_NAME) for c in CONTROLLERS}


def make_workload(
    sandbox_dirs: Mapping[str, str], *, pids: int | None, memory: int | None
) -> dict[str, str]:
    """Make (or find) the workload's cgroups below the sandbox's and give them
    the caller's limits; return their directories by controller."""
    dirs = workload_dirs(sandbox_dirs)
    try:
        for directory in dirs.values():
            os.makedirs(directory, exist_ok=True)
        if pids is not None:
            _write(os.path.join(dirs["pids"], "pids.max"), str(pids))
        if memory is not None:
            mem = dirs["memory"]
            _write(os.path.join(mem, "memory.limit_in_bytes"), str(memory))
            # Swap, where the kernel accounts it: the sandbox's allowance less
            # the agent's reserve, so that the workload cannot swap into it.
            parent = sandbox_dirs["memory"]
            parent_memsw = _read_int(os.path.join(parent, "memory.memsw.limit_in_bytes"))
            parent_mem = _read_int(os.path.join(parent, "memory.limit_in_bytes"))
            if parent_memsw is not None and parent_mem is not None and parent_memsw < _UNLIMITED:
                with contextlib.suppress(OSError):
                    _write(os.path.join(mem, "memory.memsw.limit_in_bytes"),
                           str(max(memory, parent_memsw - (parent_mem - memory))))
    except OSError as exc:
        raise ProviderError(f"cannot set up the workload's cgroup below "
                            f"{sandbox_dirs.get('pids')}: {exc}") from None
    return dirs


def open_task_files(dirs: Mapping[str, str]) -> list[int]:
    """Descriptors of the workload cgroups' ``tasks`` files, for the agent."""
    fds: list[int] = []
    try:
        for directory in dirs.values():
            fds.append(os.open(os.path.join(directory, "tasks"), os.O_WRONLY | os.O_CLOEXEC))
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        raise ProviderError(f"cannot open the workload's cgroup: {exc}") from None
    return fds


def event_count(text: str, name: str) -> int | None:
    """The count ``name`` of a cgroup's ``KEY VALUE`` lines (``memory.events``,
    ``memory.oom_control``, ``pids.events``), or None where it has none."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return int(value)
    return None


def oom_kill_count(text: str) -> int | None:
    """The ``oom_kill`` count of a memory cgroup's ``memory.events`` (v2) or
    ``memory.oom_control`` (v1) text, or None where it has none."""
    return event_count(text, "oom_kill")


def oom_counted_since(read: Callable[[], int | None], before: int) -> bool:
    """Whether the OOM kill count ``read`` gives has passed ``before``, given
    a moment to: the kernel counts a kill after it sends the SIGKILL, so a
    victim reaped at once is seen dead before its kill is counted. Blocks up
    to 100 ms; only a SIGKILLed command asks."""
    for attempt in range(21):
        now = read()
        if now is not None and now > before:
            return True
        if attempt < 20:
            time.sleep(0.005)
    return False


def oom_kills(dirs: Mapping[str, str]) -> int:
    """The OOM kills counted in the workload's memory cgroup (v1 counts a kill
    only where it happened, not in the cgroups above)."""
    try:
        with open(os.path.join(dirs["memory"], "memory.oom_control")) as fh:
            return oom_kill_count(fh.read()) or 0
    except (OSError, ValueError):
        return 0


def remove_cgroup(directory: str) -> None:
    """Remove a cgroup whose processes are gone, waiting up to a second for
    the kernel to finish accounting their exits (until then it is busy)."""
    for _ in range(100):
        try:
            os.rmdir(directory)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)  # the last exits are still being accounted


def remove_workload(sandbox_dirs: Mapping[str, str]) -> None:
    """Remove the workload's cgroups (empty by now) before the sandbox's."""
    for directory in workload_dirs(sandbox_dirs).values():
        remove_cgroup(directory)
