"""Who holds an instance's sandbox: programs named by host, pid and start
time, the daemon, and the leases and claims they take in the store."""

from __future__ import annotations

import os
import uuid

from .._errors import SandboxUnavailable
from .._liveness import still_running, this_process
from ..store import InstanceRow, Store

#: An instance whose sandbox a daemon holds says so in its description.
HELD_BY_DAEMON = "daemon"
#: How long a program's claim to act on a sandbox's idleness lasts (a
#: holder of this host that died frees it at once).
CLAIM_SECONDS = 600.0


def this_program() -> str:
    """This program, as the store names a holder: ``host:pid:start`` (its
    start time: a pid the kernel hands on later is not this program)."""
    pid, start = this_process()
    return f"{os.uname().nodename}:{pid}:{start}"


def program_alive(holder: str) -> bool:
    """Whether the program ``holder`` names (see :func:`this_program`) lives."""
    host, _, rest = holder.partition(":")
    pid, _, start = rest.partition(":")
    if host != os.uname().nodename:
        return True  # another host's: it cannot be looked at from here
    return pid.isdigit() and start.isdigit() and still_running(int(pid), int(start))


def live_holders(store: Store, key: str) -> list[str]:
    """The programs holding the instance's sandbox in-process now; the holds
    of programs that died (killed, crashed) are dropped on the way."""
    alive = []
    for holder in store.instance_holders(key):
        if program_alive(holder):
            alive.append(holder)
        else:
            store.release_instance(key, holder)
    return alive


def held_elsewhere(row: InstanceRow, holder: str) -> SandboxUnavailable:
    """The error of a caller that may not take over a sandbox ``holder`` holds."""
    host, _, rest = holder.partition(":")
    return SandboxUnavailable(
        f"the sandbox of thread {row.thread_id!r} of definition {row.definition_id!r} "
        f"({row.sandbox_id}) is held in-process by the program with pid "
        f"{rest.partition(':')[0]} on {host}: ensure it in that program, or end it first "
        "(its hold ends with it)"
    )


def claim_name(sandbox_id: str) -> str:
    """The lease a program holds while it changes a shared sandbox's state."""
    return f"lifecycle:{sandbox_id}"


def lease_holder() -> str:
    """Who holds a lease: this program, once (``host:pid:start:nonce``)."""
    return f"{this_program()}:{uuid.uuid4().hex[:8]}"
