"""Whether a process on this host is still the one that was there: its pid
and its start time (clock ticks after boot), so a pid the kernel gave to
another process since does not pass for the first one. What a process
leaves on disk for others to judge (a sandbox's owner, a ref's socket
directory) records both."""

from __future__ import annotations

import os

#: ``PF_EXITING`` in /proc/PID/stat's flags: the process has begun its exit.
_PF_EXITING = 0x4


def stat_fields(pid: int) -> list[bytes] | None:
    """/proc/PID/stat's fields after the command name (the state first, then
    the parent, the group, ...; the start time at index 19), or None if no
    such process is there (a zombie still is)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    # The command name (in parentheses) may hold spaces: count after its end.
    return stat[stat.rindex(b")") + 2:].split()


def process_start_time(pid: int) -> int | None:
    """When ``pid`` started, or None if no such process lives. A zombie is
    dead, and so is one that has begun to exit: a killed sandbox's init
    stays in its exit while the kernel ends the processes of its namespace,
    and their connections break before it is a zombie."""
    fields = stat_fields(pid)
    if fields is None:
        return None
    if fields[0] in (b"Z", b"X") or int(fields[6]) & _PF_EXITING:
        return None
    return int(fields[19])


#: This process's pid and start time, read once (a child forked since reads its own).
_this: tuple[int, int] | None = None


def this_process() -> tuple[int, int]:
    """This process's pid and start time."""
    global _this
    pid = os.getpid()
    if _this is None or _this[0] != pid:
        start = process_start_time(pid)
        assert start is not None  # this process is running
        _this = pid, start
    return _this


def still_running(pid: int, start: int) -> bool:
    """Whether the process that had ``pid`` and started at ``start`` lives."""
    return process_start_time(pid) == start
