"""Warm pools: create-to-first-exec through the daemon's sync SDK from a
warm pool beside a cold create (docker and bubblewrap), the pool's refill
time, and the daemon's CPU while a pool of 20 sits idle.

Floor of the warm create: the cold create of the same settings (what the
pool saves). Goals (issue 26): docker <= 30 ms, bubblewrap <= 5 ms from a pool.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.daemon_fixture import DaemonProcess

import hutch
from _common import header, median_ms, row, run, scratch_dir

IMAGE = os.environ.get("HUTCH_TEST_IMAGE", "hutch-test:bookworm")
RUNS = int(os.environ.get("HUTCH_BENCH_POOL_RUNS", "7"))
IDLE_POOL = 20
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


def idle_pool_cpu(c: hutch.Client, pid: int) -> None:
    c.set_pool("idle", IDLE_POOL, {"provider": "bubblewrap"})
    wait_ready(c, "idle", IDLE_POOL)
    time.sleep(1)
    before = cpu_seconds(pid)
    time.sleep(IDLE_SECONDS)
    used = cpu_seconds(pid) - before
    print(f"{'daemon CPU, a pool of 20 idle (bubblewrap)':<44} "
          f"{used / IDLE_SECONDS * 100:>9.2f}%  over {IDLE_SECONDS:g} s  goal: ~0")
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
            idle_pool_cpu(c, daemon.proc.pid)
    finally:
        daemon.close()


if __name__ == "__main__":
    run(main)
