"""The host's processes by name, as the kill tests look for a sandbox's tree."""

from __future__ import annotations

import os


def named(tag: str) -> list[tuple[int, str, int]]:
    """(pid, state, parent) of the host's processes whose name starts with ``tag``."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as fh:
                stat = fh.read().decode(errors="replace")
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        if comm.startswith(tag):
            found.append((int(entry.name), fields[0], int(fields[1])))
    return found
