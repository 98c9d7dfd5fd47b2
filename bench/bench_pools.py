"""Warm pools: create-to-first-exec through the daemon's sync SDK from a
warm pool beside a cold create (docker and bubblewrap), the pool's refill
time, and the CPU of the daemon and of the pooled sandboxes themselves
(their keepers and agents, by their cgroups) while a pool of 20 sits idle.

Floor of the warm create: the cold create of the same settings (what the
pool saves). Goals (issue 26): docker <= 30 ms, bubblewrap <= 5 ms from a pool.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.daemon_fixture import DaemonProcess

import hutch
from _common import header, median_ms, row, run, scratch_dir

IMAGE = os.environ.get("HUTCH_TEST_IMAGE", "hutch-test:bookworm")
RUNS = int(os.environ.get("HUTCH_BENCH_POOL_RUNS", "7"))
IDLE_POOL = 20
IDLE_DOCKER_POOL = 5
IDLE_SECONDS = 10.0
GOALS = {"docker": "goal: <= 30 ms", "bubblewrap": "goal: <= 5 ms"}


def ready(c: hutch.Client, name: str) -> int:
    return int(next(p for p in c.list_pools() if p["name"] == name)["ready"])


def wait_ready(c: hutch.Client, name: str, wanted: int) -> float:
    """Seconds until the pool holds ``wanted`` ready."""
    started = time.perf_counter()
    while ready(c, name) < wanted:
        time.sleep(0.005)
    return time.perf_counter() - started


def create_and_exec(
    c: hutch.Client, provider: str, settings: dict[str, Any], pool: str | None = None
) -> tuple[float, float]:
    """Seconds to create and run a first command; with ``pool``, also from the
    take until the pool holds one ready again (its refill)."""
    started = time.perf_counter()
    sb = c.create_sandbox(provider, **settings)
    sb.exec(["true"])
    took = time.perf_counter() - started
    refilled = took + wait_ready(c, pool, 1) if pool else 0.0
    c.delete_sandbox(sb.id)
    return took, refilled


def compare(c: hutch.Client, provider: str, settings: dict[str, Any]) -> None:
    c.set_pool(provider, 1, {"provider": provider, **settings})
    warm, cold, refill = [], [], []
    for _ in range(RUNS + 1):
        wait_ready(c, provider, 1)
        took, refilled = create_and_exec(c, provider, settings, pool=provider)
        warm.append(took)
        refill.append(refilled)
        c.set_pool(provider, 0, {"provider": provider, **settings})  # no pool for the cold
        cold.append(create_and_exec(c, provider, settings)[0])
        c.set_pool(provider, 1, {"provider": provider, **settings})
    warm, cold, refill = warm[1:], cold[1:], refill[1:]
    row(f"{provider}: create-to-first-exec, warm pool", median_ms(warm), median_ms(cold),
        GOALS[provider])
    row(f"{provider}: pool refill (take to ready again)", median_ms(refill), median_ms(cold))
    c.remove_pool(provider)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pooled_ids(data_dir: str) -> list[str]:
    """The sandboxes a daemon's pools keep ready: its rows still ``creating``."""
    db = os.path.join(data_dir, "hutch.db")
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
        return [r[0] for r in con.execute("SELECT id FROM sandboxes WHERE state = 'creating'")]


def cgroup_cpu_seconds(candidates: list[tuple[str, str]]) -> float:
    """CPU used by each cgroup named by its (cgroup v1 ``cpuacct``
    directory, cgroup v2 directory) pair: the first of the two that exists."""
    total = 0.0
    for v1, v2 in candidates:
        for path, scale in ((f"{v1}/cpuacct.usage", 1e-9), (f"{v2}/cpu.stat", 1e-6)):
            try:
                with open(path) as fh:
                    text = fh.read()
            except OSError:
                continue
            if path.endswith("cpu.stat"):
                text = next(line.split()[1] for line in text.splitlines()
                            if line.startswith("usage_usec"))
            total += int(text) * scale
            break
    return total


