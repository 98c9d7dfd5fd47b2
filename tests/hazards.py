"""Workloads that try a sandbox's limits, shared by the provider tests."""

from __future__ import annotations

import os
import time
from typing import Any

from hutch import OutputChunk
from hutch.providers import _diskcap

#: Forks until the pids limit says no (printing the errno), holds what it
#: made, says how many, then sleeps: the sandbox stays full until it is killed.
FORK_BOMB = (
    "import os, errno, time\n"
    "kids = []\n"
    "while True:\n"
    "    try:\n"
    "        pid = os.fork()\n"
    "    except OSError as e:\n"
    "        print('errno', errno.errorcode[e.errno], flush=True); break\n"
    "    if pid == 0:\n"
    "        time.sleep(60); os._exit(0)\n"
    "    kids.append(pid)\n"
    "print('forked', len(kids), flush=True)\n"
    "time.sleep(60)\n"
)

#: Busy loops that never end (50 of them, each its own runnable process),
#: started in the background: the sandbox's CPU is all theirs until killed.
BUSY_LOOPS = ("echo 'while :; do :; done' > /tmp/busy.sh; "
              "for i in $(seq 50); do sh /tmp/busy.sh >/dev/null 2>&1 & done; echo started")


def cpu_cgroup(proc_cgroup: str) -> str:
    """The cpu controller's cgroup in a /proc/PID/cgroup text (``cpu`` may
    share its hierarchy with ``cpuacct``)."""
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return path
    raise AssertionError(f"no cpu cgroup in {proc_cgroup!r}")


async def answers_beside_busy_loops(sb: Any, agent_pid: int) -> None:
    """Start :data:`BUSY_LOOPS` in ``sb``; see that they share one cpu cgroup
    apart from the agent's (so that the agent competes with them as with one
    process, not with 50), and that execs and file reads keep answering while
    they run; then kill them."""
    started = await sb.exec(["sh", "-c", BUSY_LOOPS])
    assert started.stdout == "started\n", started
    try:
        loops = (await sb.exec(["pgrep", "-f", "busy.sh"])).stdout.split()
        assert len(loops) >= 50, loops
        agents = cpu_cgroup(await sb.read_text(f"/proc/{agent_pid}/cgroup"))
        for pid in loops[:5]:
            theirs = cpu_cgroup(await sb.read_text(f"/proc/{pid}/cgroup"))
            assert theirs.endswith("/hutch-workload") and theirs != agents, (theirs, agents)
        for i in range(20):
            assert (await sb.exec(["echo", str(i)])).stdout == f"{i}\n"
            assert "ID=" in await sb.read_text("/etc/os-release")
    finally:
        await sb.exec(["pkill", "-9", "-f", "busy.sh"])


def workload_limits(container_id: str) -> tuple[int, int]:
    """(memory bytes, pids) of the cgroup that holds what a docker sandbox's
    agent runs (cgroup v1, cgroupfs driver, as this host has): the caller's
    limits; the container's own add the agent's reserve."""
    with open(f"/sys/fs/cgroup/memory/docker/{container_id}/hutch-workload/"
              "memory.limit_in_bytes") as fh:
        memory = int(fh.read())
    with open(f"/sys/fs/cgroup/pids/docker/{container_id}/hutch-workload/pids.max") as fh:
        pids = int(fh.read())
    return memory, pids


async def fill_with_processes(sb: Any) -> tuple[Any, str]:
    """Start :data:`FORK_BOMB` in ``sb`` and wait until the pids limit has
    said no: (the running bomb, what it printed). The sandbox is full until
    the bomb is killed."""
    bomb = await sb.start(["python3", "-c", FORK_BOMB])
    said = ""
    async for event in bomb.stream():
        if isinstance(event, OutputChunk):
            said += event.data.decode()
        if "forked" in said:
            break
    assert "errno EAGAIN" in said, said
    return bomb, said


def loop_devices_left(image: str, within: float = 10.0) -> list[str]:
    """The loop devices still backed by ``image`` once ``within`` seconds have
    passed ([] as soon as there are none). A capped mount's loop device clears
    itself on its last close, which an unmount need not be: a mount namespace
    another process is making (a container's, a bubblewrap sandbox's) holds a
    copy of the host's mounts until it drops the old root, a few milliseconds
    later. Measured: 48 in 150 devices were still bound right after the
    unmount while ``unshare -m`` ran in a loop; all were gone 15 ms later."""
    deadline = time.monotonic() + within
    while (devices := _diskcap.loop_devices_backed_by(image)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return devices


def sleepers(marker: str) -> list[str]:
    """The host's processes running ``sleep marker`` (a sandbox's are the
    host's too), by pid: a command a test starts, to see it outlive its caller or not."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                if fh.read() == f"sleep\0{marker}\0".encode():
                    found.append(entry)
        except OSError:
            continue
    return found
