"""Bench: a fleet of three daemons on one PostgreSQL store beside one
daemon on SQLite (issue 24), in one run.

- create + first exec: ``HUTCH_BENCH_FLEET_SANDBOXES`` (default 300, the
  acceptance's count) ``local`` sandboxes made concurrently (12 at a time),
  through the three fleet daemons in turn, then through the SQLite daemon;
  sandboxes per second each, and every fleet daemon lists each once.
- status reads per second (``GET /v1/sandboxes/{id}``), three clients at
  once for a few seconds: on the fleet each asks its own daemon about every
  sandbox (two thirds of them forwarded), on SQLite the one daemon.
- a forwarded exec beside a direct one: ``exec(["true"])`` on one sandbox
  through its owner and through another daemon, alternately (goal: the
  forwarding adds 2 ms at most).
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests import postgres_fixture
from tests.daemon_fixture import DaemonProcess

import hutch
from _common import header, median_ms, row, run

SANDBOXES = int(os.environ.get("HUTCH_BENCH_FLEET_SANDBOXES", "300"))
READ_SECONDS = 3.0
EXEC_ROUNDS = 200


def client(d: DaemonProcess) -> hutch.Client:
    return hutch.Client(d.url, token=d.token)


def create_and_exec(daemons: list[DaemonProcess]) -> tuple[float, list[str]]:
    clients = [client(d) for d in daemons]
    lock = threading.Lock()
    made: list[str] = []

    def one(i: int) -> None:
        sb = clients[i % len(clients)].create_sandbox("local", read_before_write=False)
        sb.exec(["true"])
        with lock:
            made.append(sb.id)

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        list(pool.map(one, range(SANDBOXES)))
    took = time.perf_counter() - started
    for c in clients:
        c.close()
    return SANDBOXES / took, made


def status_reads(daemons: list[DaemonProcess], ids: list[str]) -> float:
    stop = time.monotonic() + READ_SECONDS
    counts = [0, 0, 0]

    def reader(k: int) -> None:
        with client(daemons[k % len(daemons)]) as c:
            i = k
            while time.monotonic() < stop:
                c.get_sandbox(ids[i % len(ids)])
                i += 1
                counts[k] += 1

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / READ_SECONDS


def forwarded_exec(owner: DaemonProcess, other: DaemonProcess) -> tuple[float, float]:
    with client(owner) as c:
        sandbox_id = c.create_sandbox("local", read_before_write=False).id
    with client(owner) as direct_c, client(other) as forward_c:
        direct, forwarded = direct_c.get_sandbox(sandbox_id), forward_c.get_sandbox(sandbox_id)
        for _ in range(10):
            direct.exec(["true"])
            forwarded.exec(["true"])
        samples: dict[str, list[float]] = {"direct": [], "forwarded": []}
        for i in range(EXEC_ROUNDS):
            order = [("direct", direct), ("forwarded", forwarded)]
            for name, sb in order if i % 2 == 0 else reversed(order):
                t = time.perf_counter()
                sb.exec(["true"])
                samples[name].append(time.perf_counter() - t)
    return median_ms(samples["forwarded"]), median_ms(samples["direct"])


def end_all(d: DaemonProcess) -> None:
    with client(d) as c:
        ids = [s["id"] for s in c.list_sandboxes()]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(c.delete_sandbox, ids))


async def main() -> None:
    cluster = postgres_fixture.PostgresCluster()
    store = cluster.url(cluster.new_database())
    fleet = [DaemonProcess(extra_env={"HUTCH_STORE": store}) for _ in range(3)]
    alone = DaemonProcess()
    try:
        for d in [*fleet, alone]:
            d.start()
        fleet_rate, made = create_and_exec(fleet)
        for d in fleet:
            with client(d) as c:
                listed = [s["id"] for s in c.list_sandboxes()]
            assert sorted(listed) == sorted(made), "every sandbox listed once by each daemon"
        alone_rate, alone_made = create_and_exec([alone])
        fleet_reads = status_reads(fleet, made)
        alone_reads = status_reads([alone], alone_made)
        forwarded_ms, direct_ms = forwarded_exec(fleet[0], fleet[1])

        header(f"fleet: three daemons on PostgreSQL beside one on SQLite ({SANDBOXES} sandboxes)")
        print(f"{'create + first exec, sandboxes/s':<44} fleet {fleet_rate:>8.1f}   "
              f"sqlite {alone_rate:>8.1f}")
        print(f"{'status reads/s (3 clients)':<44} fleet {fleet_reads:>8.0f}   "
              f"sqlite {alone_reads:>8.0f}")
        row("exec true: forwarded vs direct", forwarded_ms, direct_ms,
            "goal: forwarding adds <= 2 ms")
        for d in [fleet[0], alone]:
            end_all(d)
    finally:
        for d in [*fleet, alone]:
            d.close()
        cluster.close()


if __name__ == "__main__":
    run(main)
