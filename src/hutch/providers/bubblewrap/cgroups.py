"""Resource limits and the freezer for one sandbox, through cgroups.

cgroup v1 (one hierarchy per controller: memory, pids, cpu, freezer), as this
host has, or the unified v2 hierarchy where the host has that. Every process
of a sandbox (its keeper and every exec) is born in the sandbox's cgroups or
joins them before it starts the sandbox (see :meth:`SandboxCgroup.enter_thread`
and ``JOIN_AND_EXEC``), so a fork bomb meets the pids limit
(``fork`` fails with EAGAIN), a memory hog meets the OOM killer, and pause is
one write to the freezer.

On cgroup v1 the sandbox's limits are split (see :mod:`..agent.workload`):
what runs in the sandbox (every exec, and what it starts) joins the
workload's cgroups below the sandbox's, which hold the caller's pids and
memory limits; the keeper (hutch's agent, or bwrap's init and ``sh``) stays
in the sandbox's own, which add a small reserve, so that a fork bomb or a
memory hog never takes the room the keeper needs to answer.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

from ..._errors import ProviderError
from ..agent import workload as _workload

CGROUP_ROOT = "/sys/fs/cgroup"
_V1_CONTROLLERS = ("memory", "pids", "cpu", "freezer")
_CPU_PERIOD_US = 100_000

#: The host-side launcher: join the cgroups named in $HUTCH_CGROUP_PROCS, then
#: exec the rest of argv (bwrap, or nsenter + bwrap), so that nothing the
#: sandbox starts ever runs outside its limits, not even for an instant.
#: It writes ``0`` (itself) to each v1 ``tasks`` file (see :meth:`SandboxCgroup.join_file`).
JOIN_AND_EXEC = 'for f in $HUTCH_CGROUP_PROCS; do echo 0 > "$f" || exit 125; done; exec "$@"'


def unified() -> bool:
    """Whether the host runs the cgroup v2 hierarchy alone."""
    return os.path.exists(os.path.join(CGROUP_ROOT, "cgroup.controllers"))


def _write(path: str, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


def _read(path: str) -> str:
    with open(path) as fh:
        return fh.read()


def thread_home() -> list[str]:
    """The ``tasks`` files of the calling thread's own v1 cgroups (of the
    controllers sandboxes use): where :func:`leave_thread` moves it back to."""
    if unified():
        return []
    home: dict[str, str] = {}
    with open("/proc/thread-self/cgroup") as fh:
        for line in fh:
            _, names, path = line.rstrip("\n").split(":", 2)
            for name in names.split(","):
                if name in _V1_CONTROLLERS:
                    home[name] = os.path.join(CGROUP_ROOT, name, path.lstrip("/"), "tasks")
    return [home[c] for c in _V1_CONTROLLERS if c in home]


def leave_thread(home: list[str]) -> None:
    """Move the calling thread back to ``home`` (see :meth:`SandboxCgroup.enter_thread`)."""
    for tasks in home:
        _write(tasks, "0")


class SandboxCgroup:
    """The cgroups of one sandbox, ``hutch/<sandbox id>`` in each hierarchy."""

    def __init__(self, sandbox_id: str) -> None:
        self.name = f"hutch/{sandbox_id}"
        self.v2 = unified()
        if self.v2:
            self._dirs = {"unified": os.path.join(CGROUP_ROOT, self.name)}
        else:
            self._dirs = {c: os.path.join(CGROUP_ROOT, c, self.name) for c in _V1_CONTROLLERS}
        #: The workload's cgroups (pids, memory, cpu) below the sandbox's, where
        #: the limits are split (cgroup v1); None where they are not.
        self.workload: dict[str, str] | None = (
            None if self.v2 or not _workload.splittable() else _workload.workload_dirs(self._dirs)
        )

    def _dir(self, controller: str) -> str:
        return self._dirs["unified" if self.v2 else controller]

    # -- setup -------------------------------------------------------------------
    def create(self, *, memory: int | None, pids: int | None, cpus: float | None) -> None:
        try:
            if self.v2:
                self._create_v2(memory, pids, cpus)
            else:
                self._create_v1(memory, pids, cpus)
        except OSError as exc:
            self.remove()
            raise ProviderError(f"cannot set up the cgroups of {self.name}: {exc}") from None

    def _create_v1(self, memory: int | None, pids: int | None, cpus: float | None) -> None:
        for directory in self._dirs.values():
            os.makedirs(directory, exist_ok=True)
        caller_memory, caller_pids = memory, pids
        if self.workload is not None:
            # The caller's limits are the workload's; the keeper's reserve on top.
            memory = None if memory is None else memory + _workload.MEMORY_RESERVE
            pids = None if pids is None else pids + _workload.PIDS_RESERVE
        mem = self._dirs["memory"]
        if memory is not None:
            _write(f"{mem}/memory.limit_in_bytes", str(memory))
            # No swap to escape into where the kernel accounts it.
            with contextlib.suppress(OSError):
                _write(f"{mem}/memory.memsw.limit_in_bytes", str(memory))
        if pids is not None:
            _write(f"{self._dirs['pids']}/pids.max", str(pids))
        if cpus is not None:
            cpu = self._dirs["cpu"]
            _write(f"{cpu}/cpu.cfs_period_us", str(_CPU_PERIOD_US))
            _write(f"{cpu}/cpu.cfs_quota_us", str(max(1000, int(cpus * _CPU_PERIOD_US))))
        if self.workload is not None:
            _workload.make_workload(self._dirs, pids=caller_pids, memory=caller_memory)

    def _create_v2(self, memory: int | None, pids: int | None, cpus: float | None) -> None:
        parent = os.path.dirname(self._dirs["unified"])
        os.makedirs(parent, exist_ok=True)
        for level in (CGROUP_ROOT, parent):
            with contextlib.suppress(OSError):
                _write(f"{level}/cgroup.subtree_control", "+memory +pids +cpu")
        directory = self._dirs["unified"]
        os.makedirs(directory, exist_ok=True)
        if memory is not None:
            _write(f"{directory}/memory.max", str(memory))
            with contextlib.suppress(OSError):
                _write(f"{directory}/memory.swap.max", "0")
        if pids is not None:
            _write(f"{directory}/pids.max", str(pids))
        if cpus is not None:
            _write(f"{directory}/cpu.max", f"{int(cpus * _CPU_PERIOD_US)} {_CPU_PERIOD_US}")

    def enter_thread(self) -> bool:
        """Move the calling thread, alone, into this sandbox's cgroups, so that
        the process it starts next is born in them; False where a thread
        cannot be moved alone (v2), and the process must join by itself.

        A thread moving itself (``0`` written to each v1 ``tasks`` file)
        takes no global lock; a process moved through ``cgroup.procs`` takes
        the threadgroup lock, whose first taking after a quiet spell waits a
        whole RCU grace period (5-15 ms here: the largest step of starting a
        sandbox). :func:`leave_thread` takes it back home."""
        if self.v2:
            return False
        if self.frozen():
            raise ProviderError(f"the cgroups of {self.name} are frozen")
        for directory in self._dirs.values():
            _write(f"{directory}/tasks", "0")
        return True

    def join_file(self, directory: str) -> str:
        """The file through which a process joins ``directory`` by writing 0.

        On v1, ``tasks``: the launcher (a single-threaded shell) moves its one
        thread, which takes no global lock; a move through ``cgroup.procs``
        takes the threadgroup lock, whose first taking after a quiet spell
        waits a whole RCU grace period (5-15 ms here, on every native exec).
        On v2 a process moves whole, through ``cgroup.procs``."""
        return os.path.join(directory, "cgroup.procs" if self.v2 else "tasks")

    def keeper_procs_files(self) -> str:
        """What the keeper's launcher reads from $HUTCH_CGROUP_PROCS: the
        sandbox's own cgroups."""
        return " ".join(self.join_file(d) for d in self._dirs.values())

    def procs_files(self) -> str:
        """What an exec's launcher (``JOIN_AND_EXEC``) reads from
        $HUTCH_CGROUP_PROCS: the workload's cgroups where there are."""
        dirs = {**self._dirs, **(self.workload or {})}
        return " ".join(self.join_file(d) for d in dirs.values())

    def workload_dirs(self) -> dict[str, str] | None:
        """The workload's cgroups, for the agent to start commands in."""
        return self.workload

    def exists(self) -> bool:
        return all(os.path.isdir(d) for d in self._dirs.values())

    # -- reading -----------------------------------------------------------------
    def root(self) -> str:
        """The directory of the sandbox's cgroup (the pids hierarchy's) that
        holds every process of it, the workload's in a child: where a kill
        looks for a command's processes."""
        return self._dir("pids")

    def pids(self) -> list[int]:
        """Every process in the sandbox, the workload's included."""
        dirs = [self._dir("pids")]
        if self.workload is not None:
            dirs.append(self.workload["pids"])
        found: list[int] = []
        for directory in dirs:
            try:
                text = _read(f"{directory}/cgroup.procs")
            except OSError:
                continue
            found.extend(int(line) for line in text.split())
        return found

    def oom_kills(self) -> int:
        """How many processes the OOM killer has ended in this sandbox."""
        try:
            if self.v2:
                text = _read(f"{self._dir('memory')}/memory.events")
            else:
                text = _read(f"{self._dir('memory')}/memory.oom_control")
        except OSError:
            return 0
        # cgroup v1 counts a kill in the cgroup it happened in only.
        workload = 0 if self.workload is None else _workload.oom_kills(self.workload)
        count = _workload.oom_kill_count(text)
        return workload if count is None else count + workload

    def memory_limit(self) -> int | None:
        """The caller's memory limit (the workload's, where it has its own)."""
        path = "memory.max" if self.v2 else "memory.limit_in_bytes"
        where = self._dir("memory") if self.workload is None else self.workload["memory"]
        try:
            value = _read(f"{where}/{path}").strip()
        except OSError:
            return None
        if value == "max" or int(value) >= 1 << 60:
            return None
        return int(value)

    def memory_usage(self) -> int | None:
        path = "memory.current" if self.v2 else "memory.usage_in_bytes"
        try:
            return int(_read(f"{self._dir('memory')}/{path}"))
        except (OSError, ValueError):
            return None

    # -- the freezer ---------------------------------------------------------------
    def frozen(self) -> bool:
        try:
            if self.v2:
                return "frozen 1" in _read(f"{self._dir('freezer')}/cgroup.events").splitlines()
            return _read(f"{self._dir('freezer')}/freezer.state").strip() != "THAWED"
        except OSError:
            return False

    def freeze(self, timeout: float = 10.0) -> None:
        self._set_frozen(True, timeout)

    def thaw(self, timeout: float = 10.0) -> None:
        self._set_frozen(False, timeout)

    def _set_frozen(self, frozen: bool, timeout: float) -> None:
        if self.v2:
            _write(f"{self._dir('freezer')}/cgroup.freeze", "1" if frozen else "0")
            path = f"{self._dir('freezer')}/cgroup.events"
            want = "frozen 1" if frozen else "frozen 0"
        else:
            path = f"{self._dir('freezer')}/freezer.state"
            want = "FROZEN" if frozen else "THAWED"
            _write(path, want)
            if not frozen:
                return  # v1 thaws every task before the write returns

        def check() -> bool:
            text = _read(path)
            return want in text.splitlines() if self.v2 else text.strip() == want

        deadline = time.monotonic() + timeout
        delay = 0.0001
        while not check():
            if time.monotonic() > deadline:
                raise ProviderError(f"the freezer of {self.name} did not reach {want}")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    # -- teardown ------------------------------------------------------------------
    def kill_all(self, timeout: float = 10.0) -> None:
        """SIGKILL every process in the sandbox and wait until none is left."""
        deadline = time.monotonic() + timeout
        while pids := self.pids():
            for pid in pids:
                if pid == os.getpid():
                    continue  # a thread of hutch's own, passing through (enter_thread)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            # A frozen process dies only once it is thawed.
            with contextlib.suppress(OSError, ProviderError):
                self.thaw(timeout=1)
            if time.monotonic() > deadline:
                raise ProviderError(f"processes {pids} of {self.name} outlived SIGKILL")
            time.sleep(0.002)

    def remove(self) -> None:
        if self.workload is not None:
            _workload.remove_workload(self._dirs)
        for directory in self._dirs.values():
            _workload.remove_cgroup(directory)
