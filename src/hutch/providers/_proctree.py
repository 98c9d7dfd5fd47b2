"""A command's process tree as this host's /proc sees it, and its kill: a
kill answers once the tree is gone, not once its signals are sent.

A command's processes are those of its process group and every one whose
environment carries its marker (``HUTCH_EXEC_ID=...``: children inherit
it, wherever they go, another group or session). The group counts while a
process known to be the command's holds it (its leader, by its start time,
or a marked one): once it is gone its number is free, and another's. Where the sandbox's
cgroup is known, they are looked for among its processes alone (its
``cgroup.procs``, and its child cgroups'): a kill's cost is the sandbox's,
not the host's, and nothing outside the sandbox is signalled, whatever its
environment says. Elsewhere (the local provider's commands, the host's
own), among every process of this host's /proc. A kill is SIGTERM to all,
a grace, then SIGKILL rounds until a look finds none alive (what forked
between a look and its kill, a fork bomb's, is found by the next), then a
wait until each process seen is reaped: a zombie still holds its pid (a
sandbox's pids limit counts it) until its parent or the sandbox's init
reaps it. Everything is bounded: what outlives the bound (a process stuck
in the kernel) is said, as :class:`~hutch._errors.KillIncomplete`, never
waited for forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from .._errors import KillIncomplete
from .._liveness import stat_fields

#: Seconds a kill waits, past its grace, for its SIGKILLed processes to be
#: gone and reaped: they go at once unless the kernel holds them.
REAP_SECONDS = 10.0
#: Between two looks at /proc while waiting.
_POLL_SECONDS = 0.04
#: The first wait between two looks; each next one doubles, up to the above.
_FIRST_POLL_SECONDS = 0.002


@dataclass(frozen=True)
class _Stat:
    state: str
    parent: int
    group: int
    #: Since boot, in clock ticks: a reused pid has another.
    start: int


def _stat(pid: int) -> _Stat | None:
    fields = stat_fields(pid)
    if fields is None:
        return None
    return _Stat(fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[19]))


def cgroup_members(directory: str) -> list[int]:
    """The processes in the cgroup ``directory`` and every cgroup below it
    (a cgroup's ``cgroup.procs`` lists its own only: the workload's, a child,
    holds a sandbox's commands); none once it is gone. A cgroup's members
    stay in it whatever they do (a new session, a parent gone): only the
    host moves them out."""
    found: list[int] = []
    below = [directory]
    while below:
        here = below.pop()
        # The parent read before its children: a process moved down between
        # the two reads (into the workload) is in one of them.
        try:
            with open(os.path.join(here, "cgroup.procs"), "rb") as fh:
                found.extend(int(pid) for pid in fh.read().split())
            with os.scandir(here) as entries:
                below.extend(e.path for e in entries if e.is_dir(follow_symlinks=False))
        except (OSError, ValueError):
            continue
    return list(dict.fromkeys(found))  # v1 may list a process twice


def host_pids() -> list[int]:
    """Every process of this host's /proc."""
    return [int(entry.name) for entry in os.scandir("/proc") if entry.name.isdigit()]


def _carries(pid: int, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = fh.read()
    except OSError:
        return False
    return env.startswith(needle + b"\0") or b"\0" + needle + b"\0" in env or env == needle


class ProcessTree:
    """The processes of one command: its group ``group`` (None: none of its
    own) and those carrying ``marker`` (``NAME=value``), but ``spare``
    (a monitor above the command, such as bwrap, that reaps it and ends
    with it: killed first, it would leave the command's zombie to the
    host's init). ``cgroup``: the host directory of the sandbox's cgroup
    (any hierarchy's, holding all its processes), whose members alone are
    looked at; None: every process of this host's."""

    def __init__(self, marker: str, group: int | None = None, spare: int | None = None,
                 held: Callable[[], bool] | None = None, cgroup: str | None = None,
                 *, leader_start: int | None = None) -> None:
        self._needle = marker.encode()
        self._cgroup = cgroup
        self._held = held or (lambda: False)
        self._group = group
        #: The start time of the group's leader (the process whose pid is
        #: ``group``), read while it was certainly the command's: None if unknown.
        self._leader_start = leader_start
        self._spare = spare
        self._own = os.getpid()
        #: pid -> start time of every process of the tree seen, to wait for.
        self._seen: dict[int, int] = {}
        #: Whether the last look found ``group`` still held by the command.
        self._group_held = False

    def alive(self) -> list[int]:
        """The tree's processes alive now (zombies are not), each remembered."""
        return [pid for pid, _ in self._look()]

    def _look(self) -> list[tuple[int, int]]:
        """(pid, start time) of the tree's processes alive now, each remembered."""
        looked = [(pid, stat) for pid in self.candidates()
                  if pid not in (self._own, self._spare) and (stat := _stat(pid)) is not None]
        known = {pid for pid, stat in looked if self._known(pid, stat)}
        # The group's number is the command's only while a process known to
        # be the command's still has it (a member keeps the number taken):
        # once the group is gone, the number is free, and a process outside
        # the sandbox that takes it is no member, nor is it signalled.
        self._group_held = self._group is not None and (
            any(stat.group == self._group for pid, stat in looked if pid in known)
            or self._leader_holds_group())
        found = []
        for pid, stat in looked:
            if pid in known or (self._group_held and stat.group == self._group):
                self._seen.setdefault(pid, stat.start)
                if stat.state not in ("Z", "X"):
                    found.append((pid, stat.start))
        return found

    def _known(self, pid: int, stat: _Stat) -> bool:
        """Whether ``pid`` is certainly the command's: seen before (the same
        process: the same start), or carrying its marker."""
        return self._seen.get(pid) == stat.start or _carries(pid, self._needle)

    def _leader_holds_group(self) -> bool:
        """Whether the group's leader (alive, or a zombie not reaped) still
        holds its pid: the process that started when the command's did."""
        if self._group is None or self._leader_start is None:
            return False
        stat = _stat(self._group)
        return stat is not None and stat.start == self._leader_start

    def candidates(self) -> list[int]:
        """The processes the tree is looked for among: its sandbox's cgroup's,
        where known, else this host's."""
        return host_pids() if self._cgroup is None else cgroup_members(self._cgroup)

    def signal(self, sig: int) -> int:
        """Send ``sig`` to the command's process group while it is the
        command's (the kernel lets no member fork past a group's signal: a
        fork bomb's generation in flight is caught with it), then to every
        process of the tree alive, those that left the group among them; how
        many there were. The group is signalled just after a look found it
        held by a process of the command's: its number cannot be taken
        again before the whole pid space has been gone round."""
        found = self._look()
        if self._group is not None and self._group_held:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._group, sig)
        for pid, start in found:
            _send(pid, start, sig)
        return len(found)

    def unreaped(self) -> list[int]:
        """The processes seen that still hold their pid: alive, or zombies
        not yet reaped. A zombie the host's init adopted is not waited for:
        nothing of the sandbox's is held by it, and an init that is not one
        (a container's first process) never reaps it."""
        left = []
        for pid, start in self._seen.items():
            stat = _stat(pid)
            if stat is None or stat.start != start:
                continue
            if stat.state in ("Z", "X") and stat.parent == 1:
                continue
            left.append(pid)
        return left

    async def kill(self, grace: float, *, bound: float = REAP_SECONDS) -> bool:
        """SIGTERM, ``grace`` for the tree to go, then SIGKILL until none is
        alive and every one seen is reaped; raises :class:`KillIncomplete`
        if some are still there ``bound`` seconds past the grace. While the
        sandbox is held frozen (``held``: its user's pause), its processes
        cannot end: the kill answers once its SIGKILLs are sent, and they
        end at the thaw, before anything of theirs runs again. Returns
        whether it answered so (True: the tree is doomed, held; False: gone)."""
        held = self._held
        # Each look reads many files of /proc: in a worker thread, never on the loop.
        if await asyncio.to_thread(self.signal, signal.SIGTERM):
            await _until(lambda: not self.alive() or held(), time.monotonic() + grace)
        until = time.monotonic() + bound
        await _until(lambda: not self.signal(signal.SIGKILL) or held(), until, _POLL_SECONDS / 4)
        await _until(lambda: not self.unreaped() or held(), until)
        left = self.unreaped()
        if not left:
            return False
        if held():
            # One more round, looked for now that the sandbox is frozen: a
            # process forked while it was freezing gets its SIGKILL too.
            await asyncio.to_thread(self.signal, signal.SIGKILL)
            return True
        states = {pid: (s.state if (s := _stat(pid)) else "?") for pid in left}
        raise KillIncomplete(
            f"{len(left)} processes of the command outlived its kill by {bound:g} s "
            f"(pid: state {states}); they still hold their share of the sandbox"
        )


def _send(pid: int, start: int, sig: int) -> None:
    """``sig`` to ``pid`` if it is still the process seen, the one that
    started at ``start``: pinned by a pidfd before its start is looked at
    again, so that a pid freed since it was seen, and taken by a process
    outside the tree (outside the sandbox), never gets it."""
    try:
        pinned = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # gone
    except OSError:  # a kernel before pidfds (5.3): the check, then the kill
        stat = _stat(pid)
        if stat is not None and stat.start == start:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        return
    try:
        stat = _stat(pid)
        if stat is not None and stat.start == start:
            # Gone since it was pinned, it gets nothing (ESRCH), whoever took its pid.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                signal.pidfd_send_signal(pinned, sig)
    finally:
        os.close(pinned)


async def _until(done: Callable[[], bool], deadline: float,
                 every: float = _POLL_SECONDS) -> None:
    """Look at ``done`` (in a worker thread) until it says so or ``deadline``
    passes: soon at first (a signalled process ends in a millisecond or
    two, and a look at a sandbox's cgroup is cheap), then every ``every`` s."""
    pause = min(every, _FIRST_POLL_SECONDS)
    while True:
        if await asyncio.to_thread(done) or time.monotonic() >= deadline:
            return
        await asyncio.sleep(pause)
        pause = min(pause * 2, every)
