"""Bench: the daemon beside in-process hutch and the raw floor.

Exec round trip of ``true`` on the local provider: through the daemon (the
sync SDK over HTTP), in-process, and a bare subprocess. Status GETs per
second: wrk (32 connections) against one sandbox's status, beside the same
daemon's trivial /healthz. wrk shares the machine's 2 cores with the daemon.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.daemon_fixture import DaemonProcess

import hutch
from _common import header, median_ms, row

RUNS = 300
LOAD_SECONDS = 4

def requests_per_second(url: str, token: str) -> float:
    """wrk (a separate C process, 2 threads, 32 connections) against one URL."""
    out = subprocess.run(
        ["wrk", "-t2", "-c32", f"-d{LOAD_SECONDS}s", "-H", f"Authorization: Bearer {token}", url],
        capture_output=True, text=True, check=True,
    ).stdout
    match = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if match is None:
        raise RuntimeError(f"no figure in wrk's output:\n{out}")
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if non_2xx:
        raise RuntimeError(f"{non_2xx.group(1)} requests failed:\n{out}")
    return float(match.group(1))


async def main() -> None:
    workdir = tempfile.mkdtemp(prefix="hutch-bench-", dir="/dev/shm")
    daemon = DaemonProcess().start()
    try:
        header("exec round trip, local provider (floor: subprocess.run)")
        with hutch.Client(daemon.url, token=daemon.token) as client:
            remote = client.create_sandbox("local", workdir=workdir)
            async with await hutch.create_sandbox("local", workdir=workdir) as sb:
                # Three figures, measured in turn within one loop.
                samples: dict[str, list[float]] = {"floor": [], "in": [], "daemon": []}
                for i in range(RUNS + 3):
                    t = time.perf_counter()
                    subprocess.run(["true"], check=True)
                    t1 = time.perf_counter()
                    await sb.exec(["true"])
                    t2 = time.perf_counter()
                    remote.exec(["true"])
                    t3 = time.perf_counter()
                    if i >= 3:
                        samples["floor"].append(t1 - t)
                        samples["in"].append(t2 - t1)
                        samples["daemon"].append(t3 - t2)
            floor, in_process, through_daemon = (
                median_ms(samples[k]) for k in ("floor", "in", "daemon")
            )
            row("in-process exec", in_process, floor)
            row("exec through the daemon (sync SDK)", through_daemon, floor)
            row("  daemon's own cost (vs in-process)", through_daemon, in_process,
                "goal: +3 ms at most")

            header("status GETs per second, 2 cores shared with the load process")
            status = requests_per_second(f"{daemon.url}/v1/sandboxes/{remote.id}", daemon.token)
            trivial = requests_per_second(f"{daemon.url}/healthz", daemon.token)
            print(f"{'GET /v1/sandboxes/{id}':<44} {status:>9.0f}/s {trivial:>9.0f}/s "
                  f"{status / trivial:>6.2f}x  (floor: GET /healthz; goal >= 3000/s)")
            remote.close()
    finally:
        daemon.stop()


if __name__ == "__main__":
    asyncio.run(main())