def sandboxes_cpu_seconds(sandbox_ids: list[str]) -> float:
    """CPU the bubblewrap sandboxes' processes used, by their cgroups."""
    return cgroup_cpu_seconds([
        (f"/sys/fs/cgroup/cpuacct/hutch/{sid}", f"/sys/fs/cgroup/hutch/{sid}")
        for sid in sandbox_ids
    ])


def containers_cpu_seconds(data_dir: str) -> tuple[int, float]:
    """How many containers a daemon made, and the CPU they used (their cgroups)."""
    ids = subprocess.run(
        ["docker", "ps", "-q", "--no-trunc", "--filter", f"label=hutch.home={data_dir}"],
        capture_output=True, text=True, check=True, timeout=60).stdout.split()
    return len(ids), cgroup_cpu_seconds(
        [(f"/sys/fs/cgroup/cpuacct/docker/{cid}", f"/sys/fs/cgroup/system.slice/docker-{cid}.scope")
         for cid in ids])


def idle_docker_pool_cpu(c: hutch.Client, daemon: DaemonProcess) -> None:
    assert daemon.proc is not None
    c.set_pool("idle-docker", IDLE_DOCKER_POOL, {"provider": "docker", "image": IMAGE})
    wait_ready(c, "idle-docker", IDLE_DOCKER_POOL)
    time.sleep(1)
    before, (_, before_pooled) = cpu_seconds(daemon.proc.pid), containers_cpu_seconds(
        os.path.abspath(daemon.data_dir))
    time.sleep(IDLE_SECONDS)
    used = cpu_seconds(daemon.proc.pid) - before
    count, after_pooled = containers_cpu_seconds(os.path.abspath(daemon.data_dir))
    print(f"{f'daemon CPU, a pool of {IDLE_DOCKER_POOL} idle (docker)':<44} "
          f"{used / IDLE_SECONDS * 100:>9.2f}%  over {IDLE_SECONDS:g} s  goal: ~0")
    print(f"{f'the {IDLE_DOCKER_POOL} pooled containers own CPU, idle':<44} "
          f"{(after_pooled - before_pooled) / IDLE_SECONDS * 100:>9.3f}%  "
          f"({count} containers' cgroups)")
    c.remove_pool("idle-docker")


def idle_pool_cpu(c: hutch.Client, daemon: DaemonProcess) -> None:
    assert daemon.proc is not None
    before = cpu_seconds(daemon.proc.pid)
    time.sleep(IDLE_SECONDS)
    baseline = cpu_seconds(daemon.proc.pid) - before
    print(f"{'daemon CPU, no pool (its own baseline)':<44} "
          f"{baseline / IDLE_SECONDS * 100:>9.2f}%  over {IDLE_SECONDS:g} s")
    c.set_pool("idle", IDLE_POOL, {"provider": "bubblewrap"})
    wait_ready(c, "idle", IDLE_POOL)
    time.sleep(1)
    pooled = pooled_ids(daemon.data_dir)
    before, before_pooled = cpu_seconds(daemon.proc.pid), sandboxes_cpu_seconds(pooled)
    time.sleep(IDLE_SECONDS)
    used = cpu_seconds(daemon.proc.pid) - before
    used_pooled = sandboxes_cpu_seconds(pooled) - before_pooled
    print(f"{'daemon CPU, a pool of 20 idle (bubblewrap)':<44} "
          f"{used / IDLE_SECONDS * 100:>9.2f}%  over {IDLE_SECONDS:g} s  goal: ~0")
    print(f"{'the 20 pooled sandboxes own CPU, idle':<44} "
          f"{used_pooled / IDLE_SECONDS * 100:>9.3f}%  ({len(pooled)} sandboxes' cgroups)")
    c.remove_pool("idle")


async def main() -> None:
    scratch_dir("hutch-bench-pools-")
    daemon = DaemonProcess(provider=None).start()
    try:
        assert daemon.proc is not None
        header("warm pools through the sync SDK (floor: a cold create of the same)")
        with hutch.Client(daemon.url, token=daemon.token) as c:
            compare(c, "bubblewrap", {})
            compare(c, "docker", {"image": IMAGE})
            idle_pool_cpu(c, daemon)
            idle_docker_pool_cpu(c, daemon)
    finally:
        daemon.close()


if __name__ == "__main__":
    run(main)
